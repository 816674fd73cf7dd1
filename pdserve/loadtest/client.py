"""Streaming OpenAI-compatible requests over one pooled ``aiohttp`` session.

Each call posts one request with ``stream: true`` and ``stream_options.include_usage`` (and
``continuous_usage_stats``, which vLLM-style servers answer with a running token count per chunk, so
multi-token chunks are counted right), reads the SSE ``data:`` lines as they arrive (strictly: any other non-empty line fails the request, as in
vLLM's benchmark; ``pdserve.loadtest.sse``) and folds them into
a :class:`~pdserve.loadtest.timeline.RequestRecord`. A failure is recorded by status, never raised.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdserve.loadtest.sse import SSEProtocolError, StrictSSE
from pdserve.loadtest.timeline import RequestRecord, StreamTimeline

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(slots=True)
class ClientConfig:
    """How requests are built. ``extra_body`` is merged into every request body last."""

    base_url: str
    model: str
    endpoint: str = "completions"
    api_key: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    continuous_usage_stats: bool = True
    request_timeout_s: float = 600.0
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ENDPOINTS[self.endpoint]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def make_session(cfg: ClientConfig, max_connections: int | None) -> aiohttp.ClientSession:
    """One keep-alive connection pool for the whole run (``max_connections`` None = unbounded)."""
    connector = aiohttp.TCPConnector(limit=max_connections or 0, ttl_dns_cache=300, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=cfg.request_timeout_s)
    return aiohttp.ClientSession(
        connector=connector, timeout=timeout, headers=cfg.headers(), read_bufsize=1 << 20
    )


def build_body(cfg: ClientConfig, prompt: str | None, messages: list[dict] | None, max_tokens: int) -> dict:
    body: dict[str, Any] = {"model": cfg.model, "max_tokens": max_tokens, "stream": True,
                            "temperature": cfg.temperature}
    opts: dict[str, Any] = {"include_usage": True}
    if cfg.continuous_usage_stats:
        opts["continuous_usage_stats"] = True
    body["stream_options"] = opts
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.endpoint == "chat":
        body["messages"] = messages if messages is not None else [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt if prompt is not None else render_messages(messages or [])
    body.update(cfg.extra_body)
    return body


def render_messages(messages: list[dict]) -> str:
    """A plain-text transcript for sending a conversation to ``/v1/completions``."""
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nassistant:"


def _error_message(text: str) -> str:
    try:
        err = json.loads(text).get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))
        if err:
            return str(err)
    except (ValueError, AttributeError):
        pass
    return text.strip().splitlines()[0][:300] if text.strip() else ""


async def send_streaming(
    session: aiohttp.ClientSession, cfg: ClientConfig, body: dict, record: RequestRecord
) -> RequestRecord:
    """Post ``body`` and time its stream into ``record`` (``record.actual_send`` must be set by the caller)."""
    start = time.perf_counter()
    tl = StreamTimeline(record, start)
    try:
        async with session.post(cfg.url, json=body) as resp:
            if resp.status != 200:
                return tl.fail(str(resp.status), _error_message(await resp.text()) or resp.reason or "")
            sse = StrictSSE()
            try:
                async for raw in resp.content:
                    t = time.perf_counter()
                    data = sse.feed(raw)
                    if sse.done:
                        break
                    if data is None:
                        continue
                    tl.on_chunk(t, data)
                    if record.status == "stream_error":
                        break
                else:
                    sse.close()
            except SSEProtocolError as exc:  # vLLM's benchmark fails on the same line
                return tl.fail("stream_error", f"malformed SSE stream: {exc}")
    except asyncio.TimeoutError:
        return tl.fail("timeout", f"no data for {cfg.request_timeout_s:g} s")
    except aiohttp.ClientConnectionError as exc:
        return tl.fail("connection_error", f"{type(exc).__name__}: {exc}")
    except aiohttp.ClientError as exc:
        return tl.fail("client_error", f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # e.g. a line over the read buffer: one request fails, the run goes on
        return tl.fail("client_error", f"{type(exc).__name__}: {exc}")
    return tl.finish()
