"""The lines one logger writes inside a block, formatted as the services format them (``pdserve/shared/logs.py``'s
``FORMAT`` with its request id, without the time)."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from contextlib import contextmanager

from pdserve.shared.logs import FORMAT, RequestIdFilter


@contextmanager
def captured_log(name: str) -> Iterator[io.StringIO]:
    """Logger ``name`` at INFO, writing to the yielded stream only (not propagated) until the block ends; its level
    and propagation are restored then."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter(FORMAT.replace("%(asctime)s ", "")))
    log = logging.getLogger(name)
    level, propagate = log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        yield stream
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate
