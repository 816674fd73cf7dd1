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


def shard_weight(name: str, tensor: torch.Tensor, config, shard: TPShard) -> torch.Tensor:
    """The part of checkpoint tensor ``name`` (HF names: ``...q_proj.weight``, ``...o_proj.weight``, ...) that
    rank ``shard`` holds; everything not split (norms, embedding, LM head) is returned whole."""
    if shard.size == 1:
        return tensor
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    leaf = name.split(".")[-2] if "." in name else name
    if leaf == "q_proj":
        first, count = shard.heads(config.num_attention_heads)
        return tensor[first * head_dim:(first + count) * head_dim]
    if leaf in ("k_proj", "v_proj"):
        first, count = shard.kv_heads(config.num_key_value_heads)
        return tensor[first * head_dim:(first + count) * head_dim]
    if leaf in ("gate_proj", "up_proj"):
        per = config.intermediate_size // shard.size
        return tensor[shard.rank * per:(shard.rank + 1) * per]
    if leaf == "o_proj":
        first, count = shard.heads(config.num_attention_heads)
        return tensor[:, first * head_dim:(first + count) * head_dim]
    if leaf == "down_proj":
        per = config.intermediate_size // shard.size
        return tensor[:, shard.rank * per:(shard.rank + 1) * per]
    return tensor
