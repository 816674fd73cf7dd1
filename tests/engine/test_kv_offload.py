"""KV offloading tiers (docs/engine.md "KV offloading tiers"): a prefix whose blocks the pool evicted comes back
from the CPU tier or the disk tier, and the output is the same as when it was computed fresh.

Oracles: the same engine computing the prompt fresh (greedy tokens equal, logprobs within float noise of a
different prefill split) and hitting the same blocks in the device pool (tokens and logprobs bit-identical: a
loaded block must hold exactly the KV that was evicted). One fp32 model for the module; each test installs its
own tiers on it (``KVCacheManager.set_offload``), and the restart test starts a second engine on the disk tier.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from pdserve import LLM, SamplingParams
from pdserve.shared.engine.kv_offload import build_offload

pytestmark = pytest.mark.slow

BLOCKS = 16  # 15 usable blocks of 16 tokens: two 120-token fillers evict everything else
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
FILL = SamplingParams(temperature=0, max_tokens=1)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM("smollm2-135m-instruct", dtype="float32", num_kv_blocks=BLOCKS, max_model_len=160,
               kv_offloading_size=0.01, kv_offloading_disk_path=str(tmp_path_factory.mktemp("kv-disk")))


def _install(llm: LLM, disk_path, cpu_gib: float = 0.01):
    """Fresh tiers on ``llm`` (an empty device prefix cache, an empty CPU tier, ``disk_path`` indexed)."""
    engine = llm.llm_engine
    assert engine.reset_prefix_cache()
    config = dataclasses.replace(engine.config, kv_offloading_size=cpu_gib,
                                 kv_offloading_disk_path=str(disk_path) if disk_path else None)
    engine.offload = build_offload(config, engine.model_dir, engine.kv_spec, engine.kv_cache)
    engine.kv_manager.set_offload(engine.offload)
    return engine.offload


def _evict_from_pool(llm: LLM, prompt: list[int], salt: str | None = None) -> None:
    for k in range(2):
        llm.generate([list(range(2000 + 300 * k, 2120 + 300 * k))], FILL)
    hashes = _hashes(llm, prompt, salt)
    pool = llm.llm_engine.kv_manager.block_pool
    assert all(pool.get_cached_block(h) is None for h in hashes), "precondition: the prompt left the pool"


def _hashes(llm: LLM, prompt: list[int], salt: str | None = None):
    from pdserve.shared.protocol.block_hash import compute_block_hashes

    return compute_block_hashes(prompt, llm.llm_engine.kv_spec.block_size, salt)


def _run(llm: LLM, prompt: list[int]):
    out = llm.generate([prompt], GREEDY)[0].outputs[0]
    return out.token_ids, [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]


def _fresh_and_device_hit(llm: LLM, prompt: list[int]):
    fresh = _run(llm, prompt)
    device_hit = _run(llm, prompt)
    assert llm.get_stats().prefix_cache_hits > 0
    return fresh, device_hit


def _assert_same(got, fresh, device_hit):
    assert got[0] == fresh[0]
    assert got == device_hit  # the loaded KV is bit-identical to what was evicted
    assert max(abs(a - b) for a, b in zip(got[1], fresh[1])) < 1e-4


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_a_prefix_loaded_back_from_a_tier_gives_the_fresh_output(llm, prompt_of, tmp_path, tier):
    offload = _install(llm, tmp_path if tier == "disk" else None, cpu_gib=0.01 if tier == "cpu" else 0)
    prompt = prompt_of(70)  # 4 full blocks, all of them hits when cached
    fresh, device_hit = _fresh_and_device_hit(llm, prompt)
    _evict_from_pool(llm, prompt)
    assert all(offload.tier_of(h) == tier for h in _hashes(llm, prompt))
    before = llm.get_stats()
    got = _run(llm, prompt)
    stats = llm.get_stats()
    _assert_same(got, fresh, device_hit)
    assert stats.offload[tier].hit_tokens - before.offload[tier].hit_tokens == 64
    assert stats.prefix_cache_hits - before.prefix_cache_hits == 64
    assert stats.prompt_tokens_computed - before.prompt_tokens_computed == 6
    assert stats.offload[tier].bytes_loaded == 4 * llm.llm_engine.kv_spec.bytes_per_block


def test_cpu_evictions_go_to_disk_and_both_tiers_load(llm, prompt_of, tmp_path):
    bpb = llm.llm_engine.kv_spec.bytes_per_block
    offload = _install(llm, tmp_path, cpu_gib=2 * bpb / 2**30)  # the CPU tier holds 2 blocks
    prompt = prompt_of(70)
    fresh, device_hit = _fresh_and_device_hit(llm, prompt)
    _evict_from_pool(llm, prompt)
    # tails are evicted first, so the CPU tier's LRU pushed them on to disk; the heads are still in CPU memory
    assert [offload.tier_of(h) for h in _hashes(llm, prompt)] == ["cpu", "cpu", "disk", "disk"]
    assert llm.get_stats().offload["cpu"].evictions > 0
    before = llm.get_stats()
    _assert_same(_run(llm, prompt), fresh, device_hit)
    stats = llm.get_stats()
    cpu, disk = (stats.offload[t].hit_tokens - before.offload[t].hit_tokens for t in ("cpu", "disk"))
    # loading a block evicts another from the pool into the CPU tier, which may push the next one to disk
    assert cpu >= 16 and disk >= 32 and cpu + disk == 64


def test_torn_and_bit_flipped_files_are_skipped_counted_and_output_stays_exact(llm, prompt_of, tmp_path):
    offload = _install(llm, tmp_path, cpu_gib=0)
    prompt = prompt_of(70)
    fresh, device_hit = _fresh_and_device_hit(llm, prompt)
    _evict_from_pool(llm, prompt)
    hashes = _hashes(llm, prompt)
    with open(tmp_path / (hashes[1].hex() + ".kv"), "r+b") as f:  # bit flip in the payload
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x10]))
    path = tmp_path / (hashes[3].hex() + ".kv")
    os.truncate(path, os.path.getsize(path) // 2)  # torn
    got = _run(llm, prompt)
    stats = llm.get_stats()
    assert got[0] == fresh[0]
    assert max(abs(a - b) for a, b in zip(got[1], fresh[1])) < 1e-4
    assert stats.offload["disk"].bad_files == 1  # the flipped block ends the hit; block 3 is never read
    assert stats.offload["disk"].blocks_loaded == 1
    assert offload.tier_of(hashes[1]) is None and not os.path.exists(tmp_path / (hashes[1].hex() + ".kv"))
    # a restarted tier sees the torn file at once (its length disagrees with its header)
    _install(llm, tmp_path, cpu_gib=0)
    assert llm.get_stats().offload["disk"].bad_files == 1


def test_two_salts_never_share_a_block_in_any_tier(llm, prompt_of, tmp_path):
    offload = _install(llm, tmp_path, cpu_gib=2 * llm.llm_engine.kv_spec.bytes_per_block / 2**30)
    prompt = prompt_of(70)
    engine = llm.llm_engine
    engine.add_request("a", prompt, GREEDY, cache_salt="tenant-a")
    while engine.has_unfinished_requests():
        engine.step()
    _evict_from_pool(llm, prompt, "tenant-a")
    assert None not in {offload.tier_of(h) for h in _hashes(llm, prompt, "tenant-a")}
    assert {offload.tier_of(h) for h in _hashes(llm, prompt, "tenant-b")} == {None}
    before = llm.get_stats()
    engine.add_request("b", prompt, GREEDY, cache_salt="tenant-b")
    while engine.has_unfinished_requests():
        engine.step()
    stats = llm.get_stats()
    assert stats.prefix_cache_hits == before.prefix_cache_hits
    assert stats.offload["disk"].blocks_loaded == before.offload["disk"].blocks_loaded


def test_a_restarted_engine_indexes_its_disk_tier_and_loads_from_it(llm, prompt_of, tmp_path):
    _install(llm, tmp_path, cpu_gib=0)
    prompt = prompt_of(70)
    fresh, device_hit = _fresh_and_device_hit(llm, prompt)
    _evict_from_pool(llm, prompt)
    restarted = LLM("smollm2-135m-instruct", dtype="float32", num_kv_blocks=BLOCKS, max_model_len=160,
                    kv_offloading_disk_path=str(tmp_path), enable_kv_events=True)
    engine = restarted.llm_engine
    stored = {h for e in engine.kv_events() if e.kind == "stored" and e.medium == "disk" for h in e.block_hashes}
    assert set(_hashes(llm, prompt)) <= stored  # re-announced on start
    got = _run(restarted, prompt)
    _assert_same(got, fresh, device_hit)
    assert restarted.get_stats().offload["disk"].hit_tokens == 64

