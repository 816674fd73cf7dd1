"""``pdserve router``: run the OpenAI-compatible gateway under uvicorn."""

from __future__ import annotations

from typing import Any

import click

from pdserve.shared.logs import setup_logging

from .settings import RouterSettings



@click.command("router")
@click.option("--host", default=None, help="Bind address [PDSERVE_HOST, default 0.0.0.0].")
@click.option("--port", type=int, default=None, help="HTTP port [PDSERVE_PORT, default 8000].")
@click.option("--model", default=None, help="Model name or local directory [PDSERVE_MODEL].")
@click.option("--served-model-name", default=None, help="Name clients send as 'model' [default: --model].")
@click.option("--redis-url", default=None, help="Redis URL [PDSERVE_REDIS_URL or REDIS_URL].")
@click.option("--registry-url", default=None, help="Block registry URL [PDSERVE_REGISTRY_URL].")
@click.option("--api-key", default=None, help="Accepted API key(s), comma-separated [PDSERVE_API_KEY].")
@click.option("--cache-salt-per-api-key/--no-cache-salt-per-api-key", default=None,
              help="Give each API key its own prefix-cache namespace [PDSERVE_CACHE_SALT_PER_API_KEY, off].")
@click.option("--enable-prompt-tokens-details/--no-enable-prompt-tokens-details", default=None,
              help="Report usage.prompt_tokens_details.cached_tokens [PDSERVE_ENABLE_PROMPT_TOKENS_DETAILS, off].")
@click.option("--registry-token", default=None, help="Bearer token the registry requires [PDSERVE_REGISTRY_TOKEN].")
@click.option("--max-body-bytes", type=int, default=None, help="Largest request body (413 above).")
@click.option("--max-model-len", type=int, default=None, help="Context length [default: the model's].")
@click.option("--local-prefill-threshold", type=int, default=None,
              help="Prompts of at most this many tokens are prefilled on the decode pod.")
@click.option("--local-prefill-fallback-max-tokens", type=int, default=None,
              help="With no prefill pod alive, only prompts of at most this many tokens go to a decode pod's "
                   "local prefill; longer ones wait for a prefill pod [default 256].")
@click.option("--prefill-stall-s", type=float, default=None,
              help="Move a request whose prefill worker stopped touching it (or whose queue entry Redis lost) "
                   "after this long (0 = never) [default 30].")
@click.option("--routing-mode", type=click.Choice(["kv", "round_robin", "least_loaded"]), default=None,
              help="Decode pod choice [PDSERVE_ROUTING_MODE, default kv].")
@click.option("--routing-load-weight", type=float, default=None,
              help="kv routing: cost of one request on a pod, in prompt blocks [default 8].")
@click.option("--routing-temperature", type=float, default=None,
              help="kv routing: softmax temperature over costs, in blocks (0 = cheapest) [default 1].")
@click.option("--max-concurrent-requests", type=int, default=None,
              help="Requests served at once; more get 429 (0 = no limit).")
@click.option("--request-timeout-s", type=float, default=None, help="Abort after this long without output.")
@click.option("--migration-stall-s", type=float, default=None,
              help="Move a stalled choice off a decode pod that left the registry after this long (0 = never).")
@click.option("--max-migrations", type=int, default=None, help="Moves per choice before it fails with 503.")
@click.option("--max-queued-requests", type=int, default=None,
              help="Requests (each prompt x n counts) not decoding yet; more get 429 (0 = no limit).")
@click.option("--max-prompts-per-request", type=int, default=None,
              help="Prompts one /v1/completions request may list; more get 400 [default 256].")
@click.option("--sse-ping-s", type=float, default=None,
              help="SSE keep-alive comments every this many seconds (0 = none: only data lines) [default 0].")
@click.option("--http-header-timeout-s", type=float, default=None,
              help="A request head must arrive within this long, else 408 and close [default 10].")
@click.option("--http-body-timeout-s", type=float, default=None,
              help="A request body must arrive within this long of its head, else 408 [default 60].")
@click.option("--http-keep-alive-s", type=float, default=None,
              help="Close an idle keep-alive connection after this long [default 5].")
@click.option("--max-queued-prompt-tokens", type=int, default=None,
              help="Prompt tokens of the requests not decoding yet; more get 429 (0 = no limit).")
@click.option("--shutdown-grace-s", type=float, default=None,
              help="On SIGTERM, seconds requests in flight may still run before they end with an error "
                   "[PDSERVE_SHUTDOWN_GRACE_S, default 30].")
@click.option("--log-level", default=None, help="debug|info|warning|error [PDSERVE_LOG_LEVEL].")
def command(**flags: Any) -> None:
    """Run the router (OpenAI-compatible REST gateway). Flags override PDSERVE_* environment variables."""
    import uvicorn

    from .app import create_app
    from .drain import DrainingServer
    from .server import server_config

    settings = RouterSettings(**{k: v for k, v in flags.items() if v is not None})
    setup_logging(settings.log_level)
    app = create_app(settings)
    DrainingServer(server_config(app, settings), app.state.drain).run()  # SIGTERM drains first (drain.py)


if __name__ == "__main__":
    command()
