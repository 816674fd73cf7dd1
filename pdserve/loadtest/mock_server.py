"""``pdserve bench mock-server``: an OpenAI-compatible streaming server with a set TTFT and token rate.

It answers ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (streaming and not, with
``stream_options.include_usage`` and ``continuous_usage_stats``), ``/tokenize`` when given a tokenizer,
and ``/health``. Against it the load generator measures itself: every latency beyond the configured ones
(``GET /mock/config``) is the client's overhead. ``GET /mock/stats`` counts the requests it received,
which is how the tests prove that bad input sends no load. Chat streams open with an empty
``{"role": "assistant"}`` chunk before the first token, as several real servers do.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import socket
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field

import click
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass(slots=True)
class MockConfig:
    """``token_rate`` is tokens per second per request (inf = no delay); times in ms."""

    models: list[str] = field(default_factory=lambda: ["mock-model"])
    ttft_ms: float = 0.0
    token_rate: float = math.inf
    tokens_per_chunk: int = 1
    output_len: int = 16
    max_model_len: int = 4096
    fail_every: int = 0
    role_chunk: bool = True
    tokenizer: str | None = None
    api_key: str | None = None


def _error(status: int, message: str, param: str | None, kind: str) -> JSONResponse:
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": kind, "param": param, "code": status}})


def make_app(cfg: MockConfig) -> FastAPI:
    app = FastAPI(title="pdserve mock OpenAI server")
    counts: Counter[str] = Counter()
    seq = itertools.count(1)
    state = {"in_flight": 0, "max_in_flight": 0}
    tok = None
    if cfg.tokenizer:
        from pdserve.loadtest.tokenization import load_tokenizer

        tok = load_tokenizer(cfg.tokenizer)

    def count_tokens(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False)) if tok is not None else len(text.split())

    if cfg.api_key:
        @app.middleware("http")
        async def require_key(request: Request, call_next):
            if request.url.path.startswith(("/v1/", "/tokenize")) and \
                    request.headers.get("authorization") != f"Bearer {cfg.api_key}":
                return _error(401, "Invalid or missing API key", None, "AuthenticationError")
            return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": "pdserve-mock", "root": cfg.tokenizer or m,
             "max_model_len": cfg.max_model_len}
            for m in cfg.models]}

    @app.get("/mock/config")
    async def config():
        d = asdict(cfg)
        d["token_rate"] = None if math.isinf(cfg.token_rate) else cfg.token_rate
        d.pop("api_key")
        return d

    @app.get("/mock/stats")
    async def stats():
        return {"requests": dict(counts), **state}

    if tok is not None:
        @app.post("/tokenize")
        async def tokenize(request: Request):
            body = await request.json()
            if body.get("model") not in cfg.models:
                return _error(404, f"The model `{body.get('model')}` does not exist.", "model", "NotFoundError")
            ids = tok.encode(str(body.get("prompt", "")), add_special_tokens=False)
            return {"tokens": ids, "count": len(ids), "max_model_len": cfg.max_model_len}

    async def generate(request: Request, chat: bool):
        counts[request.url.path] += 1
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "request body is not valid JSON", None, "BadRequestError")
        if body.get("model") not in cfg.models:
            return _error(404, f"The model `{body.get('model')}` does not exist.", "model", "NotFoundError")
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or cfg.output_len)
        if n < 1:
            return _error(400, "max_tokens must be at least 1", "max_tokens", "BadRequestError")
        if cfg.fail_every and next(seq) % cfg.fail_every == 0:
            return _error(500, "injected failure (--fail-every)", None, "InternalServerError")
        if chat:
            prompt_text = "\n".join(str(m.get("content", "")) for m in body.get("messages", []))
        else:
            prompt_text = str(body.get("prompt", ""))
        usage = {"prompt_tokens": count_tokens(prompt_text), "completion_tokens": n,
                 "total_tokens": 0}
        usage["total_tokens"] = usage["prompt_tokens"] + n
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:16]
        obj = "chat.completion.chunk" if chat else "text_completion"
        stream_opts = body.get("stream_options") or {}
        continuous = bool(stream_opts.get("continuous_usage_stats"))
        include_usage = bool(stream_opts.get("include_usage"))
        interval = cfg.tokens_per_chunk / cfg.token_rate
        start = time.perf_counter()

        async def until(t: float) -> None:
            delay = t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)

        def chunk(text: str | None, finish: str | None, done: int, role: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            d = {"id": rid, "object": obj, "created": int(time.time()), "model": body["model"], "choices": [choice]}
            if continuous:
                d["usage"] = {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": done,
                              "total_tokens": usage["prompt_tokens"] + done}
            return f"data: {json.dumps(d)}\n\n"

        if not body.get("stream"):
            await until(start + cfg.ttft_ms / 1000.0 + interval * (math.ceil(n / cfg.tokens_per_chunk) - 1))
            text = "".join(f" w{k}" for k in range(n))
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"})
            return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                    "model": body["model"], "choices": [choice], "usage": usage}

        async def events():
            state["in_flight"] += 1
            state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
            try:
                if chat and cfg.role_chunk:
                    yield chunk(None, None, 0, role=True)
                done = 0
                for c, k in enumerate(range(0, n, cfg.tokens_per_chunk)):
                    await until(start + cfg.ttft_ms / 1000.0 + c * interval)
                    k2 = min(k + cfg.tokens_per_chunk, n)
                    done = k2
                    yield chunk("".join(f" w{j}" for j in range(k, k2)), None, done)
                yield chunk(None, "length", done)
                if include_usage:
                    yield f"data: {json.dumps({'id': rid, 'object': obj, 'created': int(time.time()), 'model': body['model'], 'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state["in_flight"] -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    return app


def serve_mock(cfg: MockConfig, host: str, port: int, log_level: str = "warning") -> None:
    """Bind (port 0 = a free one), print ``mock server: URL`` on stdout, serve until SIGINT/SIGTERM."""
    import uvicorn

    app = make_app(cfg)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    url = f"http://{host}:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=False, backlog=4096))
    click.echo(f"mock server: {url}")
    sys_stdout_flush()
    server.run(sockets=[sock])


def sys_stdout_flush() -> None:
    import sys

    sys.stdout.flush()


@click.command("mock-server")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True, help="0 = any free port (printed).")
@click.option("--model", "models", multiple=True, default=("mock-model",), show_default=True)
@click.option("--ttft-ms", type=float, default=0.0, show_default=True, help="Time to first token.")
@click.option("--token-rate", type=float, default=float("inf"), show_default=True,
              help="Tokens per second per request after the first (inf = as fast as possible).")
@click.option("--tokens-per-chunk", type=int, default=1, show_default=True)
@click.option("--output-len", type=int, default=16, show_default=True, help="Tokens when max_tokens is absent.")
@click.option("--max-model-len", type=int, default=4096, show_default=True)
@click.option("--fail-every", type=int, default=0, show_default=True, help="Every K-th request gets HTTP 500.")
@click.option("--role-chunk/--no-role-chunk", default=True, show_default=True,
              help="Open chat streams with an empty role chunk before the first token.")
@click.option("--tokenizer", default=None, help="Enables /tokenize and exact usage counts (pdserve model name, HF dir).")
@click.option("--api-key", default=None, help="Require this Bearer token on /v1/* and /tokenize.")
@click.option("--log-level", default="warning", show_default=True)
def mock_server_command(host, port, models, ttft_ms, token_rate, tokens_per_chunk, output_len, max_model_len,
                        fail_every, role_chunk, tokenizer, api_key, log_level) -> None:
    """An OpenAI-compatible server with configurable TTFT and token rate, to measure the client itself."""
    if ttft_ms < 0 or not token_rate > 0 or tokens_per_chunk < 1 or output_len < 1 or fail_every < 0:
        raise click.ClickException("--ttft-ms >= 0, --token-rate > 0, --tokens-per-chunk >= 1, "
                                   "--output-len >= 1 and --fail-every >= 0 are required")
    cfg = MockConfig(models=list(models), ttft_ms=ttft_ms, token_rate=token_rate, tokens_per_chunk=tokens_per_chunk,
                     output_len=output_len, max_model_len=max_model_len, fail_every=fail_every,
                     role_chunk=role_chunk, tokenizer=tokenizer, api_key=api_key)
    serve_mock(cfg, host, port, log_level)
