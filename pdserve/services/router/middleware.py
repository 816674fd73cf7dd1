"""ASGI guards in front of the routes: API keys (401, and 400 for two ``Authorization`` headers), the body's
media type (415 unless JSON), size (413) and read time (408).

Pure ASGI (not ``BaseHTTPMiddleware``) so the body limit holds for chunked uploads too: ``Content-Length``
is checked first, then the bytes actually received are counted.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_body

# Paths open without a key, as in vLLM (probes and scrapers carry no key).
_OPEN_PATHS = ("/health", "/metrics", "/ping", "/version")


class BodyTooLarge(HTTPException):
    """Raised from ``receive``; an ``HTTPException`` so FastAPI's body reader passes it through unchanged."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"Request body is larger than the limit of {limit} bytes")


class BodyTimeout(HTTPException):
    """Raised from ``receive`` when the body has not fully arrived in time (a slowloris client)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(408, f"The request body did not arrive within {timeout_s:g} s")


def media_type(content_type: bytes | None) -> str:
    """``b"application/json; charset=utf-8"`` -> ``"application/json"`` ("" when absent)."""
    return (content_type or b"").decode("latin-1").split(";", 1)[0].strip().lower()


def is_json(content_type: bytes | None) -> bool:
    kind = media_type(content_type)
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


async def _send_error(send: Send, status: int, message: str, headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(error_body(status, message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


def key_matches(presented: str, keys: list[str]) -> bool:
    """Constant-time comparison against every accepted key (no early exit on the first match)."""
    return matching_key(presented, keys) is not None


def matching_key(presented: str, keys: list[str]) -> str | None:
    """The accepted key equal to ``presented`` (None if none), compared in constant time against every key."""
    found = None
    for key in keys:
        if hmac.compare_digest(presented.encode(), key.encode()):
            found = key
    return found


def key_id(key: str) -> str:
    """A stable, non-reversible name for an API key (SHA-256, 16 hex digits) — what the router keeps of it."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class GuardMiddleware:
    """``json_paths``: POST routes whose body must be ``Content-Type: application/json`` (or ``+json``);
    ``body_timeout_s``: the whole body must arrive within this long of the request head (None = no limit)."""

    def __init__(self, app: ASGIApp, api_keys: list[str], max_body_bytes: int, json_paths: frozenset[str] = frozenset(),
                 body_timeout_s: float | None = None) -> None:
        self.app = app
        self.api_keys = api_keys
        self.max_body_bytes = max_body_bytes
        self.json_paths = json_paths
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        path: str = scope.get("path", "")
        if self.api_keys and scope.get("method") != "OPTIONS" and not path.startswith(_OPEN_PATHS):
            # a proxy in front may check one and this router would read the other: which counts is ambiguous
            count = sum(1 for k, _ in scope.get("headers", []) if k.lower() == b"authorization")
            if count > 1:
                await _send_error(send, 400, f"The request has {count} Authorization headers; send exactly one")
                return
            auth = headers.get(b"authorization", b"").decode("latin-1")
            scheme, _, token = auth.partition(" ")
            key = matching_key(token.strip(), self.api_keys) if scheme.lower() == "bearer" else None
            if key is None:
                await _send_error(send, 401, "Unauthorized: a valid API key is required "
                                             "(header 'Authorization: Bearer <key>')",
                                  [(b"www-authenticate", b"Bearer")])
                return
            scope.setdefault("state", {})["api_key_id"] = key_id(key)  # request.state.api_key_id
        if scope.get("method") == "POST" and path in self.json_paths and not is_json(headers.get(b"content-type")):
            got = headers.get(b"content-type")
            await _send_error(send, 415, "Unsupported Media Type: the request body must be JSON, sent with the header "
                                         "'Content-Type: application/json' (got "
                                         + (repr(got.decode("latin-1")[:100]) if got is not None else "no Content-Type")
                                         + ")")
            return
        length = headers.get(b"content-length")
        limit = self.max_body_bytes
        if length is not None:
            try:
                too_large = int(length) > limit
            except ValueError:
                too_large = False
            if too_large:
                await _send_error(send, 413, f"Request body is larger than the limit of {limit} bytes")
                return

        received = 0
        started = False
        body_done = False
        body_timeout_s = self.body_timeout_s

        async def counted_receive() -> Message:
            nonlocal received, body_done
            if body_done or body_timeout_s is None:
                message = await receive()  # after the body: disconnect notices, which may come much later
            else:
                try:
                    message = await asyncio.wait_for(receive(), max(0.0, start + body_timeout_s - time.monotonic()))
                except asyncio.TimeoutError:
                    raise BodyTimeout(body_timeout_s) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
                body_done = not message.get("more_body", False)
            return message

        async def tracked_send(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except (BodyTooLarge, BodyTimeout) as exc:
            if not started:
                # the client is still sending (or stalling): close the connection rather than read the rest
                await _send_error(send, exc.status_code, str(exc.detail), [(b"connection", b"close")])


class StatusCounter:
    """Counts responses by path and status (``pdserve:router_requests_total``); unknown paths share one label
    so a scanner cannot blow up the metric's cardinality."""

    def __init__(self, app: ASGIApp, counter: Any, paths: set[str]) -> None:
        self.app = app
        self.counter = counter
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in self.paths else "other"
        counted = False

        async def counting_send(message: dict[str, Any]) -> None:
            nonlocal counted
            if message["type"] == "http.response.start" and not counted:
                counted = True
                self.counter.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
