"""A router incarnation's id, chosen so that the routers' relay streams spread over a Redis Cluster's shards.

Every output token a router relays goes through its relay stream (``keys.relay_stream``), whose hash tag is the
router id's: a shard carries the output traffic of the routers whose tags hash into its slots. Random ids leave one
of three shards with half of the routers or more at tens of routers. So a starting router counts the live routers
on each primary (their ``keys.router_key``, one SCAN per primary) and draws ids until one's relay stream lands on a
primary with the fewest (about as many draws as there are primaries). On a single Redis any id does.
"""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Any

from pdserve.shared import redis_client
from pdserve.shared.protocol import keys

ALIVE_PATTERN = keys.tag("r-*") + "alive"
MAX_DRAWS = 1000


async def live_routers_by_primary(redis: Any) -> Counter:
    """Primary name (host:port) -> live router keys it holds, for every primary of the cluster (0s included)."""
    await redis.initialize()  # a fresh client learns the nodes at its first command
    counts: Counter = Counter({node.name: 0 for node in redis.get_primaries()})
    for node in redis.get_primaries():
        cursor = 0
        while True:
            reply = await redis.execute_command("SCAN", cursor, "MATCH", ALIVE_PATTERN, "COUNT", 1000,
                                                target_nodes=node)
            cursor, found = reply
            if isinstance(cursor, dict):  # redis-py's cluster SCAN keeps a cursor per node
                cursor = cursor[node.name]
            counts[node.name] += len(found)
            if int(cursor) == 0:
                break
    return counts


async def balanced_router_id(redis: Any) -> str:
    """A fresh router id; on a Redis Cluster, one whose relay stream lies on a primary with the fewest live routers."""
    if not redis_client.is_cluster(redis):
        return uuid.uuid4().hex
    counts = await live_routers_by_primary(redis)
    fewest = min(counts.values())
    targets = {name for name, n in counts.items() if n == fewest}
    for _ in range(MAX_DRAWS):
        router_id = uuid.uuid4().hex
        if redis.get_node_from_key(keys.relay_stream(router_id)).name in targets:
            return router_id
    return router_id
