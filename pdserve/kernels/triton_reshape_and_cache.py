"""Triton twin of ``reshape_and_cache_ref``: scatter a step's new K/V into their paged-cache slots.

One program per token copies that token's ``num_kv_heads * head_dim`` K and V elements to slot
``slot_mapping[t]``; a slot of ``-1`` (padding) is skipped. Same contract as vLLM's
``reshape_and_cache_flash`` for the NHD layout ``[num_blocks, block_size, num_kv_heads, head_dim]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton_common import check_cache, check_device, next_power_of_2


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_slot,  # num_kv_heads * head_dim: the cache is contiguous, so slot ids index it flat
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    src_k = key_ptr + token.to(tl.int64) * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = value_ptr + token.to(tl.int64) * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst = slot * stride_cache_slot + offs_h[:, None] * stride_cache_head + offs_d[None, :]
    tl.store(k_cache_ptr + dst, tl.load(src_k, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(src_v, mask=mask), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K and V into its slot (in place).

    key, value:  [num_tokens, num_kv_heads, head_dim], same dtype as the cache; any token/head strides
                 (e.g. views into a fused QKV projection), head_dim contiguous.
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous blocks.
    slot_mapping: [num_tokens] integer, ``block_id * block_size + offset``; ``-1`` marks padding.
    Raises ValueError on mismatched shapes or dtypes. Slots are not bounds-checked (as in vLLM).
    """
    check_cache(k_cache, v_cache)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if key.shape != value.shape or key.dim() != 3 or tuple(key.shape[1:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"key and value must be [num_tokens, {num_kv_heads}, {head_dim}], got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if key.dtype != k_cache.dtype or value.dtype != k_cache.dtype:
        raise ValueError(f"key/value dtype {key.dtype}/{value.dtype} != cache dtype {k_cache.dtype}")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    check_device(_reshape_and_cache_kernel, key, value, k_cache, v_cache, slot_mapping)
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_dim),
        num_warps=1 if num_kv_heads * head_dim <= 256 else 4,
    )
