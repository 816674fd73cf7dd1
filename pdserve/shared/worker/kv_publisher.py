"""A worker's KV-event publisher: numbers its engine's block events and sends them to the registry, resyncing
with a snapshot on a gap (the wire and the scheme: ``pdserve/shared/protocol/kv_events.py``)."""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterable

from pdserve.shared.protocol.kv_events import KVEvent, KVEventBatch, KVEventsReply, KVSnapshot

log = logging.getLogger("pdserve.kv_events")


class KVEventPublisher:
    """A worker's side: number the engine's events, send them to the registry, resync on demand.

    ``record`` is called on the engine thread (after each step, and from the heartbeat) with the events
    ``BlockPool.take_events`` returned; it assigns sequence numbers under a lock, so numbering follows
    the engine's order. ``run`` (a task on the worker's loop) sends what was recorded, in order; a batch
    that fails to send is dropped — the gap it leaves makes the registry ask for a resync, which
    ``snapshot_fn`` answers (an awaitable that, on the engine thread, calls ``record`` with the pending
    events and returns ``(last_seq, all cached hashes)``, or with a third item, the offloading tiers' hashes
    ``{"cpu": [...], "disk": [...]}``).
    """

    def __init__(self, send_batch: Callable[[KVEventBatch], Awaitable[KVEventsReply]],
                 send_snapshot: Callable[[KVSnapshot], Awaitable[KVEventsReply]], pod_id: str,
                 snapshot_fn: Callable[[], Awaitable[tuple]], *, retry_s: float = 1.0) -> None:
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
                    parent_hash=e.parent_hash.hex() if e.parent_hash is not None else None,
                    medium=getattr(e, "medium", "device")))
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
        seq, hashes, *tiers = await self.snapshot_fn()  # (seq, hashes[, {"cpu": [...], "disk": [...]}])
        tiers = tiers[0] if tiers else {}
        with self._lock:  # events up to seq are in the snapshot
            self._pending = [e for e in self._pending if e.seq > seq]
        await self.send_snapshot(KVSnapshot(pod_id=self.pod_id, epoch=self.epoch, seq=seq,
                                            block_hashes=[h.hex() for h in hashes],
                                            cpu_block_hashes=[h.hex() for h in tiers.get("cpu", ())],
                                            disk_block_hashes=[h.hex() for h in tiers.get("disk", ())]))
        self._need_resync = False
        self.resyncs += 1
        log.info("KV state of %s resynchronised: %d blocks as of event %d", self.pod_id, len(hashes), seq)
