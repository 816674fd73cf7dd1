"""What one heartbeat and one block-event batch cost Redis, counted by a real redis-server (``INFO commandstats``,
which counts a script's own commands too), and that the TTLs they now refresh only now and then still outlive the
pod's liveness."""

from __future__ import annotations

import asyncio

import pytest
import redis as redis_sync
import redis.asyncio as aioredis

from pdserve.services.registry.kv_index import BlockIndex
from pdserve.services.registry.store import PodStore
from pdserve.shared.protocol import keys
from pdserve.shared.protocol.kv_events import KVEvent, KVEventBatch
from pdserve.shared.protocol.registry import PodInfo

pytestmark = pytest.mark.timeout(60)


def pod(pod_id: str = "decode-0", role: str = "decode", **kw) -> PodInfo:
    base = dict(pod_id=pod_id, role=role, host="10.0.0.7", http_port=8003, kv_port=9000 if role == "decode" else 0,
                model="m", block_size=16, total_blocks=1000, free_blocks=900, num_running=3, started_at=1.0e9)
    return PodInfo(**{**base, **kw})


def calls(sync: redis_sync.Redis) -> dict[str, int]:
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in sync.info("commandstats").items()
            if k not in ("cmdstat_info", "cmdstat_config")}


def run(url: str, scenario):
    async def main():
        client = aioredis.Redis.from_url(url)
        try:
            return await scenario(client)
        finally:
            await client.aclose()
    return asyncio.run(main())


def test_a_steady_heartbeat_is_three_redis_commands_and_keeps_the_pods_keys_alive(redis_server):
    sync = redis_sync.Redis.from_url(redis_server.url)
    blocks = keys.blocks_key("decode-0")

    async def scenario(client):
        store, index = PodStore(client, pod_ttl_s=5.0), BlockIndex(client, pod_ttl_s=5.0)
        await store.heartbeat(pod())
        await index.apply(KVEventBatch(pod_id="decode-0", epoch="e", events=[
            KVEvent(seq=1, kind="stored", block_hashes=["aa" * 16])]))
        sync.config_resetstat()
        for i in range(10):
            await store.heartbeat(pod(free_blocks=900 - i))
        return calls(sync), await store.list("decode")

    counted, listed = run(redis_server.url, scenario)
    # main sent 14 per beat: TIME, MULTI, DEL, HSET, 6 x PEXPIRE, EXEC, ZADD, PEXPIRE, ZREM
    assert counted == {"evalsha": 10, "hset": 10, "zadd": 10}
    assert [(p.pod_id, p.free_blocks) for p in listed] == [("decode-0", 891)]
    # what the beats did not refresh still outlives the pod's liveness (5 s after its last beat)
    for key in (keys.pod_key("decode-0"), blocks, keys.seq_key("decode-0")):
        assert 5000 < sync.pttl(key) <= 15000, key
    assert 0 < sync.pttl(keys.alive_key("decode")) <= 50000
    sync.close()


def test_ttls_are_refreshed_when_due_and_a_dead_pods_keys_leave_redis(redis_server):
    sync = redis_sync.Redis.from_url(redis_server.url)
    sync.xgroup_create(keys.decode_stream("decode-0"), keys.DECODE_GROUP, id="0", mkstream=True)
    record, blocks = keys.pod_key("decode-0"), keys.blocks_key("decode-0")

    async def scenario(client):
        store, index = PodStore(client, pod_ttl_s=0.3), BlockIndex(client, pod_ttl_s=0.3)
        await store.heartbeat(pod())
        await index.apply(KVEventBatch(pod_id="decode-0", epoch="e", events=[
            KVEvent(seq=1, kind="stored", block_hashes=["aa" * 16])]))
        refreshes = 0
        for _ in range(15):  # 1.5 s of beats every 0.1 s: five pod TTLs, a refresh due every 0.45 s
            await asyncio.sleep(0.1)
            sync.config_resetstat()
            await store.heartbeat(pod())
            pexpires = calls(sync).get("pexpire", 0)
            # the pod's: none, or the record, 3 block sets, the sequence record and the stream; + 1: the alive set's
            assert pexpires in (0, 1, 6, 7)
            refreshes += pexpires >= 6
            assert await index.count("decode-0") == 1 and [p.pod_id for p in await store.list()] == ["decode-0"]
        await asyncio.sleep(0.4)
        gone = await store.list("decode"), await store.get("decode-0")
        for _ in range(40):  # Redis purges the record and the block index at most 3 x TTL after the last beat
            if not sync.exists(record, blocks):
                break
            await asyncio.sleep(0.05)
        return refreshes, gone

    refreshes, gone = run(redis_server.url, scenario)
    assert 2 <= refreshes <= 4 and gone == ([], None)
    assert sync.exists(record, blocks, keys.seq_key("decode-0")) == 0
    assert 0 < sync.pttl(keys.decode_stream("decode-0")) <= 3000  # 10 x TTL
    sync.close()


def test_a_new_record_a_restarted_pod_and_a_flushed_redis_get_their_ttls_at_once(redis_server):
    sync = redis_sync.Redis.from_url(redis_server.url)

    async def scenario(client):
        store = PodStore(client, pod_ttl_s=5.0)
        await store.heartbeat(pod())
        sync.xgroup_create(keys.decode_stream("decode-0"), keys.DECODE_GROUP, id="0", mkstream=True)
        await store.heartbeat(pod())  # not due: the new stream has no TTL yet
        assert sync.pttl(keys.decode_stream("decode-0")) == -1
        await store.heartbeat(pod(started_at=2.0e9))  # a new worker process: refreshed at once
        assert sync.pttl(keys.decode_stream("decode-0")) > 40000
        sync.flushall()  # Redis lost its data: the next beat recreates the record and the alive set with TTLs
        await store.heartbeat(pod(started_at=2.0e9))
        assert 0 < sync.pttl(keys.pod_key("decode-0")) and 0 < sync.pttl(keys.alive_key("decode"))
        await store.heartbeat(pod("decode-0", "prefill", started_at=2.0e9))  # a role change
        return await store.list("decode"), await store.list("prefill")

    decode, prefill = run(redis_server.url, scenario)
    assert decode == [] and [p.pod_id for p in prefill] == ["decode-0"]
    assert sync.zcard(keys.alive_key("decode")) == 0
    sync.close()


def test_an_event_batch_refreshes_only_the_sequence_record_and_the_sets_it_added_to(redis_server):
    sync = redis_sync.Redis.from_url(redis_server.url)
    cpu = keys.tier_keys("decode-0", ("cpu",))[0]

    async def scenario(client):
        index = BlockIndex(client, pod_ttl_s=5.0)
        await index.apply(KVEventBatch(pod_id="decode-0", epoch="e", events=[
            KVEvent(seq=1, kind="stored", block_hashes=["aa" * 16])]))
        sync.config_resetstat()
        await index.apply(KVEventBatch(pod_id="decode-0", epoch="e", events=[
            KVEvent(seq=2, kind="stored", block_hashes=["bb" * 16], medium="cpu")]))  # a new set
        stored = calls(sync)
        sync.config_resetstat()
        await index.apply(KVEventBatch(pod_id="decode-0", epoch="e", events=[
            KVEvent(seq=3, kind="removed", block_hashes=["aa" * 16])]))
        return stored, calls(sync), await index.pod_seq("decode-0"), await index.pod_blocks("decode-0")

    stored, removed, seq, blocks = run(redis_server.url, scenario)
    # main: EVALSHA, 2 HGET, the SADD/SREM, HSET, 3 EXISTS and a PEXPIRE per existing key (2 to 4)
    assert stored == {"evalsha": 1, "hmget": 1, "sadd": 1, "hset": 1, "pexpire": 2}
    assert removed == {"evalsha": 1, "hmget": 1, "srem": 1, "hset": 1, "pexpire": 1}
    assert seq == ("e", 3) and blocks == set()  # the pool's set: "aa" stored, then removed
    assert 10000 < sync.pttl(cpu) <= 15000 and 10000 < sync.pttl(keys.seq_key("decode-0")) <= 15000
    sync.close()


def test_a_listing_reads_only_the_records_of_beats_another_replica_stored(redis_server):
    sync = redis_sync.Redis.from_url(redis_server.url)

    async def scenario(client):
        mine, other = PodStore(client, pod_ttl_s=5.0), PodStore(client, pod_ttl_s=5.0)  # two registry replicas
        await mine.heartbeat(pod("d0"))
        await other.heartbeat(pod("d1", free_blocks=7))
        await mine.alive("decode", count="prefill")  # the first listing trims the stale members
        sync.config_resetstat()
        first = await mine.alive("decode", count="prefill")
        after_first = calls(sync)
        sync.config_resetstat()
        await other.heartbeat(pod("d1", free_blocks=5))
        await mine.heartbeat(pod("d0", free_blocks=3))
        sync.config_resetstat()
        second = await mine.alive("decode", count="prefill")
        return first, after_first, second, calls(sync)

    first, after_first, second, after_second = run(redis_server.url, scenario)
    # main: TIME, ZREMRANGEBYSCORE, ZRANGEBYSCORE, ZCOUNT and an HGET per pod on every listing
    assert after_first == {"zrangebyscore": 1, "zcount": 1}  # both records are the ones read or written before
    assert after_second == {"zrangebyscore": 1, "zcount": 1, "hget": 1}  # d1's new beat, stored by the other
    assert [(p.pod_id, p.free_blocks) for p, _ in first[0]] == [("d0", 900), ("d1", 7)] and first[1] == 0
    assert [(p.pod_id, p.free_blocks) for p, _ in second[0]] == [("d0", 3), ("d1", 5)]
    assert [json for _, json in second[0]] == [p.model_dump_json().encode() for p, _ in second[0]]
    sync.close()


def test_the_registry_reads_the_redis_clock_once_per_resync_however_many_beats_run_at_once(redis_server):
    sync = redis_sync.Redis.from_url(redis_server.url)

    async def scenario(client):
        store = PodStore(client, pod_ttl_s=5.0)
        await store.heartbeat(pod("d0"))
        sync.config_resetstat()
        store.clock._synced_at -= store.clock.resync_s  # the offset is due for a resync
        stored = await asyncio.gather(*(store.heartbeat(pod(f"d{i}")) for i in range(8)))
        return calls(sync).get("time", 0), stored

    times, stored = run(redis_server.url, scenario)
    assert times == 1
    assert all(abs(p.last_heartbeat - stored[0].last_heartbeat) < 1.0 for p in stored)
    sync.close()
