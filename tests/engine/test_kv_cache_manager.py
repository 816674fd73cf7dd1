"""``KVCacheManager`` on its own (no model): prefix-cache lookups and the hashes it records, slot allocation
that either takes every block it needs or none, and release order (tails evicted before heads)."""

from __future__ import annotations

from pdserve.shared.protocol.block_hash import compute_block_hashes
from pdserve.shared.engine.kv_cache_manager import KVCacheManager
from pdserve.shared.engine.request import Request
from pdserve.shared.protocol.sampling_params import SamplingParams

BLOCK = 4


def req(rid: str, tokens: list[int], salt: str | None = None, **params) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4, **params), 4, frozenset(), cache_salt=salt)


def prefill(kv: KVCacheManager, request: Request) -> None:
    computed, num_computed = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_computed, computed) is not None
    request.num_computed_tokens = request.num_tokens


def test_allocation_registers_the_full_blocks_under_their_chain_hashes():
    kv = KVCacheManager(8, BLOCK)
    a = req("a", list(range(10)))
    prefill(kv, a)
    assert kv.get_block_ids("a") == [1, 2, 3]
    assert kv.cached_block_hashes() == compute_block_hashes(list(range(10)), BLOCK)  # 2 full blocks, in order
    assert [kv.block_pool.get_cached_block(h).block_id for h in kv.cached_block_hashes()] == [1, 2]


def test_a_shared_prefix_is_found_and_shared_by_reference():
    kv = KVCacheManager(8, BLOCK)
    prefill(kv, req("a", list(range(10))))
    b = req("b", list(range(8)) + [99, 98, 97])
    blocks, num_computed = kv.get_computed_blocks(b)
    assert ([blk.block_id for blk in blocks], num_computed) == ([1, 2], 8)
    kv.allocate_slots(b, b.num_tokens - 8, blocks)
    assert kv.get_block_ids("b")[:2] == [1, 2] and kv.get_block_ids("b")[2] not in kv.get_block_ids("a")
    assert [blk.ref_cnt for blk in kv.block_pool.blocks[1:3]] == [2, 2]


def test_siblings_of_one_request_share_full_prompt_blocks_and_own_their_partial_one():
    """n > 1: each choice is a request; the later ones hit the first one's full blocks (never its partial one,
    so no block is ever written by two requests)."""
    kv = KVCacheManager(8, BLOCK)
    prompt = list(range(10))
    first, second = req("x", prompt), req("x#1", prompt)
    prefill(kv, first)
    prefill(kv, second)
    assert kv.get_block_ids("x#1")[:2] == kv.get_block_ids("x")[:2]
    assert kv.get_block_ids("x#1")[2] != kv.get_block_ids("x")[2]
    assert kv.num_used_blocks == 4


def test_a_wholly_cached_prompt_still_computes_its_last_token():
    kv = KVCacheManager(8, BLOCK)
    prefill(kv, req("a", list(range(8))))
    _, num_computed = kv.get_computed_blocks(req("b", list(range(8))))
    assert num_computed == 4  # (8 - 1) // 4 blocks: the last token's logits are needed


def test_no_hit_across_salts_or_for_prompt_logprobs_or_with_caching_off():
    kv = KVCacheManager(8, BLOCK)
    prefill(kv, req("a", list(range(10)), salt="t1"))
    assert kv.get_computed_blocks(req("b", list(range(10)), salt="t2"))[1] == 0
    assert kv.get_computed_blocks(req("c", list(range(10))))[1] == 0
    assert kv.get_computed_blocks(req("d", list(range(10)), salt="t1", prompt_logprobs=1))[1] == 0
    assert kv.get_computed_blocks(req("e", list(range(10)), salt="t1"))[1] == 8
    off = KVCacheManager(8, BLOCK, enable_caching=False)
    prefill(off, req("a", list(range(10))))
    assert off.cached_block_hashes() == [] and off.get_computed_blocks(req("b", list(range(10))))[1] == 0


def test_allocation_takes_every_block_it_needs_or_none():
    kv = KVCacheManager(4, BLOCK)  # 3 usable blocks
    prefill(kv, req("a", list(range(8))))
    big = req("big", list(range(50, 62)))  # 3 blocks, 1 free
    assert not kv.can_allocate(big, 12)
    assert kv.allocate_slots(big, 12) is None
    assert kv.num_free_blocks == 1 and kv.get_block_ids("big") == []


def test_a_hit_on_a_free_cached_block_counts_against_the_free_pool():
    kv = KVCacheManager(4, BLOCK)
    a = req("a", list(range(8)))
    prefill(kv, a)
    kv.free(a)
    b = req("b", list(range(8)) + [7, 7, 7, 7, 7])  # hits block 1 and 2 (both free, cached); needs 2 more
    blocks, _ = kv.get_computed_blocks(b)
    assert len(blocks) == 2 and kv.num_free_blocks == 3
    assert not kv.can_allocate(b, 5, blocks)  # 2 hits taken out of the free queue + 2 new > 3
    assert kv.can_allocate(b, 4, blocks)


def test_reserved_blocks_enter_the_prefix_cache_only_when_cached_explicitly():
    kv = KVCacheManager(8, BLOCK)
    incoming = req("in", list(range(9)))
    kv.allocate_slots(incoming, 9, cache=False)  # a decode pod's reservation: KV not here yet
    assert kv.cached_block_hashes() == []
    kv.cache_blocks(incoming, 9)
    assert kv.cached_block_hashes() == compute_block_hashes(list(range(9)), BLOCK)


def test_free_releases_tail_first_and_keeps_hashes_until_evicted():
    kv = KVCacheManager(5, BLOCK)  # 4 usable blocks
    a = req("a", list(range(12)))
    prefill(kv, a)  # blocks 1, 2, 3
    kv.free(a)
    assert kv.num_free_blocks == 4 and kv.num_used_blocks == 0
    assert list(kv.block_pool.free_block_queue._q) == [4, 3, 2, 1]  # never-used block first, then a's tail first
    assert len(kv.cached_block_hashes()) == 3
    b = req("b", list(range(100, 108)))
    prefill(kv, b)  # takes blocks 4 and 3: evicts a's last block only
    assert kv.get_block_ids("b") == [4, 3]
    assert kv.cached_block_hashes()[:2] == compute_block_hashes(list(range(12)), BLOCK)[:2]
    assert kv.get_computed_blocks(req("c", list(range(12)) + [1]))[1] == 8  # the head survived


def test_kv_events_report_stored_and_removed_hashes():
    kv = KVCacheManager(3, BLOCK, enable_kv_events=True)  # 2 usable blocks
    a = req("a", list(range(8)))
    prefill(kv, a)
    kv.free(a)
    prefill(kv, req("b", list(range(50, 54)) + [0]))  # evicts both of a's blocks
    events = kv.take_events()
    hashes = compute_block_hashes(list(range(8)), BLOCK)
    assert [(e.kind, e.block_hashes) for e in events][:1] == [("stored", hashes)]
    assert sorted(h for e in events if e.kind == "removed" for h in e.block_hashes) == sorted(hashes)
    assert kv.take_events() == []


def test_swap_in_blocks_are_fresh_and_join_the_prefix_cache_only_as_they_are_cached_again():
    kv = KVCacheManager(8, BLOCK)
    a = req("a", list(range(10)))
    prefill(kv, a)
    cached = kv.cached_block_hashes()
    kv.free(a)  # swapped out: its blocks stay evictable in the cache
    other = req("b", [7] * 16)
    prefill(kv, other)  # takes free blocks from the head of the queue, evicting a's hashes
    ids = kv.allocate_uncached(a, 3)
    assert len(ids) == 3 and not set(ids) & set(kv.get_block_ids("b")) and kv.get_block_ids("a") == ids
    assert not set(cached) & set(kv.cached_block_hashes()) and kv.num_free_blocks == 0
    kv.cache_blocks(a, 10)  # the swapped-in KV is in place again
    assert set(cached) <= set(kv.cached_block_hashes())


def decode_to(kv: KVCacheManager, request: Request, num_tokens: int) -> None:
    """Append tokens one decode step at a time up to ``num_tokens``, freeing out-of-window blocks as the
    scheduler does before each step's allocation."""
    while request.num_tokens < num_tokens:
        kv.free_out_of_window(request)
        assert kv.allocate_slots(request, 1) is not None
        request.append_output_token(7)
        request.num_computed_tokens = request.num_tokens - 1  # the new token's KV is written by the next step


def test_a_sliding_window_frees_blocks_no_query_reads_again_and_leaves_the_null_block():
    """Window 6, blocks of 4: before the step whose first query is at position p, keys below p - 5 are never read
    again, so block b goes once 4(b+1) <= p - 5. The blocks keep their hashes (others may still hit them), the
    table keeps its length with the null block (id 0) in their place, and ``free`` never releases the null block."""
    kv = KVCacheManager(10, BLOCK, sliding_window=6)
    a = req("a", list(range(8)))
    a.sampling_params.max_tokens = 100
    prefill(kv, a)  # 8 computed: the next query, at 8, reads keys 3..8, so block 0 (0..3) stays
    assert kv.free_out_of_window(a) == 0 and kv.get_block_ids("a")[0] != 0
    assert kv.allocate_slots(a, 1) is not None
    a.append_output_token(7)
    a.num_computed_tokens = 9  # the query at 9 reads keys 4..9: block 0 goes
    assert kv.free_out_of_window(a) == 1 and kv.get_block_ids("a")[0] == 0 and kv.num_skipped("a") == 1
    decode_to(kv, a, 30)
    kv.free_out_of_window(a)  # as the next step's scheduling does
    ids = kv.get_block_ids("a")
    assert ids[:kv.num_skipped("a")] == [0] * kv.num_skipped("a")
    first_read = (a.num_computed_tokens - 6 + 1) // BLOCK  # the block holding the window's first key
    assert kv.num_skipped("a") == first_read and all(i != 0 for i in ids[first_read:])
    held = kv.num_used_blocks
    assert held == len(ids) - first_read <= 3  # a window of 6 spans at most 3 blocks of 4
    assert set(compute_block_hashes(list(range(8)), BLOCK)) <= set(kv.cached_block_hashes())  # hashes kept
    kv.free(a)
    assert kv.num_used_blocks == 0 and kv.block_pool.null_block.ref_cnt == 1


def test_without_every_layer_windowed_or_for_a_prefill_only_request_nothing_is_freed():
    kv = KVCacheManager(10, BLOCK)
    a = req("a", list(range(20)))
    prefill(kv, a)
    assert kv.free_out_of_window(a) == 0
    kv = KVCacheManager(10, BLOCK, sliding_window=4)
    b = req("b", list(range(20)))
    b.prefill_only = True  # its blocks are exported whole to a decode pod
    prefill(kv, b)
    assert kv.free_out_of_window(b) == 0 and 0 not in kv.get_block_ids("b")


def test_swapping_a_windowed_request_copies_only_its_live_blocks_and_never_caches_a_placeholder():
    from pdserve.shared.engine.swap import SwapManager

    kv = KVCacheManager(12, BLOCK, sliding_window=5)
    swap = SwapManager(kv, 8)
    a = req("a", list(range(6)))
    a.sampling_params.max_tokens = 100
    prefill(kv, a)
    decode_to(kv, a, 27)
    skipped, live = kv.num_skipped("a"), kv.get_block_ids("a")[kv.num_skipped("a"):]
    assert skipped >= 4 and 0 not in live
    assert swap.can_swap_out(a)
    pairs = swap.swap_out(a)
    assert [d for d, _ in pairs] == live and swap.num_used_cpu_blocks == len(live)
    assert swap.can_swap_in(a, kv.num_blocks_needed(a.num_computed_tokens + 1))
    back = swap.swap_in(a)
    ids = kv.get_block_ids("a")
    assert ids[:skipped] == [0] * skipped and [d for _, d in back] == ids[skipped:]
    before = set(kv.cached_block_hashes())
    kv.cache_blocks(a, a.num_computed_tokens)  # re-registers the swapped-in full blocks only
    assert kv.block_pool.null_block.block_hash is None
    assert len(set(kv.cached_block_hashes()) - before) <= len(ids) - skipped
    kv.free(a)
    assert kv.num_used_blocks == 0 and kv.block_pool.null_block.ref_cnt == 1
