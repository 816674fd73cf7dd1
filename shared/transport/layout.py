"""The KV layout both ends of a KV transfer must agree on, and the tensor shape of a block of it."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

# Wire names of the dtypes a KV cache may hold; the wire never carries torch's repr.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What a KV block is, on both ends of a transfer.

    One block holds ``block_size`` token positions of every layer's K and V:
    shape ``[num_layers, 2, block_size, num_kv_heads, head_dim]`` in ``dtype``
    (``"float32"``, ``"bfloat16"`` or ``"float16"``). ``model`` names the weights that produced it.
    """

    block_size: int
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    model: str

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"KVLayout.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block: ``(num_layers, 2, block_size, num_kv_heads, head_dim)``."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block on the wire."""
        n = self.torch_dtype.itemsize
        for d in self.block_shape:
            n *= d
        return n

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> KVLayout:
        """Builds a layout from a peer's dict; raises ``ValueError`` on missing/extra/bad fields."""
        if not isinstance(d, dict):
            raise ValueError("layout must be a map")
        expected = {"block_size", "dtype", "num_layers", "num_kv_heads", "head_dim", "model"}
        if set(d) != expected:
            raise ValueError(f"layout fields must be {sorted(expected)}, got {sorted(map(str, d))}")
        if not isinstance(d["dtype"], str) or not isinstance(d["model"], str):
            raise ValueError("layout dtype and model must be strings")
        return cls(**d)  # type: ignore[arg-type]

    def mismatch(self, other: KVLayout, mine: str = "local", theirs: str = "peer") -> str | None:
        """Human-readable list of the fields where ``other`` differs (``None`` when equal)."""
        diffs = [
            f"{name} {mine} {getattr(self, name)!r} != {theirs} {getattr(other, name)!r}"
            for name in ("block_size", "dtype", "num_layers", "num_kv_heads", "head_dim", "model")
            if getattr(self, name) != getattr(other, name)
        ]
        return ", ".join(diffs) or None
