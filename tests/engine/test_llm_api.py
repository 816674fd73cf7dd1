"""The offline API's contract: clear errors for prompts that cannot be served, n > 1 over shared
blocks, seeds independent of batch neighbours, stop strings, logprobs, stats — and the prefill/decode
hand-over hooks (take_exports -> reserve -> write_kv -> commit) giving the same tokens as one engine."""

from __future__ import annotations

import math

import pytest

from pdserve import LLM, SamplingParams
from pdserve.shared.engine.llm_engine import RequestRejected

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def test_empty_prompt_is_rejected(llm_fp32):
    with pytest.raises(ValueError, match="prompt cannot be empty") as err:
        llm_fp32.generate([[]], GREEDY)
    assert err.value.param == "prompt"


def test_prompt_beyond_max_model_len_is_rejected(llm_fp32):
    too_long = [100] * llm_fp32.llm_engine.max_model_len
    with pytest.raises(RequestRejected, match="maximum context length"):
        llm_fp32.generate([too_long], GREEDY)
    # prompt fits but prompt + max_tokens does not
    almost = [100] * (llm_fp32.llm_engine.max_model_len - 4)
    with pytest.raises(RequestRejected, match="maximum context length") as err:
        llm_fp32.generate([almost], SamplingParams(max_tokens=8))
    assert err.value.param == "max_tokens"
    assert llm_fp32.get_stats().num_running == 0  # nothing was queued


def test_unknown_token_id_is_rejected(llm_fp32):
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm_fp32.generate([[1, 2, 10**9]], GREEDY)


def test_max_model_len_beyond_kv_pool_is_refused_at_startup():
    with pytest.raises(ValueError, match="does not fit in the KV cache"):
        LLM("smollm2-135m-instruct", dtype="float32", num_kv_blocks=5, max_model_len=1024)


def test_n_greedy_completions_share_the_prompt_and_agree(llm_fp32, prompt_of):
    prompt = prompt_of(37)  # two full blocks the choices share through the prefix cache, a partial one each
    single = llm_fp32.generate([prompt], GREEDY)[0].outputs[0]
    used_before = llm_fp32.get_stats().prompt_tokens_computed
    multi = llm_fp32.generate([prompt], SamplingParams(temperature=0, max_tokens=12, n=3))[0]
    assert [c.index for c in multi.outputs] == [0, 1, 2]
    assert all(c.token_ids == single.token_ids for c in multi.outputs)
    # the prompt ran through the model once (minus what the prefix cache held), not three times
    assert llm_fp32.get_stats().prompt_tokens_computed - used_before <= 37
    assert llm_fp32.get_stats().kv_blocks_used == 0


def test_seeded_request_ignores_its_batch_neighbours(llm_fp32, prompt_of):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16)
    alone = llm_fp32.generate([prompt_of(20)], seeded)[0].outputs[0].token_ids
    noisy = SamplingParams(temperature=1.3, top_p=0.9, max_tokens=16)
    batch = llm_fp32.generate([prompt_of(9, 40), prompt_of(20), prompt_of(30, 5)], [noisy, seeded, noisy])
    assert batch[1].outputs[0].token_ids == alone
    other = llm_fp32.generate([prompt_of(20)], SamplingParams(temperature=1.0, seed=99, max_tokens=16))
    assert other[0].outputs[0].token_ids != alone


def test_stop_string_truncates_text_and_reports_reason(llm_fp32):
    free = llm_fp32.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert "." in free.text
    stopped = llm_fp32.generate(["The capital of France is"],
                                SamplingParams(temperature=0, max_tokens=12, stop=["."]))[0].outputs[0]
    assert stopped.text == free.text[: free.text.index(".")]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "."


def test_logprobs_are_normalised_and_include_the_sampled_token(llm_fp32):
    out = llm_fp32.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and entry[token].rank == 1  # greedy picks the most likely token
        assert len([lp for lp in entry.values() if lp.rank <= 3]) == 3
        assert all(lp.logprob <= 0 for lp in entry.values())
    assert math.isclose(out.cumulative_logprob, sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)),
                        rel_tol=1e-6)


def test_stats_keys(llm_fp32):
    stats = llm_fp32.get_stats()
    for key in ("kv_blocks_total", "kv_blocks_used", "kv_tokens_live", "peak_kv_blocks_used", "peak_kv_tokens_live",
                "prefix_cache_queries", "prefix_cache_hits", "prompt_tokens_computed", "generation_tokens",
                "num_preemptions"):
        assert isinstance(getattr(stats, key), int), key


@pytest.mark.parametrize("prompt_len", [1, 16, 33])
def test_kv_handover_between_engines_gives_the_same_tokens(llm_fp32, prompt_of, prompt_len):
    """What a prefill pod and a decode pod do, in one process: prefill-only on one engine, KV exported,
    reserved and written on a second engine, committed with the first token — same tokens as one engine."""
    prompt = prompt_of(prompt_len, offset=11)
    want = llm_fp32.generate([prompt], GREEDY)[0].outputs[0].token_ids
    prefill = LLM("smollm2-135m-instruct", dtype="float32", enable_prefix_caching=False).llm_engine
    decode = LLM("smollm2-135m-instruct", dtype="float32").llm_engine
    prefill.add_request("r", prompt, GREEDY, prefill_only=True)
    outs, exports = [], {}
    while "r" not in exports:
        outs += prefill.step()
        exports.update(prefill.take_exports())
    first = outs[-1].outputs[0].token_ids[0]
    hashes, kv = exports["r"]
    assert not prefill.owns("r")
    assert prefill.get_stats().kv_blocks_used == 0
    assert kv.shape[0] == math.ceil(prompt_len / 16)
    num_blocks, cached = decode.reserve("r", prompt)
    assert num_blocks == kv.shape[0] and cached == 0
    decode.write_kv("r", 0, kv)
    decode.commit("r", first, GREEDY)
    tokens = None
    while decode.has_unfinished_requests():
        for out in decode.step():
            tokens = out.outputs[0].token_ids
    assert tokens == want
    assert decode.get_stats().prompt_tokens_computed == 0  # the decode engine never ran the prompt


def test_empty_cache_salt_is_rejected_not_taken_for_no_salt(llm_fp32, prompt_of):
    engine = llm_fp32.llm_engine
    with pytest.raises(RequestRejected) as err:
        engine.add_request("salt", prompt_of(8), GREEDY, cache_salt="")
    assert (err.value.param, str(err.value)) == ("cache_salt", "cache_salt must be a non-empty string when given.")
    assert not engine.owns("salt")


def test_reset_prefix_cache_makes_a_repeated_prompt_compute_again(llm_fp32, prompt_of):
    prompt = prompt_of(40)  # two full blocks cached after a run
    params = SamplingParams(temperature=0, max_tokens=2)

    def hits_of_one_run() -> int:
        before = llm_fp32.get_stats().prefix_cache_hits
        llm_fp32.generate([prompt], params, use_tqdm=False)
        return llm_fp32.get_stats().prefix_cache_hits - before

    hits_of_one_run()
    assert hits_of_one_run() == 32  # the repeat finds both full blocks
    assert llm_fp32.reset_prefix_cache() is True
    assert hits_of_one_run() == 0
    engine = llm_fp32.llm_engine
    engine.add_request("held", prompt, params)
    try:
        engine.step()
        assert llm_fp32.reset_prefix_cache() is False  # a request holds blocks: nothing is done
        assert engine.cached_block_hashes()
    finally:
        engine.abort_request("held")
