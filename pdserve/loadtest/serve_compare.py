"""``pdserve bench serve-compare``: one ``bench serve`` workload against several servers, the same requests, in turns.

Servers (``--server``, repeatable, run in the order given):

- ``colocated`` / ``disaggregated``: ``pdserve up --colocated`` / ``pdserve up --prefill 1 --decode 1`` on a free
  port (plus every ``--up-arg``);
- ``NAME=COMMAND``: any server's command line, with ``{port}``, ``{model}`` (the served model name),
  ``{model_dir}`` (the model's local directory) and ``{python}`` (this Python) filled in. It starts in the
  environment the user's shell would give it (:func:`~pdserve.loadtest.procs.foreign_env`: no PYTHONPATH, no
  thread policy set by pdserve's import); prefix ``env KEY=VALUE`` for its own settings;
- ``NAME=URL``: a server that is already running (e.g. a ``vllm serve`` whose start takes minutes, reused across
  invocations); its CPU is read from the process listening on the URL's port on this machine and its descendants.

Every launched server is started once, before the first turn (ready = ``GET /health`` answers 200 and a one-token
completion succeeds), keeps running through all turns, and is stopped with SIGTERM to its process group at the end.
Each (round, rate) gets its own dataset (``bench serve``'s options with ``--seed`` + 1, + 2, ...; prompt lengths
from the first server's ``/tokenize``), and every server gets the same requests in that turn: a server that kept the
previous turn's prompts in its prefix cache (pdserve and vLLM both cache by default) would otherwise skip their
prefill in every turn after the first. ``--num-warmups`` requests (from ``--seed`` itself) are sent to each server
once, before any turn. Then, for each round and each rate of ``--request-rates``, every server takes its turn
(A B C A B C ...).

Per turn it reports vLLM's metrics (``output_throughput``, ``median_ttft_ms``/``p99_ttft_ms``, TPOT, ITL), the
failures (streams are read strictly, ``sse.py``: a malformed stream is a ``stream_error`` failure), the load
average, and the CPU seconds the server's whole process tree spent during the turn (user + system, from /proc
before and after: API server, engine processes, Redis, ...; the client is left out) with
``output_tokens_per_cpu_s``, which survives a shared machine better than tok/s.

    pdserve bench serve-compare --model smollm2-135m-instruct --server colocated --server disaggregated \\
        --server vllm="env VLLM_CPU_KVCACHE_SPACE=1 vllm serve {model_dir} --served-model-name {model} --port {port}" \\
        --random-input-len 128 --random-output-len 32 --ignore-eos --num-prompts 16 --request-rates 0.1,inf
"""

from __future__ import annotations

import math
import os
import shlex
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import click

from pdserve.loadtest.errors import LoadTestError
from pdserve.loadtest.options import GreedyCommand, common_options, parse_floats, to_options
from pdserve.loadtest.pd_compare import MODES

# (column title, result key) of vLLM's metrics, in the table's order
LATENCY_COLUMNS = (("TTFT p50", "median_ttft_ms"), ("TTFT p99", "p99_ttft_ms"), ("TPOT p50", "median_tpot_ms"),
                   ("TPOT p99", "p99_tpot_ms"), ("ITL p50", "median_itl_ms"), ("ITL p99", "p99_itl_ms"))


@dataclass(slots=True)
class Server:
    """One contender: ``kind`` is ``pdserve`` (a ``MODES`` entry), ``command`` or ``url``."""

    name: str
    kind: str
    spec: str
    url: str = ""
    root_pid: int | None = None  # the process tree whose CPU is counted; None = not on this machine


def parse_servers(values: tuple[str, ...]) -> list[Server]:
    """``("colocated", "vllm=vllm serve ...", "other=http://host:8000")`` -> servers, in order."""
    if not values:
        raise LoadTestError("give at least one --server (colocated, disaggregated, NAME=COMMAND or NAME=URL)")
    out: list[Server] = []
    for v in values:
        name, sep, spec = v.partition("=")
        name, spec = name.strip(), spec.strip()
        if not sep:
            if name not in MODES:
                raise LoadTestError(f"--server: {v!r} is neither {' nor '.join(MODES)} nor NAME=COMMAND / NAME=URL")
            out.append(Server(name, "pdserve", name))
        elif not name or not spec:
            raise LoadTestError(f"--server: expected NAME=COMMAND or NAME=URL, got {v!r}")
        elif spec in MODES:
            out.append(Server(name, "pdserve", spec))
        elif spec.startswith(("http://", "https://")):
            out.append(Server(name, "url", spec.rstrip("/"), url=spec.rstrip("/")))
        else:
            out.append(Server(name, "command", spec))
    names = [s.name for s in out]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise LoadTestError(f"--server: the name {dup!r} is given twice")
    return out


def server_command(server: Server, port: int, model: str, model_dir: str, up_args: tuple[str, ...]) -> list[str]:
    if server.kind == "pdserve":
        from pdserve.loadtest.cluster import up_argv

        return up_argv("--port", str(port), "--model", model, *MODES[server.spec], *up_args)
    fields = {"port": port, "model": model, "model_dir": model_dir, "python": sys.executable}
    try:
        return [a.format(**fields) for a in shlex.split(server.spec)]
    except (KeyError, IndexError, ValueError) as exc:
        raise LoadTestError(f"--server {server.name}: cannot fill in {server.spec!r} ({exc!r}); "
                            "the fields are {port}, {model}, {model_dir}, {python}") from None


def start_all(stack: ExitStack, servers: list[Server], model: str, up_args: tuple[str, ...], timeout_s: float) -> None:
    """Start the launched servers one after another (each ready before the next starts) and find every tree root."""
    from pdserve.loadtest.procs import free_port, listening_pid, running

    model_dir = ""
    for s in servers:
        if s.kind == "url":
            host, port = urlparse(s.url).hostname, urlparse(s.url).port or 80
            s.root_pid = listening_pid(port) if host in ("127.0.0.1", "localhost", "::1") else None
            click.echo(f"[{s.name}] using {s.url} (CPU of pid {s.root_pid} and its descendants)", err=True)
            continue
        if s.kind == "command" and "{model_dir}" in s.spec and not model_dir:
            from pdserve.shared.models.resolve import resolve_model

            model_dir = str(resolve_model(model))
        port = free_port()
        s.url = f"http://127.0.0.1:{port}"
        cmd = server_command(s, port, model, model_dir, up_args)
        click.echo(f"[{s.name}] starting: {shlex.join(cmd)}", err=True)
        start = time.monotonic()
        proc = stack.enter_context(running(cmd, s.url + "/health", timeout_s=timeout_s, serving_model=model,
                                           foreign=s.kind == "command"))
        s.root_pid = proc.pid
        click.echo(f"[{s.name}] ready after {time.monotonic() - start:.0f} s", err=True)


def measured_turn(opts, info, requests, server: Server, rate: float) -> dict[str, Any]:
    """One turn: the workload at ``rate`` against ``server``, with its tree's CPU seconds and the load average."""
    from pdserve.loadtest.benchmark import run_prepared, run_sync
    from pdserve.loadtest.procs import cpu_delta, tree_cpu_seconds

    before = tree_cpu_seconds(server.root_pid) if server.root_pid else {}
    result, _ = run_sync(run_prepared(opts, info, requests, rate=rate))
    after = tree_cpu_seconds(server.root_pid) if server.root_pid else {}
    cpu = cpu_delta(before, after) if after else None
    result["server_pid"] = server.root_pid
    result["server_cpu_s"] = cpu
    result["server_processes"] = len(after)
    result["output_tokens_per_cpu_s"] = result["total_output_tokens"] / cpu if cpu else None
    result["loadavg"] = os.getloadavg()[0]
    return result


def _fmt(v: Any, spec: str = ".1f") -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def summary_table(runs: list[dict[str, Any]], servers: list[Server], rate: float) -> str:
    """A markdown table of every turn at ``rate``, then each server's total over its turns and its ratio to the first
    server (tok/s: total tokens over total seconds; tok/CPU-s: total tokens over total CPU seconds)."""
    head = ["server", "round", "out tok/s", "tok/CPU-s", "server CPU-s"] + [c for c, _ in LATENCY_COLUMNS] + [
        "failed", "load"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    totals = {}
    for s in servers:
        mine = [r for r in runs if r["server"] == s.name and r["rate"] == rate]
        for r in mine:
            res = r["result"]
            cells = [s.name, str(r["round"]), _fmt(res["output_throughput"]), _fmt(res["output_tokens_per_cpu_s"]),
                     _fmt(res["server_cpu_s"], ".2f")] + [_fmt(res.get(k), ".0f") for _, k in LATENCY_COLUMNS] + [
                str(res["failed"]), _fmt(res["loadavg"])]
            lines.append("| " + " | ".join(cells) + " |")
        tokens = sum(r["result"]["total_output_tokens"] for r in mine)
        seconds = sum(r["result"]["duration"] for r in mine)
        cpus = [r["result"]["server_cpu_s"] for r in mine]
        cpu = sum(cpus) if mine and all(c for c in cpus) else None
        totals[s.name] = (tokens / seconds if seconds else None, tokens / cpu if cpu else None)
    first = servers[0].name
    lines.append("")
    for name, (tps, tpc) in totals.items():
        ratio = [_fmt(a / b, ".2f") if a and b else "n/a" for a, b in zip((tps, tpc), totals[first])]
        lines.append(f"{name}: {_fmt(tps)} tok/s, {_fmt(tpc)} tok/CPU-s over all rounds; "
                     f"{ratio[0]}x / {ratio[1]}x {first}")
    return "\n".join(lines)


def run_turns(opts, servers: list[Server], rates: tuple[float, ...], rounds: int, num_warmups: int):
    """Build one dataset per turn (and one for the warm-ups), warm every server up once, then the turns; returns
    the first turn's requests and the runs."""
    from pdserve.loadtest.benchmark import prepare, run_prepared, run_sync
    from pdserve.loadtest.preflight import check_server

    first = replace(opts, client=replace(opts.client, base_url=servers[0].url))

    def dataset(offset: int) -> list:
        return run_sync(prepare(replace(first, dataset=replace(first.dataset, seed=first.dataset.seed + offset))))[1]

    requests = dataset(0)
    turn_requests = {(rnd, rate): dataset(1 + i) for i, (rnd, rate) in
                     enumerate((rnd, rate) for rnd in range(1, rounds + 1) for rate in rates)}
    model = first.client.model
    contexts = {}
    for s in servers:
        sopts = replace(opts, client=replace(opts.client, base_url=s.url, model=model), label=s.name)
        info = run_sync(check_server(s.url, model, opts.client.api_key))
        contexts[s.name] = (sopts, info)
        if num_warmups:
            warm = [requests[i % len(requests)] for i in range(num_warmups)]
            run_sync(run_prepared(replace(sopts, run=replace(sopts.run, show_progress=False)), info, warm,
                                  rate=math.inf))
    runs = []
    for rnd in range(1, rounds + 1):
        for rate in rates:
            for s in servers:
                sopts, info = contexts[s.name]
                res = measured_turn(sopts, info, turn_requests[rnd, rate], s, rate)
                runs.append({"server": s.name, "round": rnd, "rate": rate, "result": res})
                click.echo(f"[{s.name}] round {rnd}, {rate:g} req/s: {_fmt(res['output_throughput'])} tok/s, "
                           f"{_fmt(res['output_tokens_per_cpu_s'])} tok/CPU-s ({_fmt(res['server_cpu_s'])} CPU-s in "
                           f"{res['server_processes']} processes), TTFT p50 {_fmt(res['median_ttft_ms'], '.0f')} ms, "
                           f"TPOT p50 {_fmt(res['median_tpot_ms'], '.0f')} ms, {res['failed']} failed"
                           f"{' ' + str(res['failed_by_status']) if res['failed'] else ''}, "
                           f"load {res['loadavg']:.1f}", err=True)
    return turn_requests[1, rates[0]], runs


@click.command("serve-compare", cls=GreedyCommand)
@common_options
@click.option("--server", "server_specs", multiple=True, metavar="SERVER",
              help="colocated | disaggregated | NAME=COMMAND ({port} {model} {model_dir} {python}) | NAME=URL; "
                   "repeatable, run in this order.")
@click.option("--request-rates", default="inf", show_default=True,
              help="Comma-separated request rates, each run by every server in turn; inf = all at once.")
@click.option("--rounds", type=int, default=1, show_default=True, help="Turns per server and rate (A B C A B C).")
@click.option("--up-arg", "up_args", multiple=True, help="Extra argument for `pdserve up` (repeatable).")
@click.option("--up-timeout", type=float, default=1200.0, show_default=True,
              help="Seconds a launched server may take to serve its first completion.")
@click.option("--save-result", type=click.Path(dir_okay=False), default=None, help="Write every turn's JSON here.")
def serve_compare_command(server_specs, request_rates, rounds, up_args, up_timeout, save_result, **kw) -> None:
    """The same `bench serve` requests against several servers in turns, with each server's CPU per token."""
    from pdserve.loadtest.results import save_json

    try:
        if click.get_current_context().get_parameter_source("base_url").name != "DEFAULT":
            raise LoadTestError("serve-compare takes its servers from --server, not --base-url")
        if not kw["model"]:
            raise LoadTestError("serve-compare needs --model: every server must serve it under the same name")
        rates = parse_floats(request_rates, "--request-rates")
        if not rates or any(not r > 0 for r in rates):
            raise LoadTestError(f"--request-rates must be positive numbers or inf, got {request_rates!r}")
        if rounds < 1:
            raise LoadTestError(f"--rounds must be at least 1, got {rounds}")
        servers = parse_servers(server_specs)
        num_warmups, kw["num_warmups"] = kw["num_warmups"], 0  # sent once per server, not once per turn
        opts = to_options(kw, rates[0])
        opts.percentiles = tuple(sorted({*opts.percentiles, 50.0, 99.0}))
        from pdserve.loadtest.benchmark import validate

        validate(replace(opts, client=replace(opts.client, base_url="http://127.0.0.1")))
        click.echo(f"serve-compare: {', '.join(s.name for s in servers)}; {opts.dataset.num_prompts} "
                   f"{opts.dataset.name} prompts at {request_rates} req/s x {rounds} rounds; "
                   f"load average {os.getloadavg()[0]:.1f}", err=True)
        with ExitStack() as stack:
            start_all(stack, servers, kw["model"], up_args, up_timeout)
            requests, runs = run_turns(opts, servers, rates, rounds, num_warmups)
    except LoadTestError as exc:
        raise click.ClickException(str(exc)) from None
    ins = [r.prompt_len for r in requests]
    outs = [r.expected_output_len for r in requests]
    click.echo(f"{len(requests)} requests, prompts {min(ins)}-{max(ins)} tokens, outputs up to {max(outs)}"
               f"{' (ignore_eos)' if opts.client.ignore_eos else ''}, model {opts.client.model}; latencies in ms")
    for rate in rates:
        click.echo(f"\nrequest rate {rate:g} req/s\n" + summary_table(runs, servers, rate))
    if save_result:
        save_json({"servers": {s.name: s.spec for s in servers}, "rates": [str(r) for r in rates], "runs": runs},
                  Path(save_result))
