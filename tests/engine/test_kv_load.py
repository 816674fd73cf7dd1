"""Loads from an offloading tier that overlap the step (``kv_load.py``), on ``KVCacheManager`` and a real CPU tier
over a tensor pool (no model): a load pins its blocks until it is done, two requests share one load, and a request
aborted while its load runs gets its blocks back only once the loader is finished with them."""

from __future__ import annotations

import threading

import torch

from pdserve.shared.engine.kv_cache_manager import KVCacheManager
from pdserve.shared.engine.kv_offload import CPUTier, KVOffloadManager
from pdserve.shared.engine.request import Request
from pdserve.shared.protocol.block_hash import compute_block_hashes
from pdserve.shared.protocol.sampling_params import SamplingParams

BLOCK = 4


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), 4, frozenset())


def manager_with_gated_tier(num_blocks: int = 8):
    """A manager whose evicted blocks go to a CPU tier over ``pool`` (one float per block), and whose loads wait
    for ``gate``."""
    pool = torch.zeros(num_blocks)
    gate = threading.Event()

    def write(block_id, data):
        assert gate.wait(10)
        pool[block_id] = data

    kv = KVCacheManager(num_blocks, BLOCK)
    kv.set_offload(KVOffloadManager(CPUTier(16), None, lambda block_id: pool[block_id].clone(), write, BLOCK))
    return kv, pool, gate


def compute_and_evict(kv: KVCacheManager, pool: torch.Tensor, tokens: list[int]) -> None:
    r = req("warm", tokens)
    computed, n = kv.get_computed_blocks(r)
    kv.allocate_slots(r, r.num_tokens - n, computed)
    for i, block_id in enumerate(kv.get_block_ids("warm")):
        pool[block_id] = 100 + i
    kv.free(r)
    filler = req("filler", list(range(1000, 1000 + BLOCK * (kv.num_free_blocks - 1))) + [0])
    kv.allocate_slots(filler, filler.num_tokens)  # evicts every cached block into the tier
    kv.free(filler)
    hashes = compute_block_hashes(tokens, BLOCK, None)
    assert [kv.offload.tier_of(h) for h in hashes] == ["cpu", "cpu"] and not set(hashes) & set(kv.cached_block_hashes())


def test_a_load_pins_its_blocks_until_done_then_the_prefix_is_a_device_hit():
    kv, pool, gate = manager_with_gated_tier()
    tokens = list(range(9))  # 2 full blocks can hit
    compute_and_evict(kv, pool, tokens)
    a, b = req("a", tokens), req("b", tokens)
    free_before = kv.num_free_blocks
    assert kv.is_loading(a) and kv.num_free_blocks == free_before - 2
    assert kv.is_loading(b)  # b waits for a's load instead of loading the same blocks again
    assert kv.loads.num_loads == 1
    gate.set()
    kv.loads.wait_any(10)
    assert not kv.is_loading(a) and not kv.is_loading(b)
    blocks, num_computed = kv.get_computed_blocks(a)
    assert num_computed == 8 and [pool[blk.block_id].item() for blk in blocks] == [100, 101]


def test_a_request_aborted_while_loading_frees_its_blocks_only_after_the_loader_is_done():
    kv, pool, gate = manager_with_gated_tier()
    compute_and_evict(kv, pool, list(range(9)))
    a = req("a", list(range(9)))
    free_before = kv.num_free_blocks
    assert kv.is_loading(a)
    kv.free(a)  # aborted: the loader may still be writing its blocks
    kv.reap_loads()
    assert kv.num_free_blocks == free_before - 2 and len(kv.loads) == 1
    gate.set()
    kv.loads.wait_any(10)
    kv.reap_loads()
    assert kv.num_free_blocks == free_before and not kv.loads


def test_a_reservation_counts_tier_blocks_as_cached_at_once_and_they_enter_the_cache_when_loaded():
    """A decode pod's reservation (``get_reserved_blocks``) answers before its load: the tier's blocks count as
    cached (the sender skips them) while the loader is still held back; a done load is completed by the next
    reap, and ``finish_load`` says every block arrived."""
    kv, pool, gate = manager_with_gated_tier()
    tokens = list(range(9))
    compute_and_evict(kv, pool, tokens)
    r = req("d", tokens)
    blocks, num_loading = kv.get_reserved_blocks(r)
    assert len(blocks) == 2 and num_loading == 2 and kv.finish_load("d") is None
    assert kv.allocate_slots(r, r.num_tokens - 8, blocks, cache=False) is not None
    gate.set()
    kv.loads.wait_any(10)
    kv.reap_loads()
    assert not kv.loads and kv.finish_load("d") == 2
    hits, n = kv.get_computed_blocks(req("e", tokens))
    assert n == 8 and hits == blocks and [pool[b.block_id].item() for b in hits] == [100, 101]
    kv.free(r)


def test_a_reservation_given_up_while_loading_returns_every_block_once_the_loader_is_done():
    kv, pool, gate = manager_with_gated_tier()
    tokens = list(range(9))
    compute_and_evict(kv, pool, tokens)
    free_before = kv.num_free_blocks
    r = req("d", tokens)
    blocks, _ = kv.get_reserved_blocks(r)
    kv.allocate_slots(r, r.num_tokens - 8, blocks, cache=False)
    kv.free(r)  # released (lease expired, aborted): the loader may still be writing two of its blocks
    assert kv.num_free_blocks == free_before - 2
    gate.set()
    kv.loads.wait_any(10)
    kv.reap_loads()
    assert kv.num_free_blocks == free_before and not kv.loads and not kv.loads.finished
    assert kv.get_computed_blocks(req("e", tokens))[1] == 8  # what was loaded is kept in the prefix cache
