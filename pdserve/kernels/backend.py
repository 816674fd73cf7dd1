"""Attention backends: one interface over the PyTorch reference and the Triton kernels.

Model code calls, per layer and step::

    backend = get_attention_backend("auto", device)      # once, at engine start
    backend.reshape_and_cache(k, v, k_cache, v_cache, md.slot_mapping)
    out = backend.forward(q, k_cache, v_cache, md, scale)

Both backends take the same tensors (shapes in ``attention_ref``) and return the same thing, so the
engine switches with a flag (vLLM's ``VLLM_ATTENTION_BACKEND`` idea). ``"auto"`` picks ``triton`` on
CUDA, ``cpu`` (the C kernel of ``cpu_attention``, K/V read in place) on CPU where it builds, else ``torch``. ``"triton"`` on CPU runs Triton's interpreter, which must be switched on
with ``TRITON_INTERPRET=1`` before the kernel modules are first imported (``triton.jit`` reads it
then); it is meant for tests, not speed.

The Triton backend sends decodes (``query_len == 1``) to the split-K decode kernel and everything
else (prefill chunks, with or without a cached prefix) to the prefill kernel, both writing into one
output tensor; the split of the batch is computed once per step (``md.cache``).
"""

from __future__ import annotations

import importlib.util
from typing import Literal, Protocol

import torch

from pdserve.kernels.attention_metadata import AttentionMetadata

BackendName = Literal["auto", "cpu", "torch", "triton"]


class AttentionBackend(Protocol):
    name: str

    def reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write [num_tokens, num_kv_heads, head_dim] K/V into their slots; slot -1 is skipped."""

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """[num_tokens, num_heads, head_dim] query -> same-shaped output, causal over paged K/V; with
        ``sliding_window`` over the last that many positions only (``attention_ref.paged_attention_ref``)."""


class TorchAttentionBackend:
    """The PyTorch reference (``attention_ref``): any device, any dtype."""

    name = "torch"

    def __init__(self) -> None:
        from pdserve.kernels import attention_ref

        self._ref = attention_ref

    def reshape_and_cache(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        self._ref.reshape_and_cache_ref(key, value, k_cache, v_cache, slot_mapping)

    def forward(self, query, k_cache, v_cache, md, scale, sliding_window=None) -> torch.Tensor:
        return self._ref.paged_attention_ref(query, k_cache, v_cache, md, scale, sliding_window)

    def __repr__(self) -> str:
        return "TorchAttentionBackend()"


class CpuAttentionBackend:
    """The CPU kernel (``cpu_attention``): K/V read in place, no padding; float32 and bfloat16, blocks of up to
    32 tokens (anything else goes to the reference). Writes into the cache as the reference does (``index_copy_``)."""

    name = "cpu"

    def __init__(self) -> None:
        from pdserve.kernels import attention_ref, cpu_attention

        self._ref = attention_ref
        self._kernel = cpu_attention

    def reshape_and_cache(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        # one C pass per layer instead of a mask, a sync and two index_copy_ (about 4 ms of a decode step at batch 4)
        if not self._kernel.reshape_and_cache_cpu(key, value, k_cache, v_cache, slot_mapping):
            self._ref.reshape_and_cache_ref(key, value, k_cache, v_cache, slot_mapping)

    def forward(self, query, k_cache, v_cache, md, scale, sliding_window=None) -> torch.Tensor:
        if not self._kernel.supports(query.dtype, k_cache.shape[1]):
            return self._ref.paged_attention_ref(query, k_cache, v_cache, md, scale, sliding_window)
        return self._kernel.paged_attention_cpu(query, k_cache, v_cache, md.block_tables, md.seq_lens,
                                                md.query_start_loc, scale, sliding_window=sliding_window)

    def __repr__(self) -> str:
        return "CpuAttentionBackend()"


class TritonAttentionBackend:
    """Triton kernels: ``triton_reshape_and_cache``, ``triton_paged_attention_decode`` / ``_prefill``."""

    name = "triton"

    def __init__(self) -> None:
        from pdserve.kernels import (
            triton_paged_attention_decode,
            triton_paged_attention_prefill,
            triton_reshape_and_cache,
        )

        self._cache_write = triton_reshape_and_cache.reshape_and_cache
        self._decode = triton_paged_attention_decode.paged_attention_decode
        self._prefill = triton_paged_attention_prefill.paged_attention_prefill

    def reshape_and_cache(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        self._cache_write(key, value, k_cache, v_cache, slot_mapping)

    def forward(self, query, k_cache, v_cache, md, scale, sliding_window=None) -> torch.Tensor:
        split = md.cache.get("triton_batch_split")
        if split is None:
            decodes = [s for s, q in enumerate(md.query_lens_cpu) if q == 1]
            prefills = [s for s, q in enumerate(md.query_lens_cpu) if q > 1]
            split = md.cache["triton_batch_split"] = (decodes, prefills)
        decodes, prefills = split
        if not prefills:
            all_decode = len(decodes) == md.num_seqs
            return self._decode(query, k_cache, v_cache, md, scale, seq_ids=None if all_decode else decodes,
                                sliding_window=sliding_window)
        out = self._prefill(query, k_cache, v_cache, md, scale, seq_ids=prefills, sliding_window=sliding_window)
        if decodes:
            self._decode(query, k_cache, v_cache, md, scale, out=out, seq_ids=decodes, sliding_window=sliding_window)
        return out

    def __repr__(self) -> str:
        return "TritonAttentionBackend()"


def _cpu_kernel_builds() -> bool:
    from pdserve.kernels import cpu_attention

    return cpu_attention.load() is not None


def _triton_interpreting() -> bool:
    from triton import knobs  # parses TRITON_INTERPRET exactly as triton.jit will

    return bool(knobs.runtime.interpret)


def get_attention_backend(name: BackendName = "auto", device: torch.device | str = "cpu") -> AttentionBackend:
    """Return the attention backend ``name`` for tensors on ``device``.

    ``"auto"``: ``triton`` on CUDA when triton is installed; on CPU ``cpu`` when its kernel builds here (a C
    compiler), else ``torch``.
    ``"cpu"``: the CPU kernel (ValueError when it cannot be built).
    ``"torch"``: the reference, anywhere.
    ``"triton"``: CUDA; on CPU only under ``TRITON_INTERPRET=1`` (set before the kernels are imported).
    Raises ValueError for an unknown name, or for ``"triton"`` where it cannot run (the message says why).
    """
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" and importlib.util.find_spec("triton") is not None else "torch"
        if device.type == "cpu" and _cpu_kernel_builds():
            name = "cpu"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "cpu":
        if device.type != "cpu" or not _cpu_kernel_builds():
            raise ValueError(f"attention backend 'cpu' needs device cpu and a C compiler to build its kernel (device {device.type})")
        return CpuAttentionBackend()
    if name != "triton":
        raise ValueError(f"unknown attention backend {name!r}; expected 'auto', 'cpu', 'torch' or 'triton'")
    if importlib.util.find_spec("triton") is None:
        raise ValueError("attention backend 'triton' needs the triton package (pip install triton)")
    if device.type == "cuda":
        if _triton_interpreting():
            raise ValueError("attention backend 'triton' on CUDA: unset TRITON_INTERPRET (it forces the CPU interpreter)")
    elif device.type == "cpu":
        if not _triton_interpreting():
            raise ValueError(
                "attention backend 'triton' on CPU runs only in Triton's interpreter: set TRITON_INTERPRET=1 "
                "before starting (or use attention_backend='torch')"
            )
    else:
        raise ValueError(f"attention backend 'triton' supports cuda (and cpu under TRITON_INTERPRET=1), not {device.type}")
    backend = TritonAttentionBackend()
    from pdserve.kernels.triton_common import is_interpreted
    from pdserve.kernels.triton_paged_attention_prefill import _prefill_kernel

    if is_interpreted(_prefill_kernel) != (device.type == "cpu"):
        # triton.jit reads TRITON_INTERPRET when a kernel module is first imported
        raise ValueError(
            "the pdserve Triton kernels were already imported "
            + ("for the GPU; set TRITON_INTERPRET=1 at process start" if device.type == "cpu" else "for the interpreter; unset TRITON_INTERPRET")
        )
    return backend
