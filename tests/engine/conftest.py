"""Engine test fixtures: the HF transformers greedy oracle (fp32) and a shared fp32 engine."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def hf_greedy(model_dir):
    """hf_greedy(prompt_ids, max_new_tokens) -> HF transformers' greedy continuation (fp32), stopping
    at EOS like the engine does (EOS included)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cache: dict = {}

    def generate(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in cache:
            with torch.inference_mode():
                out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                                     max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=model.config.eos_token_id)
            new = out[0, len(prompt_ids):].tolist()
            eos = model.generation_config.eos_token_id
            eos = {eos} if isinstance(eos, int) else set(eos)
            for i, t in enumerate(new):
                if t in eos:
                    new = new[: i + 1]
                    break
            cache[key] = new
        return cache[key]

    return generate


@pytest.fixture(scope="session")
def llm_fp32():
    from pdserve import LLM

    return LLM("smollm2-135m-instruct", dtype="float32")
