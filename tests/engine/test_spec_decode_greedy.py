"""Speculative decoding is exact: greedy output equals plain decoding token for token (fp32), whatever the
prompt length (1-300 tokens), k, prefix caching, chunked prefill, preemption by recompute or swap in the
middle of speculation, and n > 1; a stop string, a stop token id, EOS and max_tokens inside an accepted run
end the output where plain decoding ends it. Oracle: the same engine configuration without speculation."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from support.model_fixtures import TEXT

LENGTHS = (1, 23, 150, 300)
MAX_LEN = 336
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _ngram(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
            "adaptive": False}


@pytest.fixture(scope="module")
def prompts(tokenizer):
    # copy-friendly text (the model continues it, so drafts from the prompt get accepted) and a chat prompt
    ids = tokenizer.encode(TEXT + " " + TEXT)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Repeat exactly: the bridges are painted "
                                           "in different colours, each guild choosing its own."}],
                                         add_generation_prompt=True)
    # transformers 5 returns a BatchEncoding from apply_chat_template
    chat = list(chat["input_ids"] if hasattr(chat, "keys") else chat)
    return [ids[:n] for n in LENGTHS] + [chat]


@pytest.fixture(scope="module")
def plain(prompts):
    llm = LLM("smollm2-135m-instruct", dtype="float32", max_model_len=MAX_LEN)
    return llm, [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


# 22 usable blocks: the 300-token request (19 blocks when admitted, 20 at the end) and the chat prompt
# admitted behind it (3, then 4) cannot both keep theirs, so one is preempted while the other speculates.
# (With 29 the shorter prompts finish before the 300-token one grows: no preemption.)
CASES = {
    "k1_prefix_cache_n2": dict(k=1, n=2),
    "k3_chunked_budget16_preempt_recompute": dict(k=3, engine=dict(max_num_batched_tokens=16, num_kv_blocks=23)),
    "k5_preempt_swap": dict(k=5, engine=dict(num_kv_blocks=23, preemption_mode="swap", swap_space_bytes="64MiB")),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_speculation_equals_plain_decoding(case, prompts, plain):
    spec = CASES[case]
    llm = LLM("smollm2-135m-instruct", dtype="float32", max_model_len=MAX_LEN,
              speculative_config=_ngram(spec["k"]), **spec.get("engine", {}))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, n=spec.get("n", 1))
    if case.startswith("k1"):  # prefix caching: the second pass hits the blocks the first one cached
        llm.generate(prompts[2:3], SamplingParams(temperature=0, max_tokens=1))
    outs = llm.generate(prompts, params)
    for prompt, want, out in zip(prompts, plain[1], outs):
        for completion in out.outputs:
            assert completion.token_ids == want, (len(prompt), completion.index)
    stats = llm.llm_engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens > 0 and stats.kv_blocks_used == 0
    assert stats.spec_decode_mean_accepted_length > 1.0
    if "preempt" in case:
        assert stats.num_preemptions > 0
    if case.startswith("k1"):
        assert stats.prefix_cache_hits > 0


@pytest.mark.slow
def test_stop_eos_and_max_tokens_inside_an_accepted_run(prompts, plain):
    llm_plain, want = plain
    spec = LLM("smollm2-135m-instruct", dtype="float32", max_model_len=MAX_LEN, speculative_config=_ngram(5))
    text_prompt, chat = prompts[3], prompts[-1]  # 300 tokens of text the model keeps copying
    base = want[3]
    stop_word = llm_plain.get_tokenizer().decode(base[6:8]).strip().split()[0]
    cases = [
        SamplingParams(temperature=0, max_tokens=7),  # max_tokens mid-run
        SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[base[9]]),
        SamplingParams(temperature=0, max_tokens=32, stop=[stop_word]),
        SamplingParams(temperature=0, max_tokens=32, stop=[stop_word], include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=40),  # EOS: the chat answer ends with <|im_end|>
    ]
    for params in cases:
        prompt = chat if params.max_tokens == 40 else text_prompt
        a = llm_plain.generate([prompt], params)[0].outputs[0]
        b = spec.generate([prompt], params)[0].outputs[0]
        assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == (a.token_ids, a.text, a.finish_reason,
                                                                         a.stop_reason), params
    stats = spec.llm_engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens > 0 and stats.kv_blocks_used == 0


@pytest.mark.slow
def test_seeded_sampling_with_ngram_drafts_is_plain_sampling_and_resumes_exactly(prompts, plain):
    # One-hot drafts are verified by sampling the target's token with the plain sampler's draw for that
    # position and accepting the draft iff it matches: the seeded output is plain seeded decoding's, and a
    # request resumed mid-speculation (its generator advanced one draw per token) continues it exactly.
    llm_plain, _ = plain
    spec = LLM("smollm2-135m-instruct", dtype="float32", max_model_len=MAX_LEN, speculative_config=_ngram(3))
    params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=24, seed=3, ignore_eos=True)
    want = llm_plain.generate([prompts[3]], params)[0].outputs[0].token_ids
    assert spec.generate([prompts[3]], params)[0].outputs[0].token_ids == want
    engine = spec.llm_engine
    engine.add_request("resumed", prompts[3], params, output_token_ids=want[:10])
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out.outputs[0]
    assert list(final.token_ids) == want
    assert engine.get_stats().spec_decode_num_accepted_tokens > 0


@pytest.mark.slow
def test_logits_processors_apply_to_verification_as_to_plain_decoding(prompts, plain):
    """allowed_token_ids, bad_words and logit_bias shape the target's verification distribution: greedy and
    seeded speculative output equal plain output with the same processors (n-gram drafts that break them are
    rejected)."""
    llm_plain, want = plain
    tokenizer = llm_plain.get_tokenizer()
    spec = LLM("smollm2-135m-instruct", dtype="float32", max_model_len=MAX_LEN, speculative_config=_ngram(3))
    prompt, base = prompts[3], want[3]
    word = tokenizer.decode(base[4:6]).strip().split()[0]
    processors = dict(allowed_token_ids=sorted(set(prompt)), bad_words=[word], logit_bias={base[8]: -5.0})
    for params in (SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **processors),
                   SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True, **processors)):
        a = llm_plain.generate([prompt], params)[0].outputs[0].token_ids
        assert a != base[:24] and set(a) <= set(prompt)
        assert spec.generate([prompt], params)[0].outputs[0].token_ids == a, params
    assert spec.llm_engine.get_stats().spec_decode_num_accepted_tokens > 0
