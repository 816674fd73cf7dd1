"""The skinny CPU linear (``pdserve/kernels/cpu_linear.py``) against a float64 ``F.linear``, and its promise: a row's
result is bit-identical whether it is multiplied alone (a decode step) or among up to ``MAX_ROWS`` rows (a
speculative verify step), at any place in the batch and on any number of threads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_linear

pytestmark = pytest.mark.skipif(cpu_linear.load() is None, reason="no C compiler to build the CPU kernels")


@pytest.mark.parametrize("n, k, bias", [(1003, 576, False), (6, 1536, True), (4, 7, True), (17, 13, False)])
def test_skinny_linear_equals_float64_linear(n, k, bias):
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(cpu_linear.MAX_ROWS, 2 * k, generator=g)[:, ::2]  # strided rows, as a split of a projection
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = cpu_linear.skinny_linear(x, w, b)
    assert got.dtype == torch.float32 and got.shape == (cpu_linear.MAX_ROWS, n)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4 * k ** 0.5)


def test_a_rows_result_does_not_depend_on_the_batch_or_threads():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(1001, 576, generator=g), torch.randn(1001, generator=g)
    x = torch.randn(cpu_linear.MAX_ROWS, 576, generator=g)
    alone = torch.cat([cpu_linear.skinny_linear(x[i:i + 1], w, b) for i in range(len(x))])
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for m in (2, 3, 5, 9, cpu_linear.MAX_ROWS):
                assert torch.equal(cpu_linear.skinny_linear(x[:m], w, b), alone[:m]), (t, m)
                assert torch.equal(cpu_linear.skinny_linear(x[-m:], w, b), alone[-m:]), (t, m)
    finally:
        torch.set_num_threads(threads)


def test_usable_only_for_few_fp32_rows_on_cpu():
    w = torch.zeros(8, 4)
    assert cpu_linear.usable(torch.zeros(cpu_linear.MAX_ROWS, 4), w)
    assert not cpu_linear.usable(torch.zeros(cpu_linear.MAX_ROWS + 1, 4), w)
    assert not cpu_linear.usable(torch.zeros(0, 4), w)
    assert not cpu_linear.usable(torch.zeros(2, 4), w.bfloat16())


@pytest.mark.parametrize("m, n, k, bias", [(1, 1003, 576, False), (5, 6, 1536, True), (16, 4, 7, True),
                                           (3, 17, 13, False), (2, 49152 // 64, 576, True)])
def test_bf16_weights_give_the_bits_of_their_fp32_copy(m, n, k, bias):
    # the few-rows path of a bf16 model reads its own bf16 weights; the values are the fp32 copy's exactly, so
    # every output bit must be the copy's (tails k % 8 and n % 4 included, on 1 and 2 threads)
    g = torch.Generator().manual_seed(m * n * k)
    w16 = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(m, 2 * k, generator=g)[:, ::2]
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert torch.equal(cpu_linear.skinny_linear(x, w16, b), cpu_linear.skinny_linear(x, w16.float(), b)), t
    finally:
        torch.set_num_threads(threads)


def test_a_bf16_layer_keeps_its_weights_for_few_rows_unless_told_not_to(monkeypatch):
    from pdserve.shared.models.llama import Fp32WeightLinear

    g = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(64, 40, bias=False).bfloat16()
    x = torch.randn(3, 64, generator=g).bfloat16()
    kept = Fp32WeightLinear(lin)
    assert kept.few_rows_weight.dtype == torch.bfloat16 and kept.few_rows_weight.data_ptr() == lin.weight.data_ptr()
    monkeypatch.setenv("PDSERVE_SKINNY_BF16", "0")
    copy_only = Fp32WeightLinear(lin)
    assert copy_only.few_rows_weight is copy_only.weight
    assert torch.equal(kept(x), copy_only(x))
    assert Fp32WeightLinear(lin.float()).few_rows_weight.dtype == torch.float32  # an fp32 layer has no bf16 to keep


def test_an_included_header_is_part_of_the_build_key(tmp_path, monkeypatch):
    from pdserve.kernels import cpu_build

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "k.h").write_text("static int value(void) { return 1; }\n")
    src = tmp_path / "k.c"
    src.write_text('#include "k.h"\nint get(void) { return value(); }\n')
    flags = ["-O1", "-shared", "-fPIC"]
    first = cpu_build.build(src, flags)
    (tmp_path / "k.h").write_text("static int value(void) { return 2; }\n")
    second = cpu_build.build(src, flags)
    assert first != second
    import ctypes
    assert ctypes.CDLL(str(second)).get() == 2
