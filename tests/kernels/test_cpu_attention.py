"""The CPU paged-attention kernel (``pdserve/kernels/paged_attention_cpu.c``) equals the reference on mixed steps."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import cpu_attention
from pdserve.kernels.attention_ref import paged_attention_ref, reshape_and_cache_ref
from tests.kernels.triton_cases import REL_TOL, drop_blocks_outside_window, make_step, rel_err

pytestmark = pytest.mark.skipif(cpu_attention.load() is None, reason="no C compiler to build the CPU kernel")

STEPS = {
    "mixed": [(5, 1), (0, 17), (19, 20), (32, 1), (0, 1), (16, 16)],
    "decodes": [(5, 1), (15, 1), (48, 1), (300, 1)],
    "long_prefill": [(7, 70)],  # three row chunks of one sequence
    "verify_k_plus_1": [(40, 5), (3, 4), (77, 1)],  # speculative verification: multi-token queries
    "chunk_of_one_row": [(10, 33), (0, 65), (31, 1)],  # prefill chunks whose last task has a single row
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(STEPS))
@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(9, 3, 16), (4, 4, 32), (8, 1, 16)])
def test_kernel_matches_reference(name, dtype, num_heads, num_kv_heads, block_size):
    step = make_step(STEPS[name], num_heads, num_kv_heads, 64, block_size, dtype)
    reshape_and_cache_ref(step.key, step.value, step.k_cache, step.v_cache, step.md.slot_mapping)
    md = step.md
    ref = paged_attention_ref(step.query, step.k_cache, step.v_cache, step.fresh_md(), 0.125)
    out = cpu_attention.paged_attention_cpu(step.query, step.k_cache, step.v_cache, md.block_tables, md.seq_lens,
                                            md.query_start_loc, 0.125)
    assert out.dtype == dtype and out.shape == step.query.shape
    assert torch.isfinite(out).all()  # the cache is NaN outside the written slots: nothing else was read
    assert rel_err(out, ref) < REL_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(STEPS))
@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(9, 3, 16), (4, 4, 32), (8, 1, 16), (4, 2, 8)])
def test_single_row_tasks_equal_the_general_task_bit_for_bit(name, dtype, num_heads, num_kv_heads, block_size):
    """The one-row (decode) path reads K/V in place and shares loads over up to 3 heads; its sums run in the general
    AVX2 task's order, so outputs are equal bit for bit (2 heads per KV head: a group of 2; 8: groups of 3, 3, 2)."""
    step = make_step(STEPS[name], num_heads, num_kv_heads, 64, block_size, dtype)
    reshape_and_cache_ref(step.key, step.value, step.k_cache, step.v_cache, step.md.slot_mapping)
    md, lib = step.md, cpu_attention.load()
    outs = []
    for on in (0, 1):
        lib.set_decode_path(on)
        try:
            outs.append(cpu_attention.paged_attention_cpu(step.query, step.k_cache, step.v_cache, md.block_tables,
                                                          md.seq_lens, md.query_start_loc, 0.125))
        finally:
            lib.set_decode_path(1)
    assert torch.isfinite(outs[1]).all() and torch.equal(outs[0], outs[1])


def test_a_sequence_without_query_rows_is_skipped():
    step = make_step([(20, 3), (9, 0), (4, 2)], 4, 2, 64, 16, torch.float32)
    reshape_and_cache_ref(step.key, step.value, step.k_cache, step.v_cache, step.md.slot_mapping)
    md = step.md
    ref = paged_attention_ref(step.query, step.k_cache, step.v_cache, step.fresh_md(), 0.125)
    out = cpu_attention.paged_attention_cpu(step.query, step.k_cache, step.v_cache, md.block_tables, md.seq_lens,
                                            md.query_start_loc, 0.125)
    assert rel_err(out, ref) < REL_TOL[torch.float32]


def test_loading_the_kernels_keeps_subnormal_floats():
    """A library built with -ffast-math sets flush-to-zero for the whole process when loaded (crtfastmath.o)."""
    from pdserve.kernels import cpu_elementwise

    cpu_attention.load()
    cpu_elementwise.load()
    tiny = float.fromhex("0x1p-1022")  # the smallest normal double
    assert tiny / 2 > 0
    assert torch.tensor(1e-40, dtype=torch.float32).item() != 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_write_equals_the_reference_bit_for_bit_and_skips_padding(dtype):
    """The C cache write (``reshape_and_cache_cpu``) against ``reshape_and_cache_ref`` on strided K/V views of a fused
    QKV projection, with padding slots (-1) and slots in scattered blocks; a slot past the cache raises and writes
    nothing."""
    g = torch.Generator().manual_seed(0)
    num_blocks, bs, kvh, hd, t = 9, 16, 3, 64, 7
    qkv = torch.randn(t, (9 + 2 * kvh) * hd, generator=g).to(dtype)
    k = qkv[:, 9 * hd:(9 + kvh) * hd].view(t, kvh, hd)
    v = qkv[:, (9 + kvh) * hd:].view(t, kvh, hd)
    slots = torch.tensor([5 * bs + 3, -1, 1 * bs, 8 * bs + 15, -1, 2 * bs + 7, 6 * bs + 1])
    caches = [torch.full((num_blocks, bs, kvh, hd), float("nan"), dtype=dtype) for _ in range(4)]
    reshape_and_cache_ref(k, v, caches[0], caches[1], slots)
    assert cpu_attention.reshape_and_cache_cpu(k, v, caches[2], caches[3], slots)
    for ref, out in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(ref.isnan(), out.isnan()) and torch.equal(ref.nan_to_num(), out.nan_to_num())
    before = [c.clone() for c in caches[2:]]
    with pytest.raises(IndexError, match="outside the cache's 144 slots"):
        cpu_attention.reshape_and_cache_cpu(k, v, caches[2], caches[3], torch.tensor([0, 1, 2, 3, 4, 5, 144]))
    assert all(torch.equal(b.nan_to_num(), c.nan_to_num()) for b, c in zip(before, caches[2:]))
    # a layout it does not take (K not a row view of heads) is left to the reference: nothing written, False
    assert not cpu_attention.reshape_and_cache_cpu(k.transpose(1, 2).contiguous().transpose(1, 2), v, caches[2],
                                                   caches[3], slots)


WINDOW_STEPS = {
    "mixed": [(5, 1), (0, 17), (19, 20), (32, 1), (0, 1), (16, 16), (70, 40)],
    "decodes": [(5, 1), (15, 1), (48, 1), (300, 1)],
    "long_prefill": [(7, 70)],
    "verify_k_plus_1": [(40, 5), (3, 4), (77, 1)],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(WINDOW_STEPS))
@pytest.mark.parametrize("window", [1, 5, 16, 33])
@pytest.mark.parametrize("num_heads,num_kv_heads,block_size,head_dim", [(9, 3, 16, 64), (4, 4, 32, 64), (8, 1, 16, 64),
                                                                         (4, 2, 8, 64), (4, 2, 16, 20)])
def test_sliding_window_matches_the_reference_and_reads_no_block_before_it(name, window, dtype, num_heads,
                                                                           num_kv_heads, block_size, head_dim):
    """A windowed layer (Mistral, Qwen2/3's sliding layers) in the C kernel: equal to the masked reference
    (transformers' ``q - W < k <= q``), with blocks wholly before every row's window pointing at NaN (freed), through
    the general task and the one-row decode path alike (head_dim 20: the scalar task)."""
    step = make_step(WINDOW_STEPS[name], num_heads, num_kv_heads, head_dim, block_size, dtype)
    reshape_and_cache_ref(step.key, step.value, step.k_cache, step.v_cache, step.md.slot_mapping)
    ref = paged_attention_ref(step.query, step.k_cache, step.v_cache, step.fresh_md(), 0.125, window)
    dropped = drop_blocks_outside_window(step, window)
    assert dropped or name not in ("mixed", "decodes") or window > block_size  # these steps drop blocks
    md, lib = step.md, cpu_attention.load()
    outs = []
    for on in (0, 1):
        lib.set_decode_path(on)
        try:
            outs.append(cpu_attention.paged_attention_cpu(step.query, step.k_cache, step.v_cache, md.block_tables,
                                                          md.seq_lens, md.query_start_loc, 0.125,
                                                          sliding_window=window))
        finally:
            lib.set_decode_path(1)
    assert torch.isfinite(outs[1]).all()
    assert rel_err(outs[1], ref) < REL_TOL[dtype]
    assert torch.equal(outs[0], outs[1])
