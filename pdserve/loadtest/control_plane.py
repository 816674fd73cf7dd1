"""``pdserve bench control-plane``: how many tokens per second the control plane (Redis, routers, the registry)
carries before it adds more than ``--max-added-ms`` to p99 ITL, and what each part spends per token.

A synthetic fleet, every process real except the model: a ``redis-server`` (or a local Redis Cluster of
``--shards`` primaries, ``redis_cluster.py``), the registry and ``--routers`` routers as ``pdserve`` processes, and
N stand-in decode pods in one process (``fleet.py``: the real ``DecodeWorker`` on a ``StubEngine`` that emits one
token per running request every ``--step-ms``). Streaming clients (this process, httpx) keep ``N x batch`` requests
open, closed loop, over the routers in turn; ``batch`` ramps up (``--batches``), so the offered load is
``N x batch / step`` tokens/s. Per level, after ``--warmup-s``, for ``--seconds``:

- ITL at the client (gaps between a request's chunks after its first), p50/p99, and the p99 minus the step
  interval: what the control plane added;
- the stubs' own step lateness (their process is on the same cores): a late step is the harness, not Redis or
  the router;
- CPU per generated token of Redis (``INFO cpu``, all shards), the routers and the registry (psutil), and of the
  pods and the clients for scale; Redis commands per token (``INFO commandstats``), in all and by command.

The ramp stops at the first level whose added p99 exceeds the bound; the level before it is the ceiling.

    pdserve bench control-plane --pods 8 --pods 32 --batches 1,2,4,8
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import secrets
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from typing import Iterator

import click
import httpx
import psutil
import redis as redis_sync

from pdserve.loadtest.errors import LoadTestError
from pdserve.loadtest.procs import free_port, running
from pdserve.loadtest.redis_cluster import SETUP_COMMANDS, RedisClusterServers
from pdserve.loadtest.stub_engine import stamp_of


def quantile_ms(sorted_s: list[float], q: float) -> float:
    return 1e3 * sorted_s[min(len(sorted_s) - 1, int(q * len(sorted_s)))] if sorted_s else 0.0


@dataclass(slots=True)
class LevelResult:
    pods: int
    batch: int
    streams: int
    offered_tok_s: float
    tok_s: float = 0.0
    itl_p50_ms: float = 0.0
    itl_p99_ms: float = 0.0
    added_p99_ms: float = 0.0
    bound_ms: float = 0.0  # the added p99 this level may reach: the baseline plus --max-added-ms
    step_late_p99_ms: float = 0.0
    delivery_p50_ms: float = 0.0
    delivery_p99_ms: float = 0.0
    errors: int = 0
    first_error: str = ""
    cpu_us_per_token: dict[str, float] = field(default_factory=dict)
    cpu_ms_per_s: dict[str, float] = field(default_factory=dict)  # CPU-ms per wall second (1000 = one core)
    redis_commands_per_token: float = 0.0
    redis_commands_by_name: dict[str, float] = field(default_factory=dict)  # per token, by command, most first
    shard_share: list[float] = field(default_factory=list)  # each Redis node's share of the commands
    loadavg: float = 0.0


@dataclass(slots=True)
class Streams:
    """What the clients saw: chunk gaps and tokens inside the measuring window."""

    window: tuple[float, float] = (0.0, float("inf"))
    gaps: list[float] = field(default_factory=list)
    delays: list[float] = field(default_factory=list)  # step to client, of stamped tokens (stub_engine.stamp_of)
    tokens: int = 0
    errors: int = 0
    first_error: str = ""

    def error(self, what: str) -> None:
        self.errors += 1
        self.first_error = self.first_error or what[:300]


async def stream_one(client: httpx.AsyncClient, url: str, body: dict, seen: Streams) -> str:
    """One streamed completion; records its chunk gaps and tokens that fall in ``seen.window``; returns its text."""
    last = None
    text = []
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            seen.error(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
            return ""
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                seen.error(f"error chunk: {chunk['error']}")
                break
            choices = chunk.get("choices")
            if not choices or not choices[0].get("text"):
                continue
            now = time.monotonic()
            text.append(choices[0]["text"])
            if seen.window[0] <= now <= seen.window[1]:
                seen.tokens += 1
                stamp = stamp_of(choices[0]["text"])
                if stamp is not None:
                    seen.delays.append(time.time() - stamp)
                if last is not None:
                    seen.gaps.append(now - last)
            last = now
    return "".join(text)


async def drive(routers: list[str], model: str, streams: int, input_len: int, output_len: int, until: float,
                seen: Streams, seed: int = 0) -> None:
    """``streams`` closed-loop clients spread over ``routers`` until ``until`` (monotonic)."""
    rng = random.Random(seed)

    async def loop(i: int, client: httpx.AsyncClient) -> None:
        url = routers[i % len(routers)] + "/v1/completions"
        # arrivals spread over the first second, as a fleet's clients come (all at once is a herd on the registry's
        # lookups that no fleet sends); after an error a client waits before it tries again
        await asyncio.sleep(i / streams)
        while time.monotonic() < until:
            errors = seen.errors
            body = {"model": model, "prompt": [rng.randrange(1000, 40000) for _ in range(input_len)],
                    "max_tokens": output_len, "stream": True, "ignore_eos": True}
            try:
                await stream_one(client, url, body, seen)
            except httpx.HTTPError as exc:
                seen.error(f"{type(exc).__name__}: {exc}")
            if seen.errors > errors:
                await asyncio.sleep(0.5)

    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), limits=limits) as client:
        await asyncio.gather(*(loop(i, client) for i in range(streams)))


def command_calls(commandstats: dict) -> dict[str, int]:
    """Calls per command name (``xadd``, ...) from ``INFO commandstats``, less the bench's own reads and the
    clients' start-up (``SETUP_COMMANDS``), as the total counts them."""
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in commandstats.items()
            if k.startswith("cmdstat_") and not k.startswith(SETUP_COMMANDS)}


def per_token_by_name(deltas: dict[str, float], tokens: int) -> dict[str, float]:
    """The ``cmd_<name>`` call deltas of ``Counters.read`` per token, most first (ties by name), 0 left out."""
    counts = {k.removeprefix("cmd_"): v for k, v in deltas.items() if k.startswith("cmd_") and v}
    return {name: round(n / max(tokens, 1), 4) for name, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))}


class Counters:
    """CPU seconds of the processes by role, and Redis's CPU and command counts over every node."""

    def __init__(self, procs: dict[str, list[int]], redis_ports: list[int]) -> None:
        self.procs = {role: [psutil.Process(p) for p in pids] for role, pids in procs.items()}
        self.nodes = [redis_sync.Redis(host="127.0.0.1", port=p, socket_timeout=5) for p in redis_ports]

    def read(self) -> dict[str, float]:
        out = {}
        for role, ps in self.procs.items():
            out[role] = sum(t.user + t.system for t in (p.cpu_times() for p in ps))
        cpu = 0.0
        for i, node in enumerate(self.nodes):
            info = node.info("cpu")
            cpu += float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
            calls = command_calls(node.info("commandstats"))
            out[f"calls_{i}"] = sum(calls.values())
            for name, n in calls.items():
                out[f"cmd_{name}"] = out.get(f"cmd_{name}", 0) + n
        out["redis"], out["redis_calls"] = cpu, sum(out[f"calls_{i}"] for i in range(len(self.nodes)))
        return out


def measure_level(routers: list[str], fleet_url: str, counters: Counters, model: str, pods: int, batch: int,
                  step_s: float, input_len: int, output_len: int, warmup_s: float, seconds: float) -> LevelResult:
    streams = pods * batch
    res = LevelResult(pods, batch, streams, streams / step_s)
    seen = Streams()

    async def run() -> tuple[dict, dict]:
        start = time.monotonic()
        seen.window = (start + warmup_s, start + warmup_s + seconds)
        clients = asyncio.create_task(drive(routers, model, streams, input_len, output_len, seen.window[1], seen))
        await asyncio.sleep(warmup_s)
        async with httpx.AsyncClient() as http:
            await http.get(fleet_url + "/fleet/stats")  # resets the stubs' lateness
            before = counters.read()
            await asyncio.sleep(seconds)
            after = counters.read()
            stubs = (await http.get(fleet_url + "/fleet/stats")).json()
        await clients
        return {k: after[k] - before.get(k, 0) for k in after}, stubs

    deltas, stubs = asyncio.run(run())
    tokens = max(seen.tokens, 1)
    gaps, delays = sorted(seen.gaps), sorted(seen.delays)
    res.tok_s = seen.tokens / seconds
    res.itl_p50_ms, res.itl_p99_ms = quantile_ms(gaps, 0.5), quantile_ms(gaps, 0.99)
    res.delivery_p50_ms, res.delivery_p99_ms = quantile_ms(delays, 0.5), quantile_ms(delays, 0.99)
    res.added_p99_ms = res.itl_p99_ms - 1e3 * step_s
    res.step_late_p99_ms = stubs["step_late_p99_ms"]
    res.errors, res.first_error = seen.errors, seen.first_error
    cpu = {k: v for k, v in deltas.items() if k != "redis_calls" and not k.startswith(("calls_", "cmd_"))}
    res.cpu_us_per_token = {k: round(1e6 * v / tokens, 1) for k, v in cpu.items()}
    res.cpu_ms_per_s = {k: round(1e3 * v / seconds, 1) for k, v in cpu.items()}
    shards = [v for k, v in sorted(deltas.items()) if k.startswith("calls_")]
    res.shard_share = [round(c / max(sum(shards), 1), 3) for c in shards]
    res.redis_commands_per_token = deltas["redis_calls"] / tokens
    res.redis_commands_by_name = per_token_by_name(deltas, tokens)
    res.loadavg = os.getloadavg()[0]
    return res


@contextmanager
def redis_servers(shards: int) -> Iterator[tuple[str, list[int]]]:
    """(URL, ports): one plain ``redis-server`` (``shards`` 0) or a local cluster of ``shards`` primaries."""
    if shards:
        with RedisClusterServers(shards) as cluster:
            yield cluster.url, list(cluster.ports)
        return
    from pdserve.services.up import redis_executable

    port = free_port()
    proc = subprocess.Popen([redis_executable(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis_sync.Redis(host="127.0.0.1", port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis_sync.ConnectionError:
                if time.monotonic() > deadline:
                    raise LoadTestError("redis-server did not start") from None
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0", [port]
    finally:
        proc.terminate()
        proc.wait(10)


@dataclass(slots=True)
class Ensemble:
    routers: list[str]
    fleet_url: str
    counters: Counters
    registry_url: str = ""
    registry_token: str = ""


@contextmanager
def ensemble(pods: int, routers: int, shards: int, step_s: float, model: str, heartbeat_s: float = 1.0,
             timeout_s: float = 300.0) -> Iterator[Ensemble]:
    """Redis, the registry, ``routers`` routers and ``pods`` stand-in pods, all on loopback, ready to serve."""
    py = [sys.executable, "-m", "pdserve.services.cli"]
    token = secrets.token_hex(16)
    with ExitStack() as stack:
        redis_url, redis_ports = stack.enter_context(redis_servers(shards))
        reg_port = free_port()
        registry_url = f"http://127.0.0.1:{reg_port}"
        env = {"PDSERVE_REDIS_URL": redis_url, "PDSERVE_REGISTRY_URL": registry_url, "PDSERVE_REGISTRY_TOKEN": token,
               "PDSERVE_LOG_LEVEL": "warning", "PDSERVE_MODEL": model}
        registry = stack.enter_context(running([*py, "registry", "--host", "127.0.0.1", "--port", str(reg_port)],
                                               registry_url + "/health", timeout_s, env))
        fleet_port = free_port()
        fleet_url = f"http://127.0.0.1:{fleet_port}"
        fleet = stack.enter_context(running(
            [sys.executable, "-m", "pdserve.loadtest.fleet", "--pods", str(pods), "--port", str(fleet_port),
             "--redis-url", redis_url, "--registry-url", registry_url, "--registry-token", token, "--model", model,
             "--step-ms", str(1e3 * step_s), "--heartbeat-s", str(heartbeat_s), "--stamp"], fleet_url + "/health", timeout_s, env))
        urls, pids = [], []
        for _ in range(routers):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            proc = stack.enter_context(running([*py, "router", "--host", "127.0.0.1", "--port", str(port)],
                                               url + "/health", timeout_s, env, serving_model=model))
            urls.append(url)
            pids.append(proc.pid)
        counters = Counters({"router": pids, "registry": [registry.pid], "pods": [fleet.pid],
                             "clients": [os.getpid()]}, redis_ports)
        yield Ensemble(urls, fleet_url, counters, registry_url, token)


def ramp(pods: int, batches: list[int], routers: int = 1, shards: int = 0, step_ms: float = 25.0,
         model: str = "smollm2-135m-instruct", input_len: int = 32, output_len: int = 64, warmup_s: float = 2.0,
         seconds: float = 6.0, max_added_ms: float = 10.0, baseline: str = "first", heartbeat_s: float = 1.0,
         echo=click.echo) -> list[LevelResult]:
    """One ensemble for ``pods``; levels in ``batches`` order. A level's bound is ``max_added_ms`` over the first
    level's added p99 (``baseline`` "first": on a shared machine the lightest load already shows the host's
    scheduling noise) or over nothing (``baseline`` "none", the absolute rule). The ramp goes on past the bound (the
    CPU per token of the higher levels is what the paper extrapolation needs) and stops at errors or when the
    clients get less than half the offered tokens (saturated)."""
    step_s = step_ms / 1e3
    levels: list[LevelResult] = []
    with ensemble(pods, routers, shards, step_s, model, heartbeat_s) as ens:
        for batch in batches:
            r = measure_level(ens.routers, ens.fleet_url, ens.counters, model, pods, batch, step_s, input_len,
                              output_len, warmup_s, seconds)
            floor = levels[0].added_p99_ms if levels else r.added_p99_ms
            r.bound_ms = (max(0.0, floor) if baseline == "first" else 0.0) + max_added_ms
            levels.append(r)
            echo(format_level(r))
            if r.errors:
                echo(f"    first error: {r.first_error}")
            if r.errors or r.tok_s < 0.5 * r.offered_tok_s:
                break
    return levels


def format_level(r: LevelResult) -> str:
    cpu = "  ".join(f"{k} {v:.0f}" for k, v in r.cpu_us_per_token.items())
    shares = f" (shards {' / '.join(f'{100 * x:.0f}%' for x in r.shard_share)})" if len(r.shard_share) > 1 else ""
    return (f"  N={r.pods:<4} batch {r.batch:<3} offered {r.offered_tok_s:>7.0f} tok/s  got {r.tok_s:>7.0f}  "
            f"ITL p50 {r.itl_p50_ms:5.1f} p99 {r.itl_p99_ms:5.1f} ms (added {r.added_p99_ms:+5.1f}; stub steps late "
            f"p99 {r.step_late_p99_ms:4.1f})  step->client p50 {r.delivery_p50_ms:5.1f} p99 {r.delivery_p99_ms:5.1f} ms  errors {r.errors}  µs/token: {cpu}  Redis cmds/token "
            f"{r.redis_commands_per_token:.3f}{shares}  load {r.loadavg:.1f}\n"
            f"    Redis cmds/token by command: {format_by_name(r.redis_commands_by_name)}")


def format_by_name(by_name: dict[str, float]) -> str:
    return "  ".join(f"{name} {v:.3f}" for name, v in by_name.items()) or "-"


def ceiling(levels: list[LevelResult]) -> LevelResult | None:
    """The last level before the first one over its bound (or with errors); None when the first is."""
    top = None
    for r in levels:
        if r.added_p99_ms > r.bound_ms or r.errors:
            break
        top = r
    return top


def cpu_flags() -> str:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return "?"
    return " ".join(f for f in ("avx2", "avx512f", "avx512_bf16") if f" {f}" in text)


@click.command("control-plane")
@click.option("--pods", "pod_counts", multiple=True, type=int, default=(8, 32), show_default=True,
              help="Stand-in decode pods (repeat for several fleets, each a fresh ensemble).")
@click.option("--batches", default="1,2,4,8,16", show_default=True,
              help="Running requests per pod at each level of the ramp, comma-separated.")
@click.option("--step-ms", default=25.0, show_default=True, help="The stubs' decode step interval (ITL floor).")
@click.option("--routers", default=1, show_default=True, help="Router processes; clients use them in turn.")
@click.option("--redis-cluster", "shards", default=0, show_default=True,
              help="Shards of a local Redis Cluster (0: one plain redis-server).")
@click.option("--model", default="smollm2-135m-instruct", show_default=True,
              help="Model whose tokenizer the routers load (no weights are used).")
@click.option("--input-len", default=32, show_default=True, help="Prompt tokens per request (random ids).")
@click.option("--output-len", default=64, show_default=True, help="Tokens per request (ignore_eos).")
@click.option("--warmup-s", default=2.0, show_default=True, help="Seconds of each level before measuring.")
@click.option("--seconds", default=6.0, show_default=True, help="Measuring window per level.")
@click.option("--max-added-ms", default=10.0, show_default=True, help="p99 ITL the control plane may add.")
@click.option("--baseline", type=click.Choice(["first", "none"]), default="first", show_default=True,
              help="What --max-added-ms is counted over: the first level's added p99 (the host's noise at the lightest "
                   "load) or nothing (the absolute rule).")
@click.option("--heartbeat-s", default=1.0, show_default=True,
              help="Seconds between each stand-in pod's registry heartbeats (the workers' default is 1).")
@click.option("--json-out", type=click.Path(dir_okay=False), default=None)
def control_plane_command(pod_counts, batches, step_ms, routers, shards, model, input_len, output_len, warmup_s,
                          seconds, max_added_ms, baseline, heartbeat_s, json_out) -> None:
    """The tokens/s the control plane carries, and its CPU per token, with stand-in decode pods.

    N stand-in decode pods (the real decode worker on a stub engine that emits one token per running request every
    --step-ms; all N in one process) behind real Redis (--redis-cluster: a local cluster), routers and registry.
    Streaming clients keep pods x batch requests open, so the offered load is pods x batch / step tokens/s, for each
    batch of --batches. Per level: client ITL p50/p99 and what p99 adds over the step, each token's step-to-client
    time, the stubs' own lateness, and CPU per token of Redis, routers, registry, pods and clients. The ceiling is
    the last level before p99 ITL grows by more than --max-added-ms (pdserve/loadtest/README.md).

    \b
    pdserve bench control-plane --pods 8 --pods 32 --batches 1,2,4,8
    pdserve bench control-plane --pods 32 --step-ms 100 --redis-cluster 3 --routers 2
    """
    levels = [int(b) for b in batches.split(",") if b.strip()]
    click.echo(f"control-plane: step {step_ms:g} ms, {input_len} in / {output_len} out, {routers} router(s), "
               f"{'Redis Cluster x' + str(shards) if shards else 'one Redis'}; CPU flags {cpu_flags()}; load "
               f"{os.getloadavg()[0]:.1f}")
    results = []
    try:
        for pods in pod_counts:
            rows = ramp(pods, levels, routers, shards, step_ms, model, input_len, output_len, warmup_s, seconds,
                        max_added_ms, baseline, heartbeat_s)
            top = ceiling(rows)
            reached = top is not rows[-1]
            click.echo(f"N={pods}: ceiling {f'{top.tok_s:.0f} tok/s (batch {top.batch})' if top else 'below the first level'}"
                       f"{'' if reached else ' (the ramp ended, saturated or out of levels, within the bound)'}; bound {rows[-1].bound_ms:.1f} ms "
                       f"added p99 ITL; load {os.getloadavg()[0]:.1f}")
            results += [asdict(r) for r in rows]
    except LoadTestError as exc:
        raise click.ClickException(str(exc)) from None
    if json_out:
        with open(json_out, "w") as f:
            json.dump(results, f, indent=2)
