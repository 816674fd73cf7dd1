"""Physical KV blocks: reference counts, the LRU free queue and the prefix-cache map.

Names and behaviour follow vLLM v1 (``BlockPool``, ``FreeKVCacheBlockQueue``, ``KVCacheBlock``):
a block whose reference count drops to 0 goes to the *tail* of the free queue but keeps its hash,
so a later request with the same prefix can take it back (``touch``) until ``get_new_blocks`` pops
it from the *head* and evicts its hash. Callers free a request's blocks tail-first, so the tails of
chains are evicted before their heads (a head is worth more: every longer prefix needs it).
Block 0 is the null block: never handed out, kept zero (padding in block tables points at it).
With offloading tiers (``kv_offload.py``), ``on_evict(block_hash, block_id)`` sees each cached block as it is
evicted for reuse, while its KV is still in place.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from pdserve.shared.protocol.block_hash import BlockHash


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


@dataclass(slots=True)
class KVCacheEvent:
    """``stored`` or ``removed`` block hashes, in order (for the block registry); ``medium``: the tier that
    stored or removed them, ``device`` (the pool) or an offloading tier (``cpu``, ``disk``)."""

    kind: str
    block_hashes: list[BlockHash] = field(default_factory=list)
    parent_hash: BlockHash | None = None
    medium: str = "device"


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order (head first). O(1) append, popleft and remove by id."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._q: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in blocks)

    def __len__(self) -> int:
        return len(self._q)

    def popleft(self) -> KVCacheBlock:
        return self._q.popitem(last=False)[1]

    def remove(self, block: KVCacheBlock) -> None:
        del self._q[block.block_id]

    def append(self, block: KVCacheBlock) -> None:
        self._q[block.block_id] = block

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.block_id in self._q


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, enable_kv_events: bool = False) -> None:
        assert num_blocks >= 2, "block 0 is the null block; a pool needs at least one more"
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # pinned forever
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.enable_kv_events = enable_kv_events
        self.kv_event_queue: list[KVCacheEvent] = []
        self.on_evict = None  # callable(block_hash, block_id), set when offloading tiers exist

    def get_num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, including evictable cached ones)."""
        return len(self.free_block_queue)

    def get_usage(self) -> float:
        """Fraction of allocatable blocks held by requests (vLLM's ``kv_cache_usage``)."""
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` from the head of the free queue (evicting their hashes), ref_cnt 1.

        Raises ``ValueError`` when fewer are free: callers check ``get_num_free_blocks`` first.
        """
        if num_blocks > len(self.free_block_queue):
            raise ValueError(f"cannot get {num_blocks} free blocks from the pool ({len(self.free_block_queue)} free)")
        out = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            assert block.ref_cnt == 0
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock, offload: bool = True) -> None:
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            if offload and self.on_evict is not None:
                self.on_evict(block.block_hash, block.block_id)
            del self.cached_block_hash_to_block[block.block_hash]
            if self.enable_kv_events:
                self.kv_event_queue.append(KVCacheEvent("removed", [block.block_hash]))
        block.block_hash = None

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks) -> None:
        """Drop one reference from each block, in the given order (pass chains tail-first)."""
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash], start: int, end: int) -> None:
        """Register blocks ``start:end`` of a request (now full) under their hashes."""
        if not self.enable_caching or start >= end:
            return
        stored = []
        for i in range(start, end):
            block, h = blocks[i], block_hashes[i]
            if block.block_hash is not None or block is self.null_block:  # a prefix hit; a window-freed placeholder
                continue
            if h in self.cached_block_hash_to_block:
                # Same content computed twice (two requests prefilled the prefix in one step): keep
                # the first; this block stays private and is freed without a hash.
                continue
            block.block_hash = h
            self.cached_block_hash_to_block[h] = block
            stored.append(h)
        if stored and self.enable_kv_events:
            parent = block_hashes[start - 1] if start > 0 else None
            self.kv_event_queue.append(KVCacheEvent("stored", stored, parent))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (only when no block is in use). Returns whether it did."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        for block in self.blocks[1:]:
            self._evict(block, offload=False)
        return True

    def cache_loaded_block(self, block: KVCacheBlock, block_hash: BlockHash, parent: BlockHash | None) -> None:
        """Register a block whose KV was just loaded back from an offloading tier under its hash."""
        assert block_hash not in self.cached_block_hash_to_block and block.block_hash is None
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block
        if self.enable_kv_events:
            self.kv_event_queue.append(KVCacheEvent("stored", [block_hash], parent))

    def take_events(self) -> list[KVCacheEvent]:
        events, self.kv_event_queue = self.kv_event_queue, []
        return events
