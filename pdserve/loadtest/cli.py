"""``pdserve bench``: load tests against any OpenAI-compatible server (pdserve/loadtest/README.md)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import click

from pdserve.loadtest.errors import LoadTestError
from pdserve.services.cli import LazyGroup
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


# name -> ("module:attribute" of a click command, one-line help): imported only when run, as ``pdserve``'s own
# sub-commands (pdserve/services/cli.py), so that ``bench serve`` and ``mock-server`` do not import torch and
# transformers for the offline benchmarks' sake (3 CPU-s per start before this).
COMMANDS: dict[str, tuple[str, str]] = {
    "chaos": ("pdserve.loadtest.chaos:command", "Run every fault scenario against fresh local ensembles."),
    "client-overhead": ("pdserve.loadtest.overhead:client_overhead_command",
                        "The request rate the client sustains against a mock server, and its added latency."),
    "control-plane": ("pdserve.loadtest.control_plane:control_plane_command",
                      "Stand-in decode pods through real Redis, routers and registry: the tokens/s ceiling, CPU/token."),
    "ensemble-cpu": ("pdserve.loadtest.ensemble_cpu:ensemble_cpu_command",
                     "CPU per generated token: offline engine vs `pdserve up` colocated and 1P+1D, in turns."),
    "kv-routing": ("pdserve.loadtest.kv_routing_bench:kv_routing_command",
                   "Multi-turn chat through 1 prefill + 2 decode pods, round-robin vs KV-aware routing."),
    "kv-transfer": ("pdserve.loadtest.kv_transfer_bench:kv_transfer_command",
                    "KV-transfer throughput over loopback next to a plain socket copy of the same bytes."),
    "mock-server": ("pdserve.loadtest.mock_server:mock_server_command",
                    "An OpenAI-compatible server with configurable TTFT and token rate."),
    "overload": ("pdserve.loadtest.overload:command", "Offer 10x the sustainable rate against admission limits."),
    "pd-vs-colocated": ("pdserve.loadtest.pd_compare:pd_vs_colocated_command",
                        "Same workload against `pdserve up` disaggregated and colocated; one table."),
    "prefill-budget": ("pdserve.loadtest.prefill_budget:prefill_budget_command",
                       "A burst's prompt tokens per CPU-s, TTFT and peak RSS per prefill step budget, in turns."),
    "registry-lookup": ("pdserve.loadtest.registry_lookup:registry_lookup_command",
                        "Latency and registry CPU per KV lookup at 8 to 128 pods, checkouts in turns."),
    "router-start": ("pdserve.loadtest.router_start:router_start_command",
                     "Wall seconds and CPU-seconds of a router start, source trees in turns."),
    "serve-compare": ("pdserve.loadtest.serve_compare:serve_compare_command",
                      "The same `bench serve` requests against several servers in turns, with CPU per token."),
    "spec": ("pdserve.loadtest.spec_bench:spec_command",
             "Decode tok/s and TPOT with and without speculative decoding."),
    "step": ("pdserve.loadtest.step_bench:step_command", "A decode step and a prefill against their matmul floor."),
    "structured": ("pdserve.loadtest.structured_bench:structured_command",
                   "TPOT with a JSON schema (structured outputs) vs without, in turns; compile time cold and cached."),
    "sweep": ("pdserve.loadtest.sweep:sweep_command", "Run a list of rates (or up to saturation) and report SLO capacity."),
    "token-cost": ("pdserve.loadtest.token_cost:token_cost_command",
                   "Redis commands, Redis CPU and router CPU per generated token under `pdserve up`, checkouts in turns."),
    "throughput": ("pdserve.loadtest.throughput_bench:throughput_command",
                   "Offline throughput in turns: pdserve vs HF static, HF continuous batching and vLLM-CPU."),
    "multi-turn": ("pdserve.loadtest.kv_tiers_bench:multi_turn_command",
                   "Multi-turn chat against KV offloading tiers: none, CPU, CPU+disk, unlimited pool, in turns."),
    "tracing-overhead": ("pdserve.loadtest.tracing_overhead:tracing_overhead_command",
                         "`bench serve` against fresh `pdserve up`, OpenTelemetry tracing off and on in turns."),
    "tp": ("pdserve.loadtest.tp_bench:tp_command", "Memory per rank and decode step time at several TP sizes."),
    "ttft-breakdown": ("pdserve.loadtest.ttft_breakdown:ttft_breakdown_command",
                       "TTFT of a disaggregated request split into queue, prefill, KV transfer, first step."),
}


@click.group(cls=LazyGroup, lazy=COMMANDS)
def bench() -> None:
    """Load tests and benchmarks, serving and offline (pdserve/loadtest/README.md); each command is listed below."""


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


if __name__ == "__main__":
    sys.exit(bench())
