"""Datasets are made offline, reproducibly, at the requested token lengths."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.loadtest.datasets import DatasetSpec, build_dataset
from pdserve.loadtest.datasets.sharegpt import load_pairs
from pdserve.loadtest.errors import LoadTestError
from pdserve.loadtest.tokenization import PromptMaker, load_tokenizer, local_counter, sampling_vocab

from loadtest_support import TOKENIZER


@pytest.fixture(scope="module")
def maker():
    tok = load_tokenizer(TOKENIZER)
    return PromptMaker(tok, local_counter(tok), sampling_vocab(tok))


def build(spec, maker):
    return asyncio.run(build_dataset(spec, maker))


def test_random_prompts_have_exact_lengths_and_are_reproducible(maker):
    spec = DatasetSpec(name="random", num_prompts=6, input_len=40, output_len=9, seed=3)
    a, b = build(spec, maker), build(spec, maker)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert [r.prompt_len for r in a] == [40] * 6
    assert [len(maker.tokenizer.encode(r.prompt)) for r in a] == [40] * 6
    assert {r.expected_output_len for r in a} == {9}
    other = build(DatasetSpec(name="random", num_prompts=6, input_len=40, seed=4), maker)
    assert [r.prompt for r in other] != [r.prompt for r in a]


def test_range_ratio_spreads_lengths_within_bounds(maker):
    reqs = build(DatasetSpec(name="random", num_prompts=30, input_len=20, output_len=10, range_ratio=0.5), maker)
    assert all(10 <= r.prompt_len <= 30 for r in reqs)
    assert all(5 <= r.expected_output_len <= 15 for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 3


def test_shared_prefix_groups_share_their_prefix(maker):
    reqs = build(DatasetSpec(name="shared-prefix", num_prompts=8, num_groups=2, prefix_len=30, suffix_len=6), maker)
    assert [r.prompt_len for r in reqs] == [36] * 8
    by_group: dict[str, list[str]] = {}
    for r in reqs:
        by_group.setdefault(r.label, []).append(r.prompt)
    assert sorted(by_group) == ["group0", "group1"]
    heads = {g: {p[:40] for p in ps} for g, ps in by_group.items()}
    assert all(len(h) == 1 for h in heads.values()) and heads["group0"] != heads["group1"]
    assert len({r.prompt for r in reqs}) == 8  # suffixes are unique


def test_multi_turn_orders_turns_after_their_predecessors(maker):
    reqs = build(DatasetSpec(name="multi-turn", num_prompts=7, turns=3, input_len=5), maker)
    assert [(r.session_id, r.turn) for r in reqs] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (0, 2)]


def test_sharegpt_pairs_and_filters(tmp_path, maker):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "Explain the rules of chess to me please."},
                           {"from": "gpt", "value": "Each side has sixteen pieces and moves in turn."}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there friend"}]},
        {"conversations": [{"from": "human", "value": "only one turn"}]},
    ]))
    assert len(load_pairs(str(path))) == 2
    reqs = build(DatasetSpec(name="sharegpt", num_prompts=1, path=str(path)), maker)
    assert reqs[0].prompt.startswith("Explain")  # "hi" is under 4 tokens: filtered as vLLM does
    assert reqs[0].expected_output_len == len(maker.tokenizer.encode("Each side has sixteen pieces and moves in turn."))
    with pytest.raises(LoadTestError, match="has only 1 usable conversations, --num-prompts is 2"):
        build(DatasetSpec(name="sharegpt", num_prompts=2, path=str(path)), maker)
    with pytest.raises(LoadTestError, match="dataset file not found"):
        load_pairs(str(tmp_path / "missing.json"))


def test_random_prefix_is_shared_by_every_prompt(maker):
    reqs = build(DatasetSpec(name="random", num_prompts=4, input_len=10, prefix_len=20), maker)
    assert [r.prompt_len for r in reqs] == [30] * 4
    prefix = build(DatasetSpec(name="random", num_prompts=1, input_len=20), maker)  # independent draw
    heads = {r.prompt[:30] for r in reqs}
    assert len(heads) == 1 and len({r.prompt for r in reqs}) == 4
    assert prefix[0].prompt[:30] not in heads
