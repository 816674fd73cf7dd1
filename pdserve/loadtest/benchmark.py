"""One benchmark from options to result: validate, check the server, build the dataset, run, summarise.

``pdserve bench serve``, ``sweep``, ``client-overhead`` and ``pd-vs-colocated`` all go through here,
so they validate and measure identically.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from pdserve.loadtest.client import ClientConfig
from pdserve.loadtest.datasets import DATASETS, DatasetSpec, build_dataset
from pdserve.loadtest.errors import LoadTestError
from pdserve.loadtest.metrics import METRICS
from pdserve.loadtest.preflight import ServerInfo, check_server
from pdserve.loadtest.request import SampleRequest
from pdserve.loadtest.results import build_result, rate_value
from pdserve.loadtest.runner import RunConfig, run_benchmark
from pdserve.loadtest.tokenization import PromptMaker, load_tokenizer, local_counter, sampling_vocab, server_counter


@dataclass(slots=True)
class BenchOptions:
    """Everything ``bench serve`` takes. ``model`` None = the first model the server lists."""

    client: ClientConfig
    run: RunConfig
    dataset: DatasetSpec
    tokenizer: str | None = None
    percentile_metrics: tuple[str, ...] = METRICS
    percentiles: tuple[float, ...] = (99.0,)
    goodput_slos_ms: dict[str, float] = field(default_factory=dict)
    lag_warning_ms: float = 10.0
    label: str | None = None
    use_server_tokenize: bool = True


def validate(opts: BenchOptions) -> None:
    """Impossible arguments, found before anything touches the network."""
    r, d = opts.run, opts.dataset
    if not opts.client.base_url.startswith(("http://", "https://")):
        raise LoadTestError(f"--base-url must start with http:// or https://, got {opts.client.base_url!r}")
    if not (r.request_rate > 0) or math.isnan(r.request_rate):
        raise LoadTestError(f"--request-rate must be a positive number or inf, got {r.request_rate:g}")
    if not (r.burstiness > 0) or math.isinf(r.burstiness):
        raise LoadTestError(f"--burstiness must be a positive number, got {r.burstiness:g}")
    if r.num_warmups < 0:
        raise LoadTestError(f"--num-warmups must be at least 0, got {r.num_warmups}")
    if r.max_concurrency is not None and r.max_concurrency < 1:
        raise LoadTestError(f"--max-concurrency must be at least 1, got {r.max_concurrency}")
    if d.num_prompts < 1:
        raise LoadTestError(f"--num-prompts must be at least 1, got {d.num_prompts}")
    if d.name not in DATASETS:
        raise LoadTestError(f"unknown --dataset {d.name!r} (choose from {', '.join(DATASETS)})")
    for flag, value in (("--random-input-len", d.input_len), ("--random-output-len", d.output_len)):
        if value < 1:
            raise LoadTestError(f"{flag} must be at least 1, got {value}")
    if not 0 <= d.range_ratio < 1:
        raise LoadTestError(f"--random-range-ratio must be in [0, 1), got {d.range_ratio:g}")
    if d.name == "shared-prefix" and (d.prefix_len < 1 or d.suffix_len < 1 or d.num_groups < 1):
        raise LoadTestError("--shared-prefix-len, --shared-prefix-suffix-len and --shared-prefix-groups must be at least 1")
    if d.name == "multi-turn" and d.turns < 1:
        raise LoadTestError(f"--multi-turn-turns must be at least 1, got {d.turns}")
    bad = [m for m in opts.percentile_metrics if m not in METRICS]
    if bad:
        raise LoadTestError(f"--percentile-metrics: unknown metric {bad[0]!r} (choose from {', '.join(METRICS)})")
    for p in opts.percentiles:
        if not 0 < p < 100:
            raise LoadTestError(f"--metric-percentiles must be in (0, 100), got {p:g}")
    if opts.client.request_timeout_s <= 0:
        raise LoadTestError("--request-timeout must be positive")
    if d.name == "sharegpt":
        from pdserve.loadtest.datasets.sharegpt import load_pairs

        load_pairs(d.path)


async def prepare(opts: BenchOptions) -> tuple[ServerInfo, list[SampleRequest]]:
    """Validate, check the server and make the dataset; nothing here sends a generation request."""
    validate(opts)
    info = await check_server(opts.client.base_url, opts.client.model or None, opts.client.api_key)
    opts.client.model = info.model
    tokenizer = load_tokenizer(opts.tokenizer) if opts.tokenizer else load_tokenizer(info.model, info.root or "")
    async with aiohttp.ClientSession(headers=opts.client.headers(),
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:
        count = (server_counter(session, info.base_url, info.model)
                 if info.has_tokenize and opts.use_server_tokenize else local_counter(tokenizer))
        maker = PromptMaker(tokenizer, count, sampling_vocab(tokenizer))
        try:
            requests = await build_dataset(opts.dataset, maker)
        except aiohttp.ClientError as exc:
            raise LoadTestError(f"building the dataset with {info.base_url}/tokenize failed: {exc}") from None
    check_fits(requests, info)
    return info, requests


def check_fits(requests: list[SampleRequest], info: ServerInfo) -> None:
    """Refuse a dataset whose prompts plus output budgets exceed the server's ``max_model_len``.

    Multi-turn requests are skipped: their context grows with the answers, known only at run time.
    """
    if not info.max_model_len:
        return
    too_long = [r for r in requests if r.session_id is None
                and r.prompt_len + r.expected_output_len > info.max_model_len]
    if too_long:
        r = max(too_long, key=lambda r: r.prompt_len + r.expected_output_len)
        raise LoadTestError(
            f"{len(too_long)} of {len(requests)} requests exceed the server's max_model_len {info.max_model_len} "
            f"(longest: {r.prompt_len} prompt + {r.expected_output_len} output tokens); use shorter lengths")


def result_meta(opts: BenchOptions, info: ServerInfo, rate: float) -> dict[str, Any]:
    d = opts.dataset
    return {
        "backend": "openai-chat" if opts.client.endpoint == "chat" else "openai",
        "endpoint_type": opts.client.endpoint,
        "label": opts.label,
        "base_url": info.base_url,
        "model_id": info.model,
        "tokenizer_id": opts.tokenizer or info.model,
        "dataset": d.name,
        "num_prompts": d.num_prompts,
        "request_rate": rate_value(rate),
        "burstiness": opts.run.burstiness,
        "max_concurrency": opts.run.max_concurrency,
        "num_warmups": opts.run.num_warmups,
        "seed": d.seed,
        "server_tokenize": info.has_tokenize and opts.use_server_tokenize,
    }


async def run_prepared(opts: BenchOptions, info: ServerInfo, requests: list[SampleRequest],
                       rate: float | None = None) -> tuple[dict[str, Any], Any]:
    """Run ``requests`` (at ``rate``, default the options' rate) and return (result JSON, outcome)."""
    run = opts.run if rate is None else replace(opts.run, request_rate=rate)
    outcome = await run_benchmark(requests, opts.client, run)
    result = build_result(outcome, meta=result_meta(opts, info, run.request_rate),
                          percentile_metrics=opts.percentile_metrics, percentiles=opts.percentiles,
                          goodput_slos_ms=opts.goodput_slos_ms or None, lag_warning_ms=opts.lag_warning_ms,
                          mock_config=info.mock_config)
    return result, outcome


def run_sync(coro):
    """``asyncio.run`` on uvloop when it is installed (a faster loop means less client overhead)."""
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)
