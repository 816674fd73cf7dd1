"""Fault injection against a real ensemble: kill pods, stop them, restart Redis, disconnect clients — and count
what every request got.

    python -m pdserve.loadtest.chaos --requests 16 --max-tokens 16

starts its own ensemble (real redis-server, registry, router, prefill and decode workers as processes, the
same children ``pdserve up`` starts), runs each scenario under load and prints one row per scenario:
sent, completed, failed with a clear error (an OpenAI error body or error chunk naming the cause), lost
(no answer, a broken stream, a 5xx without an error body — must be 0), leaked (what pods, Redis and routers
still hold once the ensemble is quiet, beyond what they held before: ``faults.leaks``; "-" where not measured),
wrong (a completed greedy answer that differs from the uninterrupted run's, or duplicated/missing tokens) and
the p99 latency of the completed requests. Then the fault rows 1 and 6-11
(``pdserve/loadtest/faults.py``: a full decode KV cache, Redis losing its data, the router's SIGTERM, the registry and
router killed under ``pdserve up``, a SIGSTOPped prefill worker, a KV port that never answers, a prompt list
under admission limits). The last row is the 10x overload of ``pdserve/loadtest/overload.py`` (sustainable rate
measured, then ten times it offered open-loop against the router's admission limits), whose latency and memory
tables follow the main one. ``--only`` runs some rows. ``tests/chaos`` runs the same scenarios small, as
assertions.
"""

from __future__ import annotations

import asyncio
import random
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

import click
import httpx
import redis as redis_sync

from pdserve.loadtest.faultkit import Cluster, Outcome, Tally, completion, errors_note, prompts, table, wait_for
from pdserve.services import up
from pdserve.shared.protocol import keys

# ---- scenarios -------------------------------------------------------------------------------------------------


async def reference(url: str, texts: list[str], max_tokens: int, **extra: Any) -> list[Outcome]:
    """The uninterrupted run's answers (greedy), one request at a time."""
    async with httpx.AsyncClient(timeout=300) as client:
        return [await completion(client, url, p, max_tokens, stream=False, **extra) for p in texts]


def check(outcomes: list[Outcome], expected: list[Outcome]) -> None:
    for got, want in zip(outcomes, expected):
        if got.kind == "completed":
            got.wrong = got.text != want.text or got.completion_tokens != want.completion_tokens


def relayed_request_ids(r: redis_sync.Redis) -> set[str]:
    """The request ids with events still in a router's relay stream (``keys.relay_stream``; a router trims what it
    read in whole stream nodes of ~100 entries, so a young request's events are still there) or in a stream of
    their own (``keys.output_stream``: requests that name no router)."""
    from pdserve.shared.protocol.messages import OutputBatch

    ids = {keys.output_stream_request(k) for k in r.scan_iter(match=keys.OUTPUT_STREAMS_MATCH, count=1000)}
    for stream in r.scan_iter(match=keys.relay_stream("*"), count=1000):
        for _, fields in r.xrange(stream):
            ids.update(e.request_id for e in OutputBatch.decode(fields).events)
    return ids


async def prefill_kill(cluster: Cluster, n: int, max_tokens: int, wait_s: float = 6.0) -> Tally:
    """SIGKILL the prefill worker holding the most queue entries after the first tokens went out but before the
    KV hand-over (the decode pods are stopped meanwhile, so the hand-over cannot complete and the entries stay
    pending); the surviving prefill workers reclaim them after ``claim_idle_s`` and prefill them again, so the
    first tokens are emitted twice — the client must see them once. ``wait_s`` must stay below the registry's
    pod TTL (stopped decode pods do not heartbeat)."""
    texts = prompts(n, seed=1)
    want = await reference(cluster.router_url, texts, max_tokens)
    decode = cluster.names("decode")
    r = cluster.redis()
    cluster.pause(*decode)
    try:
        progress = [0] * n  # tokens each client has: the first tokens out are the clients' own count
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [asyncio.create_task(completion(client, cluster.router_url, p, max_tokens,
                                                    on_token=lambda count, i=i: progress.__setitem__(i, count)))
                     for i, p in enumerate(texts)]
            await asyncio.to_thread(wait_for, lambda: sum(1 for c in progress if c) >= n, wait_s)
            emitted = sum(1 for c in progress if c)
            holders = {c["name"].decode() if isinstance(c["name"], bytes) else c["name"]: c["pending"]
                       for c in r.xpending(keys.PREFILL_STREAM, keys.PREFILL_GROUP)["consumers"]}
            victim = max(holders, key=holders.get) if holders else cluster.names("prefill")[0]
            cluster.kill(victim)
            cluster.resume(*decode)
            outcomes = await asyncio.gather(*tasks)
    finally:
        cluster.resume(*decode)
        r.close()
    check(outcomes, want)
    return Tally("prefill worker SIGKILL", list(outcomes),
                 f"{emitted}/{n} first tokens out, {holders.get(victim, 0)} entries held by {victim} at the kill")


async def decode_kill(cluster: Cluster, n: int, max_tokens: int,
                      variants: Sequence[dict[str, Any]] = ({"ignore_eos": True},)) -> Tally:
    """SIGKILL a decode worker while it generates (after every client got 3 tokens); its requests move to a
    live decode pod and resume after the tokens already sent. Request ``i`` adds ``variants[i % len]`` to its
    body (e.g. ``temperature`` + ``seed``: a seeded request resumes its sampling; ``stop``)."""
    texts = prompts(n, seed=2)
    per = [dict(variants[i % len(variants)]) for i in range(n)]
    want = [(await reference(cluster.router_url, [t], max_tokens, **p))[0] for t, p in zip(texts, per)]
    progress = [0] * n
    async with httpx.AsyncClient(timeout=120) as client:
        def on_token(i: int) -> Callable[[int], None]:
            return lambda count: progress.__setitem__(i, count)
        tasks = [asyncio.create_task(completion(client, cluster.router_url, p, max_tokens, on_token=on_token(i),
                                                **per[i])) for i, p in enumerate(texts)]
        while min(progress) < 3 and not all(t.done() for t in tasks):
            await asyncio.sleep(0.02)
        busy = [name for name in cluster.names("decode") if cluster.stats(name).get("num_running", 0) > 0]
        victim = busy[0] if busy else cluster.names("decode")[0]
        cluster.kill(victim)
        outcomes = await asyncio.gather(*tasks)
    check(outcomes, want)
    moved = sum(1 for o in outcomes if o.kind == "completed")
    return Tally("decode worker SIGKILL", list(outcomes), f"killed {victim} mid-generation; {moved} finished")


async def no_decode_left(cluster: Cluster, n: int, max_tokens: int) -> Tally:
    """Every decode worker killed: requests get a clear 503, never hang."""
    for name in cluster.names("decode"):
        cluster.kill(name)
    async with httpx.AsyncClient(timeout=120) as client:
        outcomes = await asyncio.gather(*[completion(client, cluster.router_url, p, max_tokens)
                                          for p in prompts(n, seed=3)])
    return Tally("no decode pod left", list(outcomes), "503 expected")


async def abort_storm(cluster: Cluster, n: int, max_tokens: int, seed: int = 0) -> Tally:
    """``n`` streaming clients, each hanging up after a random number of tokens (0 = before the first)."""
    rng = random.Random(seed)
    texts = prompts(n, words=40, seed=4)
    # all n at once: httpx's default pool (100 connections) would hold the rest back in the client
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=n + 16)) as client:
        outcomes = await asyncio.gather(*[completion(client, cluster.router_url, p, max_tokens, ignore_eos=True,
                                                     disconnect_after=rng.randint(0, max_tokens - 1))
                                          for p in texts])
    tally = Tally("abort storm", [], "clients hang up at random; counted: cleanup")
    for o in outcomes:  # a client that hung up got what it asked for
        if o.exception == "disconnected by the client":
            o.exception, o.status, o.done, o.finish_reason = None, 200, True, "stop"
        tally.outcomes.append(o)
    tally.note = errors_note(tally.outcomes)
    return tally


async def overload(url: str, n: int, max_tokens: int) -> Tally:
    """``n`` requests at once against a router with admission limits: the surplus gets 429 + Retry-After."""
    async with httpx.AsyncClient(timeout=300) as client:
        outcomes = await asyncio.gather(*[completion(client, url, p, max_tokens, stream=False)
                                          for p in prompts(n, words=30, seed=5)])
    for o in outcomes:
        if o.status == 429 and not o.retry_after:
            o.error = None  # a 429 without Retry-After is not a clear answer
    return Tally("overload (all at once)", list(outcomes), "429 + Retry-After above the limits")


class AofRedis:
    """A redis-server with an append-only file (fsync always) on a free port, restartable in place."""

    def __init__(self, data_dir: Path) -> None:
        self.dir, self.port, self.proc = Path(data_dir), up.free_port(), None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> AofRedis:
        import subprocess
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([up.redis_executable(), "--port", str(self.port), "--bind", "127.0.0.1",
                                      "--save", "", "--appendonly", "yes", "--appendfsync", "always",
                                      "--dir", str(self.dir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis_sync.Redis.from_url(self.url, socket_timeout=1)
        def ping() -> bool:
            try:
                return bool(client.ping())
            except redis_sync.RedisError:
                return False
        ok = wait_for(ping, 20, 0.05)
        client.close()
        if not ok:
            raise RuntimeError("redis-server did not start")
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


async def redis_restart(cluster: Cluster, server: AofRedis, n: int, max_tokens: int) -> Tally:
    """Requests queued (prefill workers stopped) while Redis restarts: none may be lost."""
    texts = prompts(n, seed=8)
    want = await reference(cluster.router_url, texts, max_tokens)
    prefill = cluster.names("prefill")
    r = cluster.redis()
    base = r.xlen(keys.PREFILL_STREAM)
    cluster.pause(*prefill)
    try:
        async with httpx.AsyncClient(timeout=180) as client:
            tasks = [asyncio.create_task(completion(client, cluster.router_url, p, max_tokens)) for p in texts]
            await asyncio.to_thread(wait_for, lambda: r.xlen(keys.PREFILL_STREAM) >= base + n, 10)
            server.stop()
            await asyncio.sleep(2.0)
            server.start()
            cluster.resume(*prefill)
            outcomes = await asyncio.gather(*tasks)
    finally:
        cluster.resume(*prefill)
        r.close()
    check(outcomes, want)
    return Tally("redis restart (queued requests)", list(outcomes), "AOF; 2 s outage")


# ---- the command ---------------------------------------------------------------------------------------------


@click.command("chaos")
@click.option("--requests", "n", type=click.IntRange(min=1), default=8, show_default=True,
              help="Requests per fault scenario.")
@click.option("--storm", type=click.IntRange(min=1), default=200, show_default=True, help="Abort-storm clients.")
@click.option("--overload", "overload_n", type=click.IntRange(min=1), default=80, show_default=True,
              help="Requests sent at once against --max-queued admission.")
@click.option("--max-queued", type=click.IntRange(min=1), default=8, show_default=True,
              help="The router's --max-queued-requests in the overload scenario.")
@click.option("--max-queued-tokens", type=click.IntRange(min=1), default=512, show_default=True,
              help="The router's --max-queued-prompt-tokens in the 10x overload scenario.")
@click.option("--overload-10x-s", "ten_x_s", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="Length of the 10x open-loop phase (pdserve/loadtest/overload.py; 0 = skip it).")
@click.option("--max-tokens", type=click.IntRange(min=4), default=16, show_default=True)
@click.option("--only", default=None, metavar="ROWS",
              help="Comma-separated rows to run: the fault rows' issue items (1,6,7,8,9,10,11; pdserve/loadtest/faults.py), "
                   "'classic' (the rows above them) and '10x' [default: all].")
@click.option("--fault-bound-s", type=click.FloatRange(min=1), default=90.0, show_default=True,
              help="Fault rows: a request with no answer within this is lost (twice it for the KV-cache row).")
@click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path), default=None)
def command(n: int, storm: int, overload_n: int, max_queued: int, max_queued_tokens: int, ten_x_s: float,
            max_tokens: int, only: str | None, fault_bound_s: float, log_dir: Path | None) -> None:
    """Run every fault scenario against fresh local ensembles and print the table."""
    from pdserve.loadtest import faults
    rows = {r.strip() for r in only.split(",") if r.strip()} if only else {"classic", "10x", *faults.ITEMS}
    unknown = rows - {"classic", "10x", *faults.ITEMS}
    if unknown:
        raise click.BadParameter(f"unknown rows {sorted(unknown)}", param_hint="--only")
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="pdserve-chaos-"))
    tallies: list[Tally] = []
    if "classic" in rows:
        tallies += classic(n, storm, overload_n, max_queued, max_tokens, log_dir)
    if rows & set(faults.ITEMS):
        tallies += faults.run(rows, n, log_dir, lambda m: click.echo(m, err=True), bound_s=fault_bound_s)
    detail, ten_x_ok = "", True
    if ten_x_s > 0 and "10x" in rows:
        from pdserve.loadtest import overload as ov
        with Cluster("--prefill", "1", "--decode", "1",
                     env=ov.limits_env(max_queued, max_queued_tokens), log_dir=log_dir / "overload") as cluster:
            result = ov.run(cluster, clients=max_queued, duration_s=ten_x_s, max_tokens=max_tokens,
                            echo=lambda m: click.echo(m, err=True))
        tallies.append(ov.tally(result, max_queued))
        detail, ten_x_ok = ov.report(result), ov.ok(result)
    click.echo(table(tallies))
    if detail:
        click.echo(f"\n10x overload (max_queued_requests {max_queued}, max_queued_prompt_tokens "
                   f"{max_queued_tokens}):\n{detail}")
    if any(t.count("lost") or t.wrong or t.failures for t in tallies) or not ten_x_ok:
        sys.exit(1)


def classic(n: int, storm: int, overload_n: int, max_queued: int, max_tokens: int, log_dir: Path) -> list[Tally]:
    """The first rows: pod deaths, abort storm, overload and a Redis restart with AOF."""
    from pdserve.loadtest import faults
    env = {"PDSERVE_CLAIM_IDLE_S": "3", "PDSERVE_POD_TTL_S": "8", "PDSERVE_MIGRATION_STALL_S": "1",
           "PDSERVE_DTYPE": "float32"}
    tallies: list[Tally] = []
    with Cluster("--prefill", "2", "--decode", "2", env=env, log_dir=log_dir / "pods") as cluster:
        click.echo(f"ensemble up (logs in {cluster.log_dir})", err=True)
        probe = faults.Probe.of(cluster)
        base = faults.snapshot(probe)
        tallies.append(asyncio.run(abort_storm(cluster, storm, max_tokens)))
        found = faults.leaks(probe, base, settle_s=60)
        tallies[-1].leaked = faults.leak_text(found)
        if found:
            tallies[-1].failures.append("leaked")
        click.echo(table(tallies[-1:]), err=True)
        tallies.append(asyncio.run(prefill_kill(cluster, n, max_tokens)))
        tallies.append(asyncio.run(decode_kill(cluster, n, max_tokens * 2)))
        tallies.append(asyncio.run(no_decode_left(cluster, n, max_tokens)))
        click.echo(table(tallies[-3:]), err=True)
    server = AofRedis(log_dir / "aof").start()
    try:
        env2 = {"PDSERVE_POD_TTL_S": "10", "PDSERVE_DTYPE": "float32",
                "PDSERVE_MAX_QUEUED_REQUESTS": str(max_queued)}
        with Cluster("--prefill", "1", "--decode", "1", "--redis-url", server.url,
                     env=env2, log_dir=log_dir / "redis") as cluster:
            tally = asyncio.run(overload(cluster.router_url, overload_n, max_tokens))
            tally.scenario = f"overload ({overload_n} at once, max {max_queued} queued)"
            tallies.append(tally)
            tallies.append(asyncio.run(redis_restart(cluster, server, n, max_tokens)))
    finally:
        server.stop()
    return tallies


if __name__ == "__main__":
    command()
