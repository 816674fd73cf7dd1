"""Block events on the wire: what a pod tells the block registry about its prefix cache.

A pod's engine reports ``stored``/``removed`` block hashes (``BlockPool.take_events``). The pod numbers
every event with a sequence number that only grows (per pod and per ``epoch`` — one epoch per worker
process, so a restarted pod under the same name starts afresh) and POSTs them in batches:

    POST /v1/kv/events     body KVEventBatch   -> 200 KVEventsReply
    POST /v1/kv/snapshot   body KVSnapshot     -> 200 KVEventsReply
    POST /v1/kv/lookup     body KVLookup       -> 200 KVLookupReply

The registry applies events exactly once and in order. An event it cannot place (a gap: events lost,
a registry that forgot the pod, a new epoch not starting at 1) makes it answer ``resync: true``; the pod
then sends a :class:`KVSnapshot` — its whole current hash set as of sequence number ``seq`` — which
replaces what the registry holds. Events up to ``seq`` are then moot; later ones apply on top.
Same scheme as vLLM's KV-event publisher (``KVEventBatch`` with a sequence number; gap -> replay/resync)
and NVIDIA Dynamo's KV router indexer.

Block hashes travel as lowercase hex of the engine's 16-byte hashes (``shared/engine/block_hash.py``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import Annotated, Literal

from pydantic import BaseModel, Field, StringConstraints

from pdserve.shared.protocol.registry import POD_ID_PATTERN, PodInfo, Role

log = logging.getLogger("pdserve.kv_events")

HEX_HASH_PATTERN = r"^(?:[0-9a-f]{2}){1,64}$"
HexHash = Annotated[str, StringConstraints(pattern=HEX_HASH_PATTERN)]
# Bounds of one request body: a batch is a few engine steps' events; a snapshot is one pod's cache.
MAX_EVENTS_PER_BATCH = 100_000
MAX_HASHES_PER_REQUEST = 4_000_000
MAX_LOOKUP_BLOCKS = 100_000


class KVEvent(BaseModel):
    """One engine event: ``stored`` (blocks entered the prefix cache) or ``removed`` (evicted)."""

    seq: int = Field(ge=1)
    kind: Literal["stored", "removed"]
    block_hashes: list[HexHash] = Field(max_length=MAX_HASHES_PER_REQUEST)
    # the stored chain's parent block (informational: the registry keeps a set per pod)
    parent_hash: HexHash | None = None


class KVEventBatch(BaseModel):
    pod_id: str = Field(pattern=POD_ID_PATTERN)
    epoch: str = Field(min_length=1, max_length=64)
    events: list[KVEvent] = Field(max_length=MAX_EVENTS_PER_BATCH)


class KVSnapshot(BaseModel):
    """The pod's whole prefix-cache hash set after its event ``seq`` (0: before any event)."""

    pod_id: str = Field(pattern=POD_ID_PATTERN)
    epoch: str = Field(min_length=1, max_length=64)
    seq: int = Field(ge=0)
    block_hashes: list[HexHash] = Field(max_length=MAX_HASHES_PER_REQUEST)


class KVEventsReply(BaseModel):
    """``seq``: the last sequence number the registry has applied for the pod; ``resync``: send a snapshot."""

    applied: int = 0
    seq: int = 0
    resync: bool = False


class KVLookup(BaseModel):
    """A request's chain of full-block hashes (``compute_block_hashes``), first block first."""

    block_hashes: list[HexHash] = Field(max_length=MAX_LOOKUP_BLOCKS)
    role: Role = "decode"


class PodOverlap(BaseModel):
    """An alive pod's load (its last heartbeat) and ``overlap``: how many leading blocks of the chain it holds."""

    pod: PodInfo
    overlap: int = Field(ge=0)


class KVLookupReply(BaseModel):
    pods: list[PodOverlap]
    # alive prefill pods, so the router needs no second call to decide remote vs local prefill
    num_prefill_pods: int = 0


class KVEventPublisher:
    """A worker's side: number the engine's events, send them to the registry, resync on demand.

    ``record`` is called on the engine thread (after each step, and from the heartbeat) with the events
    ``BlockPool.take_events`` returned; it assigns sequence numbers under a lock, so numbering follows
    the engine's order. ``run`` (a task on the worker's loop) sends what was recorded, in order; a batch
    that fails to send is dropped — the gap it leaves makes the registry ask for a resync, which
    ``snapshot_fn`` answers (an awaitable that, on the engine thread, calls ``record`` with the pending
    events and returns ``(last_seq, all cached hashes)``).
    """

    def __init__(self, send_batch: Callable[[KVEventBatch], Awaitable[KVEventsReply]],
                 send_snapshot: Callable[[KVSnapshot], Awaitable[KVEventsReply]], pod_id: str,
                 snapshot_fn: Callable[[], Awaitable[tuple[int, list[bytes]]]], *, retry_s: float = 1.0) -> None:
        self.send_batch = send_batch
        self.send_snapshot = send_snapshot
        self.pod_id = pod_id
        self.snapshot_fn = snapshot_fn
        self.retry_s = retry_s
        self.epoch = uuid.uuid4().hex[:16]
        self.last_seq = 0
        self.sent_events = 0
        self.resyncs = 0
        self.failures = 0
        self._lock = threading.Lock()
        self._pending: list[KVEvent] = []
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._need_resync = False

    # engine thread
    def record(self, events: Iterable) -> None:
        """Number ``KVCacheEvent``s (``kind``, ``block_hashes`` bytes, ``parent_hash``) and queue them."""
        events = list(events)
        if not events:
            return
        with self._lock:
            for e in events:
                self.last_seq += 1
                self._pending.append(KVEvent(
                    seq=self.last_seq, kind=e.kind, block_hashes=[h.hex() for h in e.block_hashes],
                    parent_hash=e.parent_hash.hex() if e.parent_hash is not None else None))
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    # loop
    def start(self) -> asyncio.Task:
        self._loop = asyncio.get_running_loop()
        self._need_resync = True  # the registry may hold a previous process's state under this pod id
        self._wake.set()
        return self._loop.create_task(self.run(), name="pdserve-kv-events")

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self.publish_pending()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # The batch is lost; the registry will see the gap. Resync on the next round.
                self.failures += 1
                self._need_resync = True
                log.warning("publishing KV events of %s failed (resync next): %s: %s",
                            self.pod_id, type(exc).__name__, exc)
                await asyncio.sleep(self.retry_s)
                self._wake.set()

    async def publish_pending(self) -> None:
        """One round: a resync if one is due, then every recorded event in one batch. Raises what sending raises."""
        if self._need_resync:
            await self.resync()
        with self._lock:
            batch, self._pending = self._pending, []
        if batch:
            reply = await self.send_batch(KVEventBatch(pod_id=self.pod_id, epoch=self.epoch, events=batch))
            self.sent_events += len(batch)
            if reply.resync:
                await self.resync()

    async def resync(self) -> None:
        seq, hashes = await self.snapshot_fn()
        with self._lock:  # events up to seq are in the snapshot
            self._pending = [e for e in self._pending if e.seq > seq]
        await self.send_snapshot(KVSnapshot(pod_id=self.pod_id, epoch=self.epoch, seq=seq,
                                            block_hashes=[h.hex() for h in hashes]))
        self._need_resync = False
        self.resyncs += 1
        log.info("KV state of %s resynchronised: %d blocks as of event %d", self.pod_id, len(hashes), seq)
