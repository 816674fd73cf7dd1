"""Loads from the offloading tiers that overlap the step: a request waits for its blocks, the batch does not.

A waiting request whose prompt prefix is partly held by a tier (CPU or disk) but not by the device pool gets
device blocks for those hashes now, pinned; a loader thread copies the tier's bytes into them
(``KVOffloadManager.start_loads``) while the engine keeps stepping the running batch. The request stays in the
waiting queue, skipped by the scheduler, until the load is done (vLLM v1's ``WAITING_FOR_REMOTE_KVS``); then the
loaded blocks enter the prefix cache under their hashes, the pins are dropped, and the request's ordinary prefix
lookup finds its whole prefix in the pool. A block whose file turns out bad ends the chain there: the blocks after
it are freed unregistered and recomputed. A request aborted while its load runs leaves the load to finish
(the loader may still be writing its blocks) before the blocks are released.
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


class PendingLoads:
    """The loads in flight, per request id (``start`` / ``is_waiting`` / ``cancel`` / ``reap``)."""

    def __init__(self, pool: BlockPool, offload) -> None:
        self.pool = pool
        self.offload = offload
        self.by_request: dict[str, PendingLoad] = {}
        self.orphans: list[PendingLoad] = []  # loads of aborted requests, finishing
        self.in_flight: set[BlockHash] = set()
        self.num_loads = 0  # loads started, ever

    def __len__(self) -> int:
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
        pool = self.pool
        hits: list[KVCacheBlock] = []
        todo: list[BlockHash] = []
        for h in hashes:
            if h in self.in_flight:
                return True  # another request is loading this block: wait for it instead of loading it twice
            block = pool.get_cached_block(h)
            if block is not None and not todo:
                hits.append(block)
            elif block is None and self.offload.tier_of(h) is not None:
                todo.append(h)
            else:
                break
        if not todo:
            return False
        pool.touch(hits)  # pinned, so that taking blocks for the load cannot evict them
        todo = todo[: pool.get_num_free_blocks()]
        if not todo:
            pool.free_blocks(reversed(hits))
            return False
        copies = self.offload.take_cpu_copies(todo)
        blocks = pool.get_new_blocks(len(todo))  # may evict (offload) other blocks
        start = len(hits)
        loading = [(h, b, hashes[start + i - 1] if start + i else None) for i, (h, b) in enumerate(zip(todo, blocks))]
        future = self.offload.start_loads([(h, b.block_id, c) for (h, b, _), c in zip(loading, copies)])
        self.by_request[request_id] = PendingLoad(hits, loading, future)
        self.in_flight.update(todo)
        self.num_loads += 1
        return True

    def _complete(self, load: PendingLoad) -> None:
        results = load.future.result()
        for (h, block, parent), (tier, bad) in zip(load.loading, results + [(None, False)] * len(load.loading)):
            if bad:
                self.offload.emit_removed_disk(h)
            if tier is not None and self.pool.get_cached_block(h) is None:
                self.pool.cache_loaded_block(block, h, parent)
        self.in_flight.difference_update(h for h, _, _ in load.loading)
        self.pool.free_blocks(reversed(load.pinned + [b for _, b, _ in load.loading]))

    def cancel(self, request_id: str) -> None:
        """The request is gone (aborted, finished): its load completes at a later ``reap``."""
        load = self.by_request.pop(request_id, None)
        if load is not None:
            self.orphans.append(load)
            self.reap()

    def reap(self) -> None:
        """Complete the finished loads of requests that are gone."""
        done = [load for load in self.orphans if load.future.done()]
        for load in done:
            self.orphans.remove(load)
            self._complete(load)

    def wait_any(self, timeout_s: float) -> None:
        """Block until a load finishes or ``timeout_s`` passes (a step with nothing else to run)."""
        futures = [load.future for load in (*self.by_request.values(), *self.orphans)]
        if futures:
            wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)
