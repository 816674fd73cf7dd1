"""CPU paged attention that reads K/V blocks in place: ``paged_attention_cpu.c`` built at first use, called by ctypes.

The reference (``attention_ref``) gathers every sequence's K/V through its block table, padded to the
longest context, in every layer of every step, then runs a padded SDPA; on a 2-core CPU that was ~28% of a
decode step. This kernel walks each sequence's blocks where they lie, one task per (sequence, KV head,
chunk of 32 query rows), with an fp32 online softmax; decodes and prefill chunks of any query length
(a speculative k+1-token verification too) go in one call, without padding.

Built by ``cpu_build`` at first use (about a second). When no C compiler is found or the build fails,
``load()`` returns ``None`` and the backend choice falls back to the reference (logged once).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pdserve.kernels import cpu_build

SOURCE = Path(__file__).with_name("paged_attention_cpu.c")
# The reassociation -ffast-math would allow (vectorized reductions), without -ffast-math itself: gcc links
# crtfastmath.o into a shared library built with -ffast-math/-Ofast/-funsafe-math-optimizations, and its
# constructor sets flush-to-zero and denormals-are-zero for the whole process at dlopen -- every float in
# the server (and hypothesis, in the tests) then lost subnormals.
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math",
         "-freciprocal-math", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_lib: ctypes.CDLL | None = None
_tried = False


def load() -> ctypes.CDLL | None:
    """The built kernel library, or ``None`` when it cannot be built here (the reason is logged once)."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    lib = cpu_build.load_library(SOURCE, FLAGS)
    if lib is None:
        return None
    lib.paged_attention.restype = ctypes.c_int
    lib.paged_attention.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [
        ctypes.c_float, ctypes.c_int, ctypes.c_int64]
    lib.set_decode_path.argtypes = [ctypes.c_int]
    lib.reshape_and_cache.restype = ctypes.c_int
    lib.reshape_and_cache.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                      ctypes.c_int]
    _lib = lib
    return lib


MAX_BLOCK_SIZE = 32  # MAX_BS in the C source


def supports(dtype: torch.dtype, block_size: int) -> bool:
    return dtype in _DTYPES and block_size <= MAX_BLOCK_SIZE


def paged_attention_cpu(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                        out: torch.Tensor | None = None, sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of ``query`` [num_tokens, num_heads, head_dim] over the paged K/V; with
    ``sliding_window`` ``W`` a query at position ``q`` sees keys ``q - W < k <= q`` only (as
    ``attention_ref.paged_attention_ref``), and blocks wholly before every row's window are never read.

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], query's dtype (float32 or bfloat16),
    contiguous; block_tables [num_seqs, max_blocks] int32; seq_lens [num_seqs] int32 (context including this
    step's tokens, already written to the cache); query_start_loc [num_seqs + 1] int32. ``query`` may be a
    row-strided view (heads contiguous), e.g. a split of the fused QKV projection. Sequences with no
    query rows are skipped; rows of no sequence are left as ``out`` had them. Returns ``out`` (new if None).
    Raises RuntimeError when the kernel is not built or rejects the shapes.
    """
    lib = load()
    if lib is None:
        raise RuntimeError("the CPU paged-attention kernel is not available")
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, kv_dim = k_cache.shape
    if kv_dim != head_dim or num_heads % num_kv_heads or query.dtype not in _DTYPES or k_cache.dtype != query.dtype:
        raise ValueError(f"unsupported shapes/dtypes: query {tuple(query.shape)} {query.dtype}, "
                         f"k_cache {tuple(k_cache.shape)} {k_cache.dtype}")
    if query.stride(2) != 1 or query.stride(1) != head_dim:
        query = query.contiguous()  # the kernel needs each row's heads contiguous; rows may be strided
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    qsl = query_start_loc.to(torch.int32).contiguous()
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype)
    rc = lib.paged_attention(query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                             tables.data_ptr(), lens.data_ptr(), qsl.data_ptr(), len(lens), tables.shape[1],
                             num_heads, num_kv_heads, head_dim, block_size, float(scale), _DTYPES[query.dtype],
                             int(sliding_window or 0))
    if rc != 0:
        raise RuntimeError(f"paged_attention_cpu failed (block_size {block_size} > 32, or out of memory)")
    return out


def reshape_and_cache_cpu(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> bool:
    """``attention_ref.reshape_and_cache_ref`` in one C pass: each token's K/V [num_tokens, num_kv_heads, head_dim]
    (rows may be strided, heads contiguous) into its slot of the contiguous caches; slot -1 is skipped. Returns
    False, writing nothing, where the tensors do not fit that layout (the caller then takes the reference)."""
    lib = load()
    row = k_cache.shape[2] * k_cache.shape[3]
    if (lib is None or key.dtype != k_cache.dtype or value.dtype != v_cache.dtype or key.dtype != value.dtype
            or not (k_cache.is_contiguous() and v_cache.is_contiguous()) or slot_mapping.dtype != torch.int64
            or key.shape != value.shape or key.shape[1:] != k_cache.shape[2:] or v_cache.shape != k_cache.shape
            or key.stride(2) != 1 or value.stride(2) != 1 or key.stride(1) != key.shape[2]
            or value.stride(1) != value.shape[2] or not slot_mapping.is_contiguous()
            or slot_mapping.numel() != key.shape[0]):
        return False
    rc = lib.reshape_and_cache(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), k_cache.data_ptr(),
                               v_cache.data_ptr(), slot_mapping.data_ptr(), key.shape[0],
                               k_cache.shape[0] * k_cache.shape[1], row, key.element_size())
    if rc != 0:
        raise IndexError(f"slot_mapping holds a slot outside the cache's {k_cache.shape[0] * k_cache.shape[1]} slots")
    return True
