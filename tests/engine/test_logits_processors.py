"""Logits processors follow their definitions: ``allowed_token_ids`` keeps only those tokens, ``logit_bias`` +100
forces its token, ``bad_words`` never appear (a multi-token word is banned only right after its prefix),
``min_p`` drops tokens below ``min_p`` times the top probability; rows without them are untouched, and a batch
without them builds no processor. The slow half runs the offline engine on SmolLM2."""

from __future__ import annotations

import pytest
import torch

from pdserve.shared.engine.sampler import Sampler, SamplingMetadata, process_logits, sampling_probs
from pdserve.shared.protocol.sampling_params import SamplingParams
from support.model_fixtures import TEXT

VOCAB = 1000


def metadata(params, outputs=None):
    n = len(params)
    return SamplingMetadata.from_requests(params, [[1]] * n, outputs or [[] for _ in range(n)], [None] * n,
                                          {2}, VOCAB)


def test_a_batch_without_processor_parameters_builds_no_processor():
    md = metadata([SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.9, top_k=5)])
    assert md.logits_processors == [] and md.random_row_processors == [] and md.no_processing


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_allowed_token_ids_only_those_tokens_are_sampled(temperature):
    torch.manual_seed(0)
    allowed = [3, 500, 999]
    params = [SamplingParams(temperature=temperature, allowed_token_ids=allowed), SamplingParams(temperature=0)]
    sampler = Sampler(0)
    for _ in range(50):
        logits = torch.randn(2, VOCAB) * 3
        out = sampler(logits, metadata(params)).sampled_token_ids
        assert out[0] in allowed
        assert out[1] == int(logits[1].argmax())  # the neighbour row is untouched


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_plus_100_forces_its_token_and_adds_exactly(temperature):
    torch.manual_seed(1)
    logits = torch.randn(4, VOCAB) * 3
    params = [SamplingParams(temperature=temperature, logit_bias={7: 100.0, 8: -2.5})] * 4
    md = metadata(params)
    assert Sampler(0)(logits, md).sampled_token_ids == [7] * 4
    expected = logits.clone()
    expected[:, 7] += 100.0
    expected[:, 8] -= 2.5
    torch.testing.assert_close(process_logits(logits, md), expected)


def test_bad_words_ban_a_word_s_last_token_only_after_its_prefix():
    logits = torch.zeros(3, VOCAB)
    p = SamplingParams(temperature=0, bad_words=["x"], bad_words_token_ids=[[5], [8, 9]])
    out = process_logits(logits, metadata([p] * 3, outputs=[[], [1, 8], [8, 1]]))
    banned = [set(torch.isinf(row).nonzero().flatten().tolist()) for row in out]
    assert banned == [{5}, {5, 9}, {5}]


def test_min_p_keeps_tokens_at_least_min_p_times_the_top_probability():
    torch.manual_seed(2)
    logits = torch.randn(2, VOCAB) * 2
    params = [SamplingParams(temperature=0.7, min_p=0.2), SamplingParams(temperature=0.7)]
    md = metadata(params)
    probs = torch.softmax(logits / 0.7, dim=-1)
    got = sampling_probs(process_logits(logits, md)[md.random_rows], md)
    keep = probs[0] >= 0.2 * probs[0].max()
    assert torch.equal(got[0] > 0, keep)
    torch.testing.assert_close(got[0], torch.where(keep, probs[0], 0.0) / probs[0][keep].sum())
    torch.testing.assert_close(got[1], probs[1])


# ---- the offline engine ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tokenizer.encode(TEXT)[:40]


@pytest.fixture(scope="module")
def plain(llm_fp32, prompt):
    out = llm_fp32.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    return out[0].outputs[0].token_ids


def _generate(llm, prompt, **kw):
    params = SamplingParams(max_tokens=12, ignore_eos=True, **kw)
    return llm.generate([prompt], params)[0].outputs[0]


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(temperature=0), dict(temperature=1.0, seed=3)], ids=["greedy", "seeded"])
def test_engine_allowed_token_ids_and_logit_bias(llm_fp32, prompt, plain, kw):
    allowed = sorted(set(plain[1:4]) | {11, 12})
    assert set(_generate(llm_fp32, prompt, allowed_token_ids=allowed, **kw).token_ids) <= set(allowed)
    forced = next(t for t in range(100, 200) if t not in plain)
    assert _generate(llm_fp32, prompt, logit_bias={forced: 100}, **kw).token_ids == [forced] * 12


@pytest.mark.slow
def test_engine_bad_words_never_appear(llm_fp32, tokenizer, prompt, plain):
    word = tokenizer.decode(plain[2:4]).strip()  # a word greedy decoding would produce
    params = SamplingParams(bad_words=[word])
    params.update_from_tokenizer(tokenizer)
    out = _generate(llm_fp32, prompt, temperature=0, bad_words=[word]).token_ids
    assert out != plain
    for seq in params.bad_words_token_ids:
        assert not any(out[i:i + len(seq)] == seq for i in range(len(out))), (word, seq, out)


@pytest.mark.slow
def test_engine_min_p_1_samples_the_argmax(llm_fp32, prompt, plain):
    assert _generate(llm_fp32, prompt, temperature=1.0, seed=5, min_p=1.0).token_ids == plain
