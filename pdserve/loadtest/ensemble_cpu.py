"""``pdserve bench ensemble-cpu``: CPU per generated token of the serving ensemble against the offline engine.

One workload (``--num-requests`` random-id prompts of 16-256 tokens, ``--output-len`` tokens each, greedy,
``ignore_eos``), all sent at once so that every request is in flight together, run by:

- ``offline``: pdserve's ``LLM`` in its own process (``throughput_worker.py``), loaded once;
- ``colocated``: ``pdserve up --colocated`` (router, registry, Redis, one decode worker that prefills itself);
- ``disaggregated``: ``pdserve up --prefill 1 --decode 1``.

Each ensemble is started, warmed up with a few requests, measured, and stopped. Every ensemble turn has an offline
turn right before and right after it (offline, disaggregated, offline, colocated, offline, ... for ``--rounds``;
``schedule``), and is divided by the mean of those two: on a shared machine the offline engine's own CPU per token
moves by a third or more between turns minutes apart, and a baseline that brackets the turn follows that drift. The
summary gives the median of these bracketed ratios beside the pooled ratio (all CPU-s / all tokens). CPU time (user + system) is read with psutil
for every process of the ensemble (the ``up`` supervisor and all its children) before and after the load, so each
hop's share shows: router (HTTP in, SSE out, the output relay), Redis (queue, output streams), registry, and each
worker (engine, hand-over). The client's own CPU is left out. ``--pin`` pins the tiers to their own cores, as
``pd-vs-colocated --pin`` does (``pin_args``).

    pdserve bench ensemble-cpu --num-requests 32 --output-len 64 --rounds 3

``--offline-threads`` sets the offline engine's torch threads (default: every core this process may use, 2 here;
under ``pdserve up`` on 2 cores 1P+1D's workers get 1 each and the colocated worker 2).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

import click
import httpx
import psutil

from pdserve.loadtest.errors import LoadTestError
from pdserve.loadtest.pd_compare import MODES, pin_args

NAMES = ("router", "redis", "registry", "prefill", "decode", "up")


def process_role(proc: psutil.Process) -> str:
    """Which part of an ensemble ``proc`` is: a ``NAMES`` entry, or ``other``."""
    try:
        cmd = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "other"
    if cmd and "redis" in os.path.basename(cmd[0]):
        return "redis"
    if "pdserve.services.cli" in cmd:
        role = cmd[cmd.index("pdserve.services.cli") + 1] if cmd.index("pdserve.services.cli") + 1 < len(cmd) else ""
        return role if role in NAMES else "other"
    return "other"


def tree_cpu(root: int) -> dict[int, tuple[str, float]]:
    """pid -> (role, user + system CPU seconds) for ``root`` and every descendant."""
    from pdserve.loadtest.procs import tree_cpu_seconds

    out = {}
    for pid, cpu in tree_cpu_seconds(root).items():
        try:
            out[pid] = (process_role(psutil.Process(pid)), cpu)
        except psutil.NoSuchProcess:
            out[pid] = ("other", cpu)
    return out


def cpu_by_role(before: dict, after: dict) -> dict[str, float]:
    roles: dict[str, float] = {}
    for pid, (role, cpu) in after.items():
        roles[role] = roles.get(role, 0.0) + cpu - before.get(pid, (role, 0.0))[1]
    return roles


async def send_all(base_url: str, model: str, prompts: list[list[int]], outputs: list[int]) -> int:
    """Send every request at once (streaming, as clients do); the generated tokens, from each stream's usage."""
    async def one(client: httpx.AsyncClient, ids: list[int], n: int) -> int:
        body = {"model": model, "prompt": ids, "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        tokens = 0
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                raise LoadTestError(f"a request failed with HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage")
                    if usage:
                        tokens = usage["completion_tokens"]
        return tokens

    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(1800.0), limits=limits) as client:
        return sum(await asyncio.gather(*(one(client, p, o) for p, o in zip(prompts, outputs))))


def worker_stats(root: int) -> dict[str, dict]:
    """``/v1/stats`` of every worker under ``root`` (its port from its environment), by pod id."""
    out = {}
    for p in psutil.Process(root).children(recursive=True):
        if process_role(p) in ("prefill", "decode"):
            try:
                env = p.environ()
                out[env["PDSERVE_POD_ID"]] = httpx.get(f"http://127.0.0.1:{env['PDSERVE_PORT']}/v1/stats",
                                                       timeout=10).json()
            except (psutil.Error, httpx.HTTPError, ValueError, KeyError):
                pass
    return out


def run_ensemble(mode: str, model: str, dtype: str, kv: str, pin: bool, up_args: tuple[str, ...],
                 prompts: list[list[int]], outputs: list[int], timeout_s: float) -> dict:
    from pdserve.loadtest.cluster import Cluster

    with Cluster("--model", model, "--dtype", dtype, "--kv-cache-memory", kv, *MODES[mode],
                 *(pin_args(mode) if pin else []), *up_args, timeout_s=timeout_s, process=True,
                 serving_model=model) as cluster:
        url, proc = cluster.router_url, cluster.proc
        # warm-up (first steps, connections) on prompts the measured load does not contain: the workload's own would
        # be in the prefix cache when it runs
        asyncio.run(send_all(url, model, [p[::-1] for p in prompts[:4]], [4] * 4))
        before = tree_cpu(proc.pid)
        start = time.perf_counter()
        tokens = asyncio.run(send_all(url, model, prompts, outputs))
        seconds = time.perf_counter() - start
        roles = cpu_by_role(before, tree_cpu(proc.pid))
        stats = worker_stats(proc.pid)
    return {"output_tokens": tokens, "seconds": seconds, "cpu_seconds": sum(roles.values()), "by_role": roles,
            "workers": {pod: {k: s.get(k) for k in ("peak_num_running", "num_steps", "num_threads", "cpus")}
                        for pod, s in stats.items()}}


def _line(mode: str, r: dict) -> str:
    parts = "  ".join(f"{k} {v:.1f}" for k, v in sorted(r.get("by_role", {}).items(), key=lambda kv: -kv[1])
                      if v >= 0.05)
    peak = "".join(f"; {pod}: peak batch {w['peak_num_running']} in {w['num_steps']} steps, {w['num_threads']} "
                   f"threads on cores {w['cpus']}" for pod, w in sorted(r.get("workers", {}).items()))
    return (f"  {mode:<14}{r['output_tokens'] / r['seconds']:>8.1f} tok/s {1e3 * r['cpu_seconds'] / r['output_tokens']:>7.1f}"
            f" CPU-ms/tok  ({r['seconds']:.1f} s, {r['cpu_seconds']:.1f} CPU-s, load {r['loadavg']:.1f}{peak})"
            + (f"\n      CPU-s by process: {parts}" if parts else ""))


def schedule(modes: list[str], rounds: int) -> list[str]:
    """The order of the turns: with ``offline`` among ``modes``, every other mode's turn sits between two offline
    turns (O D O C O D O C O for two rounds of two ensembles); without it, the modes in turns."""
    ensembles = [m for m in modes if m != "offline"]
    if "offline" not in modes:
        return ensembles * rounds
    if not ensembles:
        return ["offline"] * rounds
    return ["offline"] + [t for _ in range(rounds) for m in ensembles for t in (m, "offline")]


def summarize(turns: list[tuple[str, dict]]) -> dict[str, dict]:
    """Per mode, from the turns in the order they ran: pooled CPU-ms per token (all its turns' CPU-s over all their
    tokens), its ratio to the offline engine's pooled figure, each turn's ratio to the mean of the offline turns
    just before and after it (``bracketed_x_offline``; one neighbour where only one ran), and the median of those.
    Ratios are NaN without an offline run."""
    def ms(r: dict) -> float:
        return 1e3 * r["cpu_seconds"] / r["output_tokens"]

    def pooled(rs: list[dict]) -> float:
        return 1e3 * sum(r["cpu_seconds"] for r in rs) / sum(r["output_tokens"] for r in rs)

    def neighbours(i: int) -> list[float]:
        before = next((ms(r) for m, r in reversed(turns[:i]) if m == "offline"), None)
        after = next((ms(r) for m, r in turns[i + 1:] if m == "offline"), None)
        return [x for x in (before, after) if x is not None]

    by_mode: dict[str, list[int]] = {}
    for i, (m, _) in enumerate(turns):
        by_mode.setdefault(m, []).append(i)
    base = [turns[i][1] for i in by_mode.get("offline", [])]
    pooled_base = pooled(base) if base else None
    out = {}
    for m, idx in by_mode.items():
        rs = [turns[i][1] for i in idx]
        ratios = [ms(turns[i][1]) / statistics.mean(nb) for i in idx if (nb := neighbours(i))] \
            if m != "offline" else [1.0] * len(idx)
        out[m] = {"cpu_ms_per_token": pooled(rs),
                  "x_offline": pooled(rs) / pooled_base if pooled_base else float("nan"),
                  "bracketed_x_offline": ratios,
                  "median_x_offline": statistics.median(ratios) if ratios else float("nan")}
    return out


@click.command("ensemble-cpu")
@click.option("--model", default="smollm2-135m-instruct", show_default=True)
@click.option("--num-requests", default=32, show_default=True, help="All sent at once: this many in flight.")
@click.option("--output-len", default=64, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--dtype", default="bfloat16", show_default=True, type=click.Choice(["bfloat16", "float32"]))
@click.option("--kv-cache-memory", "kv", default="1GiB", show_default=True)
@click.option("--rounds", default=3, show_default=True,
              help="Turns per ensemble mode, each between two offline turns (O D O C O ...).")
@click.option("--offline-threads", type=click.IntRange(min=1), default=None,
              help="The offline engine's torch threads [default: every core this process may use].")
@click.option("--mode", "modes", multiple=True, type=click.Choice(["offline", *MODES]),
              help="Run only these (default all three).")
@click.option("--pin", is_flag=True, help="Pin the tiers to their own cores (see pd-vs-colocated --pin).")
@click.option("--up-arg", "up_args", multiple=True, help="Extra argument for `pdserve up` (repeatable).")
@click.option("--up-timeout", type=float, default=600.0, show_default=True)
@click.option("--json-out", type=click.Path(dir_okay=False), default=None)
def ensemble_cpu_command(model, num_requests, output_len, seed, dtype, kv, rounds, offline_threads, modes, pin,
                         up_args, up_timeout, json_out) -> None:
    """CPU per generated token: offline engine vs `pdserve up` colocated and 1P+1D, same requests, in turns."""
    from transformers import AutoConfig

    from pdserve.loadtest.offline_throughput import make_workload
    from pdserve.loadtest.throughput_bench import Contender
    from pdserve.shared.models.resolve import resolve_model

    modes = list(modes or ("offline", *MODES))
    model_dir = str(resolve_model(model))
    prompts, outputs = make_workload(num_requests, seed, AutoConfig.from_pretrained(model_dir).vocab_size,
                                     output_range=(output_len, output_len))
    threads = offline_threads or len(os.sched_getaffinity(0))
    click.echo(f"ensemble-cpu: {num_requests} requests at once (prompts 16-256, {output_len} out), {dtype}, greedy, "
               f"ignore_eos, KV {kv}; modes {', '.join(modes)} in turns x {rounds}{', pinned' if pin else ''}; "
               f"offline engine {threads} thread(s); load average {os.getloadavg()[0]:.1f}")
    turns: list[tuple[str, dict]] = []
    offline = None
    try:
        if "offline" in modes:
            spec = {"model_dir": model_dir, "dtype": dtype, "kv_bytes": 1 << 30, "max_model_len": 1024,
                    "threads": threads, "hf_batch_size": 32, "prompts": prompts, "outputs": outputs}
            offline = Contender("pdserve", sys.executable, spec, {**os.environ, "OMP_NUM_THREADS": str(threads)},
                                tempfile.mkdtemp(prefix="pdserve-ensemble-cpu-"))
        for mode in schedule(modes, rounds):
            r = offline.run() if mode == "offline" else run_ensemble(
                mode, model, dtype, kv, pin, up_args, prompts, outputs, up_timeout)
            r["loadavg"] = os.getloadavg()[0]
            turns.append((mode, r))
            click.echo(_line(mode, r))
    except LoadTestError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        if offline is not None:
            offline.close()
    summary = summarize(turns)
    click.echo(f"\n{'mode':<15}{'CPU-ms/tok':>11}{'x offline':>11}{'median x':>10}   each turn (x the offline turns "
               f"around it)")
    for m, row in summary.items():
        click.echo(f"{m:<15}{row['cpu_ms_per_token']:>11.1f}{row['x_offline']:>11.2f}{row['median_x_offline']:>10.2f}"
                   f"   {' '.join(f'{x:.2f}' for x in row['bracketed_x_offline'])}")
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"turns": [{"mode": m, **r} for m, r in turns], "summary": summary}, f, indent=2)
