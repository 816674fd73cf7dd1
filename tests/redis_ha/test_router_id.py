"""Routers that start one after the other on a real 3-shard Redis Cluster take ids whose relay streams fill the
shards evenly (``balanced_router_id``); on a single Redis the id is a plain random one."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from pdserve.services.router.router_id import balanced_router_id
from pdserve.shared import redis_client
from pdserve.shared.protocol import keys

from support.redis_ha import RedisClusterServers


@pytest.fixture(scope="module")
def cluster():
    with RedisClusterServers(shards=3) as c:
        yield c


def test_routers_starting_in_turn_spread_their_relay_streams_evenly_over_the_shards(cluster):
    async def main():
        first = redis_client.connect(cluster.url)
        await first.flushall()
        await first.aclose()
        client = redis_client.connect(cluster.url)  # a fresh client: it has not met the nodes yet
        try:
            ids = []
            for _ in range(9):
                ids.append(await balanced_router_id(client))
                await client.set(keys.router_key(ids[-1]), b"1", ex=60)
            return Counter(client.get_node_from_key(keys.relay_stream(r)).name for r in ids)
        finally:
            await client.aclose()

    assert sorted(asyncio.run(main()).values()) == [3, 3, 3]


def test_on_a_single_redis_any_fresh_id_will_do(redis_url):
    async def main():
        client = redis_client.connect(redis_url)
        try:
            return {await balanced_router_id(client) for _ in range(3)}
        finally:
            await client.aclose()

    ids = asyncio.run(main())
    assert len(ids) == 3 and all(len(i) == 32 for i in ids)
