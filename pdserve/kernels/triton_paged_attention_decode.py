"""Triton paged attention for decodes: one query token per sequence, split-K (flash-decoding).

Algorithm: PagedAttention (Kwon et al., SOSP 2023) reads K/V through the block table; flash-decoding
(Dao et al., "Flash-Decoding for long-context inference", 2023) splits each sequence's context into
``num_splits`` partitions computed by separate programs, each leaving a partial result
(running max, sum of exponentials, unnormalised output), and a second kernel merges them.

Stage 1 grid: (decode sequences, KV heads, splits). One program holds *all* query heads that share a
KV head (grouped-query attention), padded to 16 rows for ``tl.dot``, so each K/V element is loaded once
per sequence. Scores use ``exp2`` with ``scale * log2(e)`` folded in; max and sum live in that base-2
domain throughout, which both stages agree on. Accumulation is fp32.
Stage 2 grid: (decode sequences, query heads): log-sum-exp merge of the splits. With one split,
stage 1 writes the normalised output itself and stage 2 is skipped.
"""

from __future__ import annotations

import math
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
    num_sms,
)

LOG2E = 1.4426950408889634
# A partition shorter than this is not worth its partial-result traffic and reduction.
MIN_PARTITION_TOKENS = 256
MAX_SPLITS = 64
PROGRAMS_PER_SM = 8  # a first guess for H100/H200 (bench.py --sweep measures the alternatives)


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """Launch parameters of stage 1 (``pdserve/kernels/bench.py --sweep`` times alternatives on a GPU).

    block_n: context tokens per inner-loop tile; num_warps / num_stages: Triton's launch options.
    """

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


def default_decode_config(dtype: torch.dtype) -> DecodeConfig:
    # fp32 tiles are twice the bytes: halve them to stay within shared memory on A100-class parts
    return DecodeConfig(block_n=32) if dtype == torch.float32 else DecodeConfig()


@triton.jit
def _decode_partition_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    seq_ids_ptr,
    scale_log2,
    window,
    num_heads,
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
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_SEQ_IDS: tl.constexpr,
    FP32_DOT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    i = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if HAS_SEQ_IDS:
        seq = tl.load(seq_ids_ptr + i)
    else:
        seq = i
    seq_len = tl.load(seq_lens_ptr + seq)
    q_row = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    # The keys the query sees: all, or with a sliding window the last `window` (q - W < k <= q); blocks before
    # them are never read. Even split of that range, rounded to whole tiles: every split but the last is full.
    if HAS_WINDOW:
        first_key = tl.maximum(seq_len - window, 0)
    else:
        first_key = 0
    per_split = tl.cdiv(tl.cdiv(seq_len - first_key, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = first_key + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * QUERIES_PER_KV + offs_h
    h_mask = offs_h < QUERIES_PER_KV
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        query_ptr + q_row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if FP32_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        blk = tl.load(table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        off = pos % BLOCK_SIZE
        kv_mask = d_mask[:, None] & n_mask[None, :]
        k = tl.load(  # [BLOCK_D, BLOCK_N]: K^T
            k_cache_ptr + blk[None, :] * stride_kb + off[None, :] * stride_ks + kv_head * stride_kh + offs_d[:, None],
            mask=kv_mask,
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
        s = tl.where(n_mask[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + q_row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=h_mask[:, None] & d_mask[None, :],
        )
    else:
        # partials are [num_decodes, num_heads, NUM_SPLITS] (+ [HEAD_DIM] for acc), fp32
        part = (i * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_max_ptr + part, m_i, mask=h_mask)
        tl.store(part_sum_ptr + part, l_i, mask=h_mask)
        tl.store(
            part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=h_mask[:, None] & d_mask[None, :]
        )


@triton.jit
def _decode_reduce_kernel(
    out_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    query_start_loc_ptr,
    seq_ids_ptr,
    num_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_SEQ_IDS: tl.constexpr,
):
    i = tl.program_id(0)
    head = tl.program_id(1)
    if HAS_SEQ_IDS:
        seq = tl.load(seq_ids_ptr + i)
    else:
        seq = i
    q_row = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    part = (i * num_heads + head) * NUM_SPLITS + offs_s
    m = tl.load(part_max_ptr + part, mask=s_mask, other=float("-inf"))
    l = tl.load(part_sum_ptr + part, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - m_max)  # empty splits carry m = -inf, so weight 0
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + q_row * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def choose_num_splits(max_seq_len: int, num_decodes: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits per sequence: at least ``PROGRAMS_PER_SM`` programs per SM, no partition under 256 tokens.

    Several programs per SM keep enough loads in flight, and many small ones shorten the tail of
    the last wave. A power of two (it is a compile-time constant: this bounds the compiled variants).
    """
    by_len = max(1, math.ceil(max_seq_len / MIN_PARTITION_TOKENS))
    by_occupancy = max(1, math.ceil(PROGRAMS_PER_SM * num_sms(device) / max(1, num_decodes * num_kv_heads)))
    splits = min(by_len, by_occupancy, MAX_SPLITS)
    return 1 << (splits - 1).bit_length()


def _workspace(md: AttentionMetadata, n: int, num_heads: int, splits: int, head_dim: int, device) -> tuple:
    # same shapes in every layer of a step: allocate once per step
    key = ("triton_decode_ws", n, num_heads, splits, head_dim, str(device))
    ws = md.cache.get(key)
    if ws is None:
        part_max = torch.empty(n, num_heads, splits, dtype=torch.float32, device=device)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty(n, num_heads, splits, head_dim, dtype=torch.float32, device=device)
        ws = md.cache[key] = (part_max, part_sum, part_acc)
    return ws


def paged_attention_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    seq_ids: list[int] | None = None,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of each decode sequence's single query token over its paged K/V (with ``sliding_window``
    ``W``: over its last ``W`` keys only, as ``attention_ref.paged_attention_ref``).

    query:   [num_tokens, num_heads, head_dim], cache dtype; head_dim contiguous.
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] (fp32, fp16 or bf16).
    md:      step metadata; sequence ``s`` reads query row ``query_start_loc[s]``, ``seq_lens[s]`` tokens
             of context (its own K/V already written), blocks ``block_tables[s]``.
    seq_ids: the sequences to compute (each with ``query_len == 1``); default all, which then must
             all be decodes.
    out:     [num_tokens, num_heads, head_dim] to write rows into (others untouched); default a new
             tensor whose rows of other sequences are left uninitialised.
    num_splits: partitions per sequence (rounded up to a power of two); default ``choose_num_splits``.
    config:  tile and launch parameters; default ``default_decode_config(dtype)``.
    Returns ``out``. Raises ValueError on inconsistent shapes, dtypes or metadata.
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
        if any(q != 1 for q in md.query_lens_cpu):
            raise ValueError("paged_attention_decode: every sequence must have query_len 1 (or pass seq_ids)")
        seq_ids_t, n, max_len = None, md.num_seqs, md.max_seq_len
    else:
        n = len(seq_ids)
        max_len = max((md.seq_lens_cpu[s] for s in seq_ids), default=0)
        key = ("triton_decode_seq_ids", tuple(seq_ids))
        seq_ids_t = md.cache.get(key)
        if seq_ids_t is None:
            seq_ids_t = md.cache[key] = torch.tensor(seq_ids, dtype=torch.int32, device=query.device)
    if n == 0:
        return out
    check_device(_decode_partition_kernel, query, k_cache, md.block_tables)
    if num_splits is None:
        num_splits = choose_num_splits(min(max_len, sliding_window or max_len), n, num_kv_heads, query.device)
    num_splits = 1 << (max(1, num_splits) - 1).bit_length()
    queries_per_kv = num_heads // num_kv_heads
    config = config or default_decode_config(k_cache.dtype)
    if num_splits > 1:
        part_max, part_sum, part_acc = _workspace(md, n, num_heads, num_splits, head_dim, query.device)
    else:
        part_max = part_sum = part_acc = out  # unused
    seq_arg = seq_ids_t if seq_ids_t is not None else md.seq_lens  # unused pointer when HAS_SEQ_IDS is False
    _decode_partition_kernel[(n, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        out,
        part_max,
        part_sum,
        part_acc,
        md.block_tables,
        md.seq_lens,
        md.query_start_loc,
        seq_arg,
        scale * LOG2E,
        int(sliding_window or 0),
        num_heads,
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
        BLOCK_H=max(16, next_power_of_2(queries_per_kv)),
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_power_of_2(head_dim)),
        BLOCK_N=config.block_n,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        HAS_SEQ_IDS=seq_ids_t is not None,
        FP32_DOT=dot_in_fp32(k_cache.dtype, is_interpreted(_decode_partition_kernel)),
        HAS_WINDOW=sliding_window is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(n, num_heads)](
            out,
            part_max,
            part_sum,
            part_acc,
            md.query_start_loc,
            seq_arg,
            num_heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=next_power_of_2(head_dim),
            NUM_SPLITS=num_splits,
            BLOCK_S=num_splits,
            HAS_SEQ_IDS=seq_ids_t is not None,
            num_warps=1 if head_dim * num_splits <= 1024 else 4,
        )
    return out
