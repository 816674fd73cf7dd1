"""Per-step attention metadata: one small object the model runner builds and every layer reads.

Names and meanings follow vLLM v1 (``FlashAttentionMetadata``): a step is a flat batch of
``num_tokens`` query tokens from ``num_seqs`` sequences; sequence ``s`` owns query rows
``query_start_loc[s]:query_start_loc[s+1]`` and has ``seq_lens[s]`` tokens of context *including*
those query tokens, so its first query token sits at position ``seq_lens[s] - query_len[s]``.
A decode is a sequence with ``query_len == 1``; a prefill chunk (possibly after a cached prefix or
earlier chunks) has ``query_len >= 1``. Attention is causal within that frame.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Tensors (all on the KV cache's device) and their host-side twins.

    slot_mapping:    [num_tokens] int64; ``block_id * block_size + offset`` where each new token's K/V
                     is written, ``-1`` for padding tokens (skipped).
    block_tables:    [num_seqs, max_num_blocks] int32; physical block ids in logical order, padded
                     with 0 past a sequence's last block. Block 0 is the *null block* (as in vLLM v1):
                     never allocated to a sequence and kept zero, so a padded read is finite and masked.
    seq_lens:        [num_seqs] int32; context length per sequence after this step's tokens.
    query_start_loc: [num_seqs + 1] int32; prefix sums of the query lengths.
    query_lens_cpu / seq_lens_cpu: the same lengths as Python lists (the CPU reference loops on them).
    block_size:      tokens per KV block.
    cache:           per-step scratch that a backend fills lazily on the first layer and reuses in
                     the other layers (gather indices, masks): built once per step, not once per layer.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    cache: dict = field(default_factory=dict)

    @classmethod
    def from_lists(cls, slot_mapping: list[int], block_tables: list[list[int]], seq_lens: list[int],
                   query_lens: list[int], block_size: int, device) -> AttentionMetadata:
        """Build a step's metadata from host lists (block tables padded with the null block 0 to the longest);
        ``cache["qsl"]`` holds ``query_start_loc`` as a list, which the reference backend reads."""
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        width = max((len(t) for t in block_tables), default=0)
        md = cls(slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
                 block_tables=torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32,
                                           device=device),
                 seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
                 query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
                 query_lens_cpu=query_lens, seq_lens_cpu=seq_lens, block_size=block_size)
        md.cache["qsl"] = qsl
        return md

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens_cpu))

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)
