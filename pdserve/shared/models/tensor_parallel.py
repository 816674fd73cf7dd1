"""Megatron-style tensor parallelism for the Llama family: which heads and weight rows each rank holds.

Source: Shoeybi et al., *Megatron-LM* (2019), §3: the fused QKV and gate/up projections are split by output
rows (column-parallel), ``o_proj`` and ``down_proj`` by input columns (row-parallel) and followed by one
all-reduce each, so a layer costs two all-reduces of ``[num_tokens, hidden]``. KV heads follow vLLM's rule
(``QKVParallelLinear``): with at least as many KV heads as ranks they are split evenly; with fewer, the rank
count must be a multiple of them and each KV head is replicated on ``tp_size // num_kv_heads`` consecutive ranks.
The embedding and the LM head stay replicated (see ``docs/engine.md`` §Tensor parallelism for why).

No process management here (``pdserve/shared/engine/tp_executor.py`` starts the ranks); ``TPShard.group`` is a
``torch.distributed`` process group or None at ``tp_size == 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def check_tp_split(num_heads: int, num_kv_heads: int, intermediate_size: int, tp_size: int) -> None:
    """Raise ``ValueError`` (one line) when ``tp_size`` ranks cannot split the model's heads (vLLM's rule)."""
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp_size}")
    kv_ok = num_kv_heads % tp_size == 0 if num_kv_heads >= tp_size else tp_size % num_kv_heads == 0
    if num_heads % tp_size or not kv_ok or intermediate_size % tp_size:
        raise ValueError(
            f"tensor_parallel_size={tp_size} cannot split this model ({num_heads} attention heads, {num_kv_heads} KV "
            f"heads, intermediate size {intermediate_size}): attention heads and intermediate size must be multiples "
            f"of it, and KV heads a multiple of it or a divisor of it (then each KV head is replicated)")


@dataclass(frozen=True)
class TPShard:
    """Rank ``rank`` of ``size``: the slice of heads (and of the MLP) it computes. ``group``: the process group
    its all-reduces run on (None when ``size == 1``)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def heads(self, num_heads: int) -> tuple[int, int]:
        """``(first, count)`` of this rank's query heads."""
        per = num_heads // self.size
        return self.rank * per, per

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """``(first, count)`` of this rank's KV heads; with fewer KV heads than ranks, the one it replicates."""
        if num_kv_heads >= self.size:
            per = num_kv_heads // self.size
            return self.rank * per, per
        return self.rank // (self.size // num_kv_heads), 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks in place (the row-parallel layers' one collective); no-op at size 1."""
        if self.group is not None:
            self.group.allreduce([x]).wait()
        return x


def owner_ranks(num_kv_heads: int, size: int) -> list[tuple[int, int, int]]:
    """For gathering the full KV heads from the ranks: ``[(rank, first local head, count)]`` naming, for each KV
    head in order, one rank that holds it (the first of its replicas)."""
    out = []
    for rank in range(size):
        first, count = TPShard(rank, size).kv_heads(num_kv_heads)
        if not out or first >= out[-1][1] + out[-1][2]:
            out.append((rank, first, count))
    return out


SplitRule = tuple[str, int]  # (what splits: "heads", "kv_heads" or "intermediate"; the tensor's dim it splits)


def shard_weight(tensor: torch.Tensor, rule: SplitRule | None, config, shard: TPShard) -> torch.Tensor:
    """The part of a checkpoint tensor that rank ``shard`` holds under ``rule`` (the model class's
    ``tp_split_rules`` entry for it); with no rule (norms, embedding, LM head) the tensor is returned whole."""
    if shard.size == 1 or rule is None:
        return tensor
    what, dim = rule
    if what == "intermediate":
        per = config.intermediate_size // shard.size
        first, count = shard.rank * per, per
    else:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        first, count = shard.heads(config.num_attention_heads) if what == "heads" else \
            shard.kv_heads(config.num_key_value_heads)
        first, count = first * head_dim, count * head_dim
    return tensor.narrow(dim, first, count)
