"""The registry's prefix lookup (one ``_WALK`` script per pod) against two oracles that could disagree with it:

- the lookup it replaced, kept here as ``smismember_overlaps``: three pipelined ``SMISMEMBER`` per pod over the
  same Redis state, folded by ``leading_ones`` and ``tier_counts`` (the rule in Python);
- a pure-Python model of what the registry must hold (``Model``): each pod's sets per medium, built from the
  events and snapshots the test sends, emptied by a new epoch, gone with the pod's heartbeats.

Randomized sequences of stored/removed events on every medium, snapshots, worker restarts (new epoch), pods that
stop beating (their keys expire), chains of two hash widths, and a flushed script cache, on a real redis-server and
on a real 3-shard Redis Cluster; every lookup goes through the HTTP API with the real client.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from pdserve.services.registry.app import create_app
from pdserve.services.registry.kv_index import KEEP_TTLS, blocks_key, tier_keys
from pdserve.services.registry.settings import RegistrySettings
from pdserve.shared.protocol.kv_events import (MEDIUMS, KVEvent, KVEventBatch, KVLookupReply, KVSnapshot, PodOverlap,
                                               encode_lookup_reply)
from pdserve.shared.protocol.registry import PodInfo
from pdserve.shared.registry_client import RegistryClient

from support.redis_ha import RedisClusterServers

pytestmark = [pytest.mark.timeout(120)]

TTL_S = 1.0
HISTORY = ("resyncs", "snapshots", "restarts", "expiries", "script flushes", "long leads")


def leading_ones(flags: list[int]) -> int:
    n = 0
    for f in flags:
        if not f:
            break
        n += 1
    return n


def tier_counts(flags_per_medium: list[list[int]]) -> dict[str, int]:
    counts = dict.fromkeys(MEDIUMS, 0)
    for flags in zip(*flags_per_medium):
        best = next((m for m, f in zip(MEDIUMS, flags) if f), None)
        if best is None:
            break
        counts[best] += 1
    return counts


async def smismember_overlaps(redis: aioredis.Redis, pod_ids: list[str],
                              chain: list[str]) -> list[tuple[int, dict[str, int]]]:
    """The registry's lookup before the walk script: the whole chain against each of the pod's three sets."""
    if not pod_ids or not chain:
        return [(0, {})] * len(pod_ids)
    members = [bytes.fromhex(h) for h in chain]
    async with redis.pipeline(transaction=False) as pipe:
        for pod_id in pod_ids:
            for key in (blocks_key(pod_id), *tier_keys(pod_id)):
                pipe.smismember(key, members)
        answers = await pipe.execute()
    n = len(MEDIUMS)
    return [(leading_ones(answers[i * n]), tier_counts(answers[i * n:(i + 1) * n])) for i in range(len(pod_ids))]


def model_overlap(sets: dict[str, set[str]], chain: list[str]) -> tuple[int, dict[str, int]]:
    if not chain:
        return 0, {}
    lead = leading_ones([h in sets["device"] for h in chain])
    return lead, tier_counts([[h in sets[m] for h in chain] for m in MEDIUMS])


def pod_info(pod_id: str) -> PodInfo:
    return PodInfo(pod_id=pod_id, role="decode", host="127.0.0.1", http_port=8003, kv_port=9000, model="m",
                   block_size=4, total_blocks=64, free_blocks=60)


class Model:
    """What the registry must answer: per pod its epoch, last sequence number, sets per medium, and whether it beats."""

    def __init__(self) -> None:
        self.pods: dict[str, dict] = {}

    def pod(self, pod_id: str) -> dict:
        return self.pods.setdefault(pod_id, {"epoch": "e0", "seq": 0, "beating": True,
                                             "sets": {m: set() for m in MEDIUMS}})


def documents(rng: random.Random) -> list[list[str]]:
    """Hash chains pods cache parts of: most of 16-byte hashes (the engine's), one of 8-byte ones."""
    docs = [[rng.randbytes(16).hex() for _ in range(rng.randint(4, 40))] for _ in range(5)]
    docs.append([rng.randbytes(8).hex() for _ in range(12)])
    return docs


async def scenario(url: str, seed: int, steps: int, flush_scripts) -> Counter:
    rng = random.Random(seed)
    app = create_app(RegistrySettings(redis_url=url, pod_ttl_s=TTL_S))
    client = RegistryClient("http://registry", transport=httpx.ASGITransport(app=app))
    rds = app.state.redis
    model, docs = Model(), documents(rng)
    pod_ids = [f"d{i}" for i in range(7)]
    seen: Counter = Counter()  # what the history went through

    async def beat() -> None:
        for pod_id in pod_ids:
            if model.pod(pod_id)["beating"]:
                await client.heartbeat(pod_info(pod_id))

    async def send_events(pod_id: str) -> None:
        p = model.pod(pod_id)
        events = []
        for _ in range(rng.randint(1, 4)):
            doc = rng.choice(docs)
            start = rng.choice([0, 0, rng.randrange(len(doc))])
            part = doc[start:start + rng.randint(1, len(doc))]
            medium = rng.choice(MEDIUMS)
            kind = "stored" if rng.random() < 0.65 else "removed"
            if kind == "removed":
                part = rng.sample(sorted(p["sets"][medium] | set(part)), k=min(3, len(p["sets"][medium] | set(part))))
            p["seq"] += 1
            events.append(KVEvent(seq=p["seq"], kind=kind, block_hashes=part, medium=medium))
            (p["sets"][medium].update if kind == "stored" else p["sets"][medium].difference_update)(part)
        reply = await client.publish_kv_events(KVEventBatch(pod_id=pod_id, epoch=p["epoch"], events=events))
        if reply.resync:  # the registry lost the pod (it expired): the pod sends its whole state
            seen["resyncs"] += 1
            await snapshot(pod_id)
        else:
            assert (reply.applied, reply.seq) == (len(events), p["seq"])

    async def snapshot(pod_id: str, replace: bool = False) -> None:
        p = model.pod(pod_id)
        if replace:  # the pod's true state differs from its events' (a resync after lost events)
            for m in MEDIUMS:
                p["sets"][m] = {h for doc in docs for h in doc if rng.random() < 0.15}
        reply = await client.publish_kv_snapshot(KVSnapshot(
            pod_id=pod_id, epoch=p["epoch"], seq=p["seq"], block_hashes=sorted(p["sets"]["device"]),
            cpu_block_hashes=sorted(p["sets"]["cpu"]), disk_block_hashes=sorted(p["sets"]["disk"])))
        assert reply.seq == p["seq"]

    async def check() -> None:
        await beat()
        for _ in range(6):
            doc = rng.choice(docs)
            chain = doc[:rng.randint(0, len(doc))]
            if chain and rng.random() < 0.2:  # a block nobody holds in the middle
                chain.insert(rng.randrange(len(chain)), rng.randbytes(16).hex())
            if chain and rng.random() < 0.1:  # two widths in one chain
                chain.append(rng.choice(docs[-1]))
            # the walk and the SMISMEMBER reference on the same state, alive or not
            assert await app.state.index.overlaps(pod_ids, chain) == await smismember_overlaps(rds, pod_ids, chain)
            reply = await client.lookup(chain, "decode")
            got = {o.pod.pod_id: (o.overlap, o.tier_overlap) for o in reply.pods}
            want = {pod_id: model_overlap(p["sets"], chain) for pod_id, p in model.pods.items() if p["beating"]}
            assert got == want, (seed, chain)
            assert reply.num_prefill_pods == 0
            seen['lookups'] += 1
            seen['long leads'] += max(o for o, _ in want.values()) >= 4

    try:
        await rds.flushall()  # another scenario may have run on this server
        await beat()
        for step in range(steps):
            pod_id = rng.choice(pod_ids)
            p = model.pod(pod_id)
            roll = rng.random()
            if not p["beating"]:
                if roll < 0.3:  # it comes back: new events cannot be placed, a snapshot follows
                    p["beating"] = True
                    await client.heartbeat(pod_info(pod_id))
                    await send_events(pod_id)
            elif roll < 0.65:
                await send_events(pod_id)
            elif roll < 0.75:
                seen["snapshots"] += 1
                await snapshot(pod_id, replace=True)
            elif roll < 0.82:  # the worker restarts: a new epoch starts at 1 from an empty cache
                seen["restarts"] += 1
                p["epoch"], p["seq"] = f"e{step}", 0
                p["sets"] = {m: set() for m in MEDIUMS}
                await send_events(pod_id)
            elif roll < 0.86 and sum(q["beating"] for q in model.pods.values()) > 2:
                seen["expiries"] += 1
                p["beating"] = False  # it stops beating: its record and sets expire (KEEP_TTLS x TTL at most)
                for _ in range(int(KEEP_TTLS * TTL_S / 0.25) + 2):
                    await asyncio.sleep(0.25)
                    await beat()
                    if not await rds.exists(blocks_key(pod_id), *tier_keys(pod_id)):
                        break
                # the registry forgot it; the pod keeps its cache and its numbering, so its next events ask for a resync
                assert await rds.exists(blocks_key(pod_id), *tier_keys(pod_id)) == 0
            elif roll < 0.89:
                seen["script flushes"] += 1
                await flush_scripts()  # a restarted or failed-over Redis has no scripts: the lookup loads its own
            if step % 5 == 4:
                await check()
        await check()
    finally:
        await client.aclose()
        await rds.aclose()
    return seen


def test_walk_agrees_with_smismember_and_the_model_on_random_histories(redis_url):
    async def flush():
        r = aioredis.from_url(redis_url)
        await r.script_flush()
        await r.aclose()

    seen = sum((asyncio.run(scenario(redis_url, seed, 120, flush)) for seed in (1, 2)), Counter())
    assert seen["lookups"] >= 50 and all(seen[k] for k in HISTORY), seen


def test_walk_agrees_with_smismember_and_the_model_on_a_redis_cluster():
    with RedisClusterServers(shards=3) as cluster:
        async def flush():
            for port in cluster.ports:
                with redis.Redis(port=port) as node:
                    node.script_flush()

        seen = asyncio.run(scenario(cluster.url, 3, 100, flush))
    assert seen["lookups"] >= 20 and seen["script flushes"] and seen["expiries"], seen


def test_lookup_reply_encoding_is_the_models_json_byte_for_byte():
    pods = [pod_info("d0"), pod_info("d1").model_copy(update={"kv_endpoint": {"port": 9, "x": "é\"q"},
                                                               "last_heartbeat": 1.5})]
    tiers = [{"device": 2, "cpu": 1, "disk": 0}, {}]
    reply = KVLookupReply(num_prefill_pods=3, pods=[PodOverlap(pod=p, overlap=i, tier_overlap=t)
                                                    for i, (p, t) in enumerate(zip(pods, tiers))])
    encoded = encode_lookup_reply([(p.model_dump_json().encode(), i, t) for i, (p, t) in enumerate(zip(pods, tiers))],
                                  3)
    assert encoded == reply.model_dump_json().encode()
    assert KVLookupReply.model_validate_json(encoded) == reply
    assert encode_lookup_reply([], 0) == KVLookupReply(pods=[]).model_dump_json().encode()
