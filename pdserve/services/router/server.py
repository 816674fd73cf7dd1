"""The router's HTTP server: uvicorn with h11 and the guards a public endpoint needs.

* h11, not httptools: h11 frames a response without ``Content-Length`` by the peer's version, so a stream to
  an HTTP/1.0 client is close-delimited (HTTP/1.0 has no chunked encoding; httptools sends it chunked anyway).
* A request head must arrive within ``http_header_timeout_s`` of the connection opening or of the previous
  response (uvicorn has no such limit: a client dribbling header bytes held a connection for ever), answered
  408 and closed; the body's limit is ``GuardMiddleware``'s. A response sent before its request's body was
  read (408, 413) closes the connection instead of waiting for the rest.
* The access log never shows query-string values: a client that sends its key as ``?api_key=...`` must not
  leave it in the logs (the router reads keys only from ``Authorization``; it has no query parameters).
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .settings import RouterSettings

_QUERY_VALUE = re.compile(r"=[^&]*")
_HEAD_TIMEOUT_BODY = b"The request head did not arrive in time"
_HEAD_TIMEOUT_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(_HEAD_TIMEOUT_BODY), _HEAD_TIMEOUT_BODY))


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request-head deadline (``header_timeout_s``, set by ``protocol_class``)."""

    header_timeout_s: float = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return  # a request is being served: its body and response have their own limits
        self.transport.write(_HEAD_TIMEOUT_408)
        self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # a request head was parsed: its cycle started
            self._cancel_head_timer()

    def on_response_complete(self) -> None:
        body_unread = self.conn.their_state is h11.SEND_BODY  # before super() starts the next cycle
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if body_unread:
            self.transport.close()  # answered before its body arrived (408, 413): the rest is not worth reading
            return
        if self.cycle is None or self.cycle.response_complete:  # no pipelined request started meanwhile
            self._arm_head_timer()


def protocol_class(header_timeout_s: float) -> type[GuardedH11Protocol]:
    return type("RouterH11Protocol", (GuardedH11Protocol,), {"header_timeout_s": header_timeout_s})


def redact_query(path: str) -> str:
    """``/v1/models?api_key=sk-1&x=2`` -> ``/v1/models?api_key=<redacted>&x=<redacted>``."""
    base, sep, query = path.partition("?")
    return base + sep + _QUERY_VALUE.sub("=<redacted>", query) if sep else path


class RedactQueryFilter(logging.Filter):
    """Replaces query-string values in uvicorn's access log lines (args: client, method, path, version, status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], redact_query(args[2]), *args[3:])
        return True


def install_access_log_redaction() -> None:
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactQueryFilter) for f in access.filters):
        access.addFilter(RedactQueryFilter())


def server_config(app: Any, settings: RouterSettings, **kwargs: Any) -> uvicorn.Config:
    """The router's ``uvicorn.Config`` (``kwargs`` override, e.g. ``log_level`` in tests)."""
    options: dict[str, Any] = dict(host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
                                   timeout_graceful_shutdown=5, timeout_keep_alive=settings.http_keep_alive_s,
                                   http=protocol_class(settings.http_header_timeout_s))
    options.update(kwargs)
    config = uvicorn.Config(app, **options)  # configures logging: the filter goes on afterwards
    install_access_log_redaction()
    return config
