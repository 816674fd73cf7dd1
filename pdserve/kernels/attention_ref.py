"""PyTorch reference attention over a paged KV cache: the CPU path and the oracle for the Triton kernels.

Layout (docs/design.md §2, vLLM's): one K and one V pool per layer, each
``[num_blocks, block_size, num_kv_heads, head_dim]``. Grouped-query attention: query head ``h`` reads
KV head ``h // (num_heads // num_kv_heads)``.

Algorithm: PagedAttention (Kwon et al., SOSP 2023) semantics, computed the plain way: gather each
sequence's K/V through its block table, then scaled dot-product attention with a causal mask offset
by the cached context. Decodes (query_len == 1) are batched into one padded SDPA call and prefill
chunks into another. Gather indices and masks are built once per step (``AttentionMetadata.cache``).
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


def _group_plan(md: AttentionMetadata, seqs: list[int], sliding_window: int | None = None):
    """Gather indices and masks for one padded SDPA call over the sequences ``seqs``; with ``sliding_window``
    ``W`` a query at position ``q`` sees keys ``q - W < k <= q`` only.

    Returns ``(key_slots [n*max_ctx], mask [n, 1, max_q, max_ctx], query_rows [n*max_q],
    out_sel [m], out_rows [m] | None, n, max_q, max_ctx)``. Padded keys read the null block and are
    masked; padded query rows attend to key 0 only (finite, then dropped by ``out_sel``).
    ``out_rows`` is ``None`` when the group's rows are exactly the step's tokens in order.
    """
    key = ("ref_plan", tuple(seqs), sliding_window)
    plan = md.cache.get(key)
    if plan is not None:
        return plan
    device = md.block_tables.device
    qlens = [md.query_lens_cpu[s] for s in seqs]
    ctxs = [md.seq_lens_cpu[s] for s in seqs]
    qsl = md.cache["qsl"]
    n, max_q, max_ctx = len(seqs), max(qlens), max(ctxs)
    idx = torch.tensor(seqs, device=device)
    pos = torch.arange(max_ctx, device=device)
    tables = md.block_tables.index_select(0, idx).long()
    blk = tables.gather(1, (pos // md.block_size).clamp(max=tables.shape[1] - 1).expand(n, -1))
    ctx_t = torch.tensor(ctxs, device=device)
    q_t = torch.tensor(qlens, device=device)
    valid_k = pos[None, :] < ctx_t[:, None]  # [n, max_ctx]
    slots = torch.where(valid_k, blk * md.block_size + pos % md.block_size, torch.zeros_like(blk))
    i = torch.arange(max_q, device=device)
    real_q = i[None, :] < q_t[:, None]  # [n, max_q]
    qpos = (ctx_t - q_t)[:, None] + i[None, :]  # position of query row i
    mask = valid_k[:, None, :] & (pos[None, None, :] <= qpos[:, :, None]) & real_q[:, :, None]
    if sliding_window is not None:
        mask &= pos[None, None, :] > qpos[:, :, None] - sliding_window
    mask[:, :, 0] |= ~real_q  # padded query rows: attend to key 0 only
    starts = torch.tensor([qsl[s] for s in seqs], device=device)
    query_rows = (starts[:, None] + torch.minimum(i[None, :], q_t[:, None] - 1)).reshape(-1)
    out_sel = real_q.reshape(-1).nonzero().squeeze(1)
    out_rows = query_rows.index_select(0, out_sel)
    if len(out_rows) == md.num_tokens and bool((out_rows == torch.arange(md.num_tokens, device=device)).all()):
        out_rows = None
    plan = (slots.reshape(-1), mask[:, None], query_rows, out_sel, out_rows, n, max_q, max_ctx)
    md.cache[key] = plan
    return plan


def paged_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of a step's query tokens over their sequences' paged K/V; with ``sliding_window`` ``W``
    (tokens), over the last ``W`` positions only, the query's own included (transformers'
    ``sliding_window_overlay``: key ``k`` is seen from query ``q`` when ``q - W < k <= q``).

    query: [num_tokens, num_heads, head_dim]; returns [num_tokens, num_heads, head_dim] in query's
    dtype. The step's own K/V must already be in the cache (``reshape_and_cache_ref`` first).
    Sequences with ``query_len == 0`` are skipped. Decodes go in one padded SDPA call and prefill
    chunks in another (padding a decode to a long chunk's length would waste its compute); the
    padding costs little because attention is a small share of a step's FLOPs at these lengths.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    gqa = num_heads != num_kv_heads
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    if "qsl" not in md.cache:
        md.cache["qsl"] = md.query_start_loc.tolist()
    groups = md.cache.get("ref_groups")
    if groups is None:
        decodes = [s for s, q in enumerate(md.query_lens_cpu) if q == 1]
        prefills = [s for s, q in enumerate(md.query_lens_cpu) if q > 1]
        groups = md.cache["ref_groups"] = [g for g in (decodes, prefills) if g]
    out = None
    for seqs in groups:
        slots, mask, query_rows, out_sel, out_rows, n, max_q, max_ctx = _group_plan(md, seqs, sliding_window)
        # index_select, not advanced indexing: ~10x faster gathers on CPU
        k = flat_k.index_select(0, slots).view(n, max_ctx, num_kv_heads, head_dim).transpose(1, 2)
        v = flat_v.index_select(0, slots).view(n, max_ctx, num_kv_heads, head_dim).transpose(1, 2)
        q = query.index_select(0, query_rows).view(n, max_q, num_heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        o = o.transpose(1, 2).reshape(n * max_q, num_heads, head_dim)
        if len(out_sel) != n * max_q:
            o = o.index_select(0, out_sel)
        if out_rows is None:
            return o
        if out is None:
            out = torch.empty_like(query)
        out.index_copy_(0, out_rows, o)
    return out if out is not None else torch.empty_like(query)
