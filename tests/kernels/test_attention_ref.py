"""The PyTorch reference attention equals dense causal attention computed from contiguous K/V, with and without a
sliding window (masked as transformers' ``sliding_window_overlay`` masks it)."""

import math

import pytest
import torch

from pdserve.kernels.attention_metadata import AttentionMetadata
from pdserve.kernels.attention_ref import paged_attention_ref, reshape_and_cache_ref


def dense_attention(q, k, v, q_pos, scale, sliding_window=None):
    """q: [q_len, H, D]; k, v: [ctx, Hkv, D]; plain softmax(QK^T)V with a causal mask, fp64; with
    ``sliding_window``, transformers' own window rule on top."""
    h, hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(h // hkv, dim=1).double()
    v = v.repeat_interleave(h // hkv, dim=1).double()
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    mask = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        from transformers.masking_utils import sliding_window_overlay

        mask &= sliding_window_overlay(sliding_window)(0, 0, q_pos[:, None], torch.arange(k.shape[0])[None, :])
    s = s.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


# (context before this step, query tokens this step), in units of block_size where noted
MIXED = "mixed"
BATCHES = {
    # decodes, a fresh prefill, a chunk after a cached prefix that starts mid-block, one block-aligned
    MIXED: lambda bs: [(5, 1), (0, 17), (bs + 3, 20), (2 * bs, 1), (0, 1), (bs, bs)],
    "decodes_only": lambda bs: [(5, 1), (bs - 1, 1), (3 * bs, 1)],
    "one_prefill": lambda bs: [(bs + 7, 30)],
    "prefills_then_decode": lambda bs: [(0, 3), (2, 40), (bs * 2 + 1, 1)],
}


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("sliding_window", [None, 7])
def test_batch_matches_dense_attention(batch, block_size, num_heads, num_kv_heads, sliding_window):
    g = torch.Generator().manual_seed(0)
    head_dim, num_blocks = 64, 64
    seqs = BATCHES[batch](block_size)
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    k_cache[0] = 0  # block 0 is the null block: never allocated, kept zero
    v_cache[0] = 0
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # scattered block ids
    tables, full_k, full_v = [], [], []
    for ctx, q_len in seqs:
        n = math.ceil((ctx + q_len) / block_size)
        tables.append([free.pop() for _ in range(n)])
        full_k.append(torch.randn(ctx + q_len, num_kv_heads, head_dim, generator=g))
        full_v.append(torch.randn(ctx + q_len, num_kv_heads, head_dim, generator=g))
    # the cached context is already in place
    for (ctx, _), t, k, v in zip(seqs, tables, full_k, full_v):
        slots = torch.tensor([t[p // block_size] * block_size + p % block_size for p in range(ctx)], dtype=torch.long)
        reshape_and_cache_ref(k[:ctx], v[:ctx], k_cache, v_cache, slots)
    max_blocks = max(len(t) for t in tables)
    q_lens = [q for _, q in seqs]
    md = AttentionMetadata(
        slot_mapping=torch.tensor(
            [t[p // block_size] * block_size + p % block_size for (ctx, q), t in zip(seqs, tables) for p in range(ctx, ctx + q)]
        ),
        block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32),
        seq_lens=torch.tensor([c + q for c, q in seqs], dtype=torch.int32),
        query_start_loc=torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32),
        query_lens_cpu=q_lens,
        seq_lens_cpu=[c + q for c, q in seqs],
        block_size=block_size,
    )
    new_k = torch.cat([k[c:] for (c, _), k in zip(seqs, full_k)])
    new_v = torch.cat([v[c:] for (c, _), v in zip(seqs, full_v)])
    reshape_and_cache_ref(new_k, new_v, k_cache, v_cache, md.slot_mapping)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=g)
    scale = head_dim**-0.5
    out = paged_attention_ref(query, k_cache, v_cache, md, scale, sliding_window)
    start = 0
    for (ctx, q_len), k, v in zip(seqs, full_k, full_v):
        want = dense_attention(query[start : start + q_len], k, v, torch.arange(ctx, ctx + q_len), scale,
                               sliding_window)
        torch.testing.assert_close(out[start : start + q_len].double(), want, rtol=1e-4, atol=1e-4)
        start += q_len


def test_padding_slots_are_skipped():
    k_cache = torch.zeros(2, 4, 1, 2)
    v_cache = torch.zeros(2, 4, 1, 2)
    key = torch.ones(3, 1, 2)
    reshape_and_cache_ref(key, key * 2, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert k_cache.view(-1, 1, 2)[[0, 5]].eq(1).all()
    assert k_cache.view(-1, 1, 2).abs().sum() == 4  # only slots 0 and 5 were written
    assert v_cache.view(-1, 1, 2)[5].eq(2).all()
