"""Every supported architecture (Llama, Qwen2, Mistral, Qwen3) on a tiny random-weight model built with
transformers' own classes (``tests/support/tiny_models.py``): greedy tokens equal HF transformers' fp32
``generate`` at TP=1 and TP=2 (Mistral past its window, in prefill and in decode), and an unsupported
``architectures`` value is refused with one error naming the supported ones."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from support.tiny_models import hf_greedy_of

pytestmark = pytest.mark.slow


ARCHS = ["llama", "qwen2", "mistral", "qwen3"]
NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(prompt_of):
    # Mistral's window (12 tokens) is passed in the prompt (the 17- and 33-token prompts: prefill) and during decode
    return [prompt_of(3), prompt_of(9, offset=5), prompt_of(17, offset=11), prompt_of(33, offset=2)]


# Llama at TP=2 is tests/engine/test_tensor_parallel.py's (SmolLM2): not repeated here, to spare CI a rank start
@pytest.mark.parametrize("arch,tp", [(arch, 1) for arch in ARCHS] + [(arch, 2) for arch in ARCHS if arch != "llama"])
def test_greedy_tokens_equal_hf_fp32(arch, tp, tiny_model, prompts):
    want = hf_greedy_of(tiny_model(arch), prompts, NEW)
    llm = LLM(tiny_model(arch), dtype="float32", tensor_parallel_size=tp)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == want


@pytest.mark.parametrize("path", ["bf16", "fp32", "skinny"])
def test_bf16_greedy_tokens_equal_hf_for_each_cpu_linear_path(path, tiny_model, prompts, monkeypatch):
    """A bf16 model with every projection forced onto one CPU product (``PDSERVE_CPU_LINEAR``) still gives HF's
    bf16 and fp32 greedy tokens (the tiny model's logits are far apart, so rounding does not flip a token)."""
    monkeypatch.setenv("PDSERVE_CPU_LINEAR", path)
    llm = LLM(tiny_model("llama"), dtype="bfloat16")
    assert {layer.path(1) for layer in _projections(llm)} == {path}
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == hf_greedy_of(tiny_model("llama"), prompts, NEW, "bfloat16")
    assert got == hf_greedy_of(tiny_model("llama"), prompts, NEW)


def _projections(llm):
    model = llm.llm_engine.model
    return [model.lm_head] + [m for layer in model.layers
                              for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj)]


def test_unsupported_architecture_is_refused_naming_the_supported_ones(tiny_model, tmp_path):
    import json
    import shutil

    shutil.copytree(tiny_model("llama"), tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as exc:
        LLM(str(tmp_path / "m"), dtype="float32")
    assert str(exc.value) == (
        "Model architectures ['GPT2LMHeadModel'] are not supported for now. Supported architectures: "
        "['LlamaForCausalLM', 'MistralForCausalLM', 'Qwen2ForCausalLM', 'Qwen3ForCausalLM']")


@pytest.mark.parametrize("num_kv_blocks,new,preemption_mode", [(16, 100, "recompute"), (6, 50, "recompute"),
                                                               (6, 50, "swap")])
def test_a_windowed_model_frees_out_of_window_blocks_and_stays_exact(tiny_model, prompt_of, num_kv_blocks, new,
                                                                     preemption_mode):
    """Mistral (window 12, blocks of 16), 4 sequences of 20 prompt tokens. With 15 usable blocks and 100 new
    tokens: full attention would need 32 blocks and preempt; freeing the blocks that fall out of the window keeps
    each sequence at 2-3 blocks, so nothing is preempted. With 5, sequences are preempted (recomputed, or swapped
    with their freed blocks left out). Either way the greedy tokens equal HF fp32's (a kernel reading a freed
    block, by then another sequence's, would not)."""
    prompts = [prompt_of(20, offset=o) for o in (1, 4, 9, 13)]
    want = hf_greedy_of(tiny_model("mistral"), prompts, new)
    llm = LLM(tiny_model("mistral"), dtype="float32", num_kv_blocks=num_kv_blocks, max_model_len=20 + new,
              preemption_mode=preemption_mode)
    got = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))]
    engine = llm.llm_engine
    assert engine.kv_manager.sliding_window == 12
    assert got == want
    assert (engine.scheduler.num_preemptions == 0) == (num_kv_blocks == 16)
    if preemption_mode == "swap":
        assert engine.scheduler.num_blocks_swapped_out > 0
    assert engine.kv_manager.num_used_blocks == 0 and engine.kv_manager.block_pool.null_block.ref_cnt == 1
