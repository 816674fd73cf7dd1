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
