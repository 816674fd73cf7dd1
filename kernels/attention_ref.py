"""PyTorch reference attention over a paged KV cache: the CPU path and the oracle for the Triton kernels.

Layout (DESIGN.md §2, vLLM's): one K and one V pool per layer, each
``[num_blocks, block_size, num_kv_heads, head_dim]``. Grouped-query attention: query head ``h`` reads
KV head ``h // (num_heads // num_kv_heads)``.

Algorithm: PagedAttention (Kwon et al., SOSP 2023) semantics, computed the plain way: gather each
sequence's K/V through its block table, then scaled dot-product attention with a causal mask offset
by the cached context. Decodes (query_len == 1) are batched into one SDPA call; prefill chunks run one
SDPA call each. Gather indices and masks are built once per step (``AttentionMetadata.cache``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels.attention_metadata import AttentionMetadata


def reshape_and_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K and V into its slot.

    key, value:  [num_tokens, num_kv_heads, head_dim], same dtype as the cache.
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], written in place.
    slot_mapping: [num_tokens] int64, ``block_id * block_size + offset``; ``-1`` marks padding (skipped).
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    valid = slot_mapping >= 0
    if bool(valid.all()):
        flat_k.index_copy_(0, slot_mapping, key)
        flat_v.index_copy_(0, slot_mapping, value)
    else:
        slots = slot_mapping[valid]
        flat_k.index_copy_(0, slots, key[valid])
        flat_v.index_copy_(0, slots, value[valid])


def _token_slots(block_table_row: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(length, device=block_table_row.device)
    return block_table_row[pos // block_size].long() * block_size + pos % block_size


def _decode_plan(md: AttentionMetadata, decode_seqs: list[int]):
    """Gather index [n, max_len] and key-padding mask [n, 1, 1, max_len] for the batched decodes."""
    key = ("ref_decode", tuple(decode_seqs))
    plan = md.cache.get(key)
    if plan is None:
        lens = [md.seq_lens_cpu[s] for s in decode_seqs]
        max_len = max(lens)
        device = md.block_tables.device
        idx = torch.tensor(decode_seqs, device=device)
        pos = torch.arange(max_len, device=device)
        tables = md.block_tables[idx].long()
        nblk = tables.shape[1]
        blk = tables.gather(1, (pos // md.block_size).clamp(max=nblk - 1).expand(len(decode_seqs), -1))
        slots = blk * md.block_size + pos % md.block_size
        lens_t = torch.tensor(lens, device=device)
        valid = pos[None, :] < lens_t[:, None]
        slots = torch.where(valid, slots, torch.zeros_like(slots))  # padding reads the null block
        q_rows = md.query_start_loc[idx].long()
        all_decode = len(decode_seqs) == md.num_seqs
        plan = (slots.reshape(-1), valid[:, None, None, :], None if all_decode else q_rows, len(decode_seqs), max_len)
        md.cache[key] = plan
    return plan


def paged_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a step's query tokens over their sequences' paged K/V.

    query: [num_tokens, num_heads, head_dim]; returns [num_tokens, num_heads, head_dim] in query's
    dtype. The step's own K/V must already be in the cache (``reshape_and_cache_ref`` first).
    Sequences with ``query_len == 0`` are skipped.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    gqa = num_heads != num_kv_heads
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    out = torch.empty_like(query)
    qsl = md.query_start_loc.tolist() if "qsl" not in md.cache else md.cache["qsl"]
    md.cache["qsl"] = qsl

    decode_seqs = [s for s, q in enumerate(md.query_lens_cpu) if q == 1]
    if decode_seqs:
        # index_select, not advanced indexing: ~10x faster gathers on CPU
        slots, mask, q_rows, n, max_len = _decode_plan(md, decode_seqs)
        k = flat_k.index_select(0, slots).view(n, max_len, num_kv_heads, head_dim).transpose(1, 2)
        v = flat_v.index_select(0, slots).view(n, max_len, num_kv_heads, head_dim).transpose(1, 2)
        q = (query if q_rows is None else query.index_select(0, q_rows)).unsqueeze(2)  # [n, H, 1, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa).squeeze(2)
        if q_rows is None:
            out = o
        else:
            out.index_copy_(0, q_rows, o)

    for s, q_len in enumerate(md.query_lens_cpu):
        if q_len <= 1:
            continue
        ctx = md.seq_lens_cpu[s]
        start = qsl[s]
        slots = md.cache.get(("ref_slots", s))
        if slots is None:
            slots = _token_slots(md.block_tables[s], ctx, md.block_size)
            md.cache[("ref_slots", s)] = slots
        k = flat_k.index_select(0, slots).transpose(0, 1).unsqueeze(0)  # [1, Hkv, ctx, D]
        v = flat_v.index_select(0, slots).transpose(0, 1).unsqueeze(0)
        q = query[start : start + q_len].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        if ctx == q_len:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            mask = md.cache.get(("ref_mask", s))
            if mask is None:
                qpos = torch.arange(ctx - q_len, ctx, device=query.device)
                mask = torch.arange(ctx, device=query.device)[None, :] <= qpos[:, None]
                md.cache[("ref_mask", s)] = mask
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[start : start + q_len] = o.squeeze(0).transpose(0, 1)
    return out
