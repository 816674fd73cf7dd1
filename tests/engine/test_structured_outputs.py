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
from pdserve.shared.engine.structured_output import build_grammar
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
def test_a_hand_over_whose_grammar_the_decode_side_compiles_first_waits_out_of_the_batch(llm_fp32, tokenizer):
    """The decode side of a hand-over (reserve, write_kv, commit) with a grammar it has not compiled: the request
    keeps its blocks but leaves the batch while the compile runs, a plain request keeps stepping, and once
    compiled the greedy answer equals the one-engine answer under the same grammar."""
    engine = llm_fp32.llm_engine
    prompt = _chat(tokenizer, "A person as JSON.")
    params = _greedy({"json": SCHEMAS["person"]}, max_tokens=40)
    want = llm_fp32.generate(prompt, params)[0].outputs[0].token_ids
    engine.add_request("prefill", prompt, params, prefill_only=True)
    exports, first = {}, None
    while "prefill" not in exports:
        for out in engine.step():
            first = out.outputs[0].token_ids[0]
        exports.update(engine.take_exports())
    # the same grammar under a spec text this engine has not seen: the decode side's first compile
    unseen = _greedy({"json": {**SCHEMAS["person"], "title": "decode-side"}}, max_tokens=40)
    compiling: Future = Future()
    real_submit = engine.structured._pool.submit
    engine.structured._pool.submit = lambda fn: compiling
    try:
        _, cached = engine.reserve("handed", prompt)
        engine.write_kv("handed", cached, exports["prefill"][1][cached:])
        engine.commit("handed", first, unseen)
        engine.add_request("plain", _chat(tokenizer, "Hi"), SamplingParams(temperature=0.0, max_tokens=8))
        done = {}
        for _ in range(9):
            for out in engine.step():
                done[out.request_id] = out
        assert done["plain"].finished and "handed" not in done
        assert engine.num_waiting == 1 and engine.owns("handed")
        compiling.set_result(real_submit(lambda: engine.structured._get_compiler().compile_grammar(
            build_grammar("json", unseen.structured_outputs["json"]))).result())
        while engine.has_unfinished_requests():
            for out in engine.step():
                done[out.request_id] = out
        assert done["handed"].finished and done["handed"].outputs[0].token_ids[-(len(want) - 1):] == want[1:]
        jsonschema.validate(json.loads(tokenizer.decode(want, skip_special_tokens=True)), SCHEMAS["person"])
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
def test_under_ngram_speculation_grammar_requests_verify_drafts_and_equal_plain_decoding(llm_fp32, tokenizer):
    """Drafts of a grammar request are verified under the grammar, the matcher rolled back to the accepted prefix
    (structured_output.py): greedy output equals plain decoding under the same grammar, and validates."""
    from pdserve import LLM

    spec = LLM("smollm2-135m-instruct", dtype="float32", max_model_len=384, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    prompts = [_chat(tokenizer, "Copy this JSON exactly: " + json.dumps(example)) for example in (
        {"name": "Ann Lee", "age": 42}, {"name": "Bob", "age": 7})]
    prompts.append(_chat(tokenizer, "A person as JSON."))
    params = _greedy({"json": SCHEMAS["person"]}, max_tokens=48)
    want = [o.outputs[0].token_ids for o in llm_fp32.generate(prompts, params)]
    got = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == want
    for out in got:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS["person"])
    stats = spec.get_stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens  # some rolled back
