"""A few rows through an fp32 linear layer on CPU (``linear_cpu.c``): ``x @ W^T + b`` reading ``W`` once.

For 2-16 rows (a decode step at small batch, a speculative verify step of k + 1 tokens) MKL's sgemm repacks
the whole weight matrix on every call: on this project's 2-core AVX2 machine, 5 rows through SmolLM2-135M's
projections and LM head cost 2-3x one row, although both are bound by reading the weights. This kernel
multiplies every weight row with all the input rows while it is in registers, so 5 or 9 rows cost little
more than 1 (``pdserve/loadtest/README.md#speculative-decoding``). Each output element is summed in an order that
does not depend on the number of rows, so a token's logits are bit-identical in a 1-row decode step and in
a (k + 1)-row verify step. The weights may be fp32 or the model's bf16 (``skinny_linear_bf16w``): these steps are
bound by reading the weights, and bf16 reads half the bytes (SmolLM2-135M, 1 thread: all projections and the LM head
at 1 row 36 -> 27 CPU-ms, at 16 rows 104 -> 89; ``pdserve/kernels/README.md``) with bit-identical results, since a bf16
value widened to fp32 is exact. Built at first use by ``cpu_build``; ``None`` from ``load()`` (no compiler, or
``PDSERVE_SKINNY_LINEAR=0``) keeps PyTorch's path.

On CPUs whose ``/proc/cpuinfo`` lists ``avx512_bf16``, ``linear_cpu_bf16.c`` is built too (``load_dpbf16``): the same
one-pass product with bf16 inputs and weights through ``vdpbf16ps`` (``skinny_linear_dpbf16``), twice the
multiply-adds per instruction of the fp32 FMA. Its inputs are rounded to bf16 first (exact for a bf16 model's
activations), so its sums differ from the fp32 kernel's; it too sums each output in one order whatever the rows.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from pdserve.kernels import cpu_build

SOURCE = Path(__file__).with_name("linear_cpu.c")
SOURCE_DPBF16 = Path(__file__).with_name("linear_cpu_bf16.c")
# no -ffast-math and no FMA contraction outside the explicit intrinsics: one summation order everywhere
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
# Rows up to this go through the kernel; more rows are compute-bound and MKL's blocked GEMM wins (measured on
# SmolLM2-135M's shapes: at 16 rows the kernel still beat sgemm, at 32 it lost).
MAX_ROWS = 16
_lib: ctypes.CDLL | None = None
_tried = False
_dp_lib: ctypes.CDLL | None = None
_dp_tried = False
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


def load() -> ctypes.CDLL | None:
    global _lib, _tried
    if not _tried:
        _tried = True
        if os.environ.get("PDSERVE_SKINNY_LINEAR", "1") == "0":
            return None
        lib = cpu_build.load_library(SOURCE, FLAGS)
        if lib is not None:
            for fn in (lib.skinny_linear, lib.skinny_linear_bf16w):
                fn.argtypes = [_P, _I64, _I64, _P, _P, _P, _I64, _I64]
                fn.restype = None
            _lib = lib
    return _lib


def cpu_has(flag: str) -> bool:
    """Whether ``/proc/cpuinfo``'s flags list ``flag`` (e.g. ``avx512_bf16``); False where it cannot be read."""
    return flag in cpu_build.cpu_flags().split()


def load_dpbf16() -> ctypes.CDLL | None:
    """The AVX512-BF16 kernel, built only where the CPU has ``avx512_bf16`` (and ``PDSERVE_SKINNY_LINEAR`` is not 0)."""
    global _dp_lib, _dp_tried
    if not _dp_tried:
        _dp_tried = True
        if os.environ.get("PDSERVE_SKINNY_LINEAR", "1") == "0" or not cpu_has("avx512_bf16"):
            return None
        lib = cpu_build.load_library(SOURCE_DPBF16, [*FLAGS, "-mavx512bf16"])
        if lib is not None:
            lib.skinny_linear_dpbf16.argtypes = [_P, _I64, _I64, _P, _P, _P, _I64, _I64]
            lib.skinny_linear_dpbf16.restype = None
            _dp_lib = lib
    return _dp_lib


def skinny_linear_dpbf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [M, K] any float dtype (rounded to bf16) @ ``weight`` [N, K]^T bf16 contiguous + ``bias`` [N] float32
    -> [M, N] float32, through ``vdpbf16ps``; M up to ``MAX_ROWS``. Needs ``load_dpbf16()``."""
    if x.dtype != torch.bfloat16 or x.stride(1) != 1:
        x = x.to(torch.bfloat16).contiguous()
    m, k = x.shape
    n = weight.shape[0]
    assert weight.dtype == torch.bfloat16 and weight.is_contiguous() and weight.shape[1] == k
    assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
    out = torch.empty((m, n), dtype=torch.float32)
    load_dpbf16().skinny_linear_dpbf16(x.data_ptr(), m, x.stride(0), weight.data_ptr(),
                                       None if bias is None else bias.data_ptr(), out.data_ptr(), n, k)
    return out


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``skinny_linear(x, weight)`` applies: CPU, fp32 contiguous weight, 1..MAX_ROWS rows, kernel built."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.device.type == "cpu" and weight.dtype == torch.float32
            and weight.is_contiguous() and load() is not None)


def bf16_weights_enabled() -> bool:
    """Whether ``Fp32WeightLinear`` keeps a bf16 model's own weights for this kernel (``PDSERVE_SKINNY_BF16=0``:
    no, saving their memory, about half the fp32 copies' size)."""
    return os.environ.get("PDSERVE_SKINNY_BF16", "1") != "0"


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [M, K] float32 (rows may be strided) @ ``weight`` [N, K]^T + ``bias`` [N] -> [M, N] float32.
    ``weight`` is float32 or bfloat16 (contiguous); both give the same bits for the same values."""
    if x.dtype != torch.float32 or x.stride(1) != 1:
        x = x.float().contiguous()
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
    out = torch.empty((m, n), dtype=torch.float32)
    assert weight.dtype in (torch.float32, torch.bfloat16) and weight.is_contiguous()
    fn = load().skinny_linear if weight.dtype == torch.float32 else load().skinny_linear_bf16w
    fn(x.data_ptr(), m, x.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(), n, k)
    return out
