"""The block index in Redis: which pod holds which prefix-cache block, kept from the pods' block events.

Keys (prefix ``pdserve:registry:``):
    kv:blocks:{pod_id}   set of the pod's cached block hashes (16 raw bytes each)
    kv:seq:{pod_id}      hash {epoch, seq}: the pod's worker process and its last applied event
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

from pdserve.shared.protocol.kv_events import KVEventBatch, KVEventsReply, KVSnapshot

PREFIX = "pdserve:registry:"
_CHUNK = 1000  # members per SADD/SREM inside the scripts (Lua's unpack limit is ~8000)


def blocks_key(pod_id: str) -> str:
    return f"{PREFIX}kv:blocks:{pod_id}"


def seq_key(pod_id: str) -> str:
    return f"{PREFIX}kv:seq:{pod_id}"


# ARGV: epoch, ttl_ms, n_events, then per event: seq, kind ("stored"|"removed"), count, hashes...
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
local function each_chunk(cmd, first, count)
  local k = 0
  while k < count do
    local m = math.min({_CHUNK}, count - k)
    redis.call(cmd, KEYS[1], unpack(ARGV, first + k, first + k + m - 1))
    k = k + m
  end
end
for e = 1, n do
  local seq, kind, count = tonumber(ARGV[i]), ARGV[i + 1], tonumber(ARGV[i + 2])
  local first = i + 3
  i = first + count
  if not known then
    if seq ~= 1 then resync = 1; break end
    -- a new worker process starting from an empty cache: forget the previous one's blocks
    redis.call('DEL', KEYS[1])
    known, last = true, 0
  end
  if seq == last + 1 then
    if count > 0 then each_chunk(kind == 'stored' and 'SADD' or 'SREM', first, count) end
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
  if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('PEXPIRE', KEYS[1], ttl) end
end
return {{applied, last, resync}}
"""

# ARGV: epoch, seq, ttl_ms, hashes... Returns {1, seq} when applied, {0, current seq} when stale.
_SNAPSHOT = f"""
local epoch, seq, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
if redis.call('HGET', KEYS[2], 'epoch') == epoch then
  local last = tonumber(redis.call('HGET', KEYS[2], 'seq'))
  if last > seq then return {{0, last}} end
end
redis.call('DEL', KEYS[1])
local total = #ARGV - 3
local k = 0
while k < total do
  local m = math.min({_CHUNK}, total - k)
  redis.call('SADD', KEYS[1], unpack(ARGV, 4 + k, 4 + k + m - 1))
  k = k + m
end
redis.call('HSET', KEYS[2], 'epoch', epoch, 'seq', seq)
redis.call('PEXPIRE', KEYS[2], ttl)
if total > 0 then redis.call('PEXPIRE', KEYS[1], ttl) end
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
            argv += [e.seq, e.kind, len(e.block_hashes), *(bytes.fromhex(h) for h in e.block_hashes)]
        applied, last, resync = await self._apply(keys=[blocks_key(batch.pod_id), seq_key(batch.pod_id)], args=argv)
        return KVEventsReply(applied=int(applied), seq=max(0, int(last)), resync=bool(resync))

    async def snapshot(self, snap: KVSnapshot) -> KVEventsReply:
        """Replaces the pod's block set with the snapshot (unless the registry already holds a later state)."""
        argv = [snap.epoch, snap.seq, self.ttl_ms, *(bytes.fromhex(h) for h in snap.block_hashes)]
        ok, seq = await self._snapshot(keys=[blocks_key(snap.pod_id), seq_key(snap.pod_id)], args=argv)
        return KVEventsReply(applied=len(snap.block_hashes) if ok else 0, seq=int(seq))

    async def overlaps(self, pod_ids: list[str], block_hashes: list[str]) -> list[int]:
        """For each pod, how many leading blocks of the chain (hex hashes) it holds."""
        if not pod_ids or not block_hashes:
            return [0] * len(pod_ids)
        members = [bytes.fromhex(h) for h in block_hashes]
        async with self.redis.pipeline(transaction=False) as pipe:
            for pod_id in pod_ids:
                pipe.smismember(blocks_key(pod_id), members)
            answers = await pipe.execute()
        return [leading_ones(a) for a in answers]

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
