"""``plan_kv_cache`` sizes the KV pools from the config alone (no model): which setting wins, the default that
holds one full-length sequence, the context limit that follows, and the errors for what cannot fit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.kv_cache import KVCacheSpec
from pdserve.shared.engine.kv_plan import DEFAULT_KV_CACHE_BYTES, plan_kv_cache

# 2 layers x 2 (K, V) x 16 tokens x 2 heads x 8 dims x 4 bytes = 4 KiB per block
SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype=torch.float32)
MODEL = SimpleNamespace(max_position_embeddings=2048)


def test_a_block_is_k_and_v_of_every_layer():
    assert SPEC.bytes_per_block == 2 * 2 * 16 * 2 * 8 * 4 == 4096
    mc = SimpleNamespace(num_hidden_layers=3, num_key_value_heads=2, hidden_size=64, num_attention_heads=4)
    assert KVCacheSpec.from_model_config(mc, 16, torch.float32).head_dim == 16


def test_num_kv_blocks_wins_over_memory():
    plan = plan_kv_cache(EngineConfig(num_kv_blocks=9, kv_cache_memory_bytes="1MiB"), MODEL, SPEC)
    assert (plan.num_blocks, plan.num_cpu_blocks, plan.max_model_len) == (9, 0, 8 * 16)


def test_memory_buys_whole_blocks_plus_the_null_block():
    plan = plan_kv_cache(EngineConfig(kv_cache_memory_bytes=10 * 4096 + 100), MODEL, SPEC)
    assert plan.num_blocks == 11 and plan.max_model_len == 160


def test_default_is_256_mib_or_one_full_length_sequence():
    plan = plan_kv_cache(EngineConfig(), MODEL, SPEC)
    assert plan.num_blocks == 1 + DEFAULT_KV_CACHE_BYTES // 4096
    assert plan.max_model_len == 2048  # the model's limit: the pool holds far more
    huge = SimpleNamespace(max_position_embeddings=2**30)
    plan = plan_kv_cache(EngineConfig(), huge, SPEC)
    assert plan.num_blocks == 1 + 2**30 // 16 and plan.max_model_len == 2**30
    plan = plan_kv_cache(EngineConfig(max_model_len=100), SimpleNamespace(), SPEC)  # no positions: 8192
    assert plan.num_blocks == 1 + DEFAULT_KV_CACHE_BYTES // 4096 and plan.max_model_len == 100


def test_a_draft_models_kv_shares_the_memory():
    # a block costs 4096 (target) + 1024 (draft) bytes: 10 * 5120 + 100 bytes buy 10 blocks, not 12
    plan = plan_kv_cache(EngineConfig(kv_cache_memory_bytes=10 * 5120 + 100), MODEL, SPEC, draft_bytes_per_block=1024)
    assert plan.num_blocks == 11 and plan.max_model_len == 160
    assert plan_kv_cache(EngineConfig(), MODEL, SPEC, 1024).num_blocks == 1 + DEFAULT_KV_CACHE_BYTES // 5120
    assert plan_kv_cache(EngineConfig(num_kv_blocks=9), MODEL, SPEC, 1024).num_blocks == 9  # explicit: as asked
    with pytest.raises(ValueError, match=r"^kv_cache_memory_bytes=5119 holds no KV block \(5120 bytes each with "
                                         r"the draft model's 1024\)$"):
        plan_kv_cache(EngineConfig(kv_cache_memory_bytes=5119), MODEL, SPEC, 1024)


def test_the_swap_pool_exists_only_under_swap_preemption():
    swap = EngineConfig(num_kv_blocks=9, preemption_mode="swap", swap_space_bytes="40KiB")
    assert plan_kv_cache(swap, MODEL, SPEC).num_cpu_blocks == 10
    assert plan_kv_cache(EngineConfig(num_kv_blocks=9, swap_space_bytes="40KiB"), MODEL, SPEC).num_cpu_blocks == 0


def test_what_cannot_fit_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"^kv_cache_memory_bytes=4095 holds no KV block \(4096 bytes each\)$"):
        plan_kv_cache(EngineConfig(kv_cache_memory_bytes=4095), MODEL, SPEC)
    with pytest.raises(ValueError, match=r"^max_model_len=4096 exceeds the model's max_position_embeddings=2048$"):
        plan_kv_cache(EngineConfig(max_model_len=4096), MODEL, SPEC)
    with pytest.raises(ValueError, match=r"does not fit in the KV cache \(4 blocks x 16 = 64 tokens\)"):
        plan_kv_cache(EngineConfig(num_kv_blocks=5, max_model_len=65), MODEL, SPEC)
    assert plan_kv_cache(EngineConfig(num_kv_blocks=5, max_model_len=64), MODEL, SPEC).max_model_len == 64


@pytest.mark.parametrize("dtype,device,want", [
    ("auto", "cpu", torch.float32), ("auto", "cuda:0", torch.bfloat16), ("bf16", "cpu", torch.bfloat16),
    ("fp16", "cpu", torch.float16), ("float32", "cuda", torch.float32)])
def test_dtype_names_the_kv_and_weight_dtype(dtype, device, want):
    assert EngineConfig(dtype=dtype, device=device).torch_dtype() is want
