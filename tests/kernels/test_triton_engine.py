"""The engine gives the same greedy tokens (and log-probabilities) with the triton backend as with torch.

Model: the default model cut to its first 2 layers (real weights, so attention patterns are real;
9 query heads over 3 KV heads, head_dim 64). A token budget of 13 per step makes prompts arrive in
chunks that start mid-block, mixed in one step with other sequences' decodes; the repeated prompt
prefix gives prefix-cache hits. In Triton's interpreter on CPU (compiled where CUDA is present).
"""

import os

import torch

if not os.environ.get("TRITON_INTERPRET") and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any triton.jit kernel is defined

import pytest

llm_module = pytest.importorskip("pdserve.shared.engine.llm", reason="the engine is not importable yet")

pytestmark = pytest.mark.slow

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


@pytest.fixture(scope="module")
def two_layer_model(tmp_path_factory):
    import shutil

    from transformers import AutoModelForCausalLM

    from pdserve.shared.models.resolve import resolve_model

    src = resolve_model("smollm2-135m-instruct")
    out = tmp_path_factory.mktemp("smollm2-2-layers")
    model = AutoModelForCausalLM.from_pretrained(src, num_hidden_layers=2, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    for name in os.listdir(src):
        if name.startswith("tokenizer") or name.endswith(".jinja"):
            shutil.copy(os.path.join(src, name), out)
    return str(out)


@pytest.mark.timeout(600)
def test_triton_backend_generates_the_torch_backends_greedy_tokens(two_layer_model):
    from pdserve import LLM, SamplingParams

    story = "Once upon a time, in a land far away, there lived a dragon who loved to read books about"
    prompts = ["The capital of France is", story + " the sea.", "def fibonacci(n):\n    ", story + " the stars and"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    results = {}
    for backend in ("torch", "triton"):
        llm = LLM(model=two_layer_model, attention_backend=backend, dtype="float32", device=DEVICE,
                  num_kv_blocks=64, block_size=16, max_num_batched_tokens=13, enable_prefix_caching=True)
        assert llm.llm_engine.backend.name == backend
        results[backend] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for want, got in zip(results["torch"], results["triton"]):
        assert got.token_ids == want.token_ids
        assert len(set(want.token_ids)) > 1  # not a degenerate repetition
        for w, g in zip(want.logprobs, got.logprobs):
            assert w.keys() == g.keys()
            for tok in w:
                assert abs(w[tok].logprob - g[tok].logprob) < 1e-3
