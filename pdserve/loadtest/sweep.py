"""``pdserve bench sweep``: the same dataset at several request rates, SLO capacity, and plots.

Rates come from ``--request-rates`` or, with ``--saturation``, from a first run with every request
sent at once (under ``--max-concurrency``): its request throughput is the saturation point and the
sweep takes ``--num-rates`` evenly spaced rates up to it (guidellm's "sweep" profile does the same).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from pdserve.loadtest.errors import LoadTestError
from pdserve.loadtest.options import GreedyCommand, common_options, parse_floats, parse_slos, to_options
from pdserve.loadtest.slo import PRESETS, SloSpec, evaluate, slo_capacity


def saturation_rates(max_rate: float, k: int) -> list[float]:
    return [float(f"{max_rate * i / k:.3g}") for i in range(1, k + 1)]


def summary_point(result: dict[str, Any], offered: float, slo: dict[str, Any]) -> dict[str, Any]:
    point = {k: v for k, v in result.items() if not isinstance(v, (list, dict)) or k == "failed_by_status"}
    point.update(offered_rate=offered, **slo)
    return point


def format_sweep(points: list[dict[str, Any]], spec: SloSpec, capacity: float | None) -> str:
    head = f"{'rate':>8} {'req/s':>8} {'tok/s':>9} {'p50 TTFT':>9} {'p99 TTFT':>9} {'p50 TPOT':>9} " \
           f"{'p99 TPOT':>9} {'attain':>7} {'pass':>5} {'failed':>6}"
    lines = [head, "-" * len(head)]
    for p in points:
        lines.append(f"{p['offered_rate']:>8.3g} {p['request_throughput']:>8.2f} {p['output_throughput']:>9.1f} "
                     f"{p['median_ttft_ms']:>9.1f} {p['p99_ttft_ms']:>9.1f} {p['median_tpot_ms']:>9.1f} "
                     f"{p['p99_tpot_ms']:>9.1f} {100 * p['slo_attainment']:>6.1f}% {'yes' if p['slo_pass'] else 'no':>5} "
                     f"{p['failed']:>6}")
    crit = (f"p{spec.percentile:g} TTFT <= {spec.ttft_ms:g} ms and TPOT <= {spec.tpot_ms:g} ms"
            if spec.mode == "percentile" else
            f">= {100 * spec.attainment:g}% of requests within TTFT {spec.ttft_ms:g} ms and TPOT {spec.tpot_ms:g} ms")
    lines.append(f"SLO capacity ({spec.name}: {crit}): "
                 + (f"{capacity:g} req/s" if capacity is not None else "none of the tested rates"))
    return "\n".join(lines)


@click.command("sweep", cls=GreedyCommand)
@common_options
@click.option("--request-rates", default=None, help="Comma-separated rates, e.g. 0.5,1,2,4.")
@click.option("--saturation", is_flag=True, help="Find the saturation rate first, then sweep up to it.")
@click.option("--num-rates", type=int, default=6, show_default=True, help="Rates to test with --saturation.")
@click.option("--slo", "slo_values", multiple=True, help="SLOs: --slo ttft:MS tpot:MS.")
@click.option("--slo-preset", type=click.Choice(sorted(PRESETS)), default=None,
              help="MLPerf: mlperf-server 2000/200 ms, mlperf-interactive 450/40 ms, at p99.")
@click.option("--attainment", type=float, default=0.9, show_default=True,
              help="Share of requests that must meet both SLOs (with --slo).")
@click.option("--output-dir", type=click.Path(file_okay=False), default="bench-sweep", show_default=True)
def sweep_command(request_rates, saturation, num_rates, slo_values, slo_preset, attainment, output_dir, **kw) -> None:
    """Run a list of rates (or up to saturation) and report SLO capacity, with PNG plots."""
    from pdserve.loadtest.benchmark import prepare, run_prepared, run_sync
    from pdserve.loadtest.plots import plot_sweep
    from pdserve.loadtest.results import save_json

    try:
        if bool(request_rates) == saturation:
            raise LoadTestError("give exactly one of --request-rates R1,R2,... and --saturation")
        rates = list(parse_floats(request_rates, "--request-rates")) if request_rates else []
        if request_rates and (not rates or any(not r > 0 for r in rates)):
            raise LoadTestError(f"--request-rates must be positive numbers or inf, got {request_rates!r}")
        if saturation and num_rates < 1:
            raise LoadTestError(f"--num-rates must be at least 1, got {num_rates}")
        if slo_preset and slo_values:
            raise LoadTestError("give --slo or --slo-preset, not both")
        if slo_preset:
            spec = PRESETS[slo_preset]
        else:
            slos = parse_slos(slo_values, "--slo")
            if set(slos) != {"ttft", "tpot"}:
                raise LoadTestError("--slo needs both ttft:MS and tpot:MS (or use --slo-preset)")
            if not 0 < attainment <= 1:
                raise LoadTestError(f"--attainment must be in (0, 1], got {attainment:g}")
            spec = SloSpec(slos["ttft"], slos["tpot"], attainment=attainment)
        opts = to_options(kw, rates[0] if rates else math.inf)
        opts.percentiles = tuple(sorted(set(opts.percentiles) | {50.0, 90.0, 99.0}))
        opts.percentile_metrics = tuple(dict.fromkeys(opts.percentile_metrics + ("ttft", "tpot")))
        if not opts.goodput_slos_ms:
            opts.goodput_slos_ms = {"ttft": spec.ttft_ms, "tpot": spec.tpot_ms}
        out = Path(output_dir)

        async def main():
            # each run gets its own prompts (--seed, + 1, + 2, ...): a server keeps earlier runs' prompts in its
            # prefix cache, and a rate point that repeated them would report cached prefills' TTFT
            async def dataset(offset: int):
                return await prepare(replace(opts, dataset=replace(opts.dataset, seed=opts.dataset.seed + offset)))

            points, saturation_result = [], None
            todo = rates
            if saturation:
                click.echo("finding the saturation point (all requests at once)", err=True)
                info, requests = await dataset(0)
                saturation_result, _ = await run_prepared(opts, info, requests, math.inf)
                save_json(saturation_result, out / "saturation.json")
                todo = saturation_rates(saturation_result["request_throughput"], num_rates)
            for i, rate in enumerate(todo, start=1 if saturation else 0):
                click.echo(f"rate {rate:g} req/s", err=True)
                info, requests = await dataset(i)
                result, outcome = await run_prepared(opts, info, requests, rate)
                save_json(result, out / f"rate-{rate:g}.json")
                points.append(summary_point(result, rate, evaluate(spec, outcome.records)))
            return points, saturation_result

        points, sat = run_sync(main())
    except LoadTestError as exc:
        raise click.ClickException(str(exc)) from None
    capacity = slo_capacity(points)
    summary = {"slo": spec.as_dict(), "slo_capacity": capacity, "points": points,
               "saturation_request_throughput": sat["request_throughput"] if sat else None}
    (out / "sweep.json").write_text(json.dumps(summary, indent=2, default=str))
    plot_sweep(points, {"ttft": spec.ttft_ms, "tpot": spec.tpot_ms}, out / "sweep.png", capacity)
    click.echo(format_sweep(points, spec, capacity))
    click.echo(f"results: {out}/sweep.json, plot: {out}/sweep.png", err=True)
