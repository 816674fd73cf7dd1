"""Random paged-attention steps for the Triton kernel tests (shared by the test modules).

A step is a list of ``(cached, q_len)`` pairs: ``cached`` tokens already in the cache (a prefix hit or
earlier chunks), ``q_len`` new query tokens. The cache is poisoned with NaN everywhere except the null
block 0, block ids are scattered, and the cached context is written with the reference writer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pdserve.kernels.attention_metadata import AttentionMetadata
from pdserve.kernels.attention_ref import reshape_and_cache_ref

# ‖out − ref‖ / ‖ref‖ allowed per dtype: the reference itself rounds in the low-precision dtypes.
REL_TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}


@dataclass
class Step:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    md: AttentionMetadata
    key: torch.Tensor  # this step's new K/V, [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]

    def fresh_md(self) -> AttentionMetadata:
        """The same metadata with an empty per-step cache (so each backend builds its own)."""
        md = self.md
        return AttentionMetadata(
            md.slot_mapping, md.block_tables, md.seq_lens, md.query_start_loc,
            list(md.query_lens_cpu), list(md.seq_lens_cpu), md.block_size,
        )


def make_step(
    seqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    spare_blocks: int = 7,
) -> Step:
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil((c + q) / block_size) for c, q in seqs]
    num_blocks = 1 + sum(blocks_per_seq) + spare_blocks
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    k_cache[0] = 0  # the null block: never allocated, kept zero
    v_cache[0] = 0
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = [[free.pop() for _ in range(n)] for n in blocks_per_seq]

    def slots(table, lo, hi):
        return [table[p // block_size] * block_size + p % block_size for p in range(lo, hi)]

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    for (cached, _), table in zip(seqs, tables):
        if cached:
            reshape_and_cache_ref(
                rand(cached, num_kv_heads, head_dim), rand(cached, num_kv_heads, head_dim),
                k_cache, v_cache, torch.tensor(slots(table, 0, cached)),
            )
    max_blocks = max(blocks_per_seq) + 2  # padded with the null block, as the runner does
    q_lens = [q for _, q in seqs]
    seq_lens = [c + q for c, q in seqs]
    num_tokens = sum(q_lens)
    md = AttentionMetadata(
        slot_mapping=torch.tensor([s for (c, q), t in zip(seqs, tables) for s in slots(t, c, c + q)], dtype=torch.int64),
        block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32),
        query_lens_cpu=q_lens,
        seq_lens_cpu=seq_lens,
        block_size=block_size,
    )
    return Step(
        k_cache, v_cache, md,
        rand(num_tokens, num_kv_heads, head_dim), rand(num_tokens, num_kv_heads, head_dim),
        rand(num_tokens, num_heads, head_dim),
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def drop_blocks_outside_window(step: Step, window: int) -> int:
    """Point every block-table entry wholly before all of its sequence's query rows' windows at a NaN-poisoned block
    (what freeing such blocks would leave there), so a kernel that reads one returns NaN. Returns how many entries
    were dropped (a test that drops none proves nothing). Call after the step's K/V are written."""
    used = set(step.md.block_tables.flatten().tolist()) | {0}
    nan_block = next(b for b in range(step.k_cache.shape[0]) if b not in used)  # a spare block: never written, NaN
    assert step.k_cache[nan_block].isnan().all()
    dropped = 0
    for s, (q_len, seq_len) in enumerate(zip(step.md.query_lens_cpu, step.md.seq_lens_cpu)):
        first_pos = seq_len - q_len  # the sequence's first query row; later rows' windows start later
        for b in range(max(0, first_pos - window + 1) // step.md.block_size):
            step.md.block_tables[s, b] = nan_block
            dropped += 1
    return dropped
