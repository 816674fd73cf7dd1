"""Shared fixtures for engine tests: the default model's directory, prompts of exact lengths, and the
HF transformers greedy oracle (fp32)."""

from __future__ import annotations

import pytest
import torch

TEXT = (
    "The history of the city begins with a small settlement on the river bank, where traders from the north "
    "met farmers from the valley. Over the centuries the market grew into a town, the town built walls, and "
    "the walls were replaced by boulevards. Today the old quarter is a maze of narrow streets, cafes and "
    "bookshops, and every summer a festival fills the squares with music. Visitors often ask why the bridges "
    "are painted in different colours; the answer lies in the guilds that paid for them, each choosing its own. "
    "In the archives one can still read the letters of the bridge builders, who complained about the price "
    "of stone, the weather, the slowness of the carts and the stubbornness of the river, which flooded the "
    "works twice before the first arch was closed. Their names are carved under the arches, next to the year."
)


@pytest.fixture(scope="session")
def model_dir():
    from pdserve.shared.models.resolve import resolve_model

    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def prompt_of(tokenizer):
    """prompt_of(n, offset=0) -> exactly n token ids of natural text (starting ``offset`` tokens in)."""
    ids = tokenizer.encode(TEXT)
    assert len(ids) > 140

    def make(n: int, offset: int = 0) -> list[int]:
        return ids[offset : offset + n]

    return make


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
