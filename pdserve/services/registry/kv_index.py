"""The block index in Redis: which pod holds which prefix-cache block, kept from the pods' block events.

Keys (named in pdserve/shared/protocol/keys.py, all in the pod's hash-tag slot, so each script touches one slot):
    blocks_key(pod_id)   set of the pod's cached block hashes (16 raw bytes each), in its KV pool
    tier_keys(pod_id)    the same for its offloading tiers (event ``medium``: cpu, disk)
    seq_key(pod_id)      hash {epoch, seq}: the pod's worker process and its last applied event
Both expire ``pod_ttl_s`` after the pod's last heartbeat or event (refreshed by either), together with the
pod's record: a pod that stops beating has its blocks purged by Redis itself, and its deregistration
deletes them at once. The index is bounded by the pods' cache sizes (a set holds what the pod's block pool
holds) and by the pod count.

Why one set per pod and no reverse (hash -> pods) keys: a lookup asks every alive pod of the role with one
``SMISMEMBER`` (one round trip for all pods, pipelined), which for tens of pods costs less than keeping a
second structure consistent on every event and purge. Events and snapshots are applied by Lua scripts, so
an event's membership change and the sequence number move together, atomically, whatever the number of
registry replicas.
"""

from __future__ import annotations

from redis.asyncio import Redis

from pdserve.shared.protocol import keys
from pdserve.shared.protocol.keys import blocks_key, seq_key
from pdserve.shared.protocol.kv_events import MEDIUMS, KVEventBatch, KVEventsReply, KVSnapshot

_CHUNK = 1000  # members per SADD/SREM inside the scripts (Lua's unpack limit is ~8000)


def tier_keys(pod_id: str) -> list[str]:
    """The pod's block sets of the offloading tiers (``cpu``, ``disk``), beside ``blocks_key`` (the pool's)."""
    return keys.tier_keys(pod_id, MEDIUMS[1:])


def _keys(pod_id: str) -> list[str]:
    # KEYS of both scripts: the pool's set, the sequence record, then one set per tier
    return [blocks_key(pod_id), seq_key(pod_id), *tier_keys(pod_id)]


# KEYS: _keys(pod). ARGV: epoch, ttl_ms, n_events, then per event: seq, kind ("stored"|"removed"), key index
# (1: the pool, 3: cpu, 4: disk), count, hashes...
# Returns {applied, last_seq, resync}.
_APPLY = f"""
local epoch = ARGV[1]
local ttl = tonumber(ARGV[2])
local n = tonumber(ARGV[3])
local cur = redis.call('HGET', KEYS[2], 'epoch')
local known = (cur == epoch)
local last = -1
if known then last = tonumber(redis.call('HGET', KEYS[2], 'seq')) end
local applied, resync, i = 0, 0, 4
local function each_chunk(cmd, key, first, count)
  local k = 0
  while k < count do
    local m = math.min({_CHUNK}, count - k)
    redis.call(cmd, key, unpack(ARGV, first + k, first + k + m - 1))
    k = k + m
  end
end
for e = 1, n do
  local seq, kind, key, count = tonumber(ARGV[i]), ARGV[i + 1], KEYS[tonumber(ARGV[i + 2])], tonumber(ARGV[i + 3])
  local first = i + 4
  i = first + count
  if not known then
    if seq ~= 1 then resync = 1; break end
    -- a new worker process starting from an empty cache: forget the previous one's blocks
    redis.call('DEL', KEYS[1], KEYS[3], KEYS[4])
    known, last = true, 0
  end
  if seq == last + 1 then
    if count > 0 then each_chunk(kind == 'stored' and 'SADD' or 'SREM', key, first, count) end
    last = seq
    applied = applied + 1
  elseif seq > last + 1 then
    resync = 1
    break
  end
end
if known then
  redis.call('HSET', KEYS[2], 'epoch', epoch, 'seq', last)
  redis.call('PEXPIRE', KEYS[2], ttl)
  for _, k in ipairs({{KEYS[1], KEYS[3], KEYS[4]}}) do
    if redis.call('EXISTS', k) == 1 then redis.call('PEXPIRE', k, ttl) end
  end
end
return {{applied, last, resync}}
"""

# KEYS: _keys(pod). ARGV: epoch, seq, ttl_ms, n_pool, n_cpu, n_disk, hashes (pool's, cpu's, disk's)...
# Returns {1, seq} when applied, {0, current seq} when stale.
_SNAPSHOT = f"""
local epoch, seq, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
if redis.call('HGET', KEYS[2], 'epoch') == epoch then
  local last = tonumber(redis.call('HGET', KEYS[2], 'seq'))
  if last > seq then return {{0, last}} end
end
local first = 7
for j, key in ipairs({{KEYS[1], KEYS[3], KEYS[4]}}) do
  redis.call('DEL', key)
  local total = tonumber(ARGV[3 + j])
  local k = 0
  while k < total do
    local m = math.min({_CHUNK}, total - k)
    redis.call('SADD', key, unpack(ARGV, first + k, first + k + m - 1))
    k = k + m
  end
  first = first + total
  if total > 0 then redis.call('PEXPIRE', key, ttl) end
end
redis.call('HSET', KEYS[2], 'epoch', epoch, 'seq', seq)
redis.call('PEXPIRE', KEYS[2], ttl)
return {{1, seq}}
"""


def leading_ones(flags: list[int]) -> int:
    """Length of the run of members at the head of the chain (prefix blocks are only usable in order)."""
    n = 0
    for f in flags:
        if not f:
            break
        n += 1
    return n


_KEY_INDEX = {"device": 1, "cpu": 3, "disk": 4}  # an event's medium -> its set among the scripts' KEYS


def tier_counts(flags_per_medium: list[list[int]]) -> dict[str, int]:
    """Over the leading blocks held in any medium (``MEDIUMS`` order, best first), how many each medium is the
    best one for: ``{"device": 2, "cpu": 1, "disk": 0}``."""
    counts = dict.fromkeys(MEDIUMS, 0)
    for flags in zip(*flags_per_medium):
        best = next((m for m, f in zip(MEDIUMS, flags) if f), None)
        if best is None:
            break
        counts[best] += 1
    return counts


class BlockIndex:
    def __init__(self, redis: Redis, pod_ttl_s: float) -> None:
        self.redis = redis
        self.ttl_ms = max(1, int(pod_ttl_s * 1000))
        self._apply = redis.register_script(_APPLY)
        self._snapshot = redis.register_script(_SNAPSHOT)

    async def apply(self, batch: KVEventBatch) -> KVEventsReply:
        """Applies the batch's events in order, exactly once; stops at a gap and asks for a resync."""
        argv: list[bytes | str | int] = [batch.epoch, self.ttl_ms, len(batch.events)]
        for e in batch.events:
            argv += [e.seq, e.kind, _KEY_INDEX[e.medium], len(e.block_hashes),
                     *(bytes.fromhex(h) for h in e.block_hashes)]
        applied, last, resync = await self._apply(keys=_keys(batch.pod_id), args=argv)
        return KVEventsReply(applied=int(applied), seq=max(0, int(last)), resync=bool(resync))

    async def snapshot(self, snap: KVSnapshot) -> KVEventsReply:
        """Replaces the pod's block set with the snapshot (unless the registry already holds a later state)."""
        sets = [snap.block_hashes, snap.cpu_block_hashes, snap.disk_block_hashes]
        argv = [snap.epoch, snap.seq, self.ttl_ms, *map(len, sets), *(bytes.fromhex(h) for s in sets for h in s)]
        ok, seq = await self._snapshot(keys=_keys(snap.pod_id), args=argv)
        return KVEventsReply(applied=sum(map(len, sets)) if ok else 0, seq=int(seq))

    async def overlaps(self, pod_ids: list[str], block_hashes: list[str]) -> list[tuple[int, dict[str, int]]]:
        """For each pod: how many leading blocks of the chain (hex hashes) its KV pool holds, and over the leading
        blocks it holds in any medium, how many each medium is the best one for (``tier_counts``)."""
        if not pod_ids or not block_hashes:
            return [(0, {})] * len(pod_ids)
        members = [bytes.fromhex(h) for h in block_hashes]
        async with self.redis.pipeline(transaction=False) as pipe:
            for pod_id in pod_ids:
                for key in (blocks_key(pod_id), *tier_keys(pod_id)):
                    pipe.smismember(key, members)
            answers = await pipe.execute()
        n = len(MEDIUMS)
        return [(leading_ones(answers[i * n]), tier_counts(answers[i * n:(i + 1) * n])) for i in range(len(pod_ids))]

    async def pod_blocks(self, pod_id: str) -> set[str]:
        """The pod's indexed block hashes (hex); for operators and tests."""
        return {m.hex() for m in await self.redis.smembers(blocks_key(pod_id))}

    async def pod_seq(self, pod_id: str) -> tuple[str | None, int]:
        rec = await self.redis.hgetall(seq_key(pod_id))
        if not rec:
            return None, 0
        return rec[b"epoch"].decode(), int(rec[b"seq"])

    async def count(self, pod_id: str) -> int:
        return int(await self.redis.scard(blocks_key(pod_id)))
