"""Request body -> engine sampling parameters, without HTTP (vLLM's rules are the oracle)."""

from __future__ import annotations

import json

import pytest

from pdserve.services.router.errors import OpenAIError
from pdserve.services.router.params import (RequestPlan, build_sampling_params, check_context, generation_defaults,
                                            requested_max_tokens)
from pdserve.services.router.schemas import ChatCompletionRequest, CompletionRequest

MSGS = [{"role": "user", "content": "hi"}]


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "smol", "messages": MSGS, **kw})


def test_unset_max_tokens_fills_the_context():
    assert check_context(100, None, 8192, "messages", "max_tokens") == 8092


def test_prompt_and_completion_exactly_filling_the_context_is_allowed():
    assert check_context(100, 8092, 8192, "prompt", "max_tokens") == 8092
    with pytest.raises(OpenAIError) as info:
        check_context(100, 8093, 8192, "prompt", "max_tokens")
    assert (info.value.status, info.value.param) == (400, "max_tokens")


def test_max_completion_tokens_wins_over_max_tokens():
    assert requested_max_tokens(chat(max_tokens=5, max_completion_tokens=7)) == (7, "max_completion_tokens")
    assert requested_max_tokens(chat(max_tokens=5)) == (5, "max_tokens")


def test_sampling_params_follow_the_request():
    params = build_sampling_params(chat(temperature=0.7, top_k=0, stop="END", seed=3, logprobs=True,
                                        top_logprobs=4, ignore_eos=True), 50, {})
    assert params["temperature"] == 0.7
    assert params["top_k"] == -1  # 0 means disabled, as in vLLM
    assert params["stop"] == ["END"] and params["seed"] == 3 and params["logprobs"] == 4
    assert params["ignore_eos"] is True and params["max_tokens"] == 50 and params["n"] == 1


def test_chat_without_logprobs_asks_for_none_and_completions_take_an_int():
    assert build_sampling_params(chat(), 5, {})["logprobs"] is None
    completion = CompletionRequest.model_validate({"model": "smol", "prompt": "x", "logprobs": 2})
    assert build_sampling_params(completion, 5, {})["logprobs"] == 2


def test_model_generation_defaults_apply_when_the_request_is_silent(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9, "top_k": 0}))
    defaults = generation_defaults(tmp_path)
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": -1}
    params = build_sampling_params(chat(top_p=0.5), 5, defaults)
    assert (params["temperature"], params["top_p"]) == (0.6, 0.5)
    assert generation_defaults(tmp_path / "none") == {}


def test_engine_rule_violations_name_the_request_field():
    with pytest.raises(OpenAIError) as info:
        build_sampling_params(chat(stop=["ok", ""]), 5, {})
    assert info.value.param == "stop"
    with pytest.raises(OpenAIError) as info:
        build_sampling_params(chat(max_completion_tokens=2, min_tokens=3), 2, {})
    assert info.value.param == "min_tokens"


def test_choices_of_a_seeded_request_get_distinct_seeds():
    plan = RequestPlan(prompts=[[1]], sampling=[{"seed": 5, "temperature": 1.0}], n=3)
    assert [plan.choice_params(0, j).seed for j in range(3)] == [5, 6, 7]
    unseeded = RequestPlan(prompts=[[1]], sampling=[{"seed": None}], n=2)
    assert unseeded.choice_params(0, 1).seed is None


def test_a_choice_seed_past_the_seed_range_is_a_400_naming_seed():
    plan = RequestPlan(prompts=[[1]], sampling=[{"seed": 2**64 - 1, "temperature": 1.0}], n=2)
    assert plan.choice_params(0, 0).seed == 2**64 - 1
    with pytest.raises(OpenAIError) as info:
        plan.choice_params(0, 1)
    assert (info.value.status, info.value.param) == (400, "seed")
