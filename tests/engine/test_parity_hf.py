"""Greedy output is token-for-token equal to HF transformers ``generate`` (fp32), and stays equal with
prefix caching on/off, chunked prefill at any token budget, preemption (recompute and swap), and
alone versus in a batch. The oracle for every comparison is HF's own greedy continuation."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

LENGTHS = [1, 15, 16, 17, 31, 33, 120]
NEW = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW)


@pytest.fixture(scope="module")
def prompts(prompt_of):
    return [prompt_of(n, offset=i) for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def expected(prompts, hf_greedy):
    return [hf_greedy(p, NEW) for p in prompts]


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_batch_matches_hf_generate(llm_fp32, prompts, expected):
    outputs = llm_fp32.generate(prompts, GREEDY)
    assert token_ids(outputs) == expected
    for out, prompt in zip(outputs, prompts):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].finish_reason in ("stop", "length")


def test_alone_equals_in_batch(llm_fp32, prompts, expected):
    for prompt, want in zip(prompts[::3], expected[::3]):
        assert token_ids(llm_fp32.generate([prompt], GREEDY)) == [want]


def test_prefix_cache_hit_gives_same_tokens(prompts, expected):
    llm = LLM("smollm2-135m-instruct", dtype="float32", enable_prefix_caching=True)
    first = token_ids(llm.generate(prompts, GREEDY))
    hits_before = llm.get_stats().prefix_cache_hits
    second = token_ids(llm.generate(prompts, GREEDY))
    stats = llm.get_stats()
    assert first == second == expected
    assert stats.prefix_cache_hits > hits_before
    # the 120-token prompt's 7 full blocks come back from the cache: fewer prompt tokens recomputed
    assert stats.prompt_tokens_computed < 2 * sum(LENGTHS)


def test_prefix_caching_off_gives_same_tokens(prompts, expected):
    llm = LLM("smollm2-135m-instruct", dtype="float32", enable_prefix_caching=False)
    assert token_ids(llm.generate(prompts, GREEDY)) == expected
    assert token_ids(llm.generate(prompts[-1:], GREEDY)) == expected[-1:]
    assert llm.get_stats().prefix_cache_hits == 0


@pytest.mark.parametrize("budget", [16, 2048])
def test_token_budget_does_not_change_tokens(budget, prompts, expected):
    llm = LLM("smollm2-135m-instruct", dtype="float32", max_num_batched_tokens=budget)
    assert token_ids(llm.generate(prompts, GREEDY)) == expected


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_gives_same_tokens(mode, prompts, expected):
    # 20 blocks of 16 tokens hold one 152-token sequence, not all seven at once: preemption must happen
    llm = LLM("smollm2-135m-instruct", dtype="float32", num_kv_blocks=21, max_model_len=320,
              preemption_mode=mode, swap_space_bytes="64MiB")
    assert token_ids(llm.generate(prompts, GREEDY)) == expected
    stats = llm.get_stats()
    assert stats.num_preemptions > 0
    assert stats.kv_blocks_used == 0
