"""Fixtures over the default model: its directory, its tokenizer, and prompts of exact token lengths."""

from __future__ import annotations

import pytest

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
