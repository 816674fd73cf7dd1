"""What a dataset is asked to be, and the dispatch to the generator that makes it."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.loadtest.request import SampleRequest
from pdserve.loadtest.tokenization import PromptMaker

DATASETS = ("random", "shared-prefix", "multi-turn", "sharegpt")


@dataclass(slots=True)
class DatasetSpec:
    """Lengths are tokens. ``num_prompts`` counts requests (turns, for multi-turn)."""

    name: str = "random"
    num_prompts: int = 1000
    seed: int = 0
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 0
    num_groups: int = 8
    suffix_len: int = 128
    turns: int = 4
    path: str | None = None
    sharegpt_output_len: int | None = None
    label: str = ""


async def build_dataset(spec: DatasetSpec, maker: PromptMaker) -> list[SampleRequest]:
    """The requests of ``spec``, identical for the same seed, tokenizer and server tokenization."""
    from pdserve.loadtest.datasets import multi_turn, random_tokens, shared_prefix, sharegpt

    if spec.name == "random":
        reqs = await random_tokens.build(spec, maker)
    elif spec.name == "shared-prefix":
        reqs = await shared_prefix.build(spec, maker)
    elif spec.name == "multi-turn":
        reqs = await multi_turn.build(spec, maker)
    elif spec.name == "sharegpt":
        reqs = await sharegpt.build(spec, maker)
    else:
        raise ValueError(spec.name)
    if spec.label:
        for r in reqs:
            r.label = spec.label
    return reqs
