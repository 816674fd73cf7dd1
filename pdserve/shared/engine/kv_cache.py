"""The KV cache tensors: one K and one V pool per layer, plus the CPU swap pool.

Storage is a single tensor ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` so
that block copies (swap, KV transfer) are one indexing operation for all layers.
Layer ``l`` sees ``k_cache = kv[l, 0]`` and ``v_cache = kv[l, 1]``, each
``[num_blocks, block_size, num_kv_heads, head_dim]`` (docs/design.md §2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def from_model_config(cls, model_config, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """From an HF-style config (``num_hidden_layers``, ``num_key_value_heads``, ``head_dim`` or
        ``hidden_size // num_attention_heads``)."""
        mc = model_config
        head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
        return cls(mc.num_hidden_layers, mc.num_key_value_heads, head_dim, block_size, dtype)

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block across all layers, in bytes."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def num_blocks_for(self, num_bytes: int) -> int:
        return num_bytes // self.bytes_per_block


class KVCache:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, num_cpu_blocks: int = 0, device: str = "cpu") -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        # zeros, not empty: block 0 is the null block that padded reads land on; it must be finite
        self.kv = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.cpu_kv = (
            torch.zeros((spec.num_layers, 2, num_cpu_blocks, *shape[3:]), dtype=spec.dtype, device="cpu")
            if num_cpu_blocks
            else None
        )

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[i, 0], self.kv[i, 1]

    def _idx(self, ids) -> torch.Tensor:
        return torch.as_tensor(ids, dtype=torch.long, device=self.kv.device)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            dev, cpu = zip(*pairs)
            self.cpu_kv[:, :, torch.tensor(cpu)] = self.kv[:, :, self._idx(dev)].to("cpu")

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            cpu, dev = zip(*pairs)
            self.kv[:, :, self._idx(dev)] = self.cpu_kv[:, :, torch.tensor(cpu)].to(self.kv.device)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """``[n, num_layers, 2, block_size, num_kv_heads, head_dim]``: the wire layout of KV transfer."""
        return self.kv[:, :, self._idx(block_ids)].permute(2, 0, 1, 3, 4, 5).contiguous()

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Inverse of ``read_blocks``. Raises ``ValueError`` on a shape or dtype mismatch."""
        want = (len(block_ids), self.spec.num_layers, 2, self.spec.block_size, self.spec.num_kv_heads, self.spec.head_dim)
        if tuple(data.shape) != want or data.dtype != self.spec.dtype:
            raise ValueError(f"KV blocks of shape {tuple(data.shape)} {data.dtype}, expected {want} {self.spec.dtype}")
        self.kv[:, :, self._idx(block_ids)] = data.to(self.kv.device).permute(1, 2, 0, 3, 4, 5)
