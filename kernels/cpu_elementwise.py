"""Fused element-wise ops of a Llama layer on CPU (``elementwise_cpu.c``): residual add + RMSNorm, SiLU * up, RoPE.

Each replaces 3-5 PyTorch ops (casts, temporaries) by one pass that rounds where PyTorch rounds, so
results equal the unfused ops' but for the fp32 order of RMSNorm's sum of squares and SiLU's exp. Built at
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
            lib.add_rms_norm.argtypes = [_P, _P, _P, _P, _I64, _I, _F, _I]
            lib.silu_mul.argtypes = [_P, _P, _I64, _I, _I]
            lib.rope.argtypes = [_P, _I64, _P, _I64, _P, _I64, _I, _I, _I]
            _lib = lib
    return _lib


def available(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype in _DTYPES and load() is not None


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += delta`` in place (skipped when ``delta`` is None), then return
    ``weight * rms_norm(residual.float()).to(dtype)``. residual, delta [rows, n] contiguous; weight [n]."""
    out = torch.empty_like(residual)
    rows, n = residual.shape
    load().add_rms_norm(residual.data_ptr(), None if delta is None else delta.contiguous().data_ptr(),
                        weight.data_ptr(), out.data_ptr(), rows, n, eps, _DTYPES[residual.dtype])
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` [rows, 2 * inter] (gate first) -> [rows, inter]."""
    rows, two = gate_up.shape
    gate_up = gate_up.contiguous()
    out = torch.empty((rows, two // 2), dtype=gate_up.dtype)
    load().silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, two // 2, _DTYPES[gate_up.dtype])
    return out


def rope_(x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in place on ``x`` [rows, heads, head_dim] (rows may be strided, heads contiguous) with
    ``cos_sin`` [2, max_positions, head_dim] (x's dtype) and ``positions`` [rows] int64. Returns ``x``."""
    rows, heads, d = x.shape
    assert x.stride(2) == 1 and x.stride(1) == d and d <= 512 and cos_sin.is_contiguous() and cos_sin.dtype == x.dtype
    pos = positions.contiguous()
    load().rope(x.data_ptr(), x.stride(0), cos_sin.data_ptr(), cos_sin.shape[1], pos.data_ptr(), rows, heads, d,
                _DTYPES[x.dtype])
    return x
