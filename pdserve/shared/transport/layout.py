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

    Tensor parallelism: ``num_kv_heads`` is always the model's, since blocks travel with every KV head
    (rank 0 gathers them from its ranks before sending and scatters them to its ranks on receipt), so pods of
    different TP sizes exchange KV. ``tensor_parallel_size`` and ``kv_head_ranges`` (per rank, the
    ``(first, count)`` of the KV heads it holds) say how each end splits them; an end whose ranks do not cover
    every KV head cannot be mapped and is refused at the handshake (``mismatch``).
    """

    block_size: int
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    model: str
    tensor_parallel_size: int = 1
    kv_head_ranges: tuple[tuple[int, int], ...] = ()  # empty: one rank holding every head

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
        optional = {"tensor_parallel_size", "kv_head_ranges"}  # a peer from before tensor parallelism omits them
        if not expected <= set(d) <= expected | optional:
            raise ValueError(f"layout fields must be {sorted(expected)} (and optionally {sorted(optional)}), "
                             f"got {sorted(map(str, d))}")
        if not isinstance(d["dtype"], str) or not isinstance(d["model"], str):
            raise ValueError("layout dtype and model must be strings")
        d = dict(d)
        ranges = d.get("kv_head_ranges", ())
        if not isinstance(ranges, (list, tuple)) or not all(
                isinstance(r, (list, tuple)) and len(r) == 2 and all(type(x) is int for x in r) for r in ranges):
            raise ValueError("layout kv_head_ranges must be a list of [first, count] int pairs")
        d["kv_head_ranges"] = tuple(tuple(r) for r in ranges)
        return cls(**d)  # type: ignore[arg-type]

    def unmappable(self) -> str | None:
        """Why this end's ranks cannot be mapped onto the full-heads wire layout (None when they can): the
        ranges must be ``tensor_parallel_size`` pairs inside ``[0, num_kv_heads)`` that cover every head."""
        ranges = self.kv_head_ranges or ((0, self.num_kv_heads),)
        if self.kv_head_ranges and len(ranges) != self.tensor_parallel_size:
            return f"{len(ranges)} KV head ranges for tensor_parallel_size {self.tensor_parallel_size}"
        held = {h for first, count in ranges for h in range(first, first + count)}
        if held != set(range(self.num_kv_heads)) or any(c < 1 or f < 0 for f, c in ranges):
            return f"KV head ranges {list(map(list, ranges))} do not cover the {self.num_kv_heads} KV heads exactly"
        return None

    def mismatch(self, other: KVLayout, mine: str = "local", theirs: str = "peer") -> str | None:
        """Human-readable list of the fields where ``other`` differs (``None`` when equal)."""
        diffs = [
            f"{name} {mine} {getattr(self, name)!r} != {theirs} {getattr(other, name)!r}"
            for name in ("block_size", "dtype", "num_layers", "num_kv_heads", "head_dim", "model")
            if getattr(self, name) != getattr(other, name)
        ]
        # different TP sizes are fine (blocks carry every KV head); ranks that miss heads are not
        diffs += [f"{who} (tensor_parallel_size {end.tensor_parallel_size}): {why}"
                  for who, end in ((mine, self), (theirs, other)) if (why := end.unmappable()) is not None]
        return ", ".join(diffs) or None
