"""Pod records in Redis: the registry's only state, so any number of registry replicas agree.

Keys (named in pdserve/shared/protocol/keys.py):
    pod_key(pod_id)   hash, one JSON-encoded value per PodInfo field, and the whole PodInfo as JSON in field
                      ``RECORD_FIELD`` (what this registry reads back)
    alive_key(role)   sorted set pod_id -> last heartbeat (Redis server time, unix s)
    the pod's block index (``kv_index.py``)
A pod is alive while its score is within ``pod_ttl_s`` of Redis's clock (and its record exists); a read trims
stale set members (once per ``pod_ttl_s`` per role and replica). Times come from Redis ``TIME`` (``RedisClock``:
read once per ``CLOCK_RESYNC_S``, carried on by this host's monotonic clock in between), so registries on hosts
with skewed clocks agree.

A beat is three Redis commands (all that ``INFO commandstats`` counts): one script in the pod's hash-tag slot
(``_BEAT``: its EVALSHA and the HSET of the record), then the ZADD of its alive entry. A Redis Cluster refuses a
script or MULTI over several slots, and a reader that sees the alive entry before the record skips it until the
next beat. TTLs (a PEXPIRE per key) are refreshed every ``REFRESH_TTLS`` x ``pod_ttl_s``, not on every beat:
- the record and the block index (``kv_index.KEEP_TTLS`` x ``pod_ttl_s``, refreshed at least every
  ``REFRESH_TTLS`` x ``pod_ttl_s`` by this replica, and by every block event) outlive the pod's last beat by at
  least ``pod_ttl_s`` and at most 3 x ``pod_ttl_s``: a pod that stops beating has its keys purged by Redis
  itself, a little after it stopped counting as alive; its deregistration deletes them at once.
- A decode pod's own request stream (``keys.decode_stream``, local prefill) gets 10 x ``pod_ttl_s`` at each
  refresh: a dead pod's stream (its consumer group, entries nobody will read) leaves Redis; the router has
  migrated those requests once the pod left the registry. The margin keeps a live pod's stream through a
  registry outage; a stream that expires anyway is recreated by the next XADD and its group by the pod.
- The alive set gets 10 x ``pod_ttl_s`` at least once per ``pod_ttl_s`` per replica and role, and when a beat
  adds a new member (the one that created the set, after a flush too): an abandoned deployment leaves nothing.
The script refreshes the TTLs at once, whatever this replica remembers, when the HSET created the record or
added fields (first beat, after expiry, after Redis lost its data); this replica also refreshes when the pod is
new to it or restarted (``started_at`` or role changed: a new worker may have recreated its stream without a
TTL). A new alive member (first beat or a role change) also removes the pod from the other roles' sets. What a
replica remembers can only add refreshes, never skip one another replica owes: each replica's own refreshes keep
the bound above on their own.
A listing reads the alive sets with their scores, and a pod's ``RECORD_FIELD`` (one string; a record without it,
written by an older registry, is read whole) only when this registry does not hold the record of that very beat
(``PodRecords``: a beat writes its record and its score with one ``last_heartbeat``, so the score names the
record; with one registry replica a lookup reads no record at all). It parses a record only when it changed
since the last listing: a lookup on a fleet of 128 pods parses none of them between two heartbeats.
"""

from __future__ import annotations

import hashlib
import json
import time

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from pdserve.services.registry.kv_index import KEEP_TTLS, tier_keys
from pdserve.shared.protocol import keys
from pdserve.shared.protocol.keys import alive_key, blocks_key, pod_key, seq_key
from pdserve.shared.protocol.registry import ROLES, PodInfo

RECORD_FIELD = "record"
REFRESH_TTLS = 1.5  # x pod_ttl_s: how often a replica refreshes a pod's TTLs (KEEP_TTLS - REFRESH_TTLS >= 1)
STREAM_TTLS = 10  # x pod_ttl_s: a decode pod's own request stream, and the alive sets
CLOCK_RESYNC_S = 5.0

# KEYS: pod_key, then the keys whose TTL a refresh sets: the block index's, then (a decode pod) its own stream.
# ARGV: refresh ("1" or "0"), keep_ttl_ms, stream_ttl_ms, has_stream ("1" or "0"), then field, value pairs.
# Returns the fields the HSET added (> 0: a new record, whose TTLs were set).
_BEAT = """
local added = redis.call('HSET', KEYS[1], unpack(ARGV, 5))
if ARGV[1] == '1' or added > 0 then
  local last = #KEYS
  if ARGV[4] == '1' then
    redis.call('PEXPIRE', KEYS[last], ARGV[3])
    last = last - 1
  end
  for i = 1, last do redis.call('PEXPIRE', KEYS[i], ARGV[2]) end
end
return added
"""
_BEAT_SHA = hashlib.sha1(_BEAT.encode()).hexdigest()


class RedisClock:
    """Redis's clock (unix s) without a TIME per reading: one TIME every ``resync_s``, carried on by this host's
    monotonic clock in between (its drift over seconds is microseconds; a host's wall-clock steps do not touch it).
    A reading is off by at most half a TIME round trip."""

    def __init__(self, redis: Redis, resync_s: float = CLOCK_RESYNC_S) -> None:
        self.redis = redis
        self.resync_s = resync_s
        self._offset = 0.0  # Redis time - monotonic
        self._synced_at = float("-inf")  # monotonic
        self._syncing = False

    async def now(self) -> float:
        mono = time.monotonic()
        # one TIME at a time: a reading while it is in flight uses the previous offset (there is one unless it is
        # the first)
        if mono - self._synced_at >= self.resync_s and not (self._syncing and self._synced_at > float("-inf")):
            self._syncing = True
            try:
                seconds, micros = await self.redis.time()
            finally:
                self._syncing = False
            after = time.monotonic()
            self._offset = seconds + micros / 1e6 - (mono + after) / 2
            self._synced_at = mono = after
        return mono + self._offset


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

    def remember(self, pod: PodInfo, raw: bytes) -> None:
        """A record this registry just wrote (``raw``, its ``RECORD_FIELD``)."""
        self._parsed[pod.pod_id] = (raw, pod, raw)

    def at(self, pod_id: str, score: float) -> tuple[PodInfo, bytes] | None:
        """The record of the pod's beat scored ``score`` in its alive set, when this registry holds that one: a beat
        writes its record and its score with the same ``last_heartbeat``, so no other record has it."""
        hit = self._parsed.get(pod_id)
        return (hit[1], hit[2]) if hit is not None and hit[1].last_heartbeat == score else None

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
        self.clock = RedisClock(redis)
        self._refreshed: dict[str, tuple[float, str, float]] = {}  # pod id -> (monotonic, role, started_at)
        self._alive_refreshed: dict[str, float] = {}  # role -> monotonic
        self._trimmed: dict[str, float] = {}  # role -> monotonic: stale alive members removed

    async def now(self) -> float:
        """Redis's clock, unix s (``RedisClock``)."""
        return await self.clock.now()

    async def heartbeat(self, info: PodInfo) -> PodInfo:
        """Stores the pod's record stamped with Redis's clock; three Redis commands but for a refresh (module doc)."""
        now = await self.now()
        stored = info.model_copy(update={"last_heartbeat": now})
        ttl_ms = max(1, int(self.pod_ttl_s * 1000))
        mono = time.monotonic()
        refresh = self._refresh_due(info, mono)
        record = stored.model_dump_json()
        fields = {**{k: json.dumps(v) for k, v in json.loads(record).items()}, RECORD_FIELD: record}
        ttl_keys = [pod_key(info.pod_id), blocks_key(info.pod_id), *tier_keys(info.pod_id), seq_key(info.pod_id)]
        if info.role == "decode":
            ttl_keys.append(keys.decode_stream(info.pod_id))
        beat = [_BEAT_SHA, len(ttl_keys), *ttl_keys, "1" if refresh else "0", int(KEEP_TTLS * ttl_ms),
                STREAM_TTLS * ttl_ms, "1" if info.role == "decode" else "0", *(x for kv in fields.items() for x in kv)]
        alive_due = mono - self._alive_refreshed.get(info.role, float("-inf")) >= self.pod_ttl_s
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.evalsha(*beat)
            pipe.zadd(alive_key(info.role), {info.pod_id: now})
            if alive_due:  # an abandoned deployment leaves nothing behind
                pipe.pexpire(alive_key(info.role), STREAM_TTLS * ttl_ms)
            added_fields, added, *_ = await pipe.execute(raise_on_error=False)
        if isinstance(added, Exception):
            raise added
        if isinstance(added_fields, NoScriptError):  # Redis lost the script (a restart, a failover)
            await self.redis.script_load(_BEAT)
            added_fields = await self.redis.evalsha(*beat)
        elif isinstance(added_fields, Exception):
            raise added_fields
        self.records.remember(stored, record.encode())
        if refresh or int(added_fields):
            self._refreshed[info.pod_id] = (mono, info.role, info.started_at)
        if alive_due:
            self._alive_refreshed[info.role] = mono
        if int(added):
            await self._new_alive_member(info, STREAM_TTLS * ttl_ms, mono)
        return stored

    def _refresh_due(self, info: PodInfo, mono: float) -> bool:
        """Whether this beat refreshes the pod's TTLs: new to this replica, restarted, or due (module doc)."""
        last = self._refreshed.get(info.pod_id)
        if last is not None and last[1:] == (info.role, info.started_at) \
                and mono - last[0] < REFRESH_TTLS * self.pod_ttl_s:
            return False
        if len(self._refreshed) > 64:  # forget pods that stopped beating here (a bounded dict)
            stale = mono - 2 * REFRESH_TTLS * self.pod_ttl_s
            self._refreshed = {k: v for k, v in self._refreshed.items() if v[0] > stale}
        return True

    async def _new_alive_member(self, info: PodInfo, alive_ttl_ms: int, mono: float) -> None:
        # the pod's first beat, a role change, or the alive set was lost: the set may be new, and the pod may sit
        # in another role's set
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.pexpire(alive_key(info.role), alive_ttl_ms)
            for other in ROLES:
                if other != info.role:
                    pipe.zrem(alive_key(other), info.pod_id)
            await pipe.execute()
        self._alive_refreshed[info.role] = mono

    async def list(self, role: str | None = None) -> list[PodInfo]:
        return [pod for pod, _ in (await self.alive(role))[0]]

    async def alive(self, role: str | None = None,
                    count: str | None = None) -> tuple[list[tuple[PodInfo, bytes]], int]:
        """The alive pods of ``role`` (all roles: None), sorted by id, each with its JSON; and how many pods of role
        ``count`` are alive (0 when None), from the same reading of the alive sets."""
        cutoff = await self.now() - self.pod_ttl_s
        roles = [role] if role else list(ROLES)
        mono = time.monotonic()
        trim = [r for r in roles if mono - self._trimmed.get(r, float("-inf")) >= self.pod_ttl_s]
        async with self.redis.pipeline(transaction=False) as pipe:
            for r in trim:  # stale members, once per pod_ttl_s per role and replica: the range below skips them
                pipe.zremrangebyscore(alive_key(r), "-inf", f"({cutoff}")
            for r in roles:
                pipe.zrangebyscore(alive_key(r), cutoff, "+inf", withscores=True)
            if count is not None:
                pipe.zcount(alive_key(count), cutoff, "+inf")
            answers = await pipe.execute()
        self._trimmed.update((r, mono) for r in trim)
        scored = [(m.decode() if isinstance(m, bytes) else m, score)
                  for members in answers[len(trim):len(trim) + len(roles)] for m, score in members]
        counted = int(answers[-1]) if count is not None else 0
        pods: list[tuple[PodInfo, bytes]] = []
        unread: list[str] = []
        for pod_id, score in scored:
            if (hit := self.records.at(pod_id, score)) is not None:
                pods.append(hit)
            else:
                unread.append(pod_id)
        if unread:  # beats this registry did not see (another replica's, or before it started): read those records
            async with self.redis.pipeline(transaction=False) as pipe:
                for pod_id in unread:
                    pipe.hget(pod_key(pod_id), RECORD_FIELD)
                raws = await pipe.execute()
            for pod_id, raw in zip(unread, raws):
                if raw is not None:
                    pods.append(self.records.parse(pod_id, raw))
                elif (old := await self.get(pod_id)) is not None:  # expired meanwhile, or an older registry's
                    pods.append((old, old.model_dump_json().encode()))
        self.records.forget_gone(roles, {pod_id for pod_id, _ in scored})
        return sorted((p for p in pods if role is None or p[0].role == role), key=lambda p: p[0].pod_id), counted

    async def get(self, pod_id: str) -> PodInfo | None:
        """The pod's record while it is alive (its last beat within ``pod_ttl_s``: the record itself outlives that)."""
        rec = await self.redis.hgetall(pod_key(pod_id))
        if not rec:
            return None
        pod = self._decode(rec)
        return pod if pod.last_heartbeat is None or pod.last_heartbeat >= await self.now() - self.pod_ttl_s else None

    async def delete(self, pod_id: str) -> bool:
        self._refreshed.pop(pod_id, None)
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
        """A record from HGETALL: its ``RECORD_FIELD`` when there is one (a beat overwrites the fields it writes and
        leaves any other), else the fields, as an older registry wrote them."""
        fields = {k.decode() if isinstance(k, bytes) else k: v for k, v in rec.items()}
        record = fields.pop(RECORD_FIELD, None)
        if record is not None:
            return PodInfo.model_validate_json(record)
        return PodInfo.model_validate({k: json.loads(v) for k, v in fields.items()})
