"""The engine flags shared by ``pdserve prefill`` and ``pdserve decode`` (same names as the settings)."""

from __future__ import annotations

import asyncio

import click

from pdserve.shared.logs import setup_logging

_OPTIONS = [
    click.option("--host", default=None, help="HTTP bind address [PDSERVE_HOST, default 0.0.0.0]."),
    click.option("--port", type=int, default=None, help="HTTP port for /health and /metrics [PDSERVE_PORT]."),
    click.option("--pod-id", default=None, help="Unique pod name [PDSERVE_POD_ID, default hostname-random]."),
    click.option("--advertise-host", default=None, help="Address other pods reach this one at [PDSERVE_ADVERTISE_HOST]."),
    click.option("--redis-url", default=None, help="Redis URL [PDSERVE_REDIS_URL or REDIS_URL]."),
    click.option("--registry-url", default=None, help="Block registry URL [PDSERVE_REGISTRY_URL]."),
    click.option("--registry-token", default=None,
                 help="The registry's bearer token [PDSERVE_REGISTRY_TOKEN; prefer the variable: a flag shows in ps]."),
    click.option("--kv-transfer-secret", default=None, help="Shared KV-transfer secret [PDSERVE_KV_TRANSFER_SECRET]."),
    click.option("--model", default=None, help="Model name, HF directory or .gguf [PDSERVE_MODEL]."),
    click.option("--dtype", default=None, help="float32|bfloat16|float16|auto [PDSERVE_DTYPE, default float32]."),
    click.option("--block-size", type=int, default=None, help="Tokens per KV block [default 16]."),
    click.option("--max-model-len", type=int, default=None, help="Context length [default: the model's]."),
    click.option("--max-num-seqs", type=int, default=None, help="Requests per batch [default 64]."),
    click.option("--max-num-batched-tokens", type=int, default=None, help="Token budget per step [default 2048]."),
    click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=None, help="Prefix caching [on]."),
    click.option("--kv-cache-memory", default=None, help="KV cache size, e.g. 512MiB [PDSERVE_KV_CACHE_MEMORY]."),
    click.option("--attention-backend", default=None, help="auto|cpu|torch|triton."),
    click.option("--device", default=None, help="cpu|cuda [default cpu]."),
    click.option("--engine-stall-s", type=float, default=None,
                 help="An engine with no finished step for this long counts as stuck: no heartbeat, /health 503 "
                      "[PDSERVE_ENGINE_STALL_S, default 300]."),
    click.option("--log-level", default=None, help="debug|info|warning|error [PDSERVE_LOG_LEVEL]."),
]


def worker_options(fn):
    for option in reversed(_OPTIONS):
        fn = option(fn)
    return fn


def given(flags: dict) -> dict:
    """Only the flags the user set, so ``PDSERVE_*`` variables fill in the rest."""
    return {k: v for k, v in flags.items() if v is not None}


def run_worker(settings_cls, worker_cls, flags: dict) -> None:
    """Build the settings from the given flags (env fills the rest), set up logging, serve until stopped."""
    from pdserve.shared.worker.base import serve

    settings = settings_cls(**given(flags))
    setup_logging(settings.log_level)
    asyncio.run(serve(worker_cls(settings)))
