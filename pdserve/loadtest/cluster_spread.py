"""How the ensemble's Redis commands spread over the shards of a Redis Cluster (pdserve/loadtest/README.md).

Stand-in routers and decode pods drive the real Redis code paths against a local 3-shard cluster
(``RedisClusterServers``, the real ``redis-server``): each request is queued (XADD to the prefill stream or a
pod's own stream, read back with XREADGROUP and acknowledged), each pod writes one output event per running
request per step through the workers' ``publish`` (one ``OutputBatch`` XADD per step per router on the router's
relay stream), each router reads its relay stream through its ``RelayReader``, pods heartbeat into the registry's ``PodStore`` every 10 steps and
routers refresh their liveness key. ``INFO commandstats`` of each shard is read before and after. With
``--balanced`` the routers pick their ids as the router app does (``balanced_router_id``), one after the other.

    python -m pdserve.loadtest.cluster_spread --routers 8 --pods 16 --requests 64 --steps 40
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid

import click

from pdserve.loadtest.redis_cluster import RedisClusterServers
from pdserve.services.registry.store import PodStore
from pdserve.services.router.relay_reader import RelayReader
from pdserve.services.router.router_id import balanced_router_id
from pdserve.shared import redis_client
from pdserve.shared.protocol import keys
from pdserve.shared.protocol.messages import OutputEvent
from pdserve.shared.protocol.registry import PodInfo
from pdserve.shared.streams import ensure_group
from pdserve.shared.worker.events import publish
from pdserve.shared.worker.output_writer import OutputWriter


async def _queue(client, requests: list[tuple[str, str, str]]) -> None:
    """Each request through a queue: half the prefill stream, half its pod's own stream (local prefill)."""
    for i, (rid, _, pod) in enumerate(requests):
        stream, group = (keys.PREFILL_STREAM, keys.PREFILL_GROUP) if i % 2 else (keys.decode_stream(pod),
                                                                                   keys.DECODE_GROUP)
        await ensure_group(client, stream, group)
        await client.xadd(stream, {"request_id": rid})
        for name, entries in await client.xreadgroup(group, pod, {stream: ">"}, count=1) or []:
            await client.xack(name, group, *[entry_id for entry_id, _ in entries])


async def _router_ids(client, routers: int, rng: random.Random, balanced: bool) -> list[str]:
    """Random ids (seeded), or as routers pick theirs at start one after the other (``balanced_router_id``: each
    sees the ones announced before it)."""
    if not balanced:
        return [uuid.UUID(int=rng.getrandbits(128)).hex for _ in range(routers)]
    ids = []
    for _ in range(routers):
        ids.append(await balanced_router_id(client))
        await client.set(keys.router_key(ids[-1]), b"1", ex=keys.ROUTER_TTL_S * 100)
    return ids


async def _run(url: str, routers: int, pods: int, requests: int, steps: int, seed: int, balanced: bool) -> None:
    rng = random.Random(seed)
    client = redis_client.connect(url)
    router_ids = await _router_ids(client, routers, rng, balanced)
    pod_ids = [f"decode-{i}" for i in range(pods)]
    work = [(keys.owned_request_id(f"cmpl-{i}", router_ids[i % routers]), router_ids[i % routers],
             pod_ids[i % pods]) for i in range(requests)]
    store, writer = PodStore(client, pod_ttl_s=30), OutputWriter(client)
    for rid, owner, _ in work:
        writer.route(rid, owner)
    readers = {r: RelayReader(client, r, block_ms=50) for r in router_ids}
    await _queue(client, work)
    cursors = {rid: "0-0" for rid, _, _ in work}
    for step in range(steps):
        if step % 10 == 0:
            for pod in pod_ids:
                await store.heartbeat(PodInfo(pod_id=pod, role="decode", host="127.0.0.1", http_port=8003, model="m"))
            for r in router_ids:
                await client.set(keys.router_key(r), b"1", ex=keys.ROUTER_TTL_S)
        for pod in pod_ids:
            await publish(writer, client, [OutputEvent(rid, token_ids=[step], text="x") for rid, _, p in work
                                           if p == pod])
        for r, reader in readers.items():
            mine = {keys.output_stream(rid): cursors[rid] for rid, owner, _ in work if owner == r}
            for name, entries in await reader.xread(mine, block=50):
                cursors[keys.output_stream_request(name)] = entries[-1][0]
    for reader in readers.values():
        await reader.aclose()
    await client.aclose()


def measure(routers: int = 8, pods: int = 16, requests: int = 64, steps: int = 40, shards: int = 3,
            seed: int = 0, balanced: bool = False) -> dict:
    """Runs the load on a fresh local cluster; returns per-shard command counts and shares."""
    with RedisClusterServers(shards=shards) as cluster:
        cluster.reset_stats()
        asyncio.run(_run(cluster.url, routers, pods, requests, steps, seed, balanced))
        calls = cluster.commandstats()
    total = sum(calls)
    return {"routers": routers, "balanced": balanced, "pods": pods, "requests": requests, "steps": steps, "shard_commands": calls,
            "shard_share": [round(c / total, 3) for c in calls], "max_share": round(max(calls) / total, 3)}


@click.command()
@click.option("--routers", default=8, show_default=True)
@click.option("--pods", default=16, show_default=True)
@click.option("--requests", default=64, show_default=True, help="Requests in flight (spread over routers and pods).")
@click.option("--steps", default=40, show_default=True, help="Decode steps (one output event per request each).")
@click.option("--shards", default=3, show_default=True)
@click.option("--seed", default=0, show_default=True, help="Seeds the router ids (their slots).")
@click.option("--balanced", is_flag=True, help="Router ids as routers pick them (router_id.balanced_router_id), "
              "not random.")
def main(**kw) -> None:
    print(json.dumps(measure(**kw)))


if __name__ == "__main__":
    main()
