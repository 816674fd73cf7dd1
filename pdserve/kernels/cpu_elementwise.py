"""Fused element-wise ops of a Llama layer on CPU (``elementwise_cpu.c``): residual add + RMSNorm, SiLU * up, RoPE.

Each replaces 3-5 PyTorch ops (casts, temporaries) by one pass that rounds where PyTorch rounds, so
results equal the unfused ops' but for the fp32 order of RMSNorm's sum of squares and SiLU's exp (glibc's
``expf``). With AVX2/FMA they run 8 lanes at a time, equal to their scalar code bit for bit (``ref=True``).
RMSNorm and SiLU*up also read and write float32 for a bfloat16 model's fp32-weight GEMMs, rounding as the
casts they replace (``Fp32WeightLinear.forward_f32``). Built at
first use by ``cpu_build``; ``available(t)`` says whether a tensor can take this path (CPU, float32 or
bfloat16, contiguous rows), otherwise callers keep the PyTorch ops.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pdserve.kernels import cpu_build

SOURCE = Path(__file__).with_name("elementwise_cpu.c")
# no -ffast-math: products and sums must round exactly as PyTorch's do (no FMA contraction either)
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_lib: ctypes.CDLL | None = None
_tried = False
_P, _I64, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def load() -> ctypes.CDLL | None:
    global _lib, _tried
    if not _tried:
        _tried = True
        lib = cpu_build.load_library(SOURCE, FLAGS)
        if lib is not None:
            for name in ("add_rms_norm", "add_rms_norm_ref"):
                getattr(lib, name).argtypes = [_P, _P, _P, _P, _I64, _I, _F, _I, _I, _I]
            for name in ("silu_mul", "silu_mul_ref"):
                getattr(lib, name).argtypes = [_P, _P, _I64, _I, _I, _I, _I]
            for name in ("rope", "rope_ref"):
                getattr(lib, name).argtypes = [_P, _I64, _P, _I64, _P, _I64, _I, _I, _I]
            lib.expf_vec.argtypes = lib.expf_ref.argtypes = [_P, _P, _I64]
            lib.expf_mismatches.argtypes, lib.expf_mismatches.restype = [ctypes.c_uint32, ctypes.c_uint32], _I64
            _lib = lib
    return _lib


def available(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype in _DTYPES and load() is not None


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype | None = None, ref: bool = False) -> torch.Tensor:
    """``residual += delta.to(residual.dtype)`` in place (skipped when ``delta`` is None), then return
    ``weight * rms_norm(residual.float()).to(dtype)``. residual, delta [rows, n] contiguous; weight [n] in
    residual's dtype. ``delta`` may be float32 for a bfloat16 residual (an fp32-weight GEMM's output, rounded
    on load as its cast would); ``out_dtype=torch.float32`` returns the bfloat16-rounded result held as float32
    (what such a GEMM takes). ``ref``: the scalar code, the vector code's bit-for-bit reference (tests)."""
    out = torch.empty_like(residual, dtype=out_dtype or residual.dtype)
    rows, n = residual.shape
    delta = None if delta is None else delta.contiguous()
    fn = load().add_rms_norm_ref if ref else load().add_rms_norm
    fn(residual.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, n,
       eps, _DTYPES[residual.dtype], _DTYPES[residual.dtype if delta is None else delta.dtype], _DTYPES[out.dtype])
    return out


def silu_mul(gate_up: torch.Tensor, dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None,
             ref: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` [rows, 2 * inter] (gate first) -> [rows, inter], computed as in ``dtype``
    (default gate_up's): gate and up rounded to it on load (a float32 ``gate_up`` from an fp32-weight GEMM of a
    bfloat16 model), each result rounded to it and held as ``out_dtype`` (default ``dtype``)."""
    rows, two = gate_up.shape
    gate_up = gate_up.contiguous()
    dtype = dtype or gate_up.dtype
    out = torch.empty((rows, two // 2), dtype=out_dtype or dtype)
    fn = load().silu_mul_ref if ref else load().silu_mul
    fn(gate_up.data_ptr(), out.data_ptr(), rows, two // 2, _DTYPES[dtype], _DTYPES[gate_up.dtype], _DTYPES[out.dtype])
    return out


def expf(x: torch.Tensor, ref: bool = False) -> torch.Tensor:
    """The exp SiLU uses, on a contiguous float32 tensor (tests): the kernel's vector exp, or glibc's ``expf``
    with ``ref``; the two must be equal bit for bit."""
    y = torch.empty_like(x)
    (load().expf_ref if ref else load().expf_vec)(x.data_ptr(), y.data_ptr(), x.numel())
    return y


def rope_(x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor, ref: bool = False) -> torch.Tensor:
    """Rotate-half RoPE in place on ``x`` [rows, heads, head_dim] (rows may be strided, heads contiguous) with
    ``cos_sin`` [2, max_positions, head_dim] (x's dtype) and ``positions`` [rows] int64. Returns ``x``."""
    rows, heads, d = x.shape
    assert x.stride(2) == 1 and x.stride(1) == d and d <= 512 and cos_sin.is_contiguous() and cos_sin.dtype == x.dtype
    pos = positions.contiguous()
    (load().rope_ref if ref else load().rope)(x.data_ptr(), x.stride(0), cos_sin.data_ptr(), cos_sin.shape[1], pos.data_ptr(), rows, heads, d,
                _DTYPES[x.dtype])
    return x
