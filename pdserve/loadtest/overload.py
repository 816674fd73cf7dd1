"""10x overload, measured: what admission control keeps bounded when clients offer ten times what the cluster
can serve.

    python -m pdserve.loadtest.overload              # also: pdserve bench overload; a row of pdserve bench chaos

One fresh ensemble (redis-server, registry, router, 1 prefill + 1 decode worker: ``pdserve up``'s children), a
fixed small workload (distinct ~``words``-word prompts, ``max_tokens`` 16, greedy, streamed), three phases:

1. **sustainable rate** — a closed loop: ``clients`` clients, each sending its next request as soon as the last
   one is answered, for ``measure_s`` seconds. The sustainable rate is the completions per second of that loop:
   the cluster's throughput for this workload when it is never idle and never holds more than ``clients``
   requests (``clients`` <= ``--max-queued-requests``, so admission never rejects it). Open-loop arrivals above
   it queue without end unless something refuses them.
2. **1x** — open loop, Poisson arrivals (``loadtest.arrivals``, burstiness 1) at the sustainable rate for
   ``duration_s``: the admitted requests' latency when the cluster is busy but not overloaded.
3. **10x** — open loop, Poisson at 10x that rate for ``duration_s``. The router's admission limits
   (``--max-queued-requests``, ``--max-queued-prompt-tokens``: requests and prompt tokens still waiting for their
   first token) answer the surplus ``429`` with ``Retry-After``.

Every request is counted as completed, clear error (429 with ``Retry-After`` counted apart) or lost (no answer,
a broken stream, a 5xx without an error body, a 429 without ``Retry-After`` — must be 0). Latency is the
admitted (completed) requests' end-to-end time and time to first token, p50/p99. A sampler thread reads every
process's RSS (psutil, the process and its children, every ``interval_s``) and Redis ``INFO memory``
``used_memory``: before the 10x phase, the peak in each half of it (growth from the first half to the second is
what unbounded memory looks like), and after the admitted requests drained. Afterwards every process must be
alive and nothing may be left behind (``faultkit.leftovers``).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import httpx
import psutil

import redis as redis_sync

from pdserve.loadtest import faultkit
from pdserve.loadtest.arrivals import arrival_times
from pdserve.shared import redis_client

MIB = 1024 * 1024
# The processes whose memory is watched, in table order (the names ``Cluster`` gives them).
WATCHED = ("router", "registry", "prefill-0", "decode-0", "redis")


# ---- phases ----------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Phase:
    """One load phase. ``rate``: offered requests/s (closed loop: the measured completion rate)."""

    name: str
    rate: float
    duration_s: float
    outcomes: list[faultkit.Outcome] = field(default_factory=list)
    offsets: list[float] = field(default_factory=list)  # open loop: each request's send time from the start, s
    started: float = 0.0  # time.monotonic() when the first request went out
    sending_ended: float = 0.0  # ... when the last one went out
    ended: float = 0.0  # ... when the last answer came back

    def count(self, kind: str) -> int:
        return sum(1 for o in self.outcomes if o.kind == kind)

    @property
    def rejected(self) -> int:
        """Clear 429s with Retry-After."""
        return sum(1 for o in self.outcomes if o.kind == "clear_error" and o.status == 429 and o.retry_after)

    @property
    def other_errors(self) -> int:
        return self.count("clear_error") - self.rejected

    def latencies(self, attr: str = "latency_s", half: int | None = None) -> list[float]:
        """Sorted ``attr`` of the completed requests; ``half`` 1 or 2: only those sent in that half."""
        picked = self.outcomes
        if half is not None and self.offsets:
            picked = [o for o, t in zip(self.outcomes, self.offsets) if (t < self.duration_s / 2) == (half == 1)]
        return sorted(getattr(o, attr) for o in picked if o.kind == "completed" and getattr(o, attr) is not None)

    def tally(self) -> faultkit.Tally:
        return faultkit.Tally(self.name, list(self.outcomes), faultkit.errors_note(self.outcomes))


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of sorted ``values`` (None when empty)."""
    if not values:
        return None
    return values[min(len(values) - 1, max(0, math.ceil(q / 100 * len(values)) - 1))]


def workload(n: int, words: int, seed: int) -> list[str]:
    """``n`` distinct prompts (no two share more than their first word, so the prefix cache does not help)."""
    return faultkit.prompts(n, words=words, seed=seed)


def _client(timeout_s: float) -> httpx.AsyncClient:
    # httpx's default pool (100 connections) would queue an open loop's requests in the client and hide
    # the server's answer to overload: the load generator must not be the admission control.
    return httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=4096,
                                                                    max_keepalive_connections=512))


async def closed_loop(url: str, clients: int, duration_s: float, max_tokens: int, words: int,
                      seed: int = 100, timeout_s: float = 300.0) -> Phase:
    """``clients`` clients, each sending its next request when the last one is answered, until ``duration_s``
    has passed; the phase's ``rate`` is completions per second over the time it took."""
    texts = iter(workload(100_000, words, seed))
    phase = Phase("closed loop", 0.0, duration_s)
    async with _client(timeout_s) as client:
        phase.started = time.monotonic()
        stop = phase.started + duration_s

        async def one_client() -> None:
            while time.monotonic() < stop:
                out = await faultkit.completion(client, url, next(texts), max_tokens)
                phase.outcomes.append(out)
                if out.status == 429:  # more clients than --max-queued-requests: do as told
                    await asyncio.sleep(float(out.retry_after or 1))

        await asyncio.gather(*[one_client() for _ in range(clients)])
    phase.sending_ended = stop
    phase.ended = time.monotonic()
    phase.rate = phase.count("completed") / max(phase.ended - phase.started, 1e-9)
    return phase


async def open_loop(url: str, name: str, rate: float, duration_s: float, max_tokens: int, words: int,
                    seed: int = 0, timeout_s: float = 300.0) -> Phase:
    """Poisson arrivals at ``rate`` requests/s for ``duration_s`` (send times fixed in advance, so a slow
    server never slows the offered load); returns when every request has its answer."""
    n = int(rate * duration_s * 1.5) + 20
    offsets = [t for t in arrival_times(n, rate, 1.0, seed) if t < duration_s]
    texts = workload(len(offsets), words, seed + 1)
    phase = Phase(name, rate, duration_s, offsets=offsets)
    async with _client(timeout_s) as client:
        tasks = []
        phase.started = start = time.monotonic()
        for offset, text in zip(offsets, texts):
            delay = start + offset - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(faultkit.completion(client, url, text, max_tokens)))
        phase.sending_ended = time.monotonic()
        phase.outcomes = list(await asyncio.gather(*tasks))
    phase.ended = time.monotonic()
    return phase


# ---- memory -----------------------------------------------------------------------------------------------------


def _cpu_s(proc: psutil.Process) -> float:
    """CPU seconds (user + system) of ``proc`` and its children so far (0 once it is gone)."""
    total = 0.0
    try:
        for p in [proc, *proc.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
    except psutil.Error:
        pass
    return total


def _rss(proc: psutil.Process) -> int:
    """RSS of ``proc`` and its children, bytes (0 once it is gone)."""
    try:
        total = proc.memory_info().rss
        for child in proc.children(recursive=True):
            try:
                total += child.memory_info().rss
            except psutil.Error:
                pass
        return total
    except psutil.Error:
        return 0


class MemorySampler(threading.Thread):
    """Samples every watched process's RSS and Redis ``used_memory`` every ``interval_s`` (a daemon thread,
    so sampling does not wait for the event loop that drives the load). ``samples``: (monotonic time,
    {name: RSS bytes, "redis used_memory": bytes})."""

    def __init__(self, pids: dict[str, int], redis_url: str, interval_s: float = 0.2,
                 stats_urls: dict[str, str] | None = None) -> None:
        super().__init__(daemon=True, name="memory-sampler")
        self.stats_urls = stats_urls or {}
        # (monotonic time, {"decode-0 running": n, ...}): the workers' queues, once a second
        self.loads: list[tuple[float, dict[str, int]]] = []
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.redis = redis_client.connect(redis_url, sync=True, socket_timeout=2)
        self.interval_s = interval_s
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._halt = threading.Event()

    def snapshot(self) -> dict[str, int]:
        values = {name: _rss(p) for name, p in self.procs.items()}
        try:
            values["redis used_memory"] = int(self.redis.info("memory")["used_memory"])
        except redis_sync.RedisError:
            values["redis used_memory"] = 0
        return values

    def poll_load(self) -> dict[str, int]:
        out = {}
        for name, url in self.stats_urls.items():
            try:
                s = httpx.get(url, timeout=5).json()
            except (httpx.HTTPError, ValueError):
                continue
            keys = ("num_running", "num_waiting", "kv_blocks_used") if name.startswith("decode") else \
                ("num_running", "num_waiting", "requests_tracked")
            out.update({f"{name} {k}": int(s.get(k) or 0) for k in keys})
        return out

    def run(self) -> None:
        ticks = 0
        while not self._halt.is_set():
            self.samples.append((time.monotonic(), self.snapshot()))
            if self.stats_urls and ticks % max(1, round(1.0 / self.interval_s)) == 0:
                self.loads.append((time.monotonic(), self.poll_load()))
            ticks += 1
            self._halt.wait(self.interval_s)

    def peak_load(self, t0: float, t1: float) -> dict[str, int]:
        window = [values for t, values in self.loads if t0 <= t <= t1]
        names = sorted({k for v in window for k in v})
        return {k: max(v.get(k, 0) for v in window) for k in names}

    def stop(self) -> None:
        self._halt.set()
        self.join(10)
        self.redis.close()

    def cpu(self) -> dict[str, float]:
        return {name: _cpu_s(p) for name, p in self.procs.items()}

    def peak(self, t0: float, t1: float) -> dict[str, int]:
        window = [values for t, values in self.samples if t0 <= t <= t1]
        return {name: max((v.get(name, 0) for v in window), default=0) for name in self.names}

    @property
    def names(self) -> list[str]:
        return [*self.procs, "redis used_memory"]


def redis_pid(redis_url: str) -> int:
    r = redis_client.connect(redis_url, sync=True, socket_timeout=5)
    try:
        return int(r.info("server")["process_id"])
    finally:
        r.close()


# ---- the run ------------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Result:
    sustainable: Phase
    phases: list[Phase]  # 1x (when run), 10x
    memory: dict[str, dict[str, Any]]  # name -> before / peak_1 / peak_2 / after (bytes), cpu_s (the 10x phase)
    alive: dict[str, bool]
    leftovers: dict[str, Any]
    clean: bool
    load_avg: tuple[float, float, float]
    settings: dict[str, Any]
    load: dict[str, int] = field(default_factory=dict)  # the workers' peak queues during the 10x phase

    @property
    def ten_x(self) -> Phase:
        return self.phases[-1]


def limits_env(max_queued: int, max_queued_tokens: int) -> dict[str, str]:
    return {"PDSERVE_DTYPE": "float32", "PDSERVE_MAX_QUEUED_REQUESTS": str(max_queued),
            "PDSERVE_MAX_QUEUED_PROMPT_TOKENS": str(max_queued_tokens)}


def clean_after(cluster: faultkit.Cluster, base: dict[str, Any], timeout_s: float = 60.0) -> tuple[bool, dict]:
    """Waits until the finished requests left nothing behind (blocks back to ``base``, no leases, nothing
    tracked, no pending entries, no output streams); returns (clean, the last leftovers)."""
    last: dict[str, Any] = {}

    def clean() -> bool:
        nonlocal last
        last = faultkit.leftovers(cluster)
        return (not last["output_streams"] and not last["pending"]
                and all(d["kv_blocks_used"] == base["decode"][name]["kv_blocks_used"] and d["kv_active_leases"] == 0
                        and d["num_running"] == 0 and d["num_waiting"] == 0 and d["requests_tracked"] == 0
                        for name, d in last["decode"].items())
                and all(p["requests_tracked"] == 0 and p["num_running"] == 0 for p in last["prefill"].values()))

    return bool(faultkit.wait_for(clean, timeout_s, 0.5)), last


def run(cluster: faultkit.Cluster, *, clients: int = 8, measure_s: float = 20.0, duration_s: float = 30.0,
        baseline_s: float | None = None, factor: float = 10.0, max_tokens: int = 16, words: int = 20,
        interval_s: float = 0.2, echo=lambda *a, **k: None) -> Result:
    """The three phases against ``cluster`` (its router must have admission limits); ``baseline_s``: length of
    the 1x phase (default ``duration_s``; 0 skips it)."""
    url = cluster.router_url
    base = faultkit.leftovers(cluster)
    pids = {name: cluster.child(name).proc.pid for name in WATCHED if name != "redis"}
    pids["redis"] = redis_pid(cluster.redis_url)
    stats_urls = {name: cluster.child(name).health_url.removesuffix("/health") + "/v1/stats"
                  for name in ("prefill-0", "decode-0")}
    sampler = MemorySampler(pids, cluster.redis_url, interval_s, stats_urls)
    sampler.start()
    try:
        # warm-up: the first requests pay one-time costs (first batch shapes, tokenizer caches)
        asyncio.run(closed_loop(url, 2, 0.1, max_tokens, words, seed=99))
        sustainable = asyncio.run(closed_loop(url, clients, measure_s, max_tokens, words))
        rate = sustainable.rate
        echo(f"sustainable: {rate:.2f} req/s ({sustainable.count('completed')} completed by {clients} clients "
             f"in {sustainable.ended - sustainable.started:.1f} s)")
        if rate <= 0:
            raise RuntimeError("the closed loop completed nothing: " + faultkit.errors_note(sustainable.outcomes))
        phases = []
        if baseline_s is None:
            baseline_s = duration_s
        if baseline_s > 0:
            phases.append(asyncio.run(open_loop(url, "1x", rate, baseline_s, max_tokens, words, seed=1)))
            echo(f"1x: {len(phases[-1].outcomes)} sent")
        before, cpu_before = sampler.snapshot(), sampler.cpu()
        ten_x = asyncio.run(open_loop(url, f"{factor:g}x", factor * rate, duration_s, max_tokens, words, seed=2))
        cpu = {name: t - cpu_before[name] for name, t in sampler.cpu().items()}
        phases.append(ten_x)
        echo(f"{factor:g}x: {len(ten_x.outcomes)} sent")
        ok, left = clean_after(cluster, base)
        after = sampler.snapshot()
    finally:
        sampler.stop()
    mid = (ten_x.started + ten_x.sending_ended) / 2
    first, second = sampler.peak(ten_x.started, mid), sampler.peak(mid, ten_x.ended)
    memory = {name: {"before": before[name], "peak_1": first[name], "peak_2": second[name], "after": after[name],
                     "cpu_s": cpu.get(name)} for name in sampler.names}
    load = sampler.peak_load(ten_x.started, ten_x.ended)
    alive = {c.name: c.exited() is None and c.ready() for c in cluster.children}
    if "redis" not in alive:  # a Redis the cluster does not own (a test's): alive = answers PING
        alive["redis"] = bool(pids["redis"]) and psutil.pid_exists(pids["redis"])
    return Result(sustainable, phases, memory, alive, left, ok, os.getloadavg(),
                  {"clients": clients, "measure_s": measure_s, "duration_s": duration_s, "factor": factor,
                   "max_tokens": max_tokens, "words": words}, load)


# ---- tables -----------------------------------------------------------------------------------------------------


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _table(head: list[str], rows: list[list[str]]) -> str:
    rows = [head] + rows
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def requests_table(result: Result) -> str:
    head = ["phase", "offered req/s", "completed req/s", "sent", "completed", "429 + Retry-After",
            "other clear errors", "lost", "TTFT p50 / p99 s", "latency p50 / p99 s"]
    rows = []
    for p in [result.sustainable, *result.phases]:
        offered = f"{p.rate:.2f}" if p is not result.sustainable else "closed loop"
        done = p.count("completed") / max(p.ended - p.started, 1e-9)
        ttft, e2e = p.latencies("ttft_s"), p.latencies()
        rows.append([p.name if p is not result.sustainable else f"sustainable ({result.settings['clients']} clients)",
                     offered, f"{done:.2f}", str(len(p.outcomes)), str(p.count("completed")), str(p.rejected),
                     str(p.other_errors), str(p.count("lost")),
                     f"{_fmt(percentile(ttft, 50))} / {_fmt(percentile(ttft, 99))}",
                     f"{_fmt(percentile(e2e, 50))} / {_fmt(percentile(e2e, 99))}"])
    return _table(head, rows)


def memory_table(result: Result) -> str:
    ten = result.ten_x.name
    head = ["process", f"before {ten} MiB", f"peak, 1st half of {ten}", f"peak, 2nd half of {ten}",
            "after drain MiB", f"CPU s in {ten}", "alive after"]
    rows = []
    for name, m in result.memory.items():
        alive = "-" if name == "redis used_memory" else ("yes" if result.alive.get(name) else "NO")
        rows.append([name if name != "redis" else "redis-server", *(f"{m[k] / MIB:.1f}" for k in
                     ("before", "peak_1", "peak_2", "after")), _fmt(m.get("cpu_s"), 1), alive])
    return _table(head, rows)


def report(result: Result) -> str:
    la = " ".join(f"{x:.2f}" for x in result.load_avg)
    ten = result.ten_x
    halves = ", ".join(f"sent in its {h} half p50/p99 {_fmt(percentile(ten.latencies(half=i), 50))}/"
                       f"{_fmt(percentile(ten.latencies(half=i), 99))} s"
                       for i, h in ((1, "1st"), (2, "2nd")))
    load = ", ".join(f"{k} {v}" for k, v in result.load.items())
    lines = [requests_table(result), "", f"{ten.name} latency of requests {halves}",
             f"peak worker queues during {ten.name}: {load}", "", memory_table(result), "",
             f"leftovers after drain: {'none' if result.clean else json.dumps(result.leftovers)}; "
             f"every process alive: {'yes' if all(result.alive.values()) else 'NO'}; load average {la}"]
    notes = [f"{p.name}: {faultkit.errors_note(p.outcomes)}" for p in [result.sustainable, *result.phases]
             if p.other_errors or p.count("lost")]
    return "\n".join(lines + notes)


def ok(result: Result) -> bool:
    phases = [result.sustainable, *result.phases]
    return (all(p.count("lost") == 0 for p in phases) and all(result.alive.values()) and result.clean)


def tally(result: Result, max_queued: int) -> faultkit.Tally:
    """The 10x phase as a row of the chaos table."""
    p = result.ten_x
    e2e = p.latencies()
    t = p.tally()
    t.scenario = f"overload {p.name} ({p.rate:.1f} req/s for {p.duration_s:g} s, max {max_queued} queued)"
    t.note = (f"{p.rejected} x 429 + Retry-After; p50/p99 {_fmt(percentile(e2e, 50))}/{_fmt(percentile(e2e, 99))} s "
              f"vs 1x {_fmt(percentile(result.phases[0].latencies(), 50))}/"
              f"{_fmt(percentile(result.phases[0].latencies(), 99))} s"
              if len(result.phases) > 1 else f"{p.rejected} x 429 + Retry-After")
    if p.other_errors:
        t.note += "; " + faultkit.errors_note(p.outcomes)
    if not result.clean or not all(result.alive.values()):
        t.note += f"; alive {result.alive}; leftovers {result.leftovers}"
    return t


# ---- the command --------------------------------------------------------------------------------------------------


@click.command("overload")
@click.option("--clients", type=click.IntRange(min=1), default=8, show_default=True,
              help="Closed-loop clients that measure the sustainable rate (at most --max-queued: never rejected).")
@click.option("--measure-s", type=click.FloatRange(min=1), default=20.0, show_default=True,
              help="Length of the closed loop.")
@click.option("--duration-s", type=click.FloatRange(min=1), default=30.0, show_default=True,
              help="Length of the 1x and 10x open-loop phases.")
@click.option("--factor", type=click.FloatRange(min=1), default=10.0, show_default=True,
              help="Overload: this many times the sustainable rate.")
@click.option("--max-queued", type=click.IntRange(min=1), default=8, show_default=True,
              help="The router's --max-queued-requests.")
@click.option("--max-queued-tokens", type=click.IntRange(min=1), default=512, show_default=True,
              help="The router's --max-queued-prompt-tokens.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--words", type=click.IntRange(min=1), default=20, show_default=True, help="Words per prompt.")
@click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path), default=None)
def command(clients: int, measure_s: float, duration_s: float, factor: float, max_queued: int,
            max_queued_tokens: int, max_tokens: int, words: int, log_dir: Path | None) -> None:
    """Measure the sustainable rate, offer 10x it open-loop against admission limits, print what happened."""
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="pdserve-overload-"))
    with faultkit.Cluster("--prefill", "1", "--decode", "1",
                          env=limits_env(max_queued, max_queued_tokens), log_dir=log_dir) as cluster:
        click.echo(f"ensemble up (logs in {cluster.log_dir}); load average {os.getloadavg()[0]:.2f}", err=True)
        result = run(cluster, clients=clients, measure_s=measure_s, duration_s=duration_s, factor=factor,
                     max_tokens=max_tokens, words=words, echo=lambda m: click.echo(m, err=True))
    click.echo(f"max_queued_requests {max_queued}, max_queued_prompt_tokens {max_queued_tokens}, "
               f"{words}-word prompts, max_tokens {max_tokens}")
    click.echo(report(result))
    if not ok(result):
        sys.exit(1)


if __name__ == "__main__":
    command()
