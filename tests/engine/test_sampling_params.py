from __future__ import annotations

import json
import math

import msgpack
import pytest

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


def test_to_dict_round_trips_through_json_and_msgpack():
    p = SamplingParams(
        n=2, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=123, presence_penalty=0.5,
        frequency_penalty=-0.25, repetition_penalty=1.1, stop=["\n\n", "END"], stop_token_ids=[7],
        ignore_eos=True, min_tokens=3, max_tokens=64, logprobs=5, include_stop_str_in_output=True,
        skip_special_tokens=False, spaces_between_special_tokens=False,
    )
    d = p.to_dict()
    assert SamplingParams.from_dict(json.loads(json.dumps(d))) == p
    assert SamplingParams.from_dict(msgpack.unpackb(msgpack.packb(d))) == p
    assert set(d) == {
        "n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
        "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids", "ignore_eos",
        "min_tokens", "max_tokens", "logprobs", "prompt_logprobs", "include_stop_str_in_output",
        "skip_special_tokens", "spaces_between_special_tokens",
    }


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
