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
