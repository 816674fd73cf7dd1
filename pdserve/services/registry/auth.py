"""Bearer-token authentication in front of every registry path but the probes'."""

from __future__ import annotations

import hmac
import logging
import time

from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.shared.protocol.registry import TOKEN_ENV

from .errors import error_body
from .metrics import RegistryMetrics

log = logging.getLogger("pdserve.registry")

# Probes and scrapers carry no token (kubelet, Prometheus); these answer without one.
OPEN_PATHS = frozenset({"/health", "/metrics"})
_REFUSAL_LOG_EVERY_S = 10.0


class BearerAuth:
    """ASGI guard: every path but :data:`OPEN_PATHS` needs ``Authorization: Bearer <token>``.

    Runs before routing and body parsing, so an unauthenticated caller learns nothing (not even a 400
    or 404). Refusals: 401, ``WWW-Authenticate: Bearer``, the registry's error body with ``code``
    ``missing_token`` (no bearer credentials) or ``invalid_token`` (another token). The comparison is
    constant-time; neither token is ever logged.
    """

    def __init__(self, app: ASGIApp, token: str, metrics: RegistryMetrics) -> None:
        self.app = app
        self._token = token.encode()
        self._metrics = metrics
        self._logged_at = float("-inf")
        self._unlogged = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, presented = auth.partition(b" ")
        presented = presented.strip()
        if scheme.lower() != b"bearer" or not presented:
            reason = "missing_token"
            message = f"registry authentication required: send 'Authorization: Bearer <token>' ({TOKEN_ENV})"
        elif not hmac.compare_digest(presented, self._token):
            reason = "invalid_token"
            message = f"registry token refused: it is not this registry's token ({TOKEN_ENV})"
        else:
            await self.app(scope, receive, send)
            return
        self._metrics.auth_failures.labels(reason).inc()
        self._log_refusal(scope, reason)
        response = error_body(401, message, "authentication_error", code=reason,
                              headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _log_refusal(self, scope: Scope, reason: str) -> None:
        # A scanner or a misconfigured pod can refuse thousands of times a minute: one line per interval.
        now = time.monotonic()
        if now - self._logged_at < _REFUSAL_LOG_EVERY_S:
            self._unlogged += 1
            return
        client = scope.get("client") or ("?", 0)
        more = f" ({self._unlogged} more refused since the last such line)" if self._unlogged else ""
        log.warning("registry: refused %s %s from %s: %s%s", scope["method"], scope["path"], client[0], reason, more)
        self._logged_at, self._unlogged = now, 0
