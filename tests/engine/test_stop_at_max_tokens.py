"""A stop string completed by the last allowed token finishes as ``stop``, not ``length`` (vLLM checks stop
strings before the length limit). Boundary: the string ends at ``max_tokens`` - 1, at ``max_tokens`` and at
``max_tokens`` + 1, with plain and with speculative (n-gram) decoding. Oracle: the same engine's greedy output
without a stop string, and its tokenizer's decode of the token ids."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"
STOP = ", 14"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "adaptive": False}


@pytest.fixture(scope="module", params=["plain", "ngram"])
def llm(request):
    spec = NGRAM if request.param == "ngram" else None
    return LLM("smollm2-135m-instruct", dtype="float32", speculative_config=spec)


@pytest.fixture(scope="module")
def reference(llm):
    """(token ids without a stop string, the number of them that completes ``STOP``)."""
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    ids = list(out.token_ids)
    k = next(n for n in range(1, len(ids) + 1) if STOP in tokenizer.decode(ids[:n]))
    assert k >= 2, "the stop string must need more than one token for the boundary to mean anything"
    return ids, k


def _run(llm, max_tokens: int):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, stop=[STOP])
    return llm.generate([PROMPT], params)[0].outputs[0]


def test_stop_string_completed_by_the_last_allowed_token_is_stop(llm, reference):
    ids, k = reference
    accepted = llm.llm_engine.get_stats().spec_decode_num_accepted_tokens if llm.llm_engine.spec else None
    out = _run(llm, k)
    if accepted is not None:  # the counting prompt is copy-friendly: the step that ends it verified drafts
        assert llm.llm_engine.get_stats().spec_decode_num_accepted_tokens > accepted
    assert (out.finish_reason, out.stop_reason) == ("stop", STOP)
    assert list(out.token_ids) == ids[:k]
    assert out.text == llm.get_tokenizer().decode(ids[:k]).split(STOP)[0]


def test_stop_string_completed_before_the_limit_is_stop(llm, reference):
    ids, k = reference
    out = _run(llm, k + 1)
    assert (out.finish_reason, out.stop_reason) == ("stop", STOP)
    assert list(out.token_ids) == ids[:k]
    assert out.text == llm.get_tokenizer().decode(ids[:k]).split(STOP)[0]


def test_limit_one_token_before_the_stop_string_is_length(llm, reference):
    ids, k = reference
    out = _run(llm, k - 1)
    assert (out.finish_reason, out.stop_reason) == ("length", None)
    assert list(out.token_ids) == ids[:k - 1]
    assert out.text == llm.get_tokenizer().decode(ids[:k - 1])  # the held-back prefix of the stop string is released
