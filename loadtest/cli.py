"""``pdserve bench``: load tests against any OpenAI-compatible server (loadtest/README.md)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import click

from pdserve.loadtest.errors import LoadTestError
from pdserve.loadtest.options import GreedyCommand, common_options, to_options


def one_line_errors(f):
    """Bad input becomes click's one-line ``Error: ...`` (exit 1), never a traceback."""

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        try:
            return f(*args, **kwargs)
        except LoadTestError as exc:
            raise click.ClickException(str(exc)) from None

    return wrapper


@click.group()
def bench() -> None:
    """Load tests and benchmarks, serving and offline (loadtest/README.md); each command is listed below."""


@bench.command("serve", cls=GreedyCommand)
@common_options
@click.option("--request-rate", type=float, default=float("inf"), show_default=True,
              help="Mean requests per second (gamma arrivals); inf = all at once.")
@click.option("--save-result", type=click.Path(dir_okay=False), default=None, help="Write the result JSON here.")
@click.option("--save-detailed", is_flag=True, help="Also write per-request JSONL and CSV beside --save-result.")
@click.option("--plot", type=click.Path(dir_okay=False), default=None, help="Write a PNG of the latency distributions.")
@one_line_errors
def serve(request_rate: float, save_result: str | None, save_detailed: bool, plot: str | None, **kw) -> None:
    """Run one benchmark and print vLLM's result table."""
    from pdserve.loadtest.benchmark import prepare, run_prepared, run_sync
    from pdserve.loadtest.results import format_table, save_detailed as write_detailed, save_json

    opts = to_options(kw, request_rate)
    if save_detailed and not save_result:
        raise LoadTestError("--save-detailed needs --save-result PATH (the per-request files go beside it)")

    async def main():
        info, requests = await prepare(opts)
        click.echo(f"{len(requests)} requests ({opts.dataset.name}) -> {info.base_url} model {info.model} "
                   f"at {request_rate:g} req/s", err=True)
        return await run_prepared(opts, info, requests)

    result, outcome = run_sync(main())
    click.echo(format_table(result, opts.percentile_metrics, opts.percentiles))
    if save_result:
        path = Path(save_result)
        save_json(result, path)
        click.echo(f"result: {path}", err=True)
        if save_detailed:
            jsonl, csv_path = write_detailed(outcome.records, path)
            click.echo(f"per-request: {jsonl} {csv_path}", err=True)
    if plot:
        from pdserve.loadtest.plots import plot_run

        plot_run(outcome.records, result, Path(plot))
        click.echo(f"plot: {plot}", err=True)


def _register() -> None:
    from pdserve.loadtest.mock_server import mock_server_command
    from pdserve.loadtest.overhead import client_overhead_command
    from pdserve.loadtest.pd_compare import pd_vs_colocated_command
    from pdserve.loadtest.chaos import command as chaos_command
    from pdserve.loadtest.overload import command as overload_command
    from pdserve.loadtest.kv_routing_bench import kv_routing_command
    from pdserve.loadtest.kv_transfer_bench import kv_transfer_command
    from pdserve.loadtest.spec_bench import spec_command
    from pdserve.loadtest.step_bench import step_command
    from pdserve.loadtest.ensemble_cpu import ensemble_cpu_command
    from pdserve.loadtest.prefill_budget import prefill_budget_command
    from pdserve.loadtest.router_start import router_start_command
    from pdserve.loadtest.serve_compare import serve_compare_command
    from pdserve.loadtest.throughput_bench import throughput_command
    from pdserve.loadtest.tp_bench import tp_command
    from pdserve.loadtest.sweep import sweep_command
    from pdserve.loadtest.ttft_breakdown import ttft_breakdown_command

    for cmd in (sweep_command, mock_server_command, client_overhead_command, pd_vs_colocated_command,
                kv_routing_command, kv_transfer_command, ttft_breakdown_command, ensemble_cpu_command,
                serve_compare_command, prefill_budget_command, router_start_command):
        bench.add_command(cmd)
    bench.add_command(chaos_command, "chaos")
    bench.add_command(overload_command, "overload")
    bench.add_command(throughput_command, "throughput")
    bench.add_command(spec_command, "spec")
    bench.add_command(step_command, "step")
    bench.add_command(tp_command, "tp")


_register()

if __name__ == "__main__":
    sys.exit(bench())
