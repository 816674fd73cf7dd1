"""Triton paged attention for prefill chunks: variable-length causal queries over paged K/V.

Algorithm: FlashAttention-2's tiled online softmax (Dao, 2023) with K/V gathered through the block
table (PagedAttention, Kwon et al., SOSP 2023), the shape of vLLM's Triton "prefix prefill" /
unified-attention kernels. Sequence ``s`` has ``q_len = query_start_loc[s+1] - query_start_loc[s]``
query tokens at absolute positions ``seq_lens[s] - q_len ... seq_lens[s] - 1``: everything before them
(a cached prefix, earlier chunks; possibly ending mid-block) is already in the cache, as is the
chunk's own K/V. Query token at position ``p`` attends to keys ``0..p``.

Grid: (query tiles, KV heads). A tile is ``BLOCK_Q`` consecutive query tokens of one sequence times
all the query heads of one KV head (grouped-query attention packs them into the ``BLOCK_M`` rows of
one ``tl.dot``, so K/V is loaded once for the group). The tile list is built on the host from
``query_lens_cpu`` once per step, so no program is launched for nothing. fp32 accumulation.
Any ``query_len >= 1`` works, decodes included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve.kernels.attention_metadata import AttentionMetadata
from pdserve.kernels.triton_common import (
    check_cache,
    check_device,
    check_out,
    check_query,
    dot_in_fp32,
    is_interpreted,
    next_power_of_2,
)

LOG2E = 1.4426950408889634


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    """Launch parameters (``pdserve/kernels/bench.py --sweep`` times alternatives on a GPU).

    block_m: query rows (tokens x query heads of one KV head) per program, at least the group size;
    block_n: keys per inner-loop tile; num_warps / num_stages: Triton's launch options.
    """

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


def default_prefill_config(dtype: torch.dtype) -> PrefillConfig:
    # fp32 tiles are twice the bytes: halve the key tile to stay within shared memory
    return PrefillConfig(block_n=32) if dtype == torch.float32 else PrefillConfig()


@triton.jit
def _prefill_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    tile_seq_ptr,
    tile_q0_ptr,
    scale_log2,
    window,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    QUERIES_PER_KV: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP32_DOT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    q0 = tl.load(tile_q0_ptr + tile)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len  # tokens before this chunk

    # row r = (query token q0 + r // GROUP_PAD, query head kv_head * QUERIES_PER_KV + r % GROUP_PAD)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    qi = q0 + offs_m // GROUP_PAD
    gi = offs_m % GROUP_PAD
    row_mask = (qi < q_len) & (gi < QUERIES_PER_KV)
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * QUERIES_PER_KV + gi
    rows = (q_begin + qi).to(tl.int64)
    q = tl.load(
        query_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if FP32_DOT:
        q = q.to(tl.float32)
    q_pos = ctx + qi

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # causal: the tile's last query token sees keys up to its own position
    kv_end = ctx + tl.minimum(q0 + BLOCK_Q, q_len)
    # a sliding window (q - W < k <= q): the tile's first query token sees keys from ctx + q0 - W + 1 on, later
    # tokens from later still; blocks before that are never read
    if HAS_WINDOW:
        kv_start = tl.maximum(ctx + q0 - window + 1, 0)
    else:
        kv_start = 0
    for n0 in range(kv_start, kv_end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < kv_end
        blk = tl.load(table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        off = pos % BLOCK_SIZE
        k = tl.load(  # [BLOCK_D, BLOCK_N]: K^T
            k_cache_ptr + blk[None, :] * stride_kb + off[None, :] * stride_ks + kv_head * stride_kh + offs_d[:, None],
            mask=d_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        v = tl.load(  # [BLOCK_N, BLOCK_D]
            v_cache_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        if FP32_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        # key 0 is visible to every row, so each row's max is finite after the first tile -- unless a window
        # hides a whole tile from a row: its max stays -inf, and the exponentials are taken against 0 instead
        # (giving 0, not the NaN of -inf - -inf)
        visible = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
        if HAS_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if HAS_WINDOW:
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_ref = m_new
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if HAS_WINDOW:  # a padding row past the chunk may see no key in its window (l = 0; it is not stored)
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def _tiles(md: AttentionMetadata, seq_ids: tuple[int, ...], block_q: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    key = ("triton_prefill_tiles", seq_ids, block_q)
    tiles = md.cache.get(key)
    if tiles is None:
        seqs, q0s = [], []
        for s in seq_ids:
            for q0 in range(0, md.query_lens_cpu[s], block_q):
                seqs.append(s)
                q0s.append(q0)
        both = torch.tensor([seqs, q0s], dtype=torch.int32, device=device)
        tiles = md.cache[key] = (both[0], both[1])
    return tiles


def paged_attention_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    seq_ids: list[int] | None = None,
    config: PrefillConfig | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's query chunk over its paged K/V (cached prefix included); with
    ``sliding_window`` ``W`` a query at position ``q`` sees keys ``q - W < k <= q`` only.

    query:   [num_tokens, num_heads, head_dim], cache dtype; head_dim contiguous.
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] (fp32, fp16 or bf16), the
             step's own K/V already written.
    md:      step metadata (``query_start_loc``, ``seq_lens``, ``block_tables``, ``query_lens_cpu``).
    seq_ids: sequences to compute; default all with ``query_len >= 1``.
    out:     [num_tokens, num_heads, head_dim] to write rows into; default a new tensor (rows of
             sequences not computed are left uninitialised).
    config:  tile and launch parameters; default ``default_prefill_config(dtype)``.
    Returns ``out``. Alone it is a drop-in for ``paged_attention_ref``. Raises ValueError on
    inconsistent shapes, dtypes or metadata.
    """
    check_cache(k_cache, v_cache)
    check_query(query, k_cache)
    if query.stride(-1) != 1:
        query = query.contiguous()
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if block_size != md.block_size:
        raise ValueError(f"cache block_size {block_size} != metadata block_size {md.block_size}")
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    check_out(out, query)
    if seq_ids is None:
        seq_ids = [s for s, q in enumerate(md.query_lens_cpu) if q > 0]
    if not seq_ids:
        return out
    check_device(_prefill_kernel, query, k_cache, md.block_tables)
    queries_per_kv = num_heads // num_kv_heads
    group_pad = next_power_of_2(queries_per_kv)
    config = config or default_prefill_config(k_cache.dtype)
    block_m = max(config.block_m, group_pad, 16)
    block_q = block_m // group_pad
    tile_seq, tile_q0 = _tiles(md, tuple(seq_ids), block_q, query.device)
    _prefill_kernel[(tile_seq.shape[0], num_kv_heads)](
        query,
        k_cache,
        v_cache,
        out,
        md.block_tables,
        md.seq_lens,
        md.query_start_loc,
        tile_seq,
        tile_q0,
        scale * LOG2E,
        int(sliding_window or 0),
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        md.block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        QUERIES_PER_KV=queries_per_kv,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_power_of_2(head_dim)),
        BLOCK_N=config.block_n,
        BLOCK_SIZE=block_size,
        FP32_DOT=dot_in_fp32(k_cache.dtype, is_interpreted(_prefill_kernel)),
        HAS_WINDOW=sliding_window is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
