"""One logging setup for every pdserve process, with the request being handled in every line.

``request_id`` is a context variable: code handling one request sets it (``request_id.set(rid)``) and every log
line from that task, and from the tasks it starts, carries it; lines outside any request show ``-``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

request_id: ContextVar[str] = ContextVar("pdserve_request_id", default="-")

FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"


class RequestIdFilter(logging.Filter):
    """Stamps each record with the current ``request_id`` (``-`` outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True


def setup_logging(level: str) -> None:
    """Root logging to stderr at ``level`` (``debug``/``info``/``warning``/``error``, any case) in ``FORMAT``."""
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter(FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per heartbeat otherwise


@contextmanager
def logging_request(rid: str) -> Iterator[None]:
    """Log lines inside the block carry ``rid``; the previous request id comes back after it."""
    token = request_id.set(rid)
    try:
        yield
    finally:
        request_id.reset(token)
