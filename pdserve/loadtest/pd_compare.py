"""``pdserve bench pd-vs-colocated``: one workload against disaggregated and colocated pdserve, one table.

The workload mixes short requests with long prompts that keep arriving (every ``--long-every``-th
request). In a colocated engine each long prefill shares steps with the short requests' decodes, so
their TPOT and ITL spike (prefill interference); with separate prefill and decode tiers they should
not. Each configuration is started as ``pdserve up --port P --model M (--prefill 1 --decode 1 |
--colocated)`` on a free port, used once ``GET /health`` answers 200 and a one-token completion
succeeds (a router is healthy before its workers have registered), and stopped with SIGTERM.
"""

from __future__ import annotations

import math
import os
import shlex
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from pdserve.loadtest.errors import LoadTestError

MODES = {"disaggregated": ["--prefill", "1", "--decode", "1"], "colocated": ["--colocated"]}


def pin_args(mode: str) -> list[str]:
    """``pdserve up`` flags that pin each tier to its own cores, a stand-in for separate machines on one: prefill on
    the first core this process may use and decode on the second (disaggregated), or the one decode worker on both
    (colocated). The router, registry and Redis are not pinned. Needs two cores."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise LoadTestError(f"--pin needs two cores; this process may use {cores}")
    if mode == "disaggregated":
        return ["--prefill-cpus", str(cores[0]), "--decode-cpus", str(cores[1])]
    return ["--decode-cpus", f"{cores[0]},{cores[1]}"]


def up_unavailable_reason() -> str | None:
    """Why ``pdserve up`` cannot run disaggregated and colocated here, or None when it can."""
    try:
        from pdserve.services.cli import main
    except ImportError as exc:
        return f"pdserve's CLI does not import ({exc})"
    import click as _click

    up = main.get_command(_click.Context(main), "up") if isinstance(main, _click.Group) else None
    if up is None or (up.help or "").startswith("(unavailable"):
        detail = f": {up.help[len('(unavailable: '):-1]}" if up is not None and up.help else ""
        return f"`pdserve up` is not available in this install (the ensemble is not built yet){detail}"
    flags = {o for p in up.params for o in getattr(p, "opts", [])}
    missing = [f for f in ("--port", "--model", "--prefill", "--decode", "--colocated") if f not in flags]
    if missing:
        return f"`pdserve up` lacks {', '.join(missing)}"
    import importlib.util

    for service in ("router", "prefill", "decode", "registry"):
        module = f"pdserve.services.{service}.main"
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:
            found = False
        if not found:
            return f"`pdserve up` cannot start the ensemble yet: {module} is missing"
    return None


def parse_launches(values: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for v in values:
        mode, sep, cmd = v.partition("=")
        if not sep or mode not in MODES or not cmd.strip():
            raise LoadTestError(f"--launch: expected MODE=COMMAND with MODE in {', '.join(MODES)}, got {v!r}")
        out[mode] = cmd
    return out


def interleave(short: list, long: list, every: int) -> list:
    """Every ``every``-th request is long, starting with a short one; leftovers go at the end."""
    out, s, l = [], iter(short), iter(long)
    for i in range(len(short) + len(long)):
        nxt = next(l, None) if (i + 1) % every == 0 else next(s, None)
        if nxt is None:
            nxt = next(s, None) or next(l)
        out.append(nxt)
    return out


def table(rows: dict[str, dict[str, Any]]) -> str:
    cols = [("short p50 TPOT", "short", "median_tpot_ms"), ("short p99 TPOT", "short", "p99_tpot_ms"),
            ("short p99 ITL", "short", "p99_itl_ms"), ("short p50 TTFT", "short", "median_ttft_ms"),
            ("short p99 TTFT", "short", "p99_ttft_ms"), ("long p99 TTFT", "long", "p99_ttft_ms")]
    head = f"{'mode':<14}" + "".join(f"{c[0]:>16}" for c in cols) + f"{'out tok/s':>11}{'failed':>8}"
    lines = ["latencies in ms", head, "-" * len(head)]
    for mode, r in rows.items():
        cells = "".join(f"{r['by_label'].get(lbl, {}).get(key, math.nan):>16.1f}" for _, lbl, key in cols)
        lines.append(f"{mode:<14}{cells}{r['output_throughput']:>11.1f}{r['failed']:>8}")
    return "\n".join(lines)


MIXES = ("mixed", "short", "long")


def split_counts(num_prompts: int, long_every: int, mix: str) -> tuple[int, int]:
    """(short, long) request counts: every ``long_every``-th request long (``mixed``), or all of one kind."""
    if mix == "short":
        return num_prompts, 0
    if mix == "long":
        return 0, num_prompts
    n_long = num_prompts // long_every
    return num_prompts - n_long, n_long


def ratios(rows: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Disaggregated over colocated for the figures issue 29's goals name (NaN where a class or mode is missing)."""
    d, c = rows.get("disaggregated"), rows.get("colocated")
    out: dict[str, float] = {}
    for name, lbl, key in (("short p50 TTFT", "short", "median_ttft_ms"), ("short p99 TTFT", "short", "p99_ttft_ms"),
                           ("short p99 TPOT", "short", "p99_tpot_ms"), ("out tok/s", None, "output_throughput")):
        try:
            a = d[key] if lbl is None else d["by_label"][lbl][key]
            b = c[key] if lbl is None else c["by_label"][lbl][key]
            out[name] = a / b
        except (TypeError, KeyError, ZeroDivisionError):
            out[name] = math.nan
    return out


def pd_decisions(base_url: str) -> dict[str, float]:
    """``decision/reason -> count`` from the router's ``pdserve:pd_decisions_total`` (empty when unreadable)."""
    import re
    import urllib.request

    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
            text = resp.read().decode(errors="replace")
    except OSError:
        return {}
    out: dict[str, float] = {}
    for m in re.finditer(r'^pdserve:pd_decisions_total\{([^}]*)\} (\S+)$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        k = f"{labels.get('decision', '?')}/{labels.get('reason', '?')}"
        out[k] = out.get(k, 0.0) + float(m.group(2))
    return out


@click.command("pd-vs-colocated")
@click.option("--model", default="smollm2-135m-instruct", show_default=True)
@click.option("--num-prompts", type=int, default=48, show_default=True, help="Short plus long requests.")
@click.option("--long-every", type=int, default=4, show_default=True, help="Every K-th request is a long prompt.")
@click.option("--short-input-len", type=int, default=64, show_default=True)
@click.option("--short-output-len", type=int, default=64, show_default=True)
@click.option("--long-input-len", type=int, default=1024, show_default=True)
@click.option("--long-output-len", type=int, default=8, show_default=True)
@click.option("--mix", type=click.Choice(MIXES), default="mixed", show_default=True,
              help="mixed: every --long-every-th request long; short / long: --num-prompts of that kind only.")
@click.option("--rounds", type=int, default=1, show_default=True,
              help="Run the modes in turns this many times (A B A B), one table per round.")
@click.option("--request-rate", type=float, default=1.0, show_default=True)
@click.option("--burstiness", type=float, default=1.0, show_default=True)
@click.option("--max-concurrency", type=int, default=None)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--endpoint", type=click.Choice(["completions", "chat"]), default="completions", show_default=True)
@click.option("--mode", "modes", type=click.Choice(sorted(MODES)), multiple=True,
              help="Run only these (default both).")
@click.option("--up-arg", "up_args", multiple=True, help="Extra argument for `pdserve up` (repeatable).")
@click.option("--pin", is_flag=True, help="Pin each tier to its own cores: prefill on core 0 and decode on core 1, "
              "against colocated on both (a stand-in for separate machines).")
@click.option("--launch", "launches", multiple=True, metavar="MODE=COMMAND",
              help="Start MODE with COMMAND instead of `pdserve up` ({port} and {model} are filled in), "
                   "e.g. to compare other servers' configurations.")
@click.option("--up-timeout", type=float, default=600.0, show_default=True, help="Seconds to wait for /health.")
@click.option("--save-result", type=click.Path(dir_okay=False), default=None)
@click.option("--disable-tqdm", is_flag=True)
def pd_vs_colocated_command(model, num_prompts, long_every, short_input_len, short_output_len, long_input_len,
                            long_output_len, mix, rounds, request_rate, burstiness, max_concurrency, seed, endpoint, modes,
                            up_args, pin, launches, up_timeout, save_result, disable_tqdm) -> None:
    """Same workload against `pdserve up` disaggregated (1 prefill + 1 decode) and colocated; one table."""
    from pdserve.loadtest.benchmark import BenchOptions, prepare, run_prepared, run_sync, validate
    from pdserve.loadtest.cluster import up_argv
    from pdserve.loadtest.client import ClientConfig
    from pdserve.loadtest.datasets import DatasetSpec
    from pdserve.loadtest.procs import free_port, running
    from pdserve.loadtest.results import save_json
    from pdserve.loadtest.runner import RunConfig

    try:
        for flag, value in (("--long-input-len", long_input_len), ("--long-output-len", long_output_len)):
            if value < 1:
                raise LoadTestError(f"{flag} must be at least 1, got {value}")
        if long_every < 2:
            raise LoadTestError(f"--long-every must be at least 2, got {long_every}")
        if rounds < 1:
            raise LoadTestError(f"--rounds must be at least 1, got {rounds}")
        n_short, n_long = split_counts(num_prompts, long_every, mix)
        base = BenchOptions(
            client=ClientConfig(base_url="http://127.0.0.1", model=model, endpoint=endpoint),
            run=RunConfig(request_rate=request_rate, burstiness=burstiness, max_concurrency=max_concurrency,
                          seed=seed, show_progress=not disable_tqdm),
            dataset=DatasetSpec(num_prompts=max(n_short, 1), seed=seed, input_len=short_input_len,
                                output_len=short_output_len, label="short"),
            percentiles=(50.0, 90.0, 99.0), tokenizer=model,
        )
        validate(base)
        if n_long < 1 and mix != "short":
            raise LoadTestError("--num-prompts is too small for one long request at this --long-every")
        custom = parse_launches(launches)
        run_modes = modes or tuple(MODES)
        reason = None if all(m in custom for m in run_modes) else up_unavailable_reason()
        if reason:
            raise LoadTestError(reason)

        per_round: list[dict[str, dict[str, Any]]] = []
        requests = None
        for rnd in range(rounds):
            rows: dict[str, dict[str, Any]] = {}
            per_round.append(rows)
            for mode in run_modes:
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                if mode in custom:
                    cmd = [a.format(port=port, model=model) for a in shlex.split(custom[mode])]
                else:
                    cmd = up_argv("--port", str(port), "--model", model, *MODES[mode],
                                  *(pin_args(mode) if pin else []), *up_args)
                click.echo(f"[{mode}] round {rnd + 1}/{rounds} starting: {shlex.join(cmd)}", err=True)
                with running(cmd, url + "/health", timeout_s=up_timeout, serving_model=model):
                    opts = replace(base, client=replace(base.client, base_url=url), label=mode)

                    async def main(opts=opts, url=url):
                        nonlocal requests
                        if requests is None:
                            info, short = await prepare(opts)
                            long = []
                            if n_long:
                                long_opts = replace(opts, dataset=replace(
                                    opts.dataset, num_prompts=n_long, seed=seed + 1, input_len=long_input_len,
                                    output_len=long_output_len, label="long"))
                                _, long = await prepare(long_opts)
                            requests = interleave(short[:n_short], long, long_every)
                        else:
                            from pdserve.loadtest.preflight import check_server

                            info = await check_server(url, model)
                        result, _ = await run_prepared(opts, info, requests)
                        return result

                    row = rows[mode] = run_sync(main())
                    if "by_label" not in row:  # one kind of request only: the whole run is that class
                        row["by_label"] = {"long" if mix == "long" else "short": {
                            k: v for k, v in row.items() if isinstance(v, (int, float))}}
                    row["load_average"] = os.getloadavg()[0]
                    if mode not in custom:
                        row["pd_decisions"] = pd_decisions(url)
                click.echo(f"[{mode}] round {rnd + 1} done: {row['completed']} ok, {row['failed']} failed; "
                           f"load average {row['load_average']:.1f}", err=True)
    except LoadTestError as exc:
        raise click.ClickException(str(exc)) from None
    if save_result:
        save_json({"modes": per_round[0], "rounds": per_round}, Path(save_result))
    click.echo(f"{n_short} short ({short_input_len} in / {short_output_len} out) + {n_long} long "
               f"({long_input_len} in / {long_output_len} out) at {request_rate:g} req/s, model {model}, "
               f"{rounds} round(s) in turns")
    click.echo("pinned: " + ", ".join(f"{m} {shlex.join(pin_args(m))}" for m in run_modes) if pin else "not pinned")
    for rnd, rows in enumerate(per_round, 1):
        loads = ", ".join(f"{m} {r['load_average']:.1f}" for m, r in rows.items())
        click.echo(f"round {rnd} (load average at the end of each run: {loads})")
        click.echo(table(rows))
        rat = ratios(rows)
        if not all(math.isnan(v) for v in rat.values()):
            click.echo("disaggregated / colocated: " + ", ".join(f"{k} {v:.2f}x" for k, v in rat.items()))
        for m, r in rows.items():
            if r.get("pd_decisions"):
                click.echo(f"{m} pd decisions: " + ", ".join(f"{k} {v:g}" for k, v in sorted(r["pd_decisions"].items())))
