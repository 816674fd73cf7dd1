"""Which blocks each request holds: prefix-cache lookup, slot allocation, freeing.

vLLM v1's ``KVCacheManager`` (``get_computed_blocks``, ``allocate_slots``, ``free``). Requests share blocks
only through the prefix cache (full blocks, reference-counted), so a block written by one request is never
written by another: no copy-on-write (the ``n`` choices of one request are siblings that hit the first one's
prompt blocks, as in vLLM v1).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.shared.protocol.block_hash import BlockHash
from pdserve.shared.engine.block_pool import BlockPool, KVCacheBlock, KVCacheEvent
from pdserve.shared.engine.kv_load import PendingLoads
from pdserve.shared.engine.request import Request


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups in tokens, one per request admitted (a lookup whose allocation failed and is
    retried next step is not counted twice). Three kinds, never mixed:

    - ``queries``/``hits``: a new request's prompt (vLLM's ``prefix_cache_queries``/``hits``): tokens whose
      computation the cache saved.
    - ``preempted_queries``/``preempted_hits``: a request preempted by recompute looked up again (vLLM's
      ``PrefixCacheStats.preempted_*``): its own blocks found again are recompute savings, not cache hits.
    - ``transfer_queries``/``transfer_hits``: a decode pod's reservation for KV arriving over the wire:
      blocks the sender need not send (nothing is computed either way).
    """

    queries: int = 0
    hits: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    transfer_queries: int = 0
    transfer_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, kind: str = "new") -> None:
        """``kind``: ``new`` | ``preempted`` | ``transfer``."""
        if kind == "preempted":
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        elif kind == "transfer":
            self.transfer_queries += num_tokens
            self.transfer_hits += num_hits
        else:
            self.queries += num_tokens
            self.hits += num_hits


class KVCacheManager:
    """``sliding_window``: set when every layer attends over a window (Mistral): the widest, in tokens. A running
    request's blocks that fall wholly before its next query's window are then freed (``free_out_of_window``)."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, enable_kv_events: bool = False,
                 sliding_window: int | None = None):
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.num_skipped_blocks: dict[str, int] = {}  # leading blocks of a request freed by the window (null now)
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching, enable_kv_events)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}  # leading blocks of a request registered in the cache
        self.prefix_cache_stats = PrefixCacheStats()
        self.offload = None  # kv_offload.KVOffloadManager: tiers below the pool (``set_offload``)
        self.loads: PendingLoads | None = None  # loads from the tiers that overlap the step (kv_load.py)

    def set_offload(self, offload) -> None:
        """Write blocks the pool evicts down ``offload``'s tiers and load prefix hits back from them."""
        self.offload = offload
        pool = self.block_pool
        pool.on_evict = offload.offload
        self.loads = PendingLoads(pool, offload)
        if pool.enable_kv_events:
            offload.emit = lambda kind, hashes, medium: pool.kv_event_queue.append(
                KVCacheEvent(kind, hashes, None, medium))
            offload.announce()

    # prefix cache
    def is_loading(self, request: Request) -> bool:
        """Whether ``request`` waits out of this step for prefix blocks a loader thread is bringing back from an
        offloading tier (a load starts here when a tier holds blocks of its prefix that the pool lacks). False
        without tiers; a request whose load finished goes on to ``get_computed_blocks``."""
        if self.loads is None or not self.enable_caching or request.prompt_logprobs is not None:
            return False
        hashes = request.update_block_hashes(self.block_size)
        return self.loads.is_waiting(request.request_id, hashes[: (request.num_tokens - 1) // self.block_size])

    def reap_loads(self) -> None:
        """Release the blocks of finished loads whose requests are gone (aborted while loading)."""
        if self.loads is not None:
            self.loads.reap()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest prefix of the request's full blocks cached in the pool, and how many tokens it covers.

        A prompt that is cached whole still recomputes its last token (its logits are needed), so
        the hit is at most ``num_tokens - 1`` tokens, rounded down to whole blocks. A request that computes
        ``prompt_logprobs`` gets no hit (vLLM's rule): a cached block holds KV, not the logits of its positions.
        The caller records the lookup (``record_prefix_cache_stats``) once the request got its blocks.
        Blocks held by an offloading tier come back through ``is_loading`` (a request) or
        ``get_reserved_blocks`` (a reservation) first; this lookup finds them once they are loaded.
        """
        if not self.enable_caching or request.prompt_logprobs is not None:
            return [], 0
        hashes = request.update_block_hashes(self.block_size)
        blocks = []
        for h in hashes[: (request.num_tokens - 1) // self.block_size]:
            block = self.block_pool.get_cached_block(h)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def get_reserved_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int] | None:
        """A reservation's prefix (``DecodeImport.reserve``): the pool's hits, then the blocks an offloading tier
        holds, loading into new device blocks on the loader thread (``is_loading``'s mechanism; ``finish_load``
        says when they are in), and how many of them are loading. The caller takes them all with
        ``allocate_slots``. None when the pool cannot hold the whole request now (nothing taken). A walk that meets
        a block another load is bringing in stops there: the sender sends the rest."""
        computed, _ = self.get_computed_blocks(request)
        if self.loads is None or not self.enable_caching or request.prompt_logprobs is not None:
            fits = self.can_allocate(request, request.num_tokens - len(computed) * self.block_size, computed)
            return (computed, 0) if fits else None
        self.loads.reap()  # loads of reservations given up hold blocks until then (an idle engine does not step)
        hashes = request.update_block_hashes(self.block_size)[: (request.num_tokens - 1) // self.block_size]
        hits, todo, _ = self.loads.walk(hashes)
        # every block of the request, less the hits that someone else holds (a free hit costs a free block)
        needed = self.num_blocks_needed(request.num_tokens) - sum(1 for b in hits if b.ref_cnt > 0)
        if needed > self.block_pool.get_num_free_blocks():
            return None
        loading = self.loads.start(request.request_id, hits, todo, hashes, eager=True) if todo else []
        return hits + loading, len(loading)

    def finish_load(self, request_id: str) -> int | None:
        """A reservation's tier load (``get_reserved_blocks``): None while it runs, else how many of its blocks
        arrived (0 without one). A block that did not arrive (a bad disk file, a block dropped from the last tier
        meanwhile) and every one after it hold nothing: the request recomputes them."""
        return self.loads.finish(request_id) if self.loads is not None else 0

    def record_prefix_cache_stats(self, request: Request, num_hits: int, kind: str = "new") -> None:
        """Count one lookup of ``request`` (``kind``: see ``PrefixCacheStats``); nothing with caching off. With the
        tiers' admission gate, a new request's or a reservation's full blocks count as seen once more (a request
        preempted and looked up again is not a reuse)."""
        if self.enable_caching:
            self.prefix_cache_stats.record(request.num_tokens, num_hits, kind)
            if self.offload is not None and kind != "preempted":
                self.offload.note_seen(request.update_block_hashes(self.block_size))

    # allocation
    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] = ()) -> bool:
        return self._num_free_needed(request, num_new_tokens, new_computed_blocks) <= self.block_pool.get_num_free_blocks()

    def _num_free_needed(self, request, num_new_tokens, new_computed_blocks) -> int:
        held = self.req_to_blocks.get(request.request_id, ())
        total = self.num_blocks_needed(request.num_computed_tokens + len(new_computed_blocks) * self.block_size
                                       + num_new_tokens)
        new = max(0, total - len(held) - len(new_computed_blocks))
        # a cached hit that sits in the free queue is taken out of it by touch()
        evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        return new + evictable_hits

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] = (), cache: bool = True
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``; ``None`` when blocks are short.

        ``new_computed_blocks`` are prefix-cache hits (from ``get_computed_blocks``) taken now.
        Full blocks are registered in the prefix cache as soon as they are scheduled (the step that
        fills them runs before anyone can read them). ``cache=False`` defers that to ``cache_blocks``
        (KV that arrives over the wire is not there yet).
        """
        if not self.can_allocate(request, num_new_tokens, new_computed_blocks):
            return None
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if new_computed_blocks:
            self.block_pool.touch(list(new_computed_blocks))
            blocks.extend(new_computed_blocks)
            self.num_cached_block[request.request_id] = len(blocks)
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total = self.num_blocks_needed(num_computed + num_new_tokens)
        new_blocks = self.block_pool.get_new_blocks(max(0, total - len(blocks)))
        blocks.extend(new_blocks)
        if cache:
            self.cache_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def allocate_uncached(self, request: Request, num_blocks: int, num_skipped: int = 0) -> list[int]:
        """Give a request that holds no block ``num_blocks`` new ones, none registered in the prefix cache yet
        (swap-in: their KV is copied in before the step; ``cache_blocks`` registers them as they fill), after
        ``num_skipped`` null placeholders (blocks its sliding window had freed before it was swapped out; never
        registered). Returns the new blocks' ids. Raises ``ValueError`` when fewer are free (check
        ``num_free_blocks`` first)."""
        assert request.request_id not in self.req_to_blocks, "the request already holds blocks"
        blocks = self.block_pool.get_new_blocks(num_blocks)
        self.req_to_blocks[request.request_id] = [self.block_pool.null_block] * num_skipped + blocks
        self.num_cached_block[request.request_id] = num_skipped
        if num_skipped:
            self.num_skipped_blocks[request.request_id] = num_skipped
        return [b.block_id for b in blocks]

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that ``num_tokens`` computed tokens fill in the prefix cache."""
        if not self.enable_caching:
            return
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self.num_cached_block.get(request.request_id, 0)
        if num_full > start:
            hashes = request.update_block_hashes(self.block_size)
            self.block_pool.cache_full_blocks(self.req_to_blocks[request.request_id], hashes, start, num_full)
            self.num_cached_block[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (tails are evicted before heads)."""
        if self.loads is not None:
            self.loads.cancel(request.request_id)
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        skipped = self.num_skipped_blocks.pop(request.request_id, 0)  # already freed: null placeholders
        self.block_pool.free_blocks(reversed(blocks[skipped:]))

    def free_out_of_window(self, request: Request) -> int:
        """With ``sliding_window`` ``W``: free the request's blocks that lie wholly before its next query's window
        (positions below ``num_computed_tokens - W + 1``: no query of this request reads them again) and leave the
        null block in their place in its block table, as vLLM's ``SlidingWindowManager.remove_skipped_blocks``
        does. Freed blocks keep their hash (still prefix-cache hits for others until evicted). Not for a
        ``prefill_only`` request, whose every block is exported to a decode pod. Returns how many were freed."""
        w = self.sliding_window
        blocks = self.req_to_blocks.get(request.request_id)
        if w is None or not blocks or request.prefill_only:
            return 0
        done = self.num_skipped_blocks.get(request.request_id, 0)
        upto = min(max(0, request.num_computed_tokens - w + 1) // self.block_size, len(blocks))
        if upto <= done:
            return 0
        freed = blocks[done:upto]
        blocks[done:upto] = [self.block_pool.null_block] * (upto - done)
        self.num_skipped_blocks[request.request_id] = upto
        self.block_pool.free_blocks(reversed(freed))  # tail first: the prefix's head is evicted last
        return upto - done

    def num_skipped(self, request_id: str) -> int:
        """The request's leading blocks freed by ``free_out_of_window`` (null placeholders in its table)."""
        return self.num_skipped_blocks.get(request_id, 0)

    def trim(self, request: Request, num_computed_tokens: int) -> None:
        """Free the request's trailing blocks that hold no computed token (rejected drafts' slots). They were
        never hashed: ``cache_blocks`` stops at ``request.num_tokens``, which drafts are not part of."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = self.num_blocks_needed(num_computed_tokens)
        if blocks and len(blocks) > keep:
            tail = blocks[keep:]
            assert all(b.block_hash is None for b in tail), "a block holding unverified tokens was hashed"
            del blocks[keep:]
            self.block_pool.free_blocks(reversed(tail))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def num_held_blocks(self, request_id: str) -> int:
        return len(self.req_to_blocks.get(request_id, ()))

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, including evictable cached ones)."""
        return self.block_pool.get_num_free_blocks()

    def take_events(self) -> list[KVCacheEvent]:
        """Prefix-cache ``stored``/``removed`` events since the last call (with ``enable_kv_events``)."""
        return self.block_pool.take_events()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash; False (nothing done) while any block is held by a request."""
        return self.block_pool.reset_prefix_cache()

    def cached_block_hashes(self) -> list[BlockHash]:
        """Every block hash the prefix cache holds now."""
        return list(self.block_pool.cached_block_hash_to_block)

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_used_blocks(self) -> int:
        return self.block_pool.num_blocks - 1 - self.block_pool.get_num_free_blocks()
