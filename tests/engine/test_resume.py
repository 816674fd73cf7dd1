"""Resuming a request from output generated elsewhere (what a migration after a decode pod's death does):
the oracle is the same request run uninterrupted on one engine. Token ids, the text the client assembles
(what it had + the new deltas), the finish reason and the stop reason must all be equal — for a stop string
that spans the resume point, for seeded sampling with penalties, and across a prefill/decode hand-over."""

from __future__ import annotations

import itertools

import pytest

from pdserve import LLM, SamplingParams
from pdserve.shared.engine.llm_engine import RequestRejected

pytestmark = pytest.mark.slow

_ids = itertools.count()


def run(engine, prompt, params, output_token_ids=None, output_text_len=0):
    """(final CompletionOutput, [(completion tokens after the step, text delta)]) of one request."""
    rid = f"resume-{next(_ids)}"
    engine.add_request(rid, prompt, params, output_token_ids=output_token_ids, output_text_len=output_text_len)
    return drain(engine, rid)


def drain(engine, rid):
    final, deltas = None, []
    while final is None or not final.finish_reason:
        for out in engine.step():
            if out.request_id == rid:
                final = out.outputs[0]
                deltas.append((len(final.token_ids), final.new_text))
    return final, deltas


def sent_after(deltas, k: int) -> int:
    """Characters a streaming client holds once the first ``k`` tokens were generated."""
    return sum(len(text) for n, text in deltas if n <= k)


def check_resumed_equals_uninterrupted(engine, prompt, params, ks):
    want, deltas = run(engine, prompt, params)
    full_text = "".join(text for _, text in deltas)
    assert full_text == want.text
    for k in ks:
        assert k < len(want.token_ids)
        text_len = sent_after(deltas, k)
        got, new = run(engine, prompt, params, want.token_ids[:k], text_len)
        assert got.token_ids == want.token_ids, k
        assert full_text[:text_len] + "".join(text for _, text in new) == full_text, k
        assert (got.finish_reason, got.stop_reason) == (want.finish_reason, want.stop_reason), k
    return want


@pytest.fixture(scope="module")
def engine(llm_fp32):
    return llm_fp32.llm_engine


def test_stop_string_spanning_the_resume_point_is_found(engine, prompt_of, tokenizer):
    prompt = prompt_of(20, offset=3)
    plain, _ = run(engine, prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    tokens = plain.token_ids
    cum = [len(tokenizer.decode(tokens[:i])) for i in range(len(tokens) + 1)]
    # a stop string from 2 characters before token 9's text to 2 characters into token 10's
    stop = plain.text[cum[8] - 2 : cum[9] + 2]
    assert cum[9] - cum[8] >= 1 and cum[10] - cum[9] >= 2 and plain.text.find(stop) == cum[8] - 2, stop
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    want = check_resumed_equals_uninterrupted(engine, prompt, params, ks=range(1, 10))
    assert want.finish_reason == "stop" and want.stop_reason == stop
    assert want.text == plain.text[: cum[8] - 2]


def test_seeded_sampling_with_penalties_continues_where_it_was(engine, prompt_of):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, frequency_penalty=0.5, presence_penalty=0.2,
                            max_tokens=16, ignore_eos=True)
    want = check_resumed_equals_uninterrupted(engine, prompt_of(12, offset=40), params, ks=[1, 5, 11, 15])
    assert want.finish_reason == "length" and len(want.token_ids) == 16


def test_min_tokens_counts_the_resumed_output(engine, prompt_of):
    eos = sorted(engine.eos_token_ids)
    # an EOS as a stop token is masked until min_tokens; resumed output counts toward it
    params = SamplingParams(temperature=0, max_tokens=20, min_tokens=6, stop_token_ids=eos)
    check_resumed_equals_uninterrupted(engine, prompt_of(8, offset=70), params, ks=[1, 3, 5])


def test_resumed_output_that_leaves_nothing_to_generate_is_rejected(engine, prompt_of):
    prompt = prompt_of(8)
    with pytest.raises(RequestRejected) as err:
        engine.add_request("full", prompt, SamplingParams(max_tokens=3), output_token_ids=[1, 2, 3])
    assert err.value.param == "output_token_ids"
    assert str(err.value) == "The request already has 3 of its 3 output tokens; nothing is left to generate."
    with pytest.raises(RequestRejected) as err:
        engine.add_request("oov", prompt, SamplingParams(max_tokens=3), output_token_ids=[engine.vocab_size])
    assert err.value.param == "output_token_ids"
    assert not engine.owns("full") and not engine.owns("oov")


@pytest.fixture(scope="module")
def pd_engines():
    prefill = LLM("smollm2-135m-instruct", dtype="float32", enable_prefix_caching=False).llm_engine
    decode = LLM("smollm2-135m-instruct", dtype="float32").llm_engine
    return prefill, decode


@pytest.mark.parametrize("k", [0, 7, 17])
def test_handover_of_a_resumed_seeded_request_equals_one_engine(engine, pd_engines, prompt_of, k):
    """Prefill pod: prefill-only over prompt + k resumed tokens, export; decode pod: reserve all of that KV,
    commit with the resumed tokens. k = 0 is a plain hand-over: the decode pod's generator must skip the
    draw the prefill pod made for the first token."""
    prefill, decode = pd_engines
    prompt = prompt_of(15, offset=25)
    params = SamplingParams(temperature=1.0, seed=99, max_tokens=24, ignore_eos=True, repetition_penalty=1.2)
    want, deltas = run(engine, prompt, params)
    resumed, text_len = want.token_ids[:k], sent_after(deltas, k)
    rid = f"pd-{k}"
    prefill.add_request(rid, prompt, params, prefill_only=True, output_token_ids=resumed, output_text_len=text_len)
    outs, exports = [], {}
    while rid not in exports:
        outs += prefill.step()
        exports.update(prefill.take_exports())
    first = outs[-1].outputs[0]
    assert first.token_ids == want.token_ids[: k + 1]
    _, kv = exports[rid]
    assert kv.shape[0] == -(-(len(prompt) + k) // 16)
    assert decode.reserve(rid, prompt + resumed) is not None
    decode.write_kv(rid, 0, kv)
    decode.commit(rid, first.token_ids[-1], params, output_token_ids=resumed, output_text_len=text_len)
    got, new = drain(decode, rid)
    assert got.token_ids == want.token_ids
    full_text = "".join(text for _, text in deltas)
    assert full_text[:text_len] + first.new_text + "".join(text for _, text in new) == full_text


def test_commit_refuses_output_that_is_not_the_reserved_tail(pd_engines, prompt_of):
    _, decode = pd_engines
    prompt = prompt_of(20)
    used = decode.get_stats().kv_blocks_used
    assert decode.reserve("tail", prompt) is not None
    with pytest.raises(RequestRejected) as err:
        decode.commit("tail", 5, SamplingParams(max_tokens=8), output_token_ids=[1, 2])
    assert err.value.param == "output_token_ids"
    assert not decode.owns("tail") and decode.get_stats().kv_blocks_used == used
