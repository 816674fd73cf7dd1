"""The registry's block index against a real redis-server, reached over HTTP (ASGI) with the real client.

Oracles: the events posted (stored/removed sets computed by hand), and a real engine ``BlockPool`` driven
through allocations, caching, frees and evictions — its ``cached_block_hash_to_block`` is the pod's true
state, which the registry must hold after the pod's events, after a lost batch (sequence gap -> resync),
and never after the pod's heartbeat expired.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from pdserve.services.registry.app import create_app
from pdserve.services.registry.kv_index import blocks_key, seq_key, tier_keys
from pdserve.services.registry.settings import RegistrySettings
from pdserve.shared.engine.block_pool import BlockPool
from pdserve.shared.protocol.block_hash import compute_block_hashes
from pdserve.shared.protocol.kv_events import KVEvent, KVEventBatch, KVSnapshot
from pdserve.shared.protocol.registry import PodInfo
from pdserve.shared.registry_client import RegistryClient
from pdserve.shared.worker.kv_publisher import KVEventPublisher

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


def pod(pod_id: str, role: str = "decode", **kw) -> PodInfo:
    base = dict(pod_id=pod_id, role=role, host="127.0.0.1", http_port=8003, kv_port=9000, model="m",
                block_size=4, total_blocks=64, free_blocks=60, num_running=0, num_waiting=0)
    return PodInfo(**{**base, **kw})


def h(i: int) -> str:
    return i.to_bytes(16, "big").hex()


class Registry:
    def __init__(self, redis_url: str, pod_ttl_s: float = 5.0) -> None:
        self.app = create_app(RegistrySettings(redis_url=redis_url, pod_ttl_s=pod_ttl_s))
        self.client = RegistryClient("http://registry", transport=httpx.ASGITransport(app=self.app))
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://registry")

    async def blocks(self, pod_id: str) -> set[str]:
        r = await self.http.get(f"/v1/kv/pods/{pod_id}")
        assert r.status_code == 200
        return set(r.json()["block_hashes"])

    async def close(self) -> None:
        await self.client.aclose()
        await self.http.aclose()
        await self.app.state.store.redis.aclose()


@pytest_asyncio.fixture
async def registry(redis_url):
    reg = Registry(redis_url)
    yield reg
    await reg.close()


def batch(pod_id: str, epoch: str, *events: tuple[int, str, list[str]]) -> KVEventBatch:
    return KVEventBatch(pod_id=pod_id, epoch=epoch,
                        events=[KVEvent(seq=s, kind=k, block_hashes=hs) for s, k, hs in events])


async def test_stored_and_removed_events_reflected_exactly(registry):
    c = registry.client
    r = await c.publish_kv_events(batch("d0", "e1", (1, "stored", [h(1), h(2), h(3)]), (2, "removed", [h(2)])))
    assert (r.applied, r.seq, r.resync) == (2, 2, False)
    assert await registry.blocks("d0") == {h(1), h(3)}
    # a re-sent batch (a retry after a timeout) applies nothing twice
    r = await c.publish_kv_events(batch("d0", "e1", (2, "removed", [h(2)]), (3, "stored", [h(2), h(4)])))
    assert (r.applied, r.seq, r.resync) == (1, 3, False)
    assert await registry.blocks("d0") == {h(1), h(2), h(3), h(4)}
    r = await c.publish_kv_events(batch("d0", "e1", (4, "removed", [h(1), h(4), h(99)])))
    assert await registry.blocks("d0") == {h(2), h(3)}
    # another pod's events touch only its own set
    await c.publish_kv_events(batch("d1", "x", (1, "stored", [h(3), h(5)])))
    assert await registry.blocks("d0") == {h(2), h(3)}
    assert await registry.blocks("d1") == {h(3), h(5)}


async def test_gap_unknown_pod_and_new_epoch(registry):
    c = registry.client
    await c.publish_kv_events(batch("d0", "e1", (1, "stored", [h(1)])))
    r = await c.publish_kv_events(batch("d0", "e1", (3, "stored", [h(3)])))  # seq 2 never arrived
    assert r.resync and r.seq == 1 and r.applied == 0
    assert await registry.blocks("d0") == {h(1)}
    # a registry that never saw the pod cannot place seq 5
    assert (await c.publish_kv_events(batch("d9", "e1", (5, "stored", [h(5)])))).resync
    # a restarted worker (new epoch) starts from an empty cache at seq 1: the old set is dropped
    r = await c.publish_kv_events(batch("d0", "e2", (1, "stored", [h(7)])))
    assert (r.applied, r.resync) == (1, False)
    assert await registry.blocks("d0") == {h(7)}


async def test_invalid_batches_are_refused_with_openai_errors(registry):
    r = await registry.http.post("/v1/kv/events", json={"pod_id": "d0", "epoch": "e", "events": [
        {"seq": 1, "kind": "stored", "block_hashes": ["not-hex"]}]})
    assert r.status_code == 400
    assert r.json()["error"]["param"].startswith("events.0.block_hashes")
    r = await registry.http.post("/v1/kv/events", json={"pod_id": "d0", "epoch": "e", "events": [
        {"seq": 0, "kind": "stored", "block_hashes": []}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "events.0.seq"
    r = await registry.http.post("/v1/kv/lookup", json={"block_hashes": [h(1)], "role": "router"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "role"
    assert await registry.blocks("d0") == set()


class FakeEngine:
    """A real BlockPool driven like the engine does: allocate, cache full blocks, free tail-first."""

    def __init__(self, num_blocks: int, seed: int) -> None:
        self.pool = BlockPool(num_blocks, enable_caching=True, enable_kv_events=True)
        self.rng = random.Random(seed)
        self.held: list[list] = []

    def step(self) -> None:
        if self.held and (self.rng.random() < 0.45 or self.pool.get_num_free_blocks() < 8):
            blocks = self.held.pop(self.rng.randrange(len(self.held)))
            self.pool.free_blocks(reversed(blocks))
            return
        n = self.rng.randint(1, 6)
        prefix = self.rng.randrange(12)  # few distinct prefixes: hits, duplicates and evictions all happen
        tokens = [prefix] * 4 + [self.rng.randrange(3) for _ in range(4 * n - 4)]
        hashes = compute_block_hashes(tokens, 4)
        hits = []
        for hh in hashes:
            b = self.pool.get_cached_block(hh)
            if b is None:
                break
            hits.append(b)
        self.pool.touch(hits)
        blocks = hits + self.pool.get_new_blocks(len(hashes) - len(hits))
        self.pool.cache_full_blocks(blocks, hashes, len(hits), len(hashes))
        self.held.append(blocks)

    def truth(self) -> set[str]:
        return {k.hex() for k in self.pool.cached_block_hash_to_block}


def publisher_for(engine: FakeEngine, client: RegistryClient, pod_id: str, drop: set[int] = frozenset()):
    sent = {"batches": 0}

    async def send(b):
        sent["batches"] += 1
        if sent["batches"] in drop:  # lost on the way: the registry never sees it
            from pdserve.shared.protocol.kv_events import KVEventsReply
            return KVEventsReply(applied=len(b.events), seq=b.events[-1].seq)
        return await client.publish_kv_events(b)

    async def snapshot():
        pub.record(engine.pool.take_events())
        return pub.last_seq, list(engine.pool.cached_block_hash_to_block)

    pub = KVEventPublisher(send, client.publish_kv_snapshot, pod_id, snapshot)
    return pub


async def test_registry_follows_a_real_block_pool(registry):
    engine = FakeEngine(40, seed=1)
    pub = publisher_for(engine, registry.client, "d0")
    removed = 0
    for i in range(300):
        engine.step()
        events = engine.pool.take_events()
        removed += sum(e.kind == "removed" for e in events)
        pub.record(events)
        if i % 7 == 0:
            await pub.publish_pending()
            assert await registry.blocks("d0") == engine.truth()
    await pub.publish_pending()
    assert await registry.blocks("d0") == engine.truth()
    assert removed > 10 and pub.resyncs == 0  # evictions happened; no resync was needed


async def test_sequence_gap_resyncs_to_the_true_state(registry):
    engine = FakeEngine(40, seed=2)
    pub = publisher_for(engine, registry.client, "d0", drop={3})
    for i in range(200):
        engine.step()
        pub.record(engine.pool.take_events())
        if i % 10 == 0:
            await pub.publish_pending()
    await pub.publish_pending()
    assert pub.resyncs == 1
    assert await registry.blocks("d0") == engine.truth()
    epoch, seq = (await registry.http.get("/v1/kv/pods/d0")).json()["epoch"], pub.last_seq
    assert epoch == pub.epoch
    assert (await registry.http.get("/v1/kv/pods/d0")).json()["seq"] == seq
    # and it keeps following events after the resync
    for _ in range(50):
        engine.step()
        pub.record(engine.pool.take_events())
    await pub.publish_pending()
    assert await registry.blocks("d0") == engine.truth()


async def test_publisher_run_task_resyncs_after_registry_outage(redis_url):
    """The worker's task: first a snapshot (a previous process may have left state), then batches; a
    batch that fails to send is dropped and followed by a resync."""
    reg = Registry(redis_url)
    engine = FakeEngine(30, seed=3)
    calls = {"n": 0}

    async def flaky(b):
        calls["n"] += 1
        if calls["n"] == 2:
            raise httpx.ConnectError("registry down")
        return await reg.client.publish_kv_events(b)

    async def snapshot():
        pub.record(engine.pool.take_events())
        return pub.last_seq, list(engine.pool.cached_block_hash_to_block)

    pub = KVEventPublisher(flaky, reg.client.publish_kv_snapshot, "d0", snapshot, retry_s=0.05)
    task = pub.start()
    try:
        for _ in range(6):
            for _ in range(20):
                engine.step()
            pub.record(engine.pool.take_events())
            await asyncio.sleep(0.2)
        for _ in range(50):
            if await reg.blocks("d0") == engine.truth() and not pub._pending:
                break
            await asyncio.sleep(0.1)
        assert await reg.blocks("d0") == engine.truth()
        assert pub.failures == 1 and pub.resyncs == 2  # at start, and after the lost batch
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await reg.close()


async def test_lookup_answers_leading_overlap_and_load_per_alive_pod(registry):
    c = registry.client
    chain = [hh.hex() for hh in compute_block_hashes(list(range(20)), 4, "tenant")]  # 5 blocks
    await c.heartbeat(pod("d0", num_running=2, free_blocks=50, queued_prefill_tokens=0))
    await c.heartbeat(pod("d1", num_running=0, free_blocks=61))
    await c.heartbeat(pod("p0", role="prefill", kv_port=0))
    await c.publish_kv_events(batch("d0", "e", (1, "stored", chain[:3])))
    await c.publish_kv_events(batch("d1", "e", (1, "stored", [chain[0], chain[2], chain[3], chain[4]])))
    await c.publish_kv_events(batch("p0", "e", (1, "stored", chain)))
    reply = await c.lookup(chain, "decode")
    got = {o.pod.pod_id: (o.overlap, o.pod.num_running, o.pod.free_blocks) for o in reply.pods}
    assert got == {"d0": (3, 2, 50), "d1": (1, 0, 61)}  # d1 lacks block 1: only block 0 leads
    assert reply.num_prefill_pods == 1
    assert {o.pod.pod_id: o.overlap for o in (await c.lookup(chain, "prefill")).pods} == {"p0": 5}
    # another salt is another chain: nobody holds it
    other = [hh.hex() for hh in compute_block_hashes(list(range(20)), 4, "other")]
    assert {o.overlap for o in (await c.lookup(other, "decode")).pods} == {0}
    # a pod with blocks but no heartbeat is not alive: not in the answer
    await c.publish_kv_events(batch("ghost", "e", (1, "stored", chain)))
    assert "ghost" not in {o.pod.pod_id for o in (await c.lookup(chain)).pods}


async def test_expired_or_deregistered_pod_has_its_blocks_purged(redis_url):
    reg = Registry(redis_url, pod_ttl_s=0.5)
    r = aioredis.from_url(redis_url)
    try:
        c = reg.client
        await c.heartbeat(pod("d0"))
        await c.heartbeat(pod("d1"))
        await c.publish_kv_events(batch("d0", "e", (1, "stored", [h(1), h(2)])))
        await c.publish_kv_events(batch("d1", "e", (1, "stored", [h(1)])))
        quiet = time.monotonic()
        for _ in range(4):  # d1 keeps beating, d0 has gone quiet (0.8 s > its 0.5 s TTL): no longer looked up
            await asyncio.sleep(0.2)
            await c.heartbeat(pod("d1"))
        assert {o.pod.pod_id for o in (await c.lookup([h(1)])).pods} == {"d1"}
        while await r.exists(blocks_key("d0"), seq_key("d0")):  # its blocks outlive it by less than 2 x TTL
            assert time.monotonic() - quiet < 1.5 + 0.5
            await asyncio.sleep(0.2)
            await c.heartbeat(pod("d1"))
        assert await r.exists(blocks_key("d1"), seq_key("d1")) == 2
        assert {o.pod.pod_id for o in (await c.lookup([h(1)])).pods} == {"d1"}
        assert await reg.blocks("d0") == set()
        # d0 comes back: its next events cannot be placed -> resync
        assert (await c.publish_kv_events(batch("d0", "e", (2, "stored", [h(3)])))).resync
        await c.deregister("d1")
        assert await r.exists(blocks_key("d1"), seq_key("d1")) == 0
    finally:
        await r.aclose()
        await reg.close()


async def test_tier_events_are_indexed_per_medium_and_the_lookup_ranks_each_blocks_best_medium(registry):
    c = registry.client
    chain = [hh.hex() for hh in compute_block_hashes(list(range(24)), 4)]  # 6 blocks
    for name in ("d0", "d1", "d2", "d3"):
        await c.heartbeat(pod(name))

    def ev(seq, kind, hashes, medium):
        return KVEvent(seq=seq, kind=kind, block_hashes=hashes, medium=medium)

    async def publish(pod_id, *events):
        r = await c.publish_kv_events(KVEventBatch(pod_id=pod_id, epoch="e", events=list(events)))
        assert (r.applied, r.resync) == (len(events), False)

    # d0: blocks 0-1 in its pool, 2-3 in CPU (2 also on disk), 4 on disk; block 5 nowhere
    await publish("d0", ev(1, "stored", chain[:2], "device"), ev(2, "stored", chain[2:4], "cpu"),
                  ev(3, "stored", chain[2:3] + chain[4:5], "disk"))
    await publish("d1", ev(1, "stored", chain[:5], "cpu"))
    await publish("d2", ev(1, "stored", chain[:5], "disk"), ev(2, "removed", chain[1:2], "disk"))
    await publish("d3", ev(1, "stored", chain[:5], "device"), ev(2, "removed", chain[:5], "device"))
    reply = {o.pod.pod_id: (o.overlap, o.tier_overlap) for o in (await c.lookup(chain)).pods}
    assert reply == {"d0": (2, {"device": 2, "cpu": 2, "disk": 1}), "d1": (0, {"device": 0, "cpu": 5, "disk": 0}),
                     "d2": (0, {"device": 0, "cpu": 0, "disk": 1}), "d3": (0, {"device": 0, "cpu": 0, "disk": 0})}
    assert await registry.blocks("d0") == set(chain[:2])  # the pool's set is what it always was
    # a snapshot replaces every medium's set; a deregistration deletes them all
    await c.publish_kv_snapshot(KVSnapshot(pod_id="d0", epoch="e", seq=3, block_hashes=[],
                                           cpu_block_hashes=[], disk_block_hashes=chain[:1]))
    reply = {o.pod.pod_id: o.tier_overlap for o in (await c.lookup(chain)).pods}
    assert reply["d0"] == {"device": 0, "cpu": 0, "disk": 1}
    await c.deregister("d1")
    r = registry.app.state.store.redis
    assert await r.exists(*tier_keys("d1")) == 0 and await r.exists(*tier_keys("d0")) == 1
