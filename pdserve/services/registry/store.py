"""Pod records in Redis: the registry's only state, so any number of registry replicas agree.

Keys (named in pdserve/shared/protocol/keys.py):
    pod_key(pod_id)   hash, one JSON-encoded value per PodInfo field; EXPIRE pod_ttl_s on every beat
    alive_key(role)   sorted set pod_id -> last heartbeat (Redis server time, unix s)
    the pod's block index (``kv_index.py``): refreshed by each beat, deleted with the pod
A beat writes the pod's own keys (all in the pod's hash-tag slot) in one MULTI, then its alive-set entries: a
Redis Cluster refuses a MULTI over several slots, and a reader that sees the alive entry before the record
skips it until the next beat.
A decode pod's own request stream (``keys.decode_stream``, local prefill) gets 10 x ``pod_ttl_s`` on every
beat: a dead pod's stream (its consumer group, entries nobody will read) leaves Redis; the router has
migrated those requests once the pod left the registry. The margin keeps a live pod's stream through a
registry outage; a stream that expires anyway is recreated by the next XADD and its group by the pod.
A pod is alive while its hash exists and its score is within ``pod_ttl_s`` of Redis's clock; stale
set members are trimmed on read. Times come from Redis ``TIME``, so registries on hosts with skewed
clocks still agree.
"""

from __future__ import annotations

import json

from redis.asyncio import Redis

from pdserve.services.registry.kv_index import tier_keys
from pdserve.shared.protocol import keys
from pdserve.shared.protocol.keys import alive_key, blocks_key, pod_key, seq_key
from pdserve.shared.protocol.registry import ROLES, PodInfo


class PodStore:
    def __init__(self, redis: Redis, pod_ttl_s: float) -> None:
        self.redis = redis
        self.pod_ttl_s = pod_ttl_s

    async def now(self) -> float:
        seconds, micros = await self.redis.time()
        return seconds + micros / 1e6

    async def heartbeat(self, info: PodInfo) -> PodInfo:
        now = await self.now()
        stored = info.model_copy(update={"last_heartbeat": now})
        ttl_ms = max(1, int(self.pod_ttl_s * 1000))
        key = pod_key(info.pod_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            pipe.hset(key, mapping={k: json.dumps(v) for k, v in stored.model_dump(mode="json").items()})
            pipe.pexpire(key, ttl_ms)
            for key in (blocks_key(info.pod_id), *tier_keys(info.pod_id)):
                pipe.pexpire(key, ttl_ms)  # its blocks live exactly as long as its record
            pipe.pexpire(seq_key(info.pod_id), ttl_ms)
            if info.role == "decode":
                pipe.pexpire(keys.decode_stream(info.pod_id), ttl_ms * 10)
            await pipe.execute()
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zadd(alive_key(info.role), {info.pod_id: now})
            pipe.pexpire(alive_key(info.role), ttl_ms * 10)  # an abandoned deployment leaves nothing behind
            for other in ROLES:
                if other != info.role:
                    pipe.zrem(alive_key(other), info.pod_id)
            await pipe.execute()
        return stored

    async def list(self, role: str | None = None) -> list[PodInfo]:
        cutoff = await self.now() - self.pod_ttl_s
        pod_ids: list[str] = []
        for r in ([role] if role else ROLES):
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.zremrangebyscore(alive_key(r), "-inf", f"({cutoff}")
                pipe.zrangebyscore(alive_key(r), cutoff, "+inf")
                _, members = await pipe.execute()
            pod_ids += [m.decode() if isinstance(m, bytes) else m for m in members]
        if not pod_ids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for pod_id in pod_ids:
                pipe.hgetall(pod_key(pod_id))
            records = await pipe.execute()
        pods = [self._decode(rec) for rec in records if rec]
        return sorted((p for p in pods if role is None or p.role == role), key=lambda p: p.pod_id)

    async def get(self, pod_id: str) -> PodInfo | None:
        rec = await self.redis.hgetall(pod_key(pod_id))
        return self._decode(rec) if rec else None

    async def delete(self, pod_id: str) -> bool:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(pod_key(pod_id))
            pipe.delete(blocks_key(pod_id), seq_key(pod_id), *tier_keys(pod_id))
            deleted, *_ = await pipe.execute()
        async with self.redis.pipeline(transaction=False) as pipe:
            for r in ROLES:
                pipe.zrem(alive_key(r), pod_id)
            await pipe.execute()
        return bool(deleted)

    @staticmethod
    def _decode(rec: dict) -> PodInfo:
        return PodInfo.model_validate({
            (k.decode() if isinstance(k, bytes) else k): json.loads(v) for k, v in rec.items()})
