"""The Triton kernels equal the PyTorch reference (``attention_ref``) on random paged steps.

Without a GPU they run in Triton's interpreter on CPU tensors; on a CUDA machine (TRITON_INTERPRET
unset) the same cases run compiled on the GPU. Outputs are poisoned with NaN before each run and so is
every cache slot that no sequence owns (except the null block 0), so an unwritten output element or a
read outside a sequence's blocks fails the comparison. Cases are picked combinations, not the full
cross product: the interpreter is slow.
"""

import os

if not os.environ.get("TRITON_INTERPRET") and not __import__("torch").cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any triton.jit kernel is defined

import pytest
import torch

from pdserve.kernels.attention_ref import paged_attention_ref, reshape_and_cache_ref
from pdserve.kernels.triton_paged_attention_decode import choose_num_splits, paged_attention_decode
from pdserve.kernels.triton_paged_attention_prefill import paged_attention_prefill
from pdserve.kernels.triton_reshape_and_cache import reshape_and_cache
from triton_cases import REL_TOL, drop_blocks_outside_window, make_step, rel_err

pytestmark = pytest.mark.slow

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def to_device(step):
    for name in ("k_cache", "v_cache", "key", "value", "query"):
        setattr(step, name, getattr(step, name).to(DEVICE))
    md = step.md
    for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
        setattr(md, name, getattr(md, name).to(DEVICE))
    return step


def written_step(*args, **kwargs):
    """A step whose new K/V is already in the cache (written by the reference)."""
    step = to_device(make_step(*args, **kwargs))
    reshape_and_cache_ref(step.key, step.value, step.k_cache, step.v_cache, step.md.slot_mapping)
    return step


def assert_matches_ref(out, step, dtype, rows=None):
    ref = paged_attention_ref(step.query, step.k_cache, step.v_cache, step.fresh_md(), step.query.shape[-1] ** -0.5)
    if rows is not None:
        out, ref = out[rows], ref[rows]
    assert torch.isfinite(out).all(), "unwritten (NaN) output elements or reads of poisoned slots"
    err = rel_err(out, ref)
    assert err < REL_TOL[dtype], f"relative error {err:.2e} >= {REL_TOL[dtype]:.0e}"


# ---------------------------------------------------------------- reshape_and_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reshape_and_cache_writes_exactly_the_reference_slots_and_skips_padding(dtype):
    step = to_device(make_step([(3, 5), (0, 17), (16, 16), (40, 1)], 6, 3, 64, 16, dtype, seed=1))
    # padding tokens (-1) interleaved, K/V as strided views into a fused QKV projection output
    n = step.key.shape[0]
    slots = step.md.slot_mapping.clone()
    slots[[2, 9, n - 1]] = -1
    fused = torch.randn(n, 3 * 3 * 64, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE)
    key = fused[:, 3 * 64 : 6 * 64].view(n, 3, 64)
    value = fused[:, 6 * 64 :].view(n, 3, 64)
    assert not key.is_contiguous()
    want_k, want_v = step.k_cache.clone(), step.v_cache.clone()
    reshape_and_cache_ref(key, value, want_k, want_v, slots)
    reshape_and_cache(key, value, step.k_cache, step.v_cache, slots)
    torch.testing.assert_close(step.k_cache, want_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(step.v_cache, want_v, rtol=0, atol=0, equal_nan=True)


def test_reshape_and_cache_rejects_mismatched_shapes_and_dtypes():
    k_cache = torch.zeros(4, 16, 2, 64, device=DEVICE)
    key = torch.zeros(3, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="dtype"):
        reshape_and_cache(key.half(), key.half(), k_cache, k_cache.clone(), torch.zeros(3, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="key and value"):
        reshape_and_cache(key[:, :1], key[:, :1], k_cache, k_cache.clone(), torch.zeros(3, dtype=torch.long, device=DEVICE))


# ---------------------------------------------------------------- decode (split-K)

# (num_heads, num_kv_heads, head_dim, block_size, dtype, context lengths incl. the query token, num_splits)
DECODE_CASES = [
    # MHA, short and block-edge lengths, one split (stage 1 writes the output itself)
    (4, 4, 64, 16, torch.float32, [1, 15, 16, 17, 33, 64], 1),
    # GQA 3, head_dim 128, bf16, more splits than the short sequences can fill (empty partitions)
    (6, 2, 128, 32, torch.bfloat16, [1, 31, 32, 200, 257], 8),
    # GQA 8, a 2,048-token context split in 4, fp16
    (8, 1, 128, 16, torch.float16, [2048, 5, 160], 4),
    # 8 KV heads x GQA 3, automatic split count, fp32
    (24, 8, 64, 32, torch.float32, [700, 96, 3], None),
]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype,lens,splits", DECODE_CASES)
def test_decode_matches_reference(num_heads, num_kv_heads, head_dim, block_size, dtype, lens, splits):
    step = written_step([(n - 1, 1) for n in lens], num_heads, num_kv_heads, head_dim, block_size, dtype, seed=len(lens))
    out = torch.full_like(step.query, float("nan"))
    paged_attention_decode(step.query, step.k_cache, step.v_cache, step.md, head_dim**-0.5, out=out, num_splits=splits)
    assert_matches_ref(out, step, dtype)


def test_decode_of_a_subset_writes_only_its_rows():
    # a mixed batch: decodes at sequences 0 and 2, a prefill chunk in between
    step = written_step([(40, 1), (10, 7), (99, 1)], 8, 2, 64, 16, torch.float32, seed=3)
    out = torch.full_like(step.query, float("nan"))
    paged_attention_decode(step.query, step.k_cache, step.v_cache, step.md, 0.125, out=out, seq_ids=[0, 2], num_splits=2)
    rows = [0, step.query.shape[0] - 1]
    assert_matches_ref(out, step, torch.float32, rows=rows)
    assert torch.isnan(out[1:-1]).all()


def test_decode_refuses_a_batch_with_prefill_chunks_unless_told_which_sequences():
    step = written_step([(4, 1), (0, 3)], 4, 4, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="query_len 1"):
        paged_attention_decode(step.query, step.k_cache, step.v_cache, step.md, 0.125)


def test_split_count_fills_the_machine_and_respects_short_contexts():
    cpu = torch.device("cpu")
    assert choose_num_splits(100, 1, 1, cpu) == 1  # under one minimum partition
    assert choose_num_splits(4096, 1, 1, cpu) == 16  # capped by the 256-token minimum partition
    assert choose_num_splits(4096, 3, 1, cpu) == 16  # 8 programs x 4 "SMs" / 3 sequences, rounded up to 2^k
    assert choose_num_splits(4096, 64, 8, cpu) == 1  # the batch alone fills it


# ---------------------------------------------------------------- prefill (varlen, causal, paged)

# (num_heads, num_kv_heads, head_dim, block_size, dtype, [(cached, q_len), ...])
PREFILL_CASES = [
    # fresh prompt, chunk after a prefix that ends mid-block, block-aligned chunk, a decode row
    (4, 4, 64, 16, torch.float32, [(0, 37), (21, 30), (32, 32), (9, 1)]),
    # GQA 3, head_dim 128, block 32: chunks starting mid-block, bf16
    (9, 3, 128, 32, torch.bfloat16, [(45, 19), (0, 64), (64, 2)]),
    # GQA 8 with 2 KV heads, fp16, a long cached prefix (2,000) and a chunk up to 2,048
    (16, 2, 64, 16, torch.float16, [(2000, 48), (3, 70)]),
    # a 600-token fresh prompt (many causal diagonal tiles), 3 KV heads x GQA 1, fp32
    (3, 3, 128, 32, torch.float32, [(0, 600)]),
]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype,seqs", PREFILL_CASES)
def test_prefill_matches_reference(num_heads, num_kv_heads, head_dim, block_size, dtype, seqs):
    step = written_step(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=len(seqs))
    out = torch.full_like(step.query, float("nan"))
    paged_attention_prefill(step.query, step.k_cache, step.v_cache, step.md, head_dim**-0.5, out=out)
    assert_matches_ref(out, step, dtype)


def test_prefill_accepts_a_strided_query_view():
    step = written_step([(5, 20)], 6, 2, 64, 16, torch.float32, seed=5)
    n = step.query.shape[0]
    fused = torch.randn(n, 10 * 64, device=DEVICE)
    step.query = fused[:, : 6 * 64].view(n, 6, 64)
    out = paged_attention_prefill(step.query, step.k_cache, step.v_cache, step.md, 0.125)
    assert_matches_ref(out, step, torch.float32)


# ---------------------------------------------------------------- sliding window (Mistral, Qwen2/3 sliding layers)


def assert_matches_windowed_ref(step, dtype, window, run):
    """``run(step)`` (a kernel call with ``sliding_window=window``) equals the masked reference, with every block
    wholly before its sequence's windows pointing at a NaN block (what freeing them leaves)."""
    ref = paged_attention_ref(step.query, step.k_cache, step.v_cache, step.fresh_md(), step.query.shape[-1] ** -0.5,
                              window)
    assert drop_blocks_outside_window(step, window) > 0
    out = run(step)
    assert torch.isfinite(out).all(), "a read before the window (a NaN block) or an unwritten row"
    err = rel_err(out, ref)
    assert err < REL_TOL[dtype], f"relative error {err:.2e} >= {REL_TOL[dtype]:.0e}"


@pytest.mark.parametrize("window,splits", [(20, 1), (20, 4), (64, 2)])
def test_decode_with_a_sliding_window(window, splits):
    step = written_step([(n - 1, 1) for n in (1, 15, 33, 100, 260)], 4, 2, 64, 16, torch.float32, seed=11)
    assert_matches_windowed_ref(step, torch.float32, window, lambda s: paged_attention_decode(
        s.query, s.k_cache, s.v_cache, s.md, 0.125, num_splits=splits, sliding_window=window))


@pytest.mark.parametrize("window,dtype", [(7, torch.float32), (40, torch.bfloat16)])
def test_prefill_with_a_sliding_window(window, dtype):
    """Tiles whose first rows see keys that later rows' windows exclude, and tiles wholly hidden from some rows."""
    step = written_step([(0, 37), (21, 30), (70, 40), (9, 1)], 6, 2, 64, 16, dtype, seed=12)
    assert_matches_windowed_ref(step, dtype, window, lambda s: paged_attention_prefill(
        s.query, s.k_cache, s.v_cache, s.md, 0.125, sliding_window=window))
