from __future__ import annotations

import json
import math
import struct
from dataclasses import fields

import msgpack
import pytest

from pdserve.services.router.params import RequestPlan
from pdserve.shared.protocol.messages import PrefillRequest
from pdserve.shared.transport.frames import Commit, FrameLimits, encode_frame, parse_header
from pdserve.shared.protocol.sampling_params import (
    SamplingParams,
    SamplingParamsError,
    SamplingType,
)

INVALID = [
    # (kwargs, param named in the error)
    ({"n": 0}, "n"),
    ({"n": 1.5}, "n"),
    ({"n": True}, "n"),
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": -0.5}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"top_k": "5"}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.1}, "min_p"),
    ({"seed": 1.0}, "seed"),
    ({"seed": "42"}, "seed"),
    ({"seed": True}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"presence_penalty": 2.1}, "presence_penalty"),
    ({"presence_penalty": -2.1}, "presence_penalty"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"frequency_penalty": -2.0001}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop": [1, 2]}, "stop"),
    ({"stop": 7}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [1.0]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 17}, "min_tokens"),  # > default max_tokens=16
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": 1.0}, "logprobs"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"skip_special_tokens": "yes"}, "skip_special_tokens"),
    ({"include_stop_str_in_output": None}, "include_stop_str_in_output"),
]


@pytest.mark.parametrize(("kwargs", "param"), INVALID, ids=[f"{p}={k[p]!r}" for k, p in INVALID])
def test_invalid_value_raises_error_naming_the_parameter(kwargs, param):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert isinstance(info.value, ValueError)
    assert str(info.value).startswith(f"{param} must be ")
    assert repr(kwargs[param]) in str(info.value)


# The processors' parameters: a map or list may be long, so the message names the offending entry, not all of it.
INVALID_PROCESSOR_PARAMS = [
    ({"logit_bias": {5: 100.5}}, "logit_bias"),
    ({"logit_bias": {5: -101}}, "logit_bias"),
    ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"logit_bias": {-1: 1}}, "logit_bias"),
    ({"logit_bias": {5: "x"}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
    ({"allowed_token_ids": "12"}, "allowed_token_ids"),
    ({"bad_words": "word"}, "bad_words"),
    ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": [" "]}, "bad_words"),
    ({"bad_words": [3]}, "bad_words"),
    ({"bad_words": ["x"] * 33}, "bad_words"),  # MAX_BAD_WORDS
    ({"bad_words_token_ids": [[]]}, "bad_words_token_ids"),
]


@pytest.mark.parametrize(("kwargs", "param"), INVALID_PROCESSOR_PARAMS,
                         ids=[f"{p}={str(k[p])[:30]}" for k, p in INVALID_PROCESSOR_PARAMS])
def test_invalid_processor_parameter_raises_error_naming_it(kwargs, param):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert str(info.value).startswith(f"{param} must be ")


def test_error_message_format_is_exact():
    with pytest.raises(SamplingParamsError, match=r"^temperature must be non-negative, got -1\.0$"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(SamplingParamsError, match=r"^top_p must be in \(0, 1\], got 0$"):
        SamplingParams(top_p=0)


VALID_EDGES = [
    {"temperature": 0.0},
    {"temperature": 5.0},
    {"top_p": 1.0},
    {"top_p": 1e-9},
    {"top_k": -1},
    {"top_k": 1},
    {"top_k": 50.0},
    {"min_p": 0.0},
    {"min_p": 1.0},
    {"seed": 0},
    {"seed": -(2**63)},
    {"seed": 2**64 - 1},
    {"presence_penalty": -2.0, "frequency_penalty": 2.0},
    {"repetition_penalty": 1e-3},
    {"max_tokens": None, "min_tokens": 1000},
    {"min_tokens": 16},
    {"logprobs": 0},
    {"logprobs": 20},
    {"stop_token_ids": [0]},
]


@pytest.mark.parametrize("kwargs", VALID_EDGES, ids=[repr(k) for k in VALID_EDGES])
def test_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_integral_float_top_k_becomes_int():
    p = SamplingParams(top_k=50.0, temperature=0.7)
    assert p.top_k == 50 and type(p.top_k) is int


def test_stop_and_stop_token_ids_are_normalised_to_lists():
    p = SamplingParams(stop="###", stop_token_ids=(7, 8))
    assert p.stop == ["###"] and p.stop_token_ids == [7, 8]
    q = SamplingParams()
    assert q.stop == [] and q.stop_token_ids == []


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, -1, 0.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.seed) == (16, 0, None, None)
    assert p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.ignore_eos and not p.include_stop_str_in_output


@pytest.mark.parametrize(
    ("kwargs", "kind"),
    [
        ({"temperature": 0.0}, SamplingType.GREEDY),
        ({"temperature": 1e-6}, SamplingType.GREEDY),
        ({"temperature": 1e-5}, SamplingType.RANDOM),
        ({"temperature": 0.8}, SamplingType.RANDOM),
        ({"temperature": 0.8, "seed": 3}, SamplingType.RANDOM_SEED),
        ({"temperature": 0.0, "seed": 3}, SamplingType.GREEDY),
    ],
)
def test_sampling_type(kwargs, kind):
    p = SamplingParams(**kwargs)
    assert p.sampling_type is kind
    assert p.is_greedy == (kind is SamplingType.GREEDY)


def test_greedy_disables_truncation_filters_like_vllm():
    p = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.2)
    assert (p.top_k, p.top_p, p.min_p) == (-1, 1.0, 0.0)


def test_all_stop_token_ids_respects_ignore_eos():
    assert SamplingParams(stop_token_ids=[5]).all_stop_token_ids({2}) == {2, 5}
    assert SamplingParams(stop_token_ids=[5], ignore_eos=True).all_stop_token_ids({2}) == {5}


# Every field set to a non-default value, so a field any path drops or mangles shows up.
EVERY_FIELD = SamplingParams(
    n=2, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=123, presence_penalty=0.5,
    frequency_penalty=-0.25, repetition_penalty=1.1, stop=["\n\n", "END"], stop_token_ids=[7],
    ignore_eos=True, min_tokens=3, max_tokens=64, logprobs=5, prompt_logprobs=2, include_stop_str_in_output=True,
    skip_special_tokens=False, spaces_between_special_tokens=False, logit_bias={15: 100, 3: -7.5},
    allowed_token_ids=[3, 15, 99], bad_words=["foo", "bar baz"], bad_words_token_ids=[[5], [8, 9]],
    structured_outputs={"json": {"type": "object", "properties": {"a": {"type": "integer"}}}},
)


def test_every_field_is_set_by_the_wire_fixture():
    defaults = SamplingParams()
    assert [f.name for f in fields(SamplingParams) if getattr(EVERY_FIELD, f.name) == getattr(defaults, f.name)] == []


def _through_redis(p: SamplingParams) -> SamplingParams:
    entry = PrefillRequest("r1", "m", [1, 2], p, "pod", "host", 1, 0.0).encode()
    return PrefillRequest.decode(entry).sampling_params


def _through_commit_frame(p: SamplingParams) -> SamplingParams:
    frame = Commit("r1", 5, p, [1, 2], 0.0)
    wire = b"".join(bytes(b) for b in encode_frame(frame))
    (header_len,) = struct.unpack(">I", wire[:4])
    parsed, _, _ = parse_header(wire[4:4 + header_len], FrameLimits())
    return parsed.sampling_params


def _through_router_plan(p: SamplingParams) -> SamplingParams:
    return RequestPlan(prompts=[[1]], sampling=[p.to_dict()], n=1).choice_params(0, 0)


@pytest.mark.parametrize("path", [
    lambda p: SamplingParams.from_dict(json.loads(json.dumps(p.to_dict()))),
    lambda p: SamplingParams.from_dict(msgpack.unpackb(msgpack.packb(p.to_dict()))),
    lambda p: SamplingParams.from_dict(msgpack.unpackb(msgpack.packb(p.to_dict()), strict_map_key=True)),
    _through_redis,
    _through_commit_frame,
    _through_router_plan,
], ids=["json", "msgpack", "msgpack-strict-keys", "redis-entry", "commit-frame", "router-plan"])
def test_every_field_round_trips_through_every_wire(path):
    """One wire rule (``to_dict``/``from_dict``) for every path a request's params travel; ``logit_bias`` has
    integer keys in memory, which the frame decoder's ``strict_map_key`` and JSON would both break as a map."""
    assert path(EVERY_FIELD) == EVERY_FIELD
    assert path(SamplingParams()) == SamplingParams()


def test_to_dict_has_no_map_values():
    assert not any(isinstance(v, dict) for v in EVERY_FIELD.to_dict().values())
    assert EVERY_FIELD.to_dict()["logit_bias"] == [[3, -7.5], [15, 100.0]]
    assert EVERY_FIELD.to_dict()["structured_outputs"] == [
        "json", '{"type":"object","properties":{"a":{"type":"integer"}}}']


@pytest.mark.parametrize("spec", [
    {"json": {"type": "object"}}, {"json": '{"type": "object"}'}, {"regex": "[a-z]+"}, {"choice": ["yes", "no"]},
    {"grammar": 'root ::= "a"'}, {"json_object": True},
    {"json": None, "regex": "a+", "choice": None, "grammar": None, "json_object": None},  # vLLM's dataclass shape
])
def test_structured_outputs_takes_one_of_vllms_kinds(spec):
    params = SamplingParams(structured_outputs=spec)
    kind = params.structured_kind
    assert list(params.structured_outputs) == [kind]
    assert SamplingParams.from_dict(json.loads(json.dumps(params.to_dict()))) == params


def test_a_property_named_like_an_unsupported_keyword_is_a_name():
    schema = {"type": "object", "properties": {"not": {"type": "integer"}, "if": {"type": "string"}}}
    assert SamplingParams(structured_outputs={"json": schema}).structured_kind == "json"


def test_a_json_schema_as_map_or_text_normalises_to_one_compact_text_in_its_own_key_order():
    a = SamplingParams(structured_outputs={"json": {"b": 1, "a": {"type": "string"}}})
    b = SamplingParams(structured_outputs={"json": '{"b": 1,  "a": {"type": "string"}}'})
    assert a.structured_outputs == b.structured_outputs == {"json": '{"b":1,"a":{"type":"string"}}'}


@pytest.mark.parametrize("spec", [
    "json", {"json": {"type": "object"}, "regex": "a"}, {"yaml": "x"}, {"json": "{not json"}, {"json": [1]},
    {"choice": []}, {"choice": [1]}, {"regex": ""}, {"grammar": 5}, {"json_object": "yes"},
    {"regex": "a" * 70000}, {"json": {"type": "array", "uniqueItems": True}},
    {"json": {"properties": {"a": {"anyOf": [{"type": "integer"}, {"not": {"type": "string"}}]}}}},
])
def test_malformed_structured_outputs_name_the_field(spec):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(structured_outputs=spec)
    assert err.value.param == "structured_outputs"


def test_from_dict_validates_and_rejects_unknown_keys():
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams.from_dict({"temperature": -2})
    assert info.value.param == "temperature"
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams.from_dict({"best_of": 2})
    assert info.value.param == "best_of"


def test_from_dict_fills_defaults():
    assert SamplingParams.from_dict({"max_tokens": 5}) == SamplingParams(max_tokens=5)


def test_clone_is_deep():
    p = SamplingParams(stop=["a"], stop_token_ids=[1])
    q = p.clone()
    assert q == p
    q.stop.append("b")
    q.stop_token_ids.append(2)
    assert p.stop == ["a"] and p.stop_token_ids == [1]


def test_for_child_gives_n_1_and_distinct_seeds():
    p = SamplingParams(n=3, seed=10, temperature=0.5, stop=["x"])
    kids = [p.for_child(i) for i in range(3)]
    assert [k.seed for k in kids] == [10, 11, 12]
    assert all(k.n == 1 and k.temperature == 0.5 and k.stop == ["x"] for k in kids)
    assert SamplingParams(n=2).for_child(1).seed is None
    assert SamplingParams(n=2, seed=2**64 - 1).for_child(1).seed == 0  # wraps into the valid range
    assert p.n == 3 and p.seed == 10


def test_stop_strings_are_limited_in_number_and_length():
    from pdserve.shared.protocol.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS

    assert (MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS) == (32, 256)
    at_limit = [f"{i:03d}" + "z" * 253 for i in range(32)]
    assert SamplingParams(stop=at_limit).stop == at_limit
    with pytest.raises(SamplingParamsError, match=r"^stop must be at most 32 strings, got 33$") as info:
        SamplingParams(stop=at_limit + ["x"])
    assert info.value.param == "stop"
    with pytest.raises(SamplingParamsError,
                       match=r"^stop must be strings of at most 256 characters, got one of 257$") as info:
        SamplingParams.from_dict({"stop": ["ok", "y" * 257]})
    assert info.value.param == "stop"
    with pytest.raises(SamplingParamsError, match=r"^stop must be at most 32 strings, got 20000$"):
        SamplingParams(stop=["s" * 60] * 20_000)


def test_logit_bias_accepts_pairs_and_boundaries():
    assert SamplingParams(logit_bias=[[4, 100], [2, -100]]).logit_bias == {4: 100.0, 2: -100.0}
    assert SamplingParams(logit_bias={}).logit_bias is None


@pytest.mark.parametrize("kwargs, param", [
    ({"logit_bias": {50: 1.0}}, "logit_bias"),
    ({"allowed_token_ids": [1, 50]}, "allowed_token_ids"),
    ({"bad_words": ["x"], "bad_words_token_ids": [[3, 50]]}, "bad_words"),
])
def test_check_vocabulary_names_the_parameter(kwargs, param):
    SamplingParams(**kwargs).check_vocabulary(51)
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs).check_vocabulary(50)
    assert info.value.param == param


class _Tokenizer:
    """A word-level tokenizer: a leading space makes a different token, as in byte-level BPE."""

    VOCAB = {"foo": 1, " foo": 2, "bar": 3, " bar": 4, " baz": 5, "Ġ": 6}

    def encode(self, text, add_special_tokens=False):
        assert add_special_tokens is False
        out, words = [], text.split(" ")
        for i, w in enumerate(words):
            if w:
                out.append(self.VOCAB[(" " if i else "") + w])
        return out


def test_bad_words_are_tokenized_with_and_without_a_leading_space():
    p = SamplingParams(bad_words=["foo", " bar baz"])
    p.update_from_tokenizer(_Tokenizer())
    assert p.bad_words_token_ids == [[1], [2], [3, 5], [4, 5]]


def test_unset_processor_fields_stay_off_the_wire_for_pods_of_the_previous_version():
    """A pod of the version before the logits processors refuses unknown keys: a request that does not use them
    must carry exactly that version's keys."""
    assert set(SamplingParams(temperature=0.5).to_dict()) == {
        "n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
        "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids", "ignore_eos",
        "min_tokens", "max_tokens", "logprobs", "prompt_logprobs", "include_stop_str_in_output",
        "skip_special_tokens", "spaces_between_special_tokens",
    }
    assert {"logit_bias", "allowed_token_ids", "bad_words", "bad_words_token_ids"} <= set(EVERY_FIELD.to_dict())
