"""``pdserve bench registry-lookup``: what one KV lookup (``POST /v1/kv/lookup``) costs the registry as the fleet grows.

A ``redis-server`` and a registry process (``pdserve registry``, from ``--tree`` checkouts in turns: A B A B), and N
pods registered through the real client (heartbeats, then block events: every pod holds a random-length head of one
shared 64-block chain in its pool and the next few blocks in its CPU tier, so the lookup's walk has real work). For
each N of ``--pods`` (pods are added between levels) and each chain length of ``--chains``: ``--lookups`` lookups one
after the other (latency at the client, p50 and p90; the registry's CPU per lookup from /proc, Redis's from ``INFO
cpu``), then ``--herd`` lookups at once (the wall time until the last answer: a fleet's clients arriving together).
Pods are given a long TTL, so nothing beats during the measurement.

    pdserve bench registry-lookup --tree main=/work/main --tree branch=. --rounds 2
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack

import click
import redis as redis_sync

from pdserve.loadtest.control_plane import cpu_flags, redis_servers
from pdserve.loadtest.procs import cpu_delta, free_port, running, tree_cpu_seconds
from pdserve.shared.protocol.kv_events import KVEvent, KVEventBatch
from pdserve.shared.protocol.registry import PodInfo
from pdserve.shared.registry_client import RegistryClient

CHAIN_BLOCKS = 64


def redis_cpu_s(client: redis_sync.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


async def add_pods(client: RegistryClient, first: int, last: int, chain: list[str], rng: random.Random) -> None:
    for i in range(first, last):
        pod_id = f"stand-in-{i}"
        await client.heartbeat(PodInfo(pod_id=pod_id, role="decode", host="127.0.0.1", http_port=8003, kv_port=9000,
                                       model="m", block_size=16, total_blocks=4096, free_blocks=2048))
        head = rng.randint(0, len(chain))
        tail = chain[head:head + rng.randint(0, 8)]
        events = [KVEvent(seq=1, kind="stored", block_hashes=chain[:head] or [chain[-1]]),
                  KVEvent(seq=2, kind="stored", block_hashes=tail, medium="cpu")]
        await client.publish_kv_events(KVEventBatch(pod_id=pod_id, epoch="bench", events=events))


async def measure(client: RegistryClient, chain: list[str], lookups: int, herd: int, registry_pid: int,
                  redis: redis_sync.Redis) -> dict:
    await client.lookup(chain)  # warm: connections, the script cache
    cpu0, redis0 = tree_cpu_seconds(registry_pid), redis_cpu_s(redis)
    lat = []
    for _ in range(lookups):
        t = time.perf_counter()
        await client.lookup(chain)
        lat.append(time.perf_counter() - t)
    cpu = cpu_delta(cpu0, tree_cpu_seconds(registry_pid))
    redis_cpu = redis_cpu_s(redis) - redis0
    lat.sort()
    t = time.perf_counter()
    await asyncio.gather(*(client.lookup(chain) for _ in range(herd)))
    herd_s = time.perf_counter() - t
    return {"p50_ms": 1e3 * statistics.median(lat), "p90_ms": 1e3 * lat[int(0.9 * (len(lat) - 1))],
            "registry_ms": 1e3 * cpu / lookups, "redis_ms": 1e3 * redis_cpu / lookups, "herd_s": herd_s}


def run_turn(name: str, tree: str | None, pod_counts: list[int], chains: list[int], lookups: int, herd: int,
             seed: int, echo=click.echo) -> list[dict]:
    rows = []
    with ExitStack() as stack:
        redis_url, (redis_port,) = stack.enter_context(redis_servers(0))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {"PDSERVE_REDIS_URL": redis_url, "PDSERVE_POD_TTL_S": "3600", "PDSERVE_LOG_LEVEL": "warning"}
        if tree:
            env["PYTHONPATH"] = os.path.abspath(tree)
        registry = stack.enter_context(running(
            [sys.executable, "-m", "pdserve.services.cli", "registry", "--host", "127.0.0.1", "--port", str(port)],
            url + "/health", 120, env))
        redis = redis_sync.Redis(port=redis_port)
        rng = random.Random(seed)
        chain = [rng.randbytes(16).hex() for _ in range(CHAIN_BLOCKS)]

        async def levels() -> None:
            client = RegistryClient(url, timeout_s=60)
            try:
                have = 0
                for n in pod_counts:
                    await add_pods(client, have, n, chain, rng)
                    have = n
                    for length in chains:
                        r = await measure(client, chain[:length], lookups, herd, registry.pid, redis)
                        row = {"tree": name, "pods": n, "chain": length, **r, "load": os.getloadavg()[0]}
                        rows.append(row)
                        echo(f"  {name:<8} N={n:<4} chain {length:<3} lookup p50 {r['p50_ms']:6.2f} p90 "
                             f"{r['p90_ms']:6.2f} ms  registry {r['registry_ms']:6.2f} CPU-ms  Redis "
                             f"{r['redis_ms']:5.2f} CPU-ms /lookup  {herd} at once {r['herd_s']:5.2f} s  "
                             f"load {row['load']:.1f}")
            finally:
                await client.aclose()

        asyncio.run(levels())
    return rows


@click.command("registry-lookup")
@click.option("--pods", default="8,32,64,128", show_default=True, help="Fleet sizes, comma-separated, ascending.")
@click.option("--chains", default="2,64", show_default=True, help="Lookup chain lengths in blocks (at most 64).")
@click.option("--lookups", default=100, show_default=True, help="Sequential lookups per level.")
@click.option("--herd", default=64, show_default=True, help="Lookups sent at once after the sequential ones.")
@click.option("--rounds", default=1, show_default=True, help="Turns per tree (A B A B ...).")
@click.option("--tree", "trees", multiple=True,
              help="NAME=PATH: run the registry from this checkout (PYTHONPATH); repeat to compare in turns.")
@click.option("--seed", default=0, show_default=True)
def registry_lookup_command(pods, chains, lookups, herd, rounds, trees, seed) -> None:
    """Latency and registry CPU per KV lookup at growing fleet sizes, checkouts in turns."""
    pod_counts = [int(x) for x in pods.split(",") if x.strip()]
    lengths = [min(CHAIN_BLOCKS, int(x)) for x in chains.split(",") if x.strip()]
    named = [tuple(t.split("=", 1)) if "=" in t else (t, t) for t in trees] or [("this", None)]
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    click.echo(f"registry-lookup: CPU flags {cpu_flags()}; {load}")
    for _ in range(rounds):
        for name, tree in named:
            run_turn(name, tree, pod_counts, lengths, lookups, herd, seed)
