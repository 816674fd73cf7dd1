"""Consumer groups of the ensemble's Redis streams (the queues of ``pdserve/shared/protocol/keys.py``).

A group is made at id 0, so entries queued before it existed are delivered too (a group made at ``$`` would
skip them). Redis may lose a group with its data (restarted without persistence, FLUSHALL): a reader then
gets NOGROUP, makes the group again and reads on; an entry that vanished with it needs no acknowledgement.
"""

from __future__ import annotations

from typing import Any

from redis.exceptions import ResponseError


def is_nogroup(exc: BaseException) -> bool:
    """``exc`` says the stream or its consumer group does not exist (Redis lost its data)."""
    return isinstance(exc, ResponseError) and "NOGROUP" in str(exc)


async def ensure_group(redis: Any, stream: str, group: str) -> bool:
    """Make ``group`` on ``stream`` at id 0 (the stream too, if missing). Returns True when it made the group,
    False when it existed already. Raises what Redis raises otherwise (``RedisError``, ``OSError``).
    ``redis``: an asyncio redis-py client."""
    try:
        await redis.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
        return False
    return True
