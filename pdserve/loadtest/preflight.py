"""Checks made before any load is sent: the server answers, serves the model, and what it offers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aiohttp

from pdserve.loadtest.errors import LoadTestError


@dataclass(slots=True)
class ServerInfo:
    """What ``GET /v1/models`` and the optional endpoints told us."""

    base_url: str
    model: str
    served_models: list[str]
    has_tokenize: bool
    max_model_len: int | None = None
    mock_config: dict[str, Any] | None = None
    root: str | None = None  # vLLM's /v1/models "root": the checkpoint the model was loaded from


def _reason(exc: BaseException, timeout_s: float) -> str:
    if isinstance(exc, aiohttp.ClientConnectorError) and isinstance(exc.os_error, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    if isinstance(exc, aiohttp.ClientConnectorError) and exc.os_error is not None:
        return (exc.os_error.strerror or type(exc.os_error).__name__).splitlines()[0]
    return (str(exc) or type(exc).__name__).splitlines()[0]


async def check_server(base_url: str, model: str | None, api_key: str | None = None,
                       timeout_s: float = 10.0) -> ServerInfo:
    """Raise :class:`LoadTestError` (one line) when the server cannot take this benchmark."""
    base = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as s:
        try:
            async with s.get(base + "/v1/models") as resp:
                if resp.status in (401, 403):
                    raise LoadTestError(
                        f"{base} refused the API key (HTTP {resp.status}): pass --api-key or set OPENAI_API_KEY")
                if resp.status != 200:
                    raise LoadTestError(f"{base} answered GET /v1/models with HTTP {resp.status}; "
                                        "is it an OpenAI-compatible server?")
                listing = await resp.json(content_type=None)
        except LoadTestError:
            raise
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise LoadTestError(f"cannot reach {base}: {_reason(exc, timeout_s)}") from None
        except ValueError:
            raise LoadTestError(f"{base} answered GET /v1/models with a body that is not JSON") from None
        entries = listing.get("data") if isinstance(listing, dict) else None
        if not isinstance(entries, list):
            raise LoadTestError(f"{base} answered GET /v1/models without a 'data' list")
        served = [str(e.get("id")) for e in entries if isinstance(e, dict)]
        if model is None:
            if not served:
                raise LoadTestError(f"{base} serves no model")
            model = served[0]
        elif model not in served:
            raise LoadTestError(f"model {model!r} is not served by {base} (served: {', '.join(served) or 'none'})")
        entry = next(e for e in entries if isinstance(e, dict) and str(e.get("id")) == model)
        max_len = entry.get("max_model_len")

        has_tokenize = False
        try:
            async with s.post(base + "/tokenize", json={"model": model, "prompt": "hello"}) as resp:
                if resp.status == 200:
                    body = await resp.json(content_type=None)
                    has_tokenize = isinstance(body, dict) and ("count" in body or "tokens" in body)
                    max_len = max_len or body.get("max_model_len")
        except (aiohttp.ClientError, TimeoutError, ValueError):
            pass

        mock = None
        try:
            async with s.get(base + "/mock/config") as resp:
                if resp.status == 200:
                    mock = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            pass
    root = entry.get("root")
    return ServerInfo(base, model, served, has_tokenize, int(max_len) if max_len else None, mock,
                      str(root) if root else None)
