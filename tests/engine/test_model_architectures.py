"""Every supported architecture (Llama, Qwen2, Mistral, Qwen3) on a tiny random-weight model built with
transformers' own classes (``tests/support/tiny_models.py``): greedy tokens equal HF transformers' fp32
``generate``, and what the engine cannot serve exactly is refused with a clear error."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.shared.engine.input_processor import RequestRejected
from support.tiny_models import SLIDING_WINDOW

pytestmark = pytest.mark.slow


def test_mistral_request_past_its_sliding_window_is_refused_naming_max_tokens(tiny_model, prompt_of):
    llm = LLM(tiny_model("mistral"), dtype="float32")
    with pytest.raises(RequestRejected, match=f"sliding window of {SLIDING_WINDOW} tokens") as exc:
        llm.generate([prompt_of(5)], SamplingParams(temperature=0, max_tokens=SLIDING_WINDOW))
    assert exc.value.param == "max_tokens"
    with pytest.raises(RequestRejected) as exc:
        llm.generate([prompt_of(SLIDING_WINDOW)], SamplingParams(temperature=0, max_tokens=1))
    assert exc.value.param == "prompt"
    out = llm.generate([prompt_of(5)], SamplingParams(temperature=0, max_tokens=SLIDING_WINDOW - 5))
    assert len(out[0].outputs[0].token_ids) == SLIDING_WINDOW - 5
