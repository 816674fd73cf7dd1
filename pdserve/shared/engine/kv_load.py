"""Loads from the offloading tiers that overlap the step: a request waits for its blocks, the batch does not.

A waiting request whose prompt prefix is partly held by a tier (CPU or disk) but not by the device pool gets
device blocks for those hashes now, pinned; a loader thread copies the tier's bytes into them
(``KVOffloadManager.start_loads``) while the engine keeps stepping the running batch. The request stays in the
waiting queue, skipped by the scheduler, until the load is done (vLLM v1's ``WAITING_FOR_REMOTE_KVS``); then the
loaded blocks enter the prefix cache under their hashes, the pins are dropped, and the request's ordinary prefix
lookup finds its whole prefix in the pool. A block whose file turns out bad ends the chain there: the blocks after
it are freed unregistered and recomputed. A request aborted while its load runs leaves the load to finish
(the loader may still be writing its blocks) before the blocks are released.

A decode pod's reservation for a hand-over loads the same way (``start`` with ``eager``): its answer counts the
blocks being loaded as cached, so the prefill pod does not send them, and the reservation holds them like any
prefix hit. An eager load is completed by the next ``reap`` once done (its blocks enter the prefix cache at once,
not when its owner next looks), and ``finish`` tells the owner how many of its blocks arrived.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

from pdserve.shared.engine.block_pool import BlockPool, KVCacheBlock
from pdserve.shared.protocol.block_hash import BlockHash


@dataclass(slots=True)
class PendingLoad:
    """One request's load: the device hits it pinned, then the blocks being loaded with their hashes."""

    pinned: list[KVCacheBlock]
    loading: list[tuple[BlockHash, KVCacheBlock, BlockHash | None]]  # (hash, device block, parent hash)
    future: Future
    eager: bool = False  # completed by ``reap`` once done (a reservation's load)


class PendingLoads:
    """The loads in flight, per request id (``is_waiting`` / ``start`` / ``finish`` / ``cancel`` / ``reap``)."""

    def __init__(self, pool: BlockPool, offload) -> None:
        self.pool = pool
        self.offload = offload
        self.by_request: dict[str, PendingLoad] = {}
        self.orphans: list[PendingLoad] = []  # loads of aborted requests, finishing
        self.in_flight: set[BlockHash] = set()
        self.finished: dict[str, int] = {}  # eager loads completed, per request id: blocks that arrived
        self.num_loads = 0  # loads started, ever

    def __len__(self) -> int:
        """Loads not completed yet."""
        return len(self.by_request) + len(self.orphans)

    def is_waiting(self, request_id: str, hashes: list[BlockHash]) -> bool:
        """Whether the request must wait out of this step: its load is running, or one starts now. ``hashes``:
        the prefix blocks it may hit (full blocks, short of its last token). A finished load is completed here
        (its blocks enter the prefix cache), and the request goes on to its ordinary prefix lookup."""
        load = self.by_request.get(request_id)
        if load is not None:
            if not load.future.done():
                return True
            del self.by_request[request_id]
            self._complete(load)
            return False
        return self._start(request_id, hashes)

    def _start(self, request_id: str, hashes: list[BlockHash]) -> bool:
        hits, todo, blocked = self.walk(hashes)
        if blocked:
            return True  # another request is loading a block of it: wait for that load instead of loading it twice
        if not todo:
            return False
        return bool(self.start(request_id, hits, todo, hashes))

    def walk(self, hashes: list[BlockHash]) -> tuple[list[KVCacheBlock], list[BlockHash], bool]:
        """The prefix ``hashes`` as the pool and the tiers hold it now: ``(device hits, then the hashes only a tier
        holds, blocked)``; ``blocked``: the walk stopped at a block another load is bringing in. Takes nothing."""
        pool = self.pool
        hits: list[KVCacheBlock] = []
        todo: list[BlockHash] = []
        for h in hashes:
            if h in self.in_flight:
                return hits, todo, True
            block = pool.get_cached_block(h)
            if block is not None and not todo:
                hits.append(block)
            elif block is None and self.offload.tier_of(h) is not None:
                todo.append(h)
            else:
                break
        return hits, todo, False

    def start(self, request_id: str, hits: list[KVCacheBlock], todo: list[BlockHash], hashes: list[BlockHash],
              eager: bool = False) -> list[KVCacheBlock]:
        """Pin ``hits`` and load ``todo`` (from ``walk``; ``hashes``: the whole prefix, for parents) into new device
        blocks, as many as are free; returns those blocks (pinned until the load completes; none: nothing started).
        ``eager``: complete at the first ``reap`` after it is done, and keep the count for ``finish``."""
        pool = self.pool
        pool.touch(hits)  # pinned, so that taking blocks for the load cannot evict them
        todo = todo[: pool.get_num_free_blocks()]
        if not todo:
            pool.free_blocks(reversed(hits))
            return []
        copies = self.offload.take_cpu_copies(todo)
        blocks = pool.get_new_blocks(len(todo))  # may evict (offload) other blocks
        start = len(hits)
        loading = [(h, b, hashes[start + i - 1] if start + i else None) for i, (h, b) in enumerate(zip(todo, blocks))]
        future = self.offload.start_loads([(h, b.block_id, c) for (h, b, _), c in zip(loading, copies)])
        self.by_request[request_id] = PendingLoad(hits, loading, future, eager)
        self.in_flight.update(todo)
        self.num_loads += 1
        return blocks

    def _complete(self, load: PendingLoad) -> int:
        """Register the blocks that arrived and drop the load's pins; returns how many arrived (a prefix of them)."""
        results = load.future.result()
        arrived = 0
        for (h, block, parent), (tier, bad) in zip(load.loading, results + [(None, False)] * len(load.loading)):
            if bad:
                self.offload.emit_removed_disk(h)
            if tier is not None:
                arrived += 1
                if self.pool.get_cached_block(h) is None:
                    self.pool.cache_loaded_block(block, h, parent)
        self.in_flight.difference_update(h for h, _, _ in load.loading)
        self.pool.free_blocks(reversed(load.pinned + [b for _, b, _ in load.loading]))
        return arrived

    def finish(self, request_id: str) -> int | None:
        """An eager load's end: how many of its blocks arrived (they are in the prefix cache unless another copy
        got there first), or None while it runs. Forgets the load; 0 when there was none."""
        load = self.by_request.get(request_id)
        if load is not None:
            if not load.future.done():
                return None
            del self.by_request[request_id]
            return self._complete(load)
        return self.finished.pop(request_id, 0)

    def cancel(self, request_id: str) -> None:
        """The request is gone (aborted, finished): its load completes at a later ``reap``."""
        self.finished.pop(request_id, None)
        load = self.by_request.pop(request_id, None)
        if load is not None:
            self.orphans.append(load)
            self.reap()

    def reap(self) -> None:
        """Complete the finished loads of requests that are gone, and the finished eager loads."""
        done = [load for load in self.orphans if load.future.done()]
        for load in done:
            self.orphans.remove(load)
            self._complete(load)
        for request_id in [r for r, load in self.by_request.items() if load.eager and load.future.done()]:
            self.finished[request_id] = self._complete(self.by_request.pop(request_id))

    def wait_any(self, timeout_s: float) -> None:
        """Block until a load finishes or ``timeout_s`` passes (a step with nothing else to run)."""
        futures = [load.future for load in (*self.by_request.values(), *self.orphans)]
        if futures:
            wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)
