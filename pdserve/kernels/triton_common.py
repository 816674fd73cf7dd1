"""Host-side helpers shared by the Triton attention kernels (no kernels here).

Triton's interpreter (``TRITON_INTERPRET=1``, read by ``triton.jit`` when a kernel module is imported)
runs kernels on CPU tensors with NumPy. It keeps bfloat16 as raw ``uint16`` words, so arithmetic and
``tl.dot`` on bf16 operands give garbage there, while loads, stores and casts are exact. The kernels
therefore upcast bf16 operands to fp32 before any math when interpreted (``dot_in_fp32``); compiled,
bf16/fp16 operands go to the tensor cores as they are, with fp32 accumulation.
"""

from __future__ import annotations

import functools

import torch
import triton


def is_interpreted(kernel) -> bool:
    """True if ``kernel`` (a ``@triton.jit`` object) was built for the interpreter."""
    return type(kernel).__name__ == "InterpretedFunction"


def dot_in_fp32(dtype: torch.dtype, interpreted: bool) -> bool:
    """Whether a kernel must upcast operands of ``dtype`` to fp32 before ``tl.dot``.

    fp32 caches always take the fp32 path (with IEEE, not TF32, products, so the fp32 engine matches
    the reference); bf16 does so only under the interpreter (see the module docstring).
    """
    return dtype == torch.float32 or (interpreted and dtype == torch.bfloat16)


def check_device(kernel, *tensors: torch.Tensor) -> None:
    """Raise a clear error instead of a crash deep in Triton when tensors cannot reach ``kernel``."""
    interpreted = is_interpreted(kernel)
    for t in tensors:
        if t.device.type == "cuda" and interpreted:
            raise RuntimeError("Triton kernels were imported with TRITON_INTERPRET=1 and cannot run on CUDA tensors")
        if t.device.type != "cuda" and not interpreted:
            raise RuntimeError(
                f"Triton kernels need CUDA tensors (got {t.device}); on CPU set TRITON_INTERPRET=1 "
                "before the kernel modules are imported, or use the torch attention backend"
            )


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache dtypes differ: {k_cache.dtype} vs {v_cache.dtype}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need a contiguous head_dim (stride 1)")


def check_query(query: torch.Tensor, k_cache: torch.Tensor) -> None:
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_dim], got {tuple(query.shape)}")
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if query.shape[2] != head_dim:
        raise ValueError(f"query head_dim {query.shape[2]} != cache head_dim {head_dim}")
    if query.shape[1] % num_kv_heads:
        raise ValueError(f"num_heads {query.shape[1]} is not a multiple of num_kv_heads {num_kv_heads}")
    if query.dtype != k_cache.dtype:
        raise ValueError(f"query dtype {query.dtype} != cache dtype {k_cache.dtype}")


def check_out(out: torch.Tensor, query: torch.Tensor) -> None:
    if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        raise ValueError(
            f"out must match query ({tuple(query.shape)}, {query.dtype}, {query.device}), "
            f"got ({tuple(out.shape)}, {out.dtype}, {out.device})"
        )
    if out.stride(-1) != 1:
        raise ValueError("out needs a contiguous head_dim (stride 1)")


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a guess of 4 programs in flight elsewhere)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


next_power_of_2 = triton.next_power_of_2
