"""Backend selection, and the Triton backend equal to the torch backend on a mixed step.

Runs the Triton kernels in the interpreter on CPU (or compiled where CUDA is present).
"""

import os

import torch

if not os.environ.get("TRITON_INTERPRET") and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any triton.jit kernel is defined

import pytest

import pdserve.kernels.triton_paged_attention_prefill  # noqa: F401  (build the kernels for DEVICE now)
from pdserve.kernels.backend import (
    TritonAttentionBackend,
    get_attention_backend,
)
from triton_cases import REL_TOL, make_step, rel_err

pytestmark = pytest.mark.slow

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def test_auto_picks_the_cpu_kernel_on_cpu_where_it_builds():
    from pdserve.kernels import cpu_attention

    expected = "torch" if cpu_attention.load() is None else "cpu"
    assert get_attention_backend("auto", "cpu").name == expected
    assert get_attention_backend("torch", "cpu").name == "torch"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_picks_triton_on_cuda():
    assert isinstance(get_attention_backend("auto", "cuda"), TritonAttentionBackend)


def test_unknown_backend_name_is_refused():
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        get_attention_backend("flash", "cpu")


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        get_attention_backend("triton", "cpu")


def test_triton_on_cpu_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if DEVICE == "cuda":  # the kernels were already built for the GPU in this process
        with pytest.raises(ValueError, match="already imported for the GPU"):
            get_attention_backend("triton", "cpu")
    else:
        assert isinstance(get_attention_backend("triton", "cpu"), TritonAttentionBackend)


@pytest.mark.parametrize(
    "dtype,seqs",
    [
        # decodes and prefill chunks interleaved (one mid-block after a cached prefix): both kernels
        (torch.float32, [(30, 1), (0, 20), (17, 1), (45, 12), (63, 1)]),
        # decodes only: the decode kernel alone, no index list
        (torch.bfloat16, [(300, 1), (7, 1), (64, 1)]),
        # prefill only
        (torch.float16, [(0, 40), (16, 16)]),
    ],
)
def test_triton_backend_equals_torch_backend_on_a_step(dtype, seqs):
    triton_backend = get_attention_backend("triton", DEVICE)
    torch_backend = get_attention_backend("torch", DEVICE)
    a = make_step(seqs, 9, 3, 64, 16, dtype, seed=7)
    b = make_step(seqs, 9, 3, 64, 16, dtype, seed=7)
    outs = []
    for backend, step in ((triton_backend, a), (torch_backend, b)):
        k_cache, v_cache = step.k_cache.to(DEVICE), step.v_cache.to(DEVICE)
        md = step.fresh_md()
        for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
            setattr(md, name, getattr(md, name).to(DEVICE))
        backend.reshape_and_cache(step.key.to(DEVICE), step.value.to(DEVICE), k_cache, v_cache, md.slot_mapping)
        # two "layers" over the same metadata: the second reuses what the first cached in md.cache
        first = backend.forward(step.query.to(DEVICE), k_cache, v_cache, md, 0.125)
        second = backend.forward(step.query.to(DEVICE), k_cache, v_cache, md, 0.125)
        torch.testing.assert_close(first, second, rtol=0, atol=0)
        outs.append((first, k_cache, v_cache))
    (out, tk, tv), (ref, rk, rv) = outs
    torch.testing.assert_close(tk, rk, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(tv, rv, rtol=0, atol=0, equal_nan=True)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < REL_TOL[dtype]
