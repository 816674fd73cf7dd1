"""Structured outputs on the offline engine: every answer under a grammar is valid by an independent oracle
(``jsonschema`` for JSON, ``re.fullmatch`` for regex), finishes with "stop", and the grammar's state rebuilt by
replaying output tokens (a decode pod, a migrated request) continues exactly as the uninterrupted request."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future

import jsonschema
import pytest

from pdserve.shared.engine.input_processor import RequestRejected
from pdserve.shared.protocol.sampling_params import SamplingParams
from support.structured_schemas import SCHEMAS


def _chat(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def _greedy(spec: dict, max_tokens: int = 80, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=spec, **kw)


@pytest.mark.slow
def test_every_schema_s_greedy_answer_validates_and_stops(llm_fp32, tokenizer):
    names = list(SCHEMAS)
    prompts = [_chat(tokenizer, f"Answer in JSON: an example of {name}.") for name in names]
    outs = llm_fp32.generate(prompts, [_greedy({"json": SCHEMAS[n]}) for n in names])
    for name, out in zip(names, outs):
        choice = out.outputs[0]
        assert choice.finish_reason == "stop", (name, choice.text)
        jsonschema.validate(json.loads(choice.text), SCHEMAS[name])


@pytest.mark.slow
def test_sampled_answers_of_n_choices_each_validate(llm_fp32, tokenizer):
    """n > 1: a matcher per sequence, at temperature 1 where a shared matcher would break at once."""
    schema = SCHEMAS["person"]
    out = llm_fp32.generate(_chat(tokenizer, "A person as JSON."),
                            SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=40,
                                           structured_outputs={"json": schema}))[0]
    assert len({c.text for c in out.outputs}) > 1
    for choice in out.outputs:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), schema)


@pytest.mark.slow
@pytest.mark.parametrize("spec, check", [
    ({"regex": r"[0-9]{3}-[a-z]{2,4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
    ({"regex": r"(yes|no), because [a-z ]{1,20}\."}, lambda t: re.fullmatch(r"(yes|no), because [a-z ]{1,20}\.", t)),
    ({"choice": ["Paris", "London", "Rome"]}, lambda t: t in ("Paris", "London", "Rome")),
    ({"choice": ['say "hi"', "a\\b"]}, lambda t: t in ('say "hi"', "a\\b")),
    ({"grammar": 'root ::= "(" num ("+" num)* ")"\nnum ::= [0-9]'}, lambda t: re.fullmatch(r"\([0-9](\+[0-9])*\)", t)),
    ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
], ids=["regex", "regex-sentence", "choice", "choice-escapes", "ebnf", "json_object"])
def test_regex_choice_and_grammar_outputs_match(llm_fp32, tokenizer, spec, check):
    out = llm_fp32.generate(_chat(tokenizer, "What is the capital of France?"), _greedy(spec, max_tokens=120))[0]
    choice = out.outputs[0]
    assert choice.finish_reason == "stop", choice.text
    assert check(choice.text), choice.text


@pytest.mark.slow
def test_a_request_resumed_with_its_output_replays_the_grammar_and_continues_identically(llm_fp32, tokenizer):
    """What a decode pod and a migration do: a new request given the output so far rebuilds the matcher by
    replaying it; greedy output must equal the uninterrupted request's (cut after 1 token and mid-answer)."""
    engine = llm_fp32.llm_engine
    prompt = _chat(tokenizer, "A person as JSON.")
    params = _greedy({"json": SCHEMAS["person"]})
    whole = list(llm_fp32.generate(prompt, params)[0].outputs[0].token_ids)
    cuts = (1, len(whole) // 2)
    for cut in cuts:
        engine.add_request(f"resume-{cut}", prompt, params, output_token_ids=whole[:cut])
    rest: dict[str, list[int]] = {}  # token_ids at the finish (cumulative)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                rest[out.request_id] = list(out.outputs[0].token_ids)
    for cut in cuts:
        got = rest[f"resume-{cut}"]
        assert whole[:cut] + got[-(len(whole) - cut):] == whole and len(got) >= len(whole) - cut


@pytest.mark.slow
def test_a_request_whose_grammar_compiles_waits_without_stalling_the_batch(llm_fp32, tokenizer):
    engine = llm_fp32.llm_engine
    compiling: Future = Future()
    real_submit = engine.structured._pool.submit
    engine.structured._pool.submit = lambda fn: compiling  # a compile that has not finished
    try:
        schema = {"type": "object", "properties": {"held": {"type": "integer", "minimum": 0, "maximum": 9}},
                  "required": ["held"]}
        engine.add_request("guided", _chat(tokenizer, "A digit as JSON."), _greedy({"json": schema}, max_tokens=20))
        engine.add_request("plain", _chat(tokenizer, "Hi"), SamplingParams(temperature=0.0, max_tokens=8))
        done = {}
        for _ in range(9):
            for out in engine.step():
                done[out.request_id] = out
        assert done["plain"].finished and "guided" not in done
        assert engine.num_waiting == 1
        compiling.set_result(real_submit(lambda: engine.structured._get_compiler().compile_json_schema(
            json.dumps(schema), any_whitespace=False)).result())
        while engine.has_unfinished_requests():
            for out in engine.step():
                done[out.request_id] = out
        assert done["guided"].finished and json.loads(done["guided"].outputs[0].text)["held"] in range(10)
    finally:
        engine.structured._pool.submit = real_submit


@pytest.mark.slow
@pytest.mark.parametrize("spec", [{"json": {"type": "wizard"}}, {"regex": "(("}, {"grammar": "root ::= "}])
def test_a_spec_the_compiler_refuses_is_rejected_naming_structured_outputs(llm_fp32, tokenizer, spec):
    with pytest.raises(RequestRejected) as err:
        llm_fp32.generate(_chat(tokenizer, "x"), _greedy(spec))
    assert err.value.param == "structured_outputs"
    assert "/project/" not in str(err.value) and str(err.value).startswith(f"structured_outputs {next(iter(spec))}")
    assert not llm_fp32.llm_engine.has_unfinished_requests()


@pytest.mark.slow
def test_greedy_answers_under_recompute_preemption_equal_the_unpreempted_ones(llm_fp32, tokenizer):
    """A recomputed request keeps its matcher, synced to its output (the replay rule): same answers as with room."""
    from pdserve import LLM

    names = ["mixed record", "array of objects", "nested object"]
    prompts = [_chat(tokenizer, f"{name} as JSON") for name in names]
    params = [_greedy({"json": SCHEMAS[n]}, max_tokens=24) for n in names]
    want = [o.outputs[0].token_ids for o in llm_fp32.generate(prompts, params)]
    tiny = LLM("smollm2-135m-instruct", dtype="float32", num_kv_blocks=7, max_model_len=96,
               preemption_mode="recompute", enable_prefix_caching=False)
    got = tiny.generate(prompts, params)
    assert tiny.get_stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == want
    for name, out in zip(names, got):
        if out.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS[name])


@pytest.mark.slow
def test_under_ngram_speculation_a_grammar_request_decodes_without_drafts_and_equals_plain(llm_fp32, tokenizer):
    """Speculation proposes no drafts for a grammar request (docs/engine.md "Structured outputs"); a plain request
    in the same batch still speculates."""
    from pdserve import LLM

    spec = LLM("smollm2-135m-instruct", dtype="float32", max_model_len=256, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    guided = _chat(tokenizer, "A person as JSON.")
    copy = _chat(tokenizer, "Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat.")
    params = [_greedy({"json": SCHEMAS["person"]}, max_tokens=40), SamplingParams(temperature=0.0, max_tokens=24)]
    want = [o.outputs[0].token_ids for o in llm_fp32.generate([guided, copy], params)]
    got = spec.generate([guided, copy], params)
    assert [o.outputs[0].token_ids for o in got] == want
    jsonschema.validate(json.loads(got[0].outputs[0].text), SCHEMAS["person"])
    assert spec.get_stats().spec_decode_num_draft_tokens > 0
