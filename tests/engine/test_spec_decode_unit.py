"""Speculative decoding, the parts without a model: config parsing, the n-gram proposer, the rejection
sampler's distribution (chi-square against the target, with a wrong sampler that the test must catch)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2

from pdserve.shared.protocol.sampling_params import SamplingParams
from pdserve.shared.engine.spec_decode import rejection_sampler as rs
from pdserve.shared.engine.spec_decode.config import SpeculativeConfig
from pdserve.shared.engine.spec_decode.ngram_proposer import NgramProposer
from pdserve.shared.engine.spec_decode.rejection_sampler import RejectionSampler, spec_metadata

# config


def test_ngram_config_parses_vllm_dict():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                     "prompt_lookup_min": 2})
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 4, 2, 4)
    assert SpeculativeConfig.from_dict('{"method": "ngram", "num_speculative_tokens": 3}').prompt_lookup_max == 5
    only_max = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (3, 3)
    assert SpeculativeConfig.from_dict(None) is None and SpeculativeConfig.from_dict({}) is None


def test_draft_model_config_parses_vllm_dict():
    c = SpeculativeConfig.from_dict({"method": "draft_model", "model": "/m", "num_speculative_tokens": 2})
    assert (c.method, c.model, c.num_speculative_tokens) == ("draft_model", "/m", 2)
    assert SpeculativeConfig.from_dict({"model": "/m", "num_speculative_tokens": 2}).method == "draft_model"


@pytest.mark.parametrize("data, field", [
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "num_spec_tokens": 3}, "num_spec_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ("{not json", "JSON"),
])
def test_bad_config_error_names_the_field(data, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_dict(data)


# n-gram proposer


def test_ngram_proposes_continuation_of_longest_latest_match():
    p = NgramProposer(1, 3)
    # suffix [7, 8, 9] occurs earlier at index 1 -> continuation [4, 5]
    assert p.propose([1, 7, 8, 9, 4, 5, 6, 7, 8, 9], k=2) == [4, 5]
    # the 3-gram [5, 8, 9] has no match; the 2-gram [8, 9] matches twice: the latest one wins
    assert p.propose([8, 9, 1, 8, 9, 2, 5, 8, 9], k=3) == [2, 5, 8]
    assert p.propose([1, 2, 3, 4], k=3) == []  # no match
    assert p.propose([5, 5, 5, 5], k=4) == [5]  # the continuation stops at the sequence's end
    assert NgramProposer(2, 2).propose([3, 1, 2, 3], k=2) == []  # a 1-gram match does not count


# rejection sampler

V = 6
P = torch.tensor([[0.30, 0.05, 0.25, 0.10, 0.20, 0.10], [0.10, 0.40, 0.05, 0.05, 0.20, 0.20]])
Q = torch.tensor([[0.05, 0.40, 0.05, 0.30, 0.10, 0.10]])
N = 5000


def _chi2_rejects(counts: torch.Tensor, probs: torch.Tensor, alpha: float = 1e-4) -> bool:
    n = counts.sum()
    expected = probs * n
    stat = float(((counts - expected) ** 2 / expected).sum())
    return stat > chi2.ppf(1 - alpha, df=len(probs) - 1)


def _sample_counts(with_q: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    first = torch.zeros(V)
    bonus = torch.zeros(V)
    accepted = 0
    drafts = torch.multinomial(Q[0], N, replacement=True, generator=g).tolist()
    for d in drafts:
        if with_q:
            out = rs.verify_random(P, [d], Q, g)
        else:
            out = rs.verify_random(P, [3], None, g)  # an n-gram draft: always token 3
        first[out[0]] += 1
        if len(out) == 2:
            accepted += 1
            bonus[out[1]] += 1
    return first, bonus, accepted


@pytest.mark.parametrize("with_q", [True, False], ids=["draft_probs", "ngram_one_hot"])
def test_rejection_sampler_emits_the_target_distribution(with_q):
    first, bonus, accepted = _sample_counts(with_q)
    assert not _chi2_rejects(first, P[0])
    assert not _chi2_rejects(bonus, P[1])  # after an accepted draft, the bonus token is drawn from p at k
    expect = float((torch.minimum(P[0], Q[0])).sum()) if with_q else float(P[0, 3])  # P(accept) = sum min(p, q)
    assert abs(accepted / N - expect) < 0.02


def test_distribution_test_catches_a_sampler_without_the_residual(monkeypatch):
    # Resampling from p itself (not norm(max(0, p - q))) after a rejection skews the output toward q's
    # favourites: the same chi-square check must see it.
    monkeypatch.setattr(rs, "residual_probs", lambda p, q, d: p.clone())
    first, _, _ = _sample_counts(True)
    assert _chi2_rejects(first, P[0])


def test_greedy_verification_accepts_while_draft_matches_argmax():
    assert rs.verify_greedy([4, 7, 9, 1], [4, 7, 2]) == [4, 7, 9]
    assert rs.verify_greedy([4, 7, 9, 1], [4, 7, 9]) == [4, 7, 9, 1]  # all accepted: bonus
    assert rs.verify_greedy([4, 7], [5]) == [4]


def _verify(batch, seeds):
    params = [SamplingParams(temperature=1.0, seed=s) for s in seeds]
    drafts = [d for d, _ in batch]
    logits = torch.cat([lg for _, lg in batch])
    md = spec_metadata(params, [[1]] * len(batch), [[]] * len(batch), drafts, [], logits.shape[1])
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    return RejectionSampler(torch.Generator().manual_seed(99))(logits, drafts, md, gens).token_ids


def test_seeded_verification_is_independent_of_batch_neighbours():
    torch.manual_seed(0)
    mine = ([3, 1, 4], torch.randn(4, 50) * 2)
    others = [([2, 2], torch.randn(3, 50) * 2), ([7], torch.randn(2, 50) * 2)]
    alone = _verify([mine], [5])[0]
    for seeds_run in range(3):
        assert _verify([others[0], mine, others[1]], [11 + seeds_run, 5, 13])[1] == alone


def test_penalties_and_min_tokens_see_earlier_drafts_as_output():
    sp = SamplingParams(temperature=0.0, presence_penalty=2.0, min_tokens=2, stop_token_ids=[9])
    md = spec_metadata([sp], [[1]], [[]], [[5, 6]], [], 20)
    assert md.num_rows == 3
    logits = torch.zeros(3, 20)
    logits[:, 5] = 10.0
    logits[:, 9] = 20.0
    logits[:, 6] = 9.0
    # row 0: stop id 9 masked (0 outputs < min_tokens) -> 5 accepted; row 1: 5 penalised, 9 masked -> 6 accepted;
    # row 2: two outputs, 9 allowed -> bonus 9
    out = RejectionSampler(torch.Generator())(logits, [[5, 6]], md, [None])
    assert out.token_ids == [[5, 6, 9]] and out.num_accepted == [2]


# adaptive policy and metrics

from pdserve.shared.engine.spec_decode.policy import SpecPolicy  # noqa: E402


def test_policy_shrinks_k_for_a_request_whose_drafts_fail_and_caps_a_large_batch():
    policy = SpecPolicy(k=5, adaptive=True, disable_by_batch_size=None, max_draft_tokens_per_step=32)
    assert policy.num_draft_tokens("a") == 5  # optimistic start
    for _ in range(6):
        policy.record("a", 5, 0)
    assert policy.num_draft_tokens("a") == 1  # drafts keep failing: one guess a step
    for _ in range(6):
        policy.record("a", 5, 5)
    assert policy.num_draft_tokens("a") == 5
    assert policy.step_budget(1) == 32 and policy.step_budget(64) == 32  # at most 32 draft tokens per step
    fixed = SpecPolicy(k=3, adaptive=False, disable_by_batch_size=8)
    assert fixed.num_draft_tokens("a") == 3 and fixed.step_budget(8) == 24 and fixed.step_budget(9) == 0


def test_adaptive_cap_follows_acceptance_and_is_shared_evenly():
    from types import SimpleNamespace

    from pdserve.shared.engine.spec_decode.policy import draft_token_cap
    from pdserve.shared.engine.spec_decode.spec_decoder import SpecDecoder

    # round(32 * a / (1 - a)), a clipped to [0.02, 0.95], at least 4
    assert [draft_token_cap(a, 32) for a in (0.5, 0.8, 0.2, 0.99, 0.0)] == [32, 128, 8, 608, 4]
    policy = SpecPolicy(k=4, adaptive=True, disable_by_batch_size=None)
    assert policy.step_budget(64) == 32  # nothing measured: acceptance 0.5
    policy.record_step(10, 10)  # a = 0.75 * 0.5 + 0.25 * 1.0 = 0.625 -> round(32 * 0.625 / 0.375) = 53
    assert policy.acceptance == 0.625 and policy.step_budget(64) == 53
    policy.record_step(10, 0)  # a = 0.75 * 0.625 = 0.46875 -> round(32 * 0.46875 / 0.53125) = round(28.2) = 28
    assert policy.step_budget(1) == 28
    policy.record_step(0, 0)  # a step without drafts measures nothing
    assert policy.acceptance == 0.46875

    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2,
                                          "prompt_lookup_min": 1})
    spec = SpecDecoder(config, torch.Generator(), frozenset({0}), 100, 1024)

    def running(n):  # decoding requests whose tokens repeat, so prompt lookup always proposes k
        return [SimpleNamespace(request_id=f"r{i}", spec_token_ids=[], grammar=None, num_computed_tokens=39, num_tokens=40,
                                prefill_only=False, max_tokens=100, num_output_tokens=8, all_token_ids=list(range(10)) * 4)
                for i in range(n)]

    spec.policy.acceptance = 0.8  # cap 128: 2 draft tokens each for 64 requests (the old rule: 4 each for the first 8)
    batch = running(64)
    spec.propose(batch)
    assert [len(r.spec_token_ids) for r in batch] == [2] * 64
    batch = running(3)  # a small batch: the cap is not binding, each request proposes k
    spec.propose(batch)
    assert [len(r.spec_token_ids) for r in batch] == [4] * 3
    spec.policy.acceptance = 0.2  # cap 8 over 5 requests: ceil(8/5) = 2, 2, ceil(4/3) = 2, 1, 1
    batch = running(5)
    spec.propose(batch)
    assert [len(r.spec_token_ids) for r in batch] == [2, 2, 2, 1, 1]


def test_worker_metrics_export_vllm_spec_decode_counters():
    from pdserve.shared.engine.stats import EngineStats
    from pdserve.shared.worker.metrics import WorkerMetrics

    m = WorkerMetrics("decode", "d0")
    m.update_from_stats(EngineStats(spec_decode_num_drafts=4, spec_decode_num_draft_tokens=12,
                                    spec_decode_num_accepted_tokens=7, spec_decode_num_accepted_tokens_per_pos=(4, 2, 1)))
    m.update_from_stats(EngineStats(spec_decode_num_drafts=5, spec_decode_num_draft_tokens=15,
                                    spec_decode_num_accepted_tokens=8, spec_decode_num_accepted_tokens_per_pos=(5, 2, 1)))
    text = m.render().decode()
    assert 'pdserve:spec_decode_num_drafts_total{pod="d0",role="decode"} 5.0' in text
    assert 'pdserve:spec_decode_num_draft_tokens_total{pod="d0",role="decode"} 15.0' in text
    assert 'pdserve:spec_decode_num_accepted_tokens_total{pod="d0",role="decode"} 8.0' in text
    assert 'pdserve:spec_decode_num_accepted_tokens_per_pos_total{pod="d0",position="0",role="decode"} 5.0' in text
