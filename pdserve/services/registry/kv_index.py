"""The block index in Redis: which pod holds which prefix-cache block, kept from the pods' block events.

Keys (named in pdserve/shared/protocol/keys.py, all in the pod's hash-tag slot, so each script touches one slot):
    blocks_key(pod_id)   set of the pod's cached block hashes (16 raw bytes each), in its KV pool
    tier_keys(pod_id)    the same for its offloading tiers (event ``medium``: cpu, disk)
    seq_key(pod_id)      hash {epoch, seq}: the pod's worker process and its last applied event
They expire ``KEEP_TTLS`` x ``pod_ttl_s`` after the pod's last heartbeat refresh (``store.py``: a beat refreshes
them every ``REFRESH_TTLS`` x ``pod_ttl_s``, not on every beat) or the last event that wrote them (an event batch
refreshes the sequence record and the sets it added to, which may be new), together with the pod's record: a pod
that stops beating has its blocks purged by Redis itself, at most 3 x ``pod_ttl_s`` after it stopped counting as
alive, and its deregistration deletes them at once. The index is bounded by the pods' cache sizes (a set holds
what the pod's block pool holds) and by the pod count. Events and snapshots are applied by Lua scripts, so an
event's membership change and the sequence number move together, atomically, whatever the number of registry
replicas.

A lookup runs one small script per alive pod of the role (``_WALK``, all of them in one pipelined round trip):
it walks the chain from its head with ``SISMEMBER`` on the pod's three sets and stops at the first block no
medium holds, answering four integers: the pool's leading run, and over the leading blocks held in any medium,
how many each medium (``MEDIUMS`` order, best first) is the best one for. The chain travels as one string
argument (the hashes concatenated), so what the registry packs, sends and parses is one command and four
integers per pod, whatever the chain's length, and what Redis does per pod is O(the blocks it holds at the
head + 1). The earlier lookup sent three ``SMISMEMBER`` per pod, each with the whole chain,
and parsed three flag lists per pod (kept as the test oracle in tests/routing/test_block_index_oracle.py).
Measured, the registry's CPU per lookup still grows with the pods (about 50 us each, 7-8 ms at 128, mostly
redis-py parsing one reply per pod for the listing and one for the walk) and Redis's with the blocks the pods
hold; the walk removed the chain from the registry's side, not the pods.

Why not a reverse index (block hash -> pods, as llm-d's kv-cache indexer keeps): its keys would live in the
block hashes' slots, so on a Redis Cluster an event could no longer move the pod's sets, the reverse entries and
the sequence number in one script (exactly-once would need a second protocol), and its entries for an expired
pod would outlive the pod's TTL (filtered at read, purged by nobody). Its lookup cost is O(chain x holders): no
better than the walk when every pod holds a shared prefix, which is the case routing has to get right. Nor an
index in the registry's memory: replicas see disjoint shares of the events. (These two were reasoned about, not
built and measured.) Figures, main against this lookup: pdserve/loadtest/README.md ("Registry lookup cost").
"""

from __future__ import annotations

import hashlib

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from pdserve.shared.protocol import keys
from pdserve.shared.protocol.keys import blocks_key, seq_key
from pdserve.shared.protocol.kv_events import MEDIUMS, KVEventBatch, KVEventsReply, KVSnapshot

KEEP_TTLS = 3  # x pod_ttl_s: the TTL of a pod's record and block index (store.py's module doc)
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
local cur = redis.call('HMGET', KEYS[2], 'epoch', 'seq')
local known = (cur[1] == epoch)
local last = -1
if known then last = tonumber(cur[2]) end
local applied, resync, i = 0, 0, 4
local grown = {{}}
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
    if count > 0 then
      each_chunk(kind == 'stored' and 'SADD' or 'SREM', key, first, count)
      if kind == 'stored' then grown[key] = true end
    end
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
  -- a set this batch added to may be new (no TTL yet); the others keep the TTL of the last refresh
  for _, k in ipairs({{KEYS[1], KEYS[3], KEYS[4]}}) do
    if grown[k] then redis.call('PEXPIRE', k, ttl) end
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

# KEYS: _keys(pod) less the sequence record: the pool's set, then one set per tier (MEDIUMS order). ARGV: the
# hashes' width in bytes and the chain concatenated (width 0: the hashes as separate arguments, ARGV[2..]).
# Returns {leading blocks in the pool, then per medium the leading blocks it is the best one for}.
_WALK = """
local w = tonumber(ARGV[1])
local n = (w > 0) and math.floor(#ARGV[2] / w) or (#ARGV - 1)
local lead, pool_run = 0, true
local counts = {}
for k = 1, #KEYS do counts[k] = 0 end
for i = 1, n do
  local m = (w > 0) and string.sub(ARGV[2], (i - 1) * w + 1, i * w) or ARGV[i + 1]
  local best = 0
  for k = 1, #KEYS do
    if redis.call('SISMEMBER', KEYS[k], m) == 1 then best = k; break end
  end
  if best == 0 then break end
  counts[best] = counts[best] + 1
  if best == 1 then
    if pool_run then lead = lead + 1 end
  else
    pool_run = false
  end
end
return {lead, unpack(counts)}
"""


_KEY_INDEX = {"device": 1, "cpu": 3, "disk": 4}  # an event's medium -> its set among the scripts' KEYS


class BlockIndex:
    def __init__(self, redis: Redis, pod_ttl_s: float) -> None:
        self.redis = redis
        self.ttl_ms = max(1, int(KEEP_TTLS * pod_ttl_s * 1000))
        self._apply = redis.register_script(_APPLY)
        self._snapshot = redis.register_script(_SNAPSHOT)
        self._walk_sha = hashlib.sha1(_WALK.encode()).hexdigest()

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
        blocks it holds in any medium, how many each medium is the best one for. One ``_WALK`` per pod, pipelined
        (see the module's doc)."""
        if not pod_ids or not block_hashes:
            return [(0, {})] * len(pod_ids)
        width = len(block_hashes[0])
        if all(len(h) == width for h in block_hashes):
            args: list[bytes | int] = [width // 2, bytes.fromhex("".join(block_hashes))]
        else:  # hashes of several widths (no engine sends those): one argument each
            args = [0, *(bytes.fromhex(h) for h in block_hashes)]
        answers = await self._walk_all(pod_ids, args)
        return [(int(lead), dict(zip(MEDIUMS, map(int, counts)))) for lead, *counts in answers]

    async def _walk_all(self, pod_ids: list[str], args: list) -> list:
        # EVALSHA, loading the script when Redis lost it (a restart, a failover; a cluster loads it on every
        # primary): redis-py's own pipelined scripts would send SCRIPT EXISTS with every lookup.
        for attempt in (0, 1):
            async with self.redis.pipeline(transaction=False) as pipe:
                for pod_id in pod_ids:
                    pipe.evalsha(self._walk_sha, len(MEDIUMS), blocks_key(pod_id), *tier_keys(pod_id), *args)
                answers = await pipe.execute(raise_on_error=False)
            failed = next((a for a in answers if isinstance(a, Exception)), None)
            if failed is None:
                return answers
            if attempt or not isinstance(failed, NoScriptError):
                raise failed
            await self.redis.script_load(_WALK)
        raise AssertionError("unreachable")

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
