"""The fused CPU element-wise kernels equal the PyTorch ops they replace (rounding where PyTorch rounds)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_elementwise as ew
from pdserve.shared.models.llama import RMSNorm, rotate_half

pytestmark = pytest.mark.skipif(ew.load() is None, reason="no C compiler to build the CPU kernels")
DTYPES = [torch.float32, torch.bfloat16]


def close(a, b, dtype):
    # bf16: one rounding step apart at most (the fp32 sum of squares may round differently); fp32: float noise
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    return torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_equals_residual_add_then_hf_rmsnorm(dtype):
    g = torch.Generator().manual_seed(0)
    x, d = (torch.randn(7, 96, generator=g) * 3).to(dtype), torch.randn(7, 96, generator=g).to(dtype)
    norm = RMSNorm(96, 1e-5).to(dtype)
    norm.weight.data = torch.randn(96, generator=g).to(dtype)
    want_res = x + d
    want = norm(want_res)
    res = x.clone()
    got = ew.add_rms_norm(res, d, norm.weight, 1e-5)
    assert torch.equal(res, want_res)  # the residual add rounds exactly as PyTorch's
    assert close(got, want, dtype)
    if dtype == torch.bfloat16:  # most values round to the same bf16
        assert (got == want).float().mean() > 0.95
    assert close(ew.add_rms_norm(x.clone(), None, norm.weight, 1e-5), norm(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_equals_silu_gate_times_up(dtype):
    gu = (torch.randn(5, 2 * 80, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    gate, up = gu.split(80, dim=-1)
    assert close(ew.silu_mul(gu), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_on_a_strided_view_equals_rotate_half(dtype):
    g = torch.Generator().manual_seed(2)
    t, heads, d = 6, 5, 64
    qkv = torch.randn(t, (heads + 2) * d, generator=g).to(dtype)  # Q/K heads, then 2 heads of V left alone
    cos_sin = torch.randn(2, 50, d, generator=g).to(dtype)
    pos = torch.tensor([0, 3, 49, 7, 7, 20])
    qk = qkv[:, :heads * d].view(t, heads, d)
    cos, sin = cos_sin[0, pos].unsqueeze(1), cos_sin[1, pos].unsqueeze(1)
    want = qk * cos + rotate_half(qk) * sin
    v_before = qkv[:, heads * d:].clone()
    ew.rope_(qk, cos_sin, pos)
    assert torch.equal(qk, want)  # exact: each product and the sum round as PyTorch's
    assert torch.equal(qkv[:, heads * d:], v_before)


def test_vector_exp_equals_glibc_expf_bit_for_bit():
    # SiLU's exp: the AVX2 lanes replay glibc's expf (one rounding from double); every 997th float in [-104, 89]
    # apart (~2.2M values, both overflow edges, subnormal results) and the special values (the expf fallback)
    lo, hi = torch.tensor([-104.0, 89.0]).view(torch.int32).tolist()
    pos = torch.arange(0, hi, 997, dtype=torch.int32)
    neg = torch.arange(-(1 << 31), lo + 1, 997, dtype=torch.int32)  # -0.0 down to -104 (sign bit set)
    x = torch.cat([pos, neg]).view(torch.float32)
    x = torch.cat([x, torch.tensor([0.0, -0.0, 88.0, -88.0, 87.99999, -87.99999, 88.72284, 88.72285, -103.97208,
                                    -103.97209, float("inf"), -float("inf"), float("nan"), 1e-30, -1e-30])])
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(3))].contiguous()  # mix the fallback in
    got, want = ew.expf(x), ew.expf(x, ref=True)
    same = (got.view(torch.int32) == want.view(torch.int32)) | (torch.isnan(got) & torch.isnan(want))
    assert bool(same.all()), x[~same][:8]
    # and every float of whole binades, in C (~0.5 s): each of the 32 table entries, both signs, near both ends (the
    # whole range [-104, 89] was checked once this way: 0 of 2.2e9 differ; it takes ~20 s)
    bits = lambda v: torch.tensor([v]).view(torch.int32).item() & 0xFFFFFFFF  # noqa: E731
    for lo, hi in [(1.0, 2.0), (16.0, 32.0), (64.0, 88.0), (2.0**-12, 2.0**-11)]:
        for sign in (1, -1):
            assert ew.load().expf_mismatches(bits(sign * lo), bits(sign * hi)) == 0, (sign * lo, sign * hi)


def _bf16_with_specials(rows, n, g, scale):
    x = torch.randn(rows, n, generator=g) * scale
    x.view(-1)[:: 37] *= 40  # |x| >= 88 sends SiLU's exp to expf's own special cases
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 576), (7, 96), (8, 100), (9, 5), (32, 576), (33, 1536)])
def test_vector_kernels_equal_their_scalar_code_bit_for_bit(dtype, rows, n):
    # the AVX2 passes (8 rows per lane group for RMSNorm, n % 8 tails, rows past a multiple of 8) against the
    # scalar code that was the kernel before them, so a bf16 model's outputs did not change
    g = torch.Generator().manual_seed(rows * 1000 + n)
    res = (torch.randn(rows, n, generator=g) * 3).to(dtype)
    weight = torch.randn(n, generator=g).to(dtype)
    f32_delta = torch.randn(rows, n, generator=g)
    for delta in (None, f32_delta.to(dtype), f32_delta):
        if delta is not None and delta.dtype != dtype and dtype == torch.float32:
            continue
        for out_dtype in (None, torch.float32):
            a, b = res.clone(), res.clone()
            got = ew.add_rms_norm(a, delta, weight, 1e-5, out_dtype)
            want = ew.add_rms_norm(b, delta, weight, 1e-5, out_dtype, ref=True)
            assert torch.equal(a, b) and torch.equal(got, want)
    gu = _bf16_with_specials(rows, 2 * n, g, 4)
    gu.view(-1)[5] = float("nan")
    for src, out_dtype in ((gu.to(dtype), None), (gu, torch.float32), (gu, None)):
        got = ew.silu_mul(src, dtype, out_dtype)
        want = ew.silu_mul(src, dtype, out_dtype, ref=True)
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128, 24])
def test_vector_rope_equals_its_scalar_code_bit_for_bit(dtype, d):
    g = torch.Generator().manual_seed(d)
    t, heads = 9, 4
    qkv = torch.randn(t, (heads + 1) * d, generator=g).to(dtype)
    cos_sin = torch.randn(2, 40, d, generator=g).to(dtype)
    pos = torch.randint(0, 40, (t,), generator=g)
    a, b = qkv.clone(), qkv.clone()
    ew.rope_(a[:, :heads * d].view(t, heads, d), cos_sin, pos)
    ew.rope_(b[:, :heads * d].view(t, heads, d), cos_sin, pos, ref=True)
    assert torch.equal(a, b)


def test_float32_in_and_out_equal_the_casts_they_replace():
    # a bf16 model's fp32-weight GEMM output read as float32 (rounded on load) and results written as float32:
    # the same values as casting to bf16 first and after
    g = torch.Generator().manual_seed(4)
    res = (torch.randn(11, 200, generator=g) * 3).to(torch.bfloat16)
    weight = torch.randn(200, generator=g).to(torch.bfloat16)
    delta = torch.randn(11, 200, generator=g)
    a, b = res.clone(), res.clone()
    got = ew.add_rms_norm(a, delta, weight, 1e-5, torch.float32)
    want = ew.add_rms_norm(b, delta.to(torch.bfloat16), weight, 1e-5)
    assert got.dtype == torch.float32 and torch.equal(a, b) and torch.equal(got, want.float())
    gu = torch.randn(11, 400, generator=g) * 4
    got = ew.silu_mul(gu, torch.bfloat16, torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, ew.silu_mul(gu.to(torch.bfloat16)).float())
