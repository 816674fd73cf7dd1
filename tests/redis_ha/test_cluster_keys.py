"""Every multi-key Redis operation of the ensemble stays in one slot, proven on a real 3-shard Redis Cluster
(redis-server --cluster-enabled): the workers' output script, the router's shared XREAD and abort, the
registry's heartbeat MULTI and block-index scripts, the abort channel. A cluster refuses anything else with
CROSSSLOT, so each test fails on the key layout that came before the hash tags."""

from __future__ import annotations

import asyncio

import pytest
from redis.crc import key_slot

from pdserve.services.registry.kv_index import BlockIndex
from pdserve.services.registry.store import PodStore
from pdserve.services.router.relay_reader import RelayReader
from pdserve.services.router.relay import abort_requests
from pdserve.shared import redis_client
from pdserve.shared.protocol import keys
from pdserve.shared.protocol.kv_events import KVEvent, KVEventBatch, KVSnapshot
from pdserve.shared.protocol.messages import OutputEvent
from pdserve.shared.protocol.registry import PodInfo
from pdserve.shared.worker.events import publish
from pdserve.shared.worker.output_writer import OutputWriter

from support.redis_ha import RedisClusterServers


@pytest.fixture(scope="module")
def cluster():
    with RedisClusterServers(shards=3) as c:
        yield c


def run(coro_fn, url: str):
    async def main():
        client = redis_client.connect(url)
        try:
            return await coro_fn(client)
        finally:
            await client.aclose()
    return asyncio.run(main())


def slot(name: str | bytes) -> int:
    return key_slot(name.encode() if isinstance(name, str) else name)


def test_the_keys_of_a_request_its_router_and_a_pod_share_one_slot_and_spread_otherwise():
    rid = keys.owned_request_id("cmpl-1-0", "r1")
    assert {slot(keys.output_stream(rid)), slot(keys.aborted_key(rid)), slot(keys.router_key("r1")),
            slot(keys.output_stream(f"{rid}~m2"))} == {slot(keys.output_stream(keys.owned_request_id("x", "r1")))}
    assert keys.output_stream_request(keys.output_stream(f"{rid}~m2")) == f"{rid}~m2"
    assert len({slot(keys.pod_key("d0")), slot(keys.blocks_key("d0")), slot(keys.seq_key("d0")),
                slot(keys.decode_stream("d0")), *map(slot, keys.tier_keys("d0"))}) == 1
    assert slot(keys.output_stream("plain")) == slot(keys.aborted_key("plain"))  # a request no router named
    routers = {slot(keys.router_key(f"router-{i}")) for i in range(64)}
    assert len(routers) > 48  # different routers land on different slots (and so shards)


def test_workers_output_batches_script_and_the_routers_relay_readers_work_on_a_cluster(cluster):
    """Routed requests: one pipelined step writes an ``OutputBatch`` to each of three routers' relay streams (three
    slots), and each router's ``RelayReader`` gets exactly its own requests' events. Unrouted requests: the output
    script runs per event on a cluster pipeline (loaded on the primaries on demand), skipping an aborted one."""
    ids = {router: [keys.owned_request_id(f"cmpl-{i}", router) for i in range(4)] for router in ("ra", "rb", "rc")}
    loose = [f"plain-{i}" for i in range(3)]

    async def scenario(client):
        writer = OutputWriter(client)
        for router, rs in ids.items():
            for rid in rs:
                writer.route(rid, router)
        await client.set(keys.aborted_key(loose[0]), b"1")
        await publish(writer, client, [OutputEvent(rid, token_ids=[7], text="a")
                                       for rid in [r for rs in ids.values() for r in rs] + loose])
        replies = {}
        for router, rs in ids.items():
            reader = RelayReader(client, router, block_ms=200)
            try:
                replies[router] = await reader.xread({keys.output_stream(r): "0-0" for r in rs}, block=2000)
            finally:
                await reader.aclose()
        streams = [await client.xlen(keys.output_stream(rid)) for rid in loose]
        relay_lengths = [await client.xlen(keys.relay_stream(router)) for router in ids]
        return replies, streams, relay_lengths

    replies, streams, relay_lengths = run(scenario, cluster.url)
    for router, rs in ids.items():
        got = {keys.output_stream_request(name) for name, _ in replies[router]}
        assert got == set(rs)
    assert relay_lengths == [1, 1, 1]  # one batch per router for the whole step
    assert streams == [0, 1, 1]  # the aborted request's stream was never created


def test_the_registrys_heartbeat_transaction_and_block_scripts_work_on_a_cluster(cluster):
    async def scenario(client):
        store, index = PodStore(client, pod_ttl_s=30), BlockIndex(client, pod_ttl_s=30)
        for pod in ("d0", "d1", "p0"):
            await store.heartbeat(PodInfo(pod_id=pod, role="prefill" if pod == "p0" else "decode", host="127.0.0.1",
                                          http_port=8003, model="m"))
        await index.apply(KVEventBatch(pod_id="d0", epoch="e1", events=[
            KVEvent(seq=1, kind="stored", block_hashes=["aa" * 16, "bb" * 16]),
            KVEvent(seq=2, kind="stored", block_hashes=["cc" * 16], medium="cpu")]))
        await index.snapshot(KVSnapshot(pod_id="d1", epoch="e2", seq=5, block_hashes=["aa" * 16]))
        overlaps = await index.overlaps(["d0", "d1"], ["aa" * 16, "bb" * 16, "cc" * 16])
        decode = [p.pod_id for p in await store.list("decode")]
        deleted = await store.delete("d1")
        return overlaps, decode, deleted, [p.pod_id for p in await store.list()], await index.count("d1")

    overlaps, decode, deleted, after, d1_blocks = run(scenario, cluster.url)
    assert overlaps == [(2, {"device": 2, "cpu": 1, "disk": 0}), (1, {"device": 1, "cpu": 0, "disk": 0})]
    assert decode == ["d0", "d1"] and deleted and after == ["d0", "p0"] and d1_blocks == 0


def test_an_abort_published_through_one_node_reaches_a_subscriber_on_the_cluster(cluster):
    async def scenario(client):
        pubsub = client.pubsub()
        await pubsub.subscribe(keys.ABORT_CHANNEL)
        await pubsub.get_message(timeout=1.0)  # the subscribe confirmation
        await abort_requests(client, [keys.owned_request_id("cmpl-9", "rz")])
        message = None
        for _ in range(20):
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
            if message:
                break
        await pubsub.aclose()
        return message

    message = run(scenario, cluster.url)
    assert message is not None and message["data"] == keys.owned_request_id("cmpl-9", "rz").encode()


@pytest.mark.parametrize("url, kind, nodes, service, password", [
    ("redis+cluster://10.0.0.1:7000,10.0.0.2:7001", "cluster", [("10.0.0.1", 7000), ("10.0.0.2", 7001)], None, None),
    ("rediss+cluster://:s%40cret@h1:7000", "cluster", [("h1", 7000)], None, "s@cret"),
    ("redis+sentinel://s1:26379,s2/mymaster", "sentinel", [("s1", 26379), ("s2", 26379)], "mymaster", None),
    ("redis+sentinel://:pw@s1:5000/mymaster/2", "sentinel", [("s1", 5000)], "mymaster", "pw"),
])
def test_cluster_and_sentinel_urls_parse_into_seed_nodes_service_and_credentials(url, kind, nodes, service, password):
    target = redis_client.parse_url(url)
    assert (target.kind, target.nodes, target.service_name, target.password) == (kind, nodes, service, password)
    assert target.tls == url.startswith("rediss")


@pytest.mark.parametrize("url, message", [
    ("redis+sentinel://s1:26379", "names no service"),
    ("redis+cluster://", "names no host:port"),
    ("redis+cluster://h:port", "bad port"),
    ("redis+cluster://:secret@h:1/3", "unexpected path"),
])
def test_a_malformed_cluster_or_sentinel_url_is_refused_naming_the_part_and_hiding_the_password(url, message):
    with pytest.raises(ValueError, match=message) as err:
        redis_client.connect(url)
    assert "secret" not in str(err.value)


def test_plain_urls_stay_with_redis_py():
    assert redis_client.parse_url("redis://h:6379/0") is None and redis_client.parse_url("unix:///tmp/r.sock") is None
    assert not redis_client.is_cluster(redis_client.connect("unix:///tmp/r.sock", sync=True))
