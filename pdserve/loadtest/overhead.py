"""``pdserve bench client-overhead``: how fast the load generator itself is, measured against the mock server.

The mock answers with no delay (or the configured TTFT/token rate), so every millisecond beyond the
configured latencies and every request per second short of the offered rate is the client's (or the
mock's: on a small machine they share the CPU, so the sustained rate is a lower bound for the client).
"""

from __future__ import annotations

import math

import click

from pdserve.loadtest.benchmark import BenchOptions, run_prepared, run_sync
from pdserve.loadtest.client import ClientConfig
from pdserve.loadtest.datasets import DatasetSpec
from pdserve.loadtest.preflight import check_server
from pdserve.loadtest.procs import free_port, mock_cmd, running
from pdserve.loadtest.request import SampleRequest
from pdserve.loadtest.results import save_json
from pdserve.loadtest.runner import RunConfig


def fixed_requests(n: int, output_len: int) -> list[SampleRequest]:
    """Short identical prompts: the overhead run needs no tokenizer and no dataset work."""
    return [SampleRequest(prompt="Say hello to the load generator.", prompt_len=7, expected_output_len=output_len)
            for _ in range(n)]


def measure(base_url: str, model: str, n: int, rate: float, concurrency: int | None, output_len: int,
            endpoint: str, progress: bool) -> dict:
    opts = BenchOptions(
        client=ClientConfig(base_url=base_url, model=model, endpoint=endpoint),
        run=RunConfig(request_rate=rate, max_concurrency=concurrency, show_progress=progress),
        dataset=DatasetSpec(num_prompts=n), percentiles=(50.0, 99.0),
    )

    async def main():
        info = await check_server(base_url, model)
        result, _ = await run_prepared(opts, info, fixed_requests(n, output_len))
        return result

    return run_sync(main())


@click.command("client-overhead")
@click.option("--num-prompts", type=int, default=2000, show_default=True)
@click.option("--request-rate", type=float, default=math.inf, show_default=True)
@click.option("--max-concurrency", type=int, default=64, show_default=True)
@click.option("--output-len", type=int, default=16, show_default=True)
@click.option("--ttft-ms", type=float, default=0.0, show_default=True)
@click.option("--token-rate", type=float, default=math.inf, show_default=True)
@click.option("--tokens-per-chunk", type=int, default=1, show_default=True)
@click.option("--endpoint", type=click.Choice(["completions", "chat"]), default="completions", show_default=True)
@click.option("--save-result", type=click.Path(dir_okay=False), default=None)
@click.option("--disable-tqdm", is_flag=True)
def client_overhead_command(num_prompts, request_rate, max_concurrency, output_len, ttft_ms, token_rate,
                            tokens_per_chunk, endpoint, save_result, disable_tqdm) -> None:
    """Start a mock server, load it, and print the request rate the client sustains and its added latency."""
    if num_prompts < 1 or not request_rate > 0 or max_concurrency < 1:
        raise click.ClickException("--num-prompts and --max-concurrency must be at least 1, --request-rate positive")
    port = free_port()
    cmd = mock_cmd(port, "--ttft-ms", str(ttft_ms), "--token-rate", str(token_rate),
                   "--tokens-per-chunk", str(tokens_per_chunk))
    from pdserve.loadtest.errors import LoadTestError

    try:
        with running(cmd, f"http://127.0.0.1:{port}/health", timeout_s=60):
            r = measure(f"http://127.0.0.1:{port}", "mock-model", num_prompts, request_rate, max_concurrency,
                        output_len, endpoint, not disable_tqdm)
    except LoadTestError as exc:
        raise click.ClickException(str(exc)) from None
    ov = r["client_overhead"]
    click.echo(f"requests: {r['completed']} ok, {r['failed']} failed in {r['duration']:.2f} s "
               f"(concurrency {max_concurrency}, {output_len} tokens each, {endpoint})")
    click.echo(f"sustained request rate:     {r['request_throughput']:.1f} req/s")
    click.echo(f"sustained chunk rate:       {r['output_throughput']:.0f} tok/s")
    click.echo(f"client CPU:                 {100 * r['client_cpu_util']:.0f}% of one core")
    click.echo(f"TTFT overhead mean / p99:   {ov['mean_ttft_overhead_ms']:.2f} / {ov['p99_ttft_overhead_ms']:.2f} ms")
    click.echo(f"ITL overhead mean / p99:    {ov['mean_itl_overhead_ms']:.3f} / {ov['p99_itl_overhead_ms']:.3f} ms")
    click.echo(f"send lag p99 / loop lag p99: {r['p99_send_lag_ms']:.2f} / {r['p99_client_loop_lag_ms']:.2f} ms")
    if save_result:
        from pathlib import Path

        save_json(r, Path(save_result))
