"""ASGI guards in front of the routes: API keys (401) and request body size (413).

Pure ASGI (not ``BaseHTTPMiddleware``) so the body limit holds for chunked uploads too: ``Content-Length``
is checked first, then the bytes actually received are counted.
"""

from __future__ import annotations

import hashlib
import hmac
import json
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
    def __init__(self, app: ASGIApp, api_keys: list[str], max_body_bytes: int) -> None:
        self.app = app
        self.api_keys = api_keys
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        path: str = scope.get("path", "")
        if self.api_keys and scope.get("method") != "OPTIONS" and not path.startswith(_OPEN_PATHS):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            scheme, _, token = auth.partition(" ")
            key = matching_key(token.strip(), self.api_keys) if scheme.lower() == "bearer" else None
            if key is None:
                await _send_error(send, 401, "Unauthorized: a valid API key is required "
                                             "(header 'Authorization: Bearer <key>')",
                                  [(b"www-authenticate", b"Bearer")])
                return
            scope.setdefault("state", {})["api_key_id"] = key_id(key)  # request.state.api_key_id
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

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def tracked_send(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLarge:
            if not started:
                await _send_error(send, 413, f"Request body is larger than the limit of {limit} bytes")


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
