"""Pod records in Redis: the registry's only state, so any number of registry replicas agree.

Keys (named in pdserve/shared/protocol/keys.py):
    pod_key(pod_id)   hash, one JSON-encoded value per PodInfo field, and the whole PodInfo as JSON in field
                      ``RECORD_FIELD``; EXPIRE pod_ttl_s on every beat
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
A listing reads each pod's ``RECORD_FIELD`` (one string; a record without it, written by an older registry, is
read whole) and parses a record only when it changed since the last listing (``PodRecords``): a lookup on
a fleet of 128 pods parses none of them between two heartbeats.
"""

from __future__ import annotations

import json

from redis.asyncio import Redis

from pdserve.services.registry.kv_index import tier_keys
from pdserve.shared.protocol import keys
from pdserve.shared.protocol.keys import alive_key, blocks_key, pod_key, seq_key
from pdserve.shared.protocol.registry import ROLES, PodInfo

RECORD_FIELD = "record"


class PodRecords:
    """Pod records as the last listing parsed them: pod id -> (the record's raw JSON, the ``PodInfo``, its JSON
    as this registry writes it), reused while the raw JSON is the same."""

    def __init__(self) -> None:
        self._parsed: dict[str, tuple[bytes, PodInfo, bytes]] = {}

    def parse(self, pod_id: str, raw: bytes) -> tuple[PodInfo, bytes]:
        hit = self._parsed.get(pod_id)
        if hit is not None and hit[0] == raw:
            return hit[1], hit[2]
        pod = PodInfo.model_validate_json(raw)
        self._parsed[pod_id] = (raw, pod, pod.model_dump_json().encode())
        return pod, self._parsed[pod_id][2]

    def forget_gone(self, roles: list[str], alive: set[str]) -> None:
        """Forgets the pods of ``roles`` not in ``alive`` (a listing of those roles did not see them)."""
        for pod_id, (_, pod, _) in list(self._parsed.items()):
            if pod.role in roles and pod_id not in alive:
                del self._parsed[pod_id]


class PodStore:
    def __init__(self, redis: Redis, pod_ttl_s: float) -> None:
        self.redis = redis
        self.pod_ttl_s = pod_ttl_s
        self.records = PodRecords()

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
            record = stored.model_dump_json()
            pipe.hset(key, mapping={**{k: json.dumps(v) for k, v in json.loads(record).items()},
                                    RECORD_FIELD: record})
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
        return [pod for pod, _ in (await self.alive(role))[0]]

    async def alive(self, role: str | None = None,
                    count: str | None = None) -> tuple[list[tuple[PodInfo, bytes]], int]:
        """The alive pods of ``role`` (all roles: None), sorted by id, each with its JSON; and how many pods of role
        ``count`` are alive (0 when None), from the same reading of the alive sets."""
        cutoff = await self.now() - self.pod_ttl_s
        roles = [role] if role else list(ROLES)
        async with self.redis.pipeline(transaction=False) as pipe:
            for r in roles:
                pipe.zremrangebyscore(alive_key(r), "-inf", f"({cutoff}")
                pipe.zrangebyscore(alive_key(r), cutoff, "+inf")
            if count is not None:
                pipe.zcount(alive_key(count), cutoff, "+inf")
            answers = await pipe.execute()
        pod_ids = [m.decode() if isinstance(m, bytes) else m for members in answers[1:2 * len(roles):2]
                   for m in members]
        counted = int(answers[-1]) if count is not None else 0
        if not pod_ids:
            return [], counted
        async with self.redis.pipeline(transaction=False) as pipe:
            for pod_id in pod_ids:
                pipe.hget(pod_key(pod_id), RECORD_FIELD)
            raws = await pipe.execute()
        pods: list[tuple[PodInfo, bytes]] = []
        for pod_id, raw in zip(pod_ids, raws):
            if raw is not None:
                pods.append(self.records.parse(pod_id, raw))
            elif (old := await self.get(pod_id)) is not None:  # expired meanwhile, or written by an older registry
                pods.append((old, old.model_dump_json().encode()))
        self.records.forget_gone(roles, set(pod_ids))
        return sorted((p for p in pods if role is None or p[0].role == role), key=lambda p: p[0].pod_id), counted

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
        fields = {k.decode() if isinstance(k, bytes) else k: v for k, v in rec.items()}
        fields.pop(RECORD_FIELD, None)
        return PodInfo.model_validate({k: json.loads(v) for k, v in fields.items()})
