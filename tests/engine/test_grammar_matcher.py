"""The grammar's mask and matcher without the model: the byte-table mask equals xgrammar's own kernel, only the
grammar rows are touched, and a matcher synced back and forth over drafts (speculation) is in the state of a
fresh matcher replaying the final output (oracle: xgrammar's matcher and ``apply_token_bitmask_inplace``)."""

from __future__ import annotations

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from pdserve.shared.engine.logits_processors import (GrammarBitmaskLogitsProcessor, ProcessorBatch,  # noqa: E402
                                                     bitmask_to_additive)
from pdserve.shared.engine.structured_output import StructuredOutputManager  # noqa: E402
from pdserve.shared.protocol.sampling_params import SamplingParams  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
VOCAB = 49152


@pytest.fixture(scope="module")
def manager(tokenizer):
    return StructuredOutputManager(tokenizer, VOCAB, [tokenizer.eos_token_id])


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, structured_outputs={"json": SCHEMA})


def _answer(tokenizer) -> list[int]:
    return tokenizer.encode('{"name": "Ann", "age": 42}', add_special_tokens=False) + [tokenizer.eos_token_id]


def _mask_of(grammar) -> torch.Tensor:
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    grammar.fill_bitmask(bitmask, 0)
    return bitmask


def _fresh_mask(manager, tokens: list[int]) -> torch.Tensor:
    grammar = manager.grammar_for(_params())
    assert grammar.sync(tokens)
    return _mask_of(grammar)


def test_the_byte_table_mask_equals_xgrammar_s_kernel_on_random_bits():
    g = torch.Generator().manual_seed(0)
    for vocab in (VOCAB, 1000, 37):
        words = (vocab + 31) // 32
        bitmask = torch.randint(-2**31, 2**31 - 1, (5, words), generator=g, dtype=torch.int64).to(torch.int32)
        logits = torch.randn(5, vocab, generator=g)
        want = logits.clone()
        xgr.apply_token_bitmask_inplace(want, bitmask, vocab_size=vocab)
        assert torch.equal(logits + bitmask_to_additive(bitmask, vocab, logits.device), want)


def test_the_processor_masks_only_the_grammar_rows(manager, tokenizer):
    answer = _answer(tokenizer)
    grammars = [None, manager.grammar_for(_params()), None, manager.grammar_for(_params())]
    outputs = [[5, 6], answer[:3], [7], answer[:6]]
    batch = ProcessorBatch([SamplingParams()] * 4, outputs, (tokenizer.eos_token_id,), VOCAB, "cpu", grammars)
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    got = GrammarBitmaskLogitsProcessor.from_batch(batch).apply(logits.clone())
    assert torch.equal(got[[0, 2]], logits[[0, 2]])
    for row, cut in ((1, 3), (3, 6)):
        want = logits[row:row + 1].clone()
        xgr.apply_token_bitmask_inplace(want, _fresh_mask(manager, answer[:cut]), vocab_size=VOCAB)
        assert torch.equal(got[row], want[0])


def test_a_matcher_synced_over_rejected_drafts_rolls_back_to_the_accepted_prefix(manager, tokenizer):
    drafted = _answer(tokenizer)
    actual = tokenizer.encode('{"name": "Bob", "age": 7}', add_special_tokens=False) + [tokenizer.eos_token_id]
    common = next(i for i, (a, b) in enumerate(zip(drafted, actual)) if a != b)
    grammar = manager.grammar_for(_params())
    for j in range(len(drafted) + 1):  # a verify step's rows: output + drafts[:j], to the stop token
        assert grammar.sync(drafted[:j], strict=False)
    assert grammar.is_terminated
    for cut in (common + 1, len(actual), common - 1, len(actual)):  # back past the stop token, then on again
        assert grammar.sync(actual[:cut])
        assert grammar.is_terminated == (cut == len(actual))
        if cut < len(actual):
            assert torch.equal(_mask_of(grammar), _fresh_mask(manager, actual[:cut]))


def test_a_draft_the_grammar_refuses_makes_its_row_stop_only_without_failing_the_grammar(manager, tokenizer):
    answer = _answer(tokenizer)
    grammar = manager.grammar_for(_params())
    bad = tokenizer.encode("hello", add_special_tokens=False)
    assert not grammar.sync(answer[:2] + bad, strict=False)
    assert not grammar.failed
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    grammar.fill_bitmask(bitmask, 0, reachable=False)
    allowed = (bitmask_to_additive(bitmask, VOCAB, "cpu")[0] == 0).nonzero().flatten().tolist()
    assert allowed == [tokenizer.eos_token_id]
    assert grammar.sync(answer) and grammar.is_terminated  # the real output continues from the accepted prefix
    # the request's real output breaking the grammar (strict) does fail it: stop tokens only from then on
    assert not grammar.sync(answer[:2] + bad)
    assert grammar.failed
