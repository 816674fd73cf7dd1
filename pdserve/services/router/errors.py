"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with the right HTTP status.

``type`` follows vLLM's OpenAI server (the exception class the official client raises for that status,
e.g. "BadRequestError"), ``code`` is the HTTP status, ``param`` names the offending request field or is null.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("pdserve.router")

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}


class OpenAIError(Exception):
    """An error the client is told about; raise it anywhere below a route."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None, err_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers
        self.type = err_type or _TYPES.get(status, "InternalServerError")

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.type)


def redis_unavailable(exc: Exception, retry_after_s: int) -> OpenAIError:
    logger.warning("redis error: %s: %s", type(exc).__name__, exc)
    return OpenAIError(503, f"The request queue (Redis) is unavailable: {type(exc).__name__}",
                       headers={"Retry-After": str(retry_after_s)})


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)


def error_body(status: int, message: str, param: str | None = None, err_type: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type or _TYPES.get(status, "InternalServerError"),
                      "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|[A-Za-z]+\[.*\]|function-.*)$")


def _clean_loc(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """Drop pydantic's union-branch tags ("str", "list[str]", ...) from an error location."""
    return tuple(p for p in loc if not (isinstance(p, str) and _TYPE_TAG.match(p)))


def _param_of(loc: tuple[Any, ...]) -> str | None:
    """``("body", "messages", 0, "content")`` -> "messages"; the top-level field is what OpenAI names."""
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    for part in parts:
        if isinstance(part, str):
            return part
    return None


def describe_validation_error(err: dict[str, Any]) -> tuple[str, str | None]:
    """Turn one pydantic/FastAPI error entry into (message, param)."""
    if err.get("type") == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return f"Malformed JSON body: {detail}".rstrip(": "), None
    if err.get("type") == "invalid_unicode":  # schemas._Body: raised on the whole body, names the field itself
        return err.get("msg", "invalid Unicode text"), (err.get("ctx") or {}).get("param")
    loc = _clean_loc(tuple(err.get("loc", ())))
    param = _param_of(loc)
    where = ".".join(str(p) for p in loc[1:] if p is not None) if loc and loc[0] == "body" else ""
    msg = err.get("msg", "invalid value")
    if err.get("type") == "missing" and where == "":
        return "Request body must be a JSON object", None
    if err.get("type") == "model_attributes_type" and not where:
        return "Request body must be a JSON object", None
    if "input" in err and err.get("type") not in ("missing",):
        shown = repr(err["input"])
        if len(shown) > 100:
            shown = shown[:100] + "..."
        return f"Invalid value for '{where}': {msg} (got {shown})", param
    return (f"'{where}': {msg}" if where else msg), param


async def openai_error_handler(_: Request, exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def validation_error_handler(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    message, param = describe_validation_error(errors[0]) if errors else ("Invalid request", None)
    # A union field fails once per accepted type; count only errors about other fields.
    others = {_param_of(_clean_loc(tuple(e.get("loc", ())))) for e in errors[1:]} - {param}
    if others:
        message += f" (and errors in {', '.join(sorted(str(o) for o in others))})"
    return error_response(400, message, param)


async def unexpected_error_handler(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unexpected error", exc_info=exc)
    return error_response(500, f"Internal server error ({type(exc).__name__})")


def supported_endpoints(app: Any) -> list[str]:
    """``"METHOD /path"`` for every operation in ``app``'s OpenAPI schema (FastAPI builds it once and keeps it),
    in the order the routes were declared."""
    return [f"{method.upper()} {path}" for path, operations in app.openapi()["paths"].items()
            for method in operations]


def _shown_path(request: Request) -> str:
    path = request.url.path
    return path if len(path) <= 200 else path[:200] + "..."


def routing_error_message(request: Request, exc: StarletteHTTPException) -> str:
    """What the client is told for a routing miss: the path it asked for and what is served instead (a 404 for an
    unknown path, a 405 for a known path with the wrong method); other HTTP errors keep their own detail."""
    matched = "endpoint" in request.scope  # set once a route matched the path
    if exc.status_code == 404 and not matched:
        return (f"Unknown endpoint {request.method} {_shown_path(request)}. Supported endpoints: "
                f"{', '.join(supported_endpoints(request.app))}.")
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        return f"Method {request.method} is not allowed on {_shown_path(request)}; allowed: {allowed}."
    return str(exc.detail)


async def http_error_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, routing_error_message(request, exc), None,
                          headers=getattr(exc, "headers", None))
