"""The registry's error bodies (the OpenAI shape the router uses too) and its exception handlers."""

from __future__ import annotations

import logging

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError

log = logging.getLogger("pdserve.registry")


def error_body(status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
               headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status, headers=headers)


async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    """400 naming the first invalid parameter."""
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path")]
    param = ".".join(loc) or None
    return error_body(400, f"{param or 'request'}: {err.get('msg')}", "invalid_request_error", param)


async def redis_down(request: Request, exc: RedisError) -> JSONResponse:
    """503 with Retry-After: callers (heartbeats, the router) retry."""
    request.app.state.metrics.redis_errors.inc()
    log.warning("registry: redis error on %s %s: %s", request.method, request.url.path, exc)
    return error_body(503, f"registry storage unavailable: {type(exc).__name__}", "service_unavailable",
                      code="redis_unavailable", headers={"Retry-After": "1"})
