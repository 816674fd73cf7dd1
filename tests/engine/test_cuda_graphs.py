"""The decode-graph runner's CPU-checkable part (pdserve/shared/engine/cuda_graphs.py): bucket choice, padding a decode batch
into the static buffers and slicing the output back, run eagerly in place of capture/replay.

Oracle: the unpadded forward of the same model over an identical copy of the KV cache. The padded path must give the
same greedy tokens step after step as the batch shrinks through the buckets, write K/V only into the real sequences'
new slots (every other slot of the cache, the null block included, stays bit-identical), and leave batches above the
largest size, prefill and mixed steps to the eager path. A random 2-layer Llama built here (no weights loaded), on
the CPU kernel, the PyTorch reference and the Triton kernels (interpreted on CPU; compiled where CUDA is present); the
engine test runs the default model's engine with the runner attached against the same engine without it.
Where CUDA is present (skipped elsewhere) the same checks run with real capture and replay, and the default model's
engine with graphs on must give the tokens of the same engine with ``enforce_eager``: ``pdserve/loadtest/gpu_check.sh`` runs
this file first.
"""

from __future__ import annotations

import os
from collections import Counter

import torch

if not os.environ.get("TRITON_INTERPRET") and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any triton.jit kernel is defined

import pytest
from transformers import LlamaConfig

from pdserve.kernels.attention_metadata import AttentionMetadata
from pdserve.kernels.backend import get_attention_backend
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.cuda_graphs import (
    PAD_SLOT_ID,
    DecodeGraphRunner,
    build_decode_graphs,
    cudagraph_capture_sizes,
)
from pdserve.shared.engine.kv_cache import KVCache, KVCacheSpec
from pdserve.shared.models.llama import LlamaForCausalLM

BS = 16
MAX_LEN = 256
TRITON_DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or TRITON_DEVICE != "cuda",
                                reason="capture and replay need CUDA (and TRITON_INTERPRET unset)")


def test_capture_sizes_are_vllms_list_and_cover_the_largest_batch():
    assert cudagraph_capture_sizes(1) == [1]
    assert cudagraph_capture_sizes(4) == [1, 2, 4]
    assert cudagraph_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = cudagraph_capture_sizes(512)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-3:] == [480, 496, 512] and 256 in sizes and 264 not in sizes
    with pytest.raises(ValueError, match="max_cudagraph_capture_size"):
        cudagraph_capture_sizes(0)
    with pytest.raises(ValueError, match="max_cudagraph_capture_size"):
        EngineConfig(max_cudagraph_capture_size=0)


def _tiny_model(backend: str, layers: int = 2, device: str = "cpu") -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=MAX_LEN)
    model = LlamaForCausalLM(config, get_attention_backend(backend, device), MAX_LEN).to(device)
    model.init_rope(torch.float32)
    if device == "cpu":
        model.use_fp32_matmul_weights()  # as the loader does for fp32 on CPU
    return model.eval()


def _kv(model, device: str = "cpu") -> KVCache:
    kv = KVCache(KVCacheSpec.from_model_config(model.config, BS, torch.float32), 48, device=device)
    kv.kv[:, :, 1:] = torch.randn_like(kv.kv[:, :, 1:])  # earlier steps' K/V; block 0, the null block, stays zero
    return kv


def _step(seqs: list[dict], device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One decode token per sequence: ``{"blocks", "len" (tokens before this one), "token"}``."""
    pos = [s["len"] for s in seqs]
    slots = [s["blocks"][p // BS] * BS + p % BS for s, p in zip(seqs, pos)]
    md = AttentionMetadata.from_lists(slots, [s["blocks"] for s in seqs], [p + 1 for p in pos], [1] * len(seqs),
                                      BS, device)
    return torch.tensor([s["token"] for s in seqs], device=device), torch.tensor(pos, device=device), md


def _sequences(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    seqs, free = [], list(range(1, 48))
    for i in range(n):
        length = int(torch.randint(1, 60, (1,), generator=g))
        nblocks = (length + 16) // BS + 1
        seqs.append({"id": i, "blocks": [free.pop() for _ in range(nblocks)], "len": length,
                     "token": int(torch.randint(0, 512, (1,), generator=g))})
    return seqs


# emulate_replay: each size's metadata built once with the capture's host-side lengths and reused by every step, as a
# replayed graph does; the reference backend reads the host lengths (it is not capturable), so it runs per step
@pytest.mark.parametrize("backend,emulate_replay", [("cpu", True), ("cpu", False), ("torch", False),
                                                    pytest.param("triton", True, marks=pytest.mark.slow)])
def test_padded_decode_gives_the_unpadded_tokens_and_writes_only_real_slots(backend, emulate_replay):
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    # Triton's interpreter takes ~1.4 s a forward pass of 2 layers: 1 layer, 4 sequences there (about 2 s)
    small = backend == "triton" and device == "cpu"
    _check_padded_decode(backend, device, small, use_cuda_graph=False, emulate_replay=emulate_replay)


@needs_cuda
@pytest.mark.slow
def test_captured_graphs_give_the_unpadded_tokens_and_write_only_real_slots():
    """The real thing: capture every size (the capture's own runs write nothing either), then replay."""
    _check_padded_decode("triton", "cuda", False, use_cuda_graph=True, emulate_replay=False)


@torch.inference_mode()
def _check_padded_decode(backend, device, small, use_cuda_graph, emulate_replay):
    num = 4 if small else 7
    model = _tiny_model(backend, 1 if small else 2, device)
    eager_kv = _kv(model, device)
    padded_kv = KVCache(eager_kv.spec, eager_kv.num_blocks, device=device)
    padded_kv.kv.copy_(eager_kv.kv)
    before = padded_kv.kv.clone()
    layers = lambda kv: [kv.layer(i) for i in range(kv.spec.num_layers)]  # noqa: E731
    runner = DecodeGraphRunner(model, layers(padded_kv), [1, 2, 4, 8], MAX_LEN, BS, device,
                               use_cuda_graph=use_cuda_graph, emulate_replay=emulate_replay)
    if use_cuda_graph:
        runner.capture()
        assert sorted(runner.graphs) == [1, 2, 4, 8]
    eager_seqs, padded_seqs = _sequences(num), _sequences(num)
    written = []
    for step in range(num):  # one sequence leaves after each step: batches 7..1 -> sizes 8, 8, 8, 4, 4, 2, 1
        ids, pos, md = _step(eager_seqs, device)
        want = model.compute_logits(model(ids, pos, layers(eager_kv), md))
        ids, pos, md = _step(padded_seqs, device)
        assert runner.fits(md)
        got = model.compute_logits(runner.run(ids, pos, md))
        n, size = md.num_seqs, runner.padded_size(md.num_seqs)
        assert runner.slot_mapping[n:size].eq(PAD_SLOT_ID).all() and runner.seq_lens[n:size].eq(1).all()
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist(), f"step {step}"
        written += md.slot_mapping.tolist()
        for seqs, logits in ((eager_seqs, want), (padded_seqs, got)):
            for s, token in zip(seqs, logits.argmax(-1).tolist()):
                s["len"] += 1
                s["token"] = token
            seqs.pop(step % len(seqs))
    assert runner.steps == (Counter({4: 2, 2: 1, 1: 1}) if num == 4 else Counter({8: 3, 4: 2, 2: 1, 1: 1}))
    # K/V of the real rows as the eager engine wrote them; every other slot (null block, free blocks, the other
    # sequences' earlier tokens) bit-identical to before: the padding rows wrote nowhere
    torch.testing.assert_close(padded_kv.kv, eager_kv.kv, rtol=1e-4, atol=1e-4)
    untouched = torch.ones(padded_kv.num_blocks * BS, dtype=torch.bool, device=device)
    untouched[torch.tensor(written, device=device)] = False
    flat = lambda t: t.reshape(*t.shape[:2], -1, *t.shape[4:])  # noqa: E731  [layers, 2, slots, heads, dim]
    assert torch.equal(flat(padded_kv.kv)[:, :, untouched], flat(before)[:, :, untouched])
    assert not torch.equal(flat(padded_kv.kv)[:, :, ~untouched], flat(before)[:, :, ~untouched])


@torch.inference_mode()
def test_replay_emulation_catches_a_backend_that_reads_host_lengths():
    """The reference backend builds its gathers from ``seq_lens_cpu``: under a replay (capture-time lengths, plans
    cached at the first step) it attends over the wrong positions. The emulation must see that, or it proves nothing
    for the backends that pass it."""
    model = _tiny_model("torch")
    kv = _kv(model)
    layers = [kv.layer(i) for i in range(2)]
    seqs = _sequences(3)
    ids, pos, md = _step(seqs)
    want = model.compute_logits(model(ids, pos, [(k.clone(), v.clone()) for k, v in layers], md))
    runner = DecodeGraphRunner(model, layers, [1, 2, 4], MAX_LEN, BS, "cpu", False, emulate_replay=True)
    got = model.compute_logits(runner.run(ids, pos, _step(seqs)[2]))
    assert not torch.allclose(got, want, rtol=1e-3, atol=1e-3)


@torch.inference_mode()
def test_only_pure_decode_batches_up_to_the_largest_size_fit():
    model = _tiny_model("torch")
    kv = _kv(model)
    runner = DecodeGraphRunner(model, [kv.layer(i) for i in range(2)], [1, 2, 4], MAX_LEN, BS, "cpu", False)
    with pytest.raises(ValueError, match="ascending"):
        DecodeGraphRunner(model, [], [4, 2], MAX_LEN, BS, "cpu", False)
    seqs = _sequences(5)
    assert runner.fits(_step(seqs[:4])[2]) and runner.padded_size(3) == 4
    assert not runner.fits(_step(seqs)[2]) and runner.padded_size(5) is None  # above the largest size: eager
    prefill = AttentionMetadata.from_lists([17, 18, 19], [[1]], [3], [3], BS, "cpu")
    mixed = AttentionMetadata.from_lists([17, 18, 40], [[1], [2]], [2, 9], [2, 1], BS, "cpu")
    assert not runner.fits(prefill) and not runner.fits(mixed)
    wide = AttentionMetadata.from_lists([17], [[1] * (MAX_LEN // BS + 1)], [1], [1], BS, "cpu")
    assert not runner.fits(wide)  # a block table wider than the static one


def test_graphs_are_built_only_for_cuda_with_triton_and_one_rank():
    from support.log_capture import captured_log

    backend = get_attention_backend("triton", TRITON_DEVICE)  # interpreted on CPU: stands for the CUDA backend
    with captured_log("pdserve.shared.engine.cuda_graphs") as log:
        for config in (EngineConfig(), EngineConfig(device="cuda", enforce_eager=True),
                       EngineConfig(device="cuda", tensor_parallel_size=2)):
            assert build_decode_graphs(config, backend, None, [], MAX_LEN) is None
        assert "CUDA graphs off: tensor_parallel_size 2" in log.getvalue()
        torch_backend = get_attention_backend("torch")
        assert build_decode_graphs(EngineConfig(device="cuda"), torch_backend, None, [], MAX_LEN) is None
        assert "attention backend 'torch' syncs with the host" in log.getvalue()


def test_prefill_pods_never_capture_and_decode_pods_follow_their_setting():
    from pdserve.services.decode.settings import DecodeSettings
    from pdserve.services.prefill.settings import PrefillSettings

    assert PrefillSettings(device="cuda").engine_config().enforce_eager  # prefill steps only: graphs unused
    assert not DecodeSettings(device="cuda").engine_config().enforce_eager
    assert DecodeSettings(device="cuda", enforce_eager=True).engine_config().enforce_eager
    assert DecodeSettings(max_cudagraph_capture_size=16).engine_config().max_cudagraph_capture_size == 16


@torch.inference_mode()
def test_triton_decode_is_right_with_the_captures_host_lengths():
    """A graph bakes the decode kernel's split count, chosen on the host from ``seq_lens_cpu`` at capture, where
    every row claims ``max_model_len`` tokens; replays then run shorter contexts (and padding rows of 1 token)."""
    from pdserve.kernels.attention_ref import paged_attention_ref
    from pdserve.kernels.bench import fresh, make_step
    from pdserve.kernels.triton_paged_attention_decode import choose_num_splits, paged_attention_decode

    step = make_step([(0, 1), (20, 1), (300, 1), (1, 1)], 8, 2, 64, BS, torch.float32, TRITON_DEVICE)
    captured = fresh(step.md)
    captured.seq_lens_cpu = [4096] * 4
    splits = choose_num_splits(4096, 4, 2, torch.device("cpu"))  # 4 "SMs" off CUDA; a real GPU's count on it
    assert splits > choose_num_splits(max(step.md.seq_lens_cpu), 4, 2, torch.device("cpu"))
    want = paged_attention_ref(step.query, step.k_cache, step.v_cache, fresh(step.md), 0.125)
    got = paged_attention_decode(step.query, step.k_cache, step.v_cache, captured, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_engine_with_the_padded_runner_generates_the_eager_engines_tokens(llm_fp32, prompt_of):
    """The default model (fp32), 6 requests that finish one after another: decode batches 6 and 5 exceed the
    largest size (4) and run eagerly, 4..1 run padded through ``ModelRunner.execute_model``, replay emulated."""
    from pdserve import SamplingParams

    engine = llm_fp32.llm_engine
    prompts = [prompt_of(5 + 3 * i, offset=i) for i in range(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=2 + i, ignore_eos=True) for i in range(6)]
    want = [o.outputs[0].token_ids for o in llm_fp32.generate(prompts, params, use_tqdm=False)]
    runner = DecodeGraphRunner(engine.model, engine.runner.kv_caches, [1, 2, 4], engine.max_model_len,
                               engine.config.block_size, "cpu", use_cuda_graph=False, emulate_replay=True)
    assert engine.backend.name == "cpu"  # reads lengths from tensors, as the Triton backend does
    engine.runner.graphs = runner
    try:
        got = [o.outputs[0].token_ids for o in llm_fp32.generate(prompts, params, use_tqdm=False)]
    finally:
        engine.runner.graphs = None
    assert got == want
    assert runner.steps == {4: 2, 2: 1, 1: 1}  # batches 4 and 3 padded to 4, 2, 1; 6 and 5 eager


@needs_cuda
@pytest.mark.slow
def test_engine_with_cuda_graphs_generates_the_eager_engines_tokens(prompt_of):
    """The default model on the GPU (fp32): graphs on (sizes 1, 2, 4) against ``enforce_eager``, 6 requests finishing
    one after another, so batches above the largest size run eagerly and the rest replay padded graphs."""
    from pdserve import LLM, SamplingParams

    prompts = [prompt_of(5 + 3 * i, offset=i) for i in range(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 4 * i, ignore_eos=True) for i in range(6)]
    tokens = {}
    for eager in (True, False):
        llm = LLM("smollm2-135m-instruct", dtype="float32", device="cuda", enforce_eager=eager,
                  max_cudagraph_capture_size=4, kv_cache_memory_bytes="256MiB")
        graphs = llm.llm_engine.runner.graphs
        assert (graphs is None) == eager
        tokens[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if not eager:
            assert sorted(graphs.graphs) == [1, 2, 4] and set(graphs.steps) == {1, 2, 4}
        del llm
        torch.cuda.empty_cache()
    assert tokens[False] == tokens[True]
