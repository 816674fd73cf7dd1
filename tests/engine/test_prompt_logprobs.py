"""``SamplingParams.prompt_logprobs`` (vLLM's): every prompt position's logprob equals HF transformers'
log-softmax of the same prompt (fp32, within 1e-3) -- computed in chunks (a 16-token step budget), again when
the prompt is in the prefix cache (a cached block holds KV, not logits: such a request reads no hit), and after
a recompute preemption."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from support.hf_logprobs import hf_prompt_logprobs

pytestmark = pytest.mark.slow
TOL = 1e-3


def check(out, ids, want, k):
    pl = out.prompt_logprobs
    assert pl is not None and len(pl) == len(ids)
    assert pl[0] is None
    for i, (value, rank) in enumerate(want, start=1):
        entry = pl[i]
        first_id, first = next(iter(entry.items()))
        assert first_id == ids[i]  # the prompt token first, as vLLM orders them
        assert abs(first.logprob - value) < TOL, (i, first.logprob, value)
        assert abs(first.rank - rank) <= 1 + rank // 100  # near-ties may swap neighbours
        tops = sorted((lp.rank, lp.logprob) for t, lp in entry.items() if t != ids[i])
        assert [r for r, _ in tops] == [r for r in range(1, k + 1) if r != first.rank][:len(tops)]
        assert len(entry) in (k, k + 1)


def test_prompt_logprobs_match_hf_chunked_cached_and_preempted(model_dir, prompt_of):
    ids = prompt_of(40)
    want = hf_prompt_logprobs(model_dir, ids)
    llm = LLM("smollm2-135m-instruct", dtype="float32", enable_prefix_caching=True, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    first = llm.generate([ids], params)[0]
    check(first, ids, want, 3)
    # the prompt is cached now: a plain request reads it, one asking for prompt logprobs computes it again
    plain = llm.generate([ids], SamplingParams(temperature=0, max_tokens=2))[0]
    assert plain.num_cached_tokens == 32 and plain.prompt_logprobs is None
    second = llm.generate([ids], params)[0]
    assert second.num_cached_tokens == 0
    check(second, ids, want, 3)
    assert second.outputs[0].token_ids == first.outputs[0].token_ids == plain.outputs[0].token_ids

    # recompute preemption in the middle: a pool too small for both prompts at once
    small = LLM("smollm2-135m-instruct", dtype="float32", num_kv_blocks=6, max_num_batched_tokens=16,
                max_model_len=80)
    other = prompt_of(40, offset=40)
    outs = small.generate([ids, other], [SamplingParams(temperature=0, max_tokens=24, prompt_logprobs=3),
                                         SamplingParams(temperature=0, max_tokens=24, prompt_logprobs=0)])
    assert small.get_stats().num_preemptions > 0
    check(outs[0], ids, want, 3)
    check(outs[1], other, hf_prompt_logprobs(model_dir, other), 0)
