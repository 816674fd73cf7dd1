"""The per-shape choice of a bf16 linear layer's CPU product (``pdserve/kernels/linear_choice.py``): every path,
forced by ``PDSERVE_CPU_LINEAR``, agrees with a float64 product of the same bf16 values; the AVX512-BF16 kernel sums
a row the same way whatever the row count; ``auto`` keeps the fastest measured path and reads it back from its cache
without measuring again. Greedy parity with HF per forced path is ``tests/engine/test_model_architectures.py``'s."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import cpu_linear, linear_choice
from pdserve.kernels.linear_choice import BUCKETS, ChosenLinear, LinearChooser

needs_kernel = pytest.mark.skipif(cpu_linear.load() is None, reason="no C compiler to build the CPU kernels")
needs_dpbf16 = pytest.mark.skipif(cpu_linear.load_dpbf16() is None, reason="this CPU has no avx512_bf16")


def _layer(n: int, k: int, bias: bool, seed: int = 0) -> nn.Linear:
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * k**-0.5)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    return lin.to(torch.bfloat16)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


@needs_dpbf16
@pytest.mark.parametrize("n,k", [(960, 576), (37, 100), (4, 31), (8, 1)])
def test_dpbf16_kernel_matches_float64_and_is_row_count_invariant(n, k):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g)
    x = torch.randn(cpu_linear.MAX_ROWS, 2 * k, generator=g).to(torch.bfloat16)[:, ::2]  # strided rows
    got = cpu_linear.skinny_linear_dpbf16(x, w, b)
    want = F.linear(x.double(), w.double(), b.double())
    assert got.dtype == torch.float32 and got.shape == (cpu_linear.MAX_ROWS, n)
    assert _rel_err(got, want) < 1e-5  # fp32 sums of exact bf16 products
    alone = torch.cat([cpu_linear.skinny_linear_dpbf16(x[i:i + 1], w, b) for i in range(len(x))])
    for m in (2, 3, 5, 9, cpu_linear.MAX_ROWS):
        assert torch.equal(cpu_linear.skinny_linear_dpbf16(x[:m], w, b), alone[:m]), m
        assert torch.equal(cpu_linear.skinny_linear_dpbf16(x[-m:], w, b), alone[-m:]), m


@needs_kernel
@pytest.mark.parametrize("path", ["bf16", "fp32", "skinny"])
@pytest.mark.parametrize("dpbf16", [True, False])
def test_each_forced_path_matches_the_fp32_reference(path, dpbf16, monkeypatch, tmp_path):
    if dpbf16 and cpu_linear.load_dpbf16() is None:
        pytest.skip("this CPU has no avx512_bf16")
    if not dpbf16:
        monkeypatch.setattr(cpu_linear, "load_dpbf16", lambda: None)  # the fp32-FMA skinny kernel on bf16 weights
    monkeypatch.setenv("PDSERVE_CPU_LINEAR", path)
    lin = _layer(300, 200, bias=True)
    chosen = ChosenLinear(lin, LinearChooser(tmp_path / "c.json"))
    assert chosen.plan == {b: (path if path != "skinny" or b <= cpu_linear.MAX_ROWS else "bf16") for b in BUCKETS}
    assert (chosen.weight32 is not None) == (path == "fp32")  # no fp32 copy unless a bucket uses it
    g = torch.Generator().manual_seed(1)
    for rows in (1, 3, 16, 40):
        x = torch.randn(rows, 200, generator=g).to(torch.bfloat16)
        got = chosen(x)
        want = F.linear(x.double(), lin.weight.double(), lin.bias.double())
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 300)
        assert _rel_err(got, want) < 8e-3, (path, rows)  # the output's own bf16 rounding (2^-9), summed over rows
    assert not (tmp_path / "c.json").exists()  # a forced path measures nothing


def test_auto_keeps_the_fastest_path_and_reads_it_back_from_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_CPU_LINEAR", "auto")
    fake = {"bf16": 3.0, "fp32": 2.0, "skinny": 1.0}

    def timed(n, k, rows, paths):
        return {p: fake[p] * (10 if (p == "skinny" and rows > 4) else 1) for p in paths}

    monkeypatch.setattr(linear_choice, "_time_paths", timed)
    monkeypatch.setattr(linear_choice, "skinny_available", lambda: True)
    plan = LinearChooser(tmp_path / "c.json").plan(64, 32)
    assert plan == {1: "skinny", 4: "skinny", 8: "fp32", 16: "fp32", 64: "fp32", 256: "fp32"}
    saved = json.loads((tmp_path / "c.json").read_text())
    assert saved["choices"]["64x32"]["1"] == "skinny" and saved["timings"]["64x32"]["8"]["skinny"] == 10e6

    def boom(*args):
        raise AssertionError("measured again although cached")

    monkeypatch.setattr(linear_choice, "_time_paths", boom)
    again = LinearChooser(tmp_path / "c.json")
    assert again.plan(64, 32) == plan
    assert again.summary()["shapes"] == {"64x32": {str(b): p for b, p in plan.items()}}


def test_a_cached_path_this_machine_cannot_run_is_measured_again(monkeypatch, tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"choices": {"8x8": {str(b): "skinny" for b in BUCKETS}}}))
    monkeypatch.setattr(linear_choice, "skinny_available", lambda: False)
    monkeypatch.setattr(linear_choice, "_time_paths", lambda n, k, rows, paths: {p: float(i) for i, p in enumerate(paths)})
    assert set(LinearChooser(tmp_path / "c.json").plan(8, 8).values()) == {"bf16"}


@needs_kernel
def test_real_measurement_picks_a_candidate_of_each_bucket(tmp_path):
    plan = LinearChooser(tmp_path / "c.json").plan(48, 40)
    assert all(p in linear_choice.candidates(b) for b, p in plan.items())
    assert "48x40" in json.loads((tmp_path / "c.json").read_text())["timings"]


def test_an_unknown_setting_is_refused_naming_it(monkeypatch):
    monkeypatch.setenv("PDSERVE_CPU_LINEAR", "amx")
    with pytest.raises(ValueError, match="PDSERVE_CPU_LINEAR='amx'"):
        linear_choice.forced_path()


def test_buckets():
    assert [linear_choice.bucket_of(r) for r in (1, 2, 4, 5, 16, 17, 64, 65, 5000)] == [1, 4, 4, 8, 16, 64, 64, 256, 256]
