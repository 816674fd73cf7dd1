from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from pdserve.shared.engine.sampler import (
    Sampler,
    SamplingMetadata,
    advance_generator,
    exponential_,
    exponential_race,
    process_logits,
    sampling_probs,
)
from pdserve.shared.protocol.sampling_params import SamplingParams

VOCAB = 49152
EOS = 2


def metadata(params, *, outputs=None, prompts=None, generators=None, vocab=VOCAB, eos=(EOS,)):
    n = len(params)
    return SamplingMetadata.from_requests(
        params,
        prompts if prompts is not None else [[1, 2, 3]] * n,
        outputs if outputs is not None else [[] for _ in range(n)],
        generators if generators is not None else [None] * n,
        set(eos),
        vocab,
    )


def seeded(params):
    return [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]


def hf_probs(logits_row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """HF's warpers in vLLM v1's order (temperature, min-p, top-k, top-p; HF itself runs min-p last), then
    softmax."""
    scores = logits_row.unsqueeze(0).clone()
    ids = torch.zeros(1, 1, dtype=torch.long)
    scores = TemperatureLogitsWarper(p.temperature)(ids, scores)
    if p.min_p > 0.0:
        scores = MinPLogitsWarper(p.min_p)(ids, scores)
    if p.top_k > 0:
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(ids, scores)
    return torch.softmax(scores, dim=-1).squeeze(0)


# ---- greedy ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_greedy_batch_is_argmax(dtype):
    torch.manual_seed(0)
    logits = (torch.randn(64, VOCAB) * 4).to(dtype)
    out = Sampler(0)(logits, metadata([SamplingParams(temperature=0.0)] * 64))
    assert out.sampled_token_ids == logits.float().argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 64


def test_greedy_rows_in_a_mixed_batch_are_argmax_and_input_is_not_modified():
    torch.manual_seed(1)
    logits = torch.randn(8, VOCAB)
    before = logits.clone()
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, top_k=-1 if i % 2 else 50) for i in range(8)]
    out = Sampler(0)(logits, metadata(params))
    argmax = logits.argmax(dim=-1).tolist()
    assert [out.sampled_token_ids[i] for i in range(1, 8, 2)] == [argmax[i] for i in range(1, 8, 2)]
    assert torch.equal(logits, before)
    assert all(0 <= t < VOCAB for t in out.sampled_token_ids)


# ---- the distribution each random row is drawn from, vs HF's warpers -------------------------

WARPER_CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=1.7),
    SamplingParams(temperature=0.8, top_k=1),
    SamplingParams(temperature=0.8, top_k=40),
    SamplingParams(temperature=1.0, top_k=1000),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=0.7, top_p=0.5),
    SamplingParams(temperature=1.3, top_p=0.99),
    SamplingParams(temperature=1.0, top_p=1e-6),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=2.0, min_p=0.3),
    SamplingParams(temperature=0.9, top_k=50, top_p=0.8),
    SamplingParams(temperature=0.9, top_k=300, top_p=0.95, min_p=0.02),
    SamplingParams(temperature=1.1, top_p=0.9, min_p=0.1),
]


@pytest.mark.parametrize("scale", [0.5, 3.0, 10.0, None], ids=["flat", "medium", "peaked", "mixed"])
def test_sampling_distribution_equals_hf_warpers(scale):
    """All cases in one batch (so the vectorised masks must keep rows apart), several logit shapes:
    flat logits push top-p past its first candidate windows, peaked ones resolve inside them, and
    "mixed" has rows of both kinds in one batch."""
    torch.manual_seed(int(scale * 10) if scale else 99)
    scales = torch.tensor([scale] if scale else [0.5, 3.0, 10.0, 5.0, 1.0]).repeat(len(WARPER_CASES))
    logits = torch.randn(len(WARPER_CASES), VOCAB) * scales[: len(WARPER_CASES)].unsqueeze(1)
    md = metadata(WARPER_CASES)
    ours = sampling_probs(process_logits(logits, md)[md.random_rows], md)
    for row, p in enumerate(WARPER_CASES):
        expected = hf_probs(logits[row], p)
        differ = ((ours[row] > 0) != (expected > 0)).nonzero().flatten()
        # HF sums 49k float32 probabilities for top-p; a token whose cut point lies within that
        # rounding of p may land on either side. Nothing else may differ.
        assert len(differ) <= 2, (p, len(differ))
        if len(differ):
            probs = torch.softmax(logits[row].double() / p.temperature, -1)
            for tok in differ.tolist():
                above = float(probs[probs > probs[tok]].sum())
                assert abs(above - p.top_p) < 1e-4, (p, tok, above)
            expected = torch.where(differ_mask(ours[row], differ), 0.0, expected)
            ours_row = torch.where(differ_mask(ours[row], differ), 0.0, ours[row])
            torch.testing.assert_close(ours_row / ours_row.sum(), expected / expected.sum(), rtol=1e-4, atol=1e-7)
            continue
        torch.testing.assert_close(ours[row], expected, rtol=1e-4, atol=1e-7)


def differ_mask(like: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    mask = torch.zeros_like(like, dtype=torch.bool)
    mask[ids] = True
    return mask


def test_bfloat16_logits_sample_inside_the_allowed_set():
    torch.manual_seed(8)
    params = [SamplingParams(temperature=0.7, top_p=0.8, seed=1), SamplingParams(temperature=1.0, top_k=4),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.2, min_p=0.2)]
    logits = (torch.randn(4, VOCAB) * 4).to(torch.bfloat16)
    md = metadata(params, generators=seeded(params))
    allowed = sampling_probs(process_logits(logits, md)[md.random_rows], md) > 0
    out = Sampler(3)(logits, md)
    assert out.sampled_token_ids[2] == int(logits[2].float().argmax())
    for i, row in enumerate(md.random_rows):
        assert allowed[i, out.sampled_token_ids[row]]


def test_top_k_larger_than_vocab_keeps_everything():
    logits = torch.randn(1, 100)
    md = metadata([SamplingParams(top_k=500)], vocab=100)
    probs = sampling_probs(process_logits(logits, md), md)
    torch.testing.assert_close(probs[0], torch.softmax(logits[0], -1))


def test_sampled_tokens_lie_in_the_allowed_set():
    torch.manual_seed(3)
    params = [SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=1.0, top_p=0.3),
              SamplingParams(temperature=1.0, min_p=0.5)] * 10
    logits = torch.randn(len(params), VOCAB) * 3
    md = metadata(params)
    allowed = sampling_probs(process_logits(logits, md), md) > 0
    sampler = Sampler(7)
    for _ in range(5):
        out = sampler(logits, md)
        assert all(allowed[r, t] for r, t in enumerate(out.sampled_token_ids))


# ---- empirical distribution ------------------------------------------------------------------


def chi_square(counts: torch.Tensor, expected: torch.Tensor) -> float:
    return float(((counts - expected) ** 2 / expected).sum())


def chi_square_bound(df: int) -> float:
    # mean df, sd sqrt(2 df): 6 sd is far outside what a correct sampler reaches with a fixed seed.
    return df + 6 * math.sqrt(2 * df)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6, top_k=30),
        SamplingParams(temperature=1.2, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.05),
    ],
    ids=["plain", "top_k", "top_p", "min_p"],
)
def test_empirical_distribution_of_draws_matches_softmax(params):
    torch.manual_seed(11)
    vocab, draws = 1000, 20000
    base = torch.randn(vocab) * 2.5
    logits = base.expand(draws, vocab)
    md = metadata([params] * draws, vocab=vocab)
    expected_p = sampling_probs(process_logits(logits[:1], metadata([params], vocab=vocab)),
                                metadata([params], vocab=vocab))[0]
    counts = torch.bincount(torch.tensor(Sampler(1234)(logits, md).sampled_token_ids), minlength=vocab).double()
    assert counts[expected_p == 0].sum() == 0
    # Pool the tail into one bin so every bin expects >= 5 draws.
    expected = expected_p.double() * draws
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big & (expected_p > 0)].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big & (expected_p > 0)].sum().reshape(1)])
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
        obs = obs * (draws / obs.sum())
    df = len(exp) - 1
    assert chi_square(obs, exp) < chi_square_bound(df)


def test_exponential_race_matches_weights_and_never_picks_zero_weight():
    torch.manual_seed(5)
    vocab, draws = 1300, 20000
    w = torch.zeros(vocab)
    support = torch.randperm(vocab)[:40]
    w[support] = torch.rand(40) + 0.05
    q = exponential_(torch.empty(draws, vocab), torch.Generator().manual_seed(9))
    q[0, support] = float("inf")  # U = 0 exactly: that token cannot win
    q[0, support[7]] = 1.0
    idx = exponential_race(w.expand(draws, vocab), q)
    assert int(idx[0]) == int(support[7])
    assert bool((w[idx] > 0).all())
    counts = torch.bincount(idx, minlength=vocab).double()[support]
    expected = (w[support] / w.sum()).double() * draws
    assert chi_square(counts, expected) < chi_square_bound(39)


def test_exponential_draws_are_exp1_and_rows_consume_the_generator_in_order():
    q = exponential_(torch.empty(4, 50_000), torch.Generator().manual_seed(3))
    assert bool((q > 0).all())
    assert float(q.mean()) == pytest.approx(1.0, abs=0.01) and float(q.var()) == pytest.approx(1.0, abs=0.03)
    one_by_one = torch.Generator().manual_seed(3)
    assert all(torch.equal(q[i], exponential_(torch.empty(50_000), one_by_one)) for i in range(4))


def test_advance_generator_skips_exactly_what_sampled_tokens_consume():
    vocab = 300
    params = [SamplingParams(temperature=1.0, seed=11)]
    torch.manual_seed(1)
    steps = [torch.randn(1, vocab) * 2 for _ in range(140)]
    g = torch.Generator().manual_seed(11)
    md = metadata(params, generators=[g], vocab=vocab)
    sampler = Sampler(0)
    straight = [sampler(x, md).sampled_token_ids[0] for x in steps]
    for skip in (1, 5, 70, 130):  # 70 and 130 cross the chunked skip's 64 rows
        g = torch.Generator().manual_seed(11)
        advance_generator(g, skip, vocab)
        md = metadata(params, generators=[g], vocab=vocab)
        assert [sampler(x, md).sampled_token_ids[0] for x in steps[skip:]] == straight[skip:]


def test_seeded_draw_survives_float_noise_that_flips_inverse_cdf():
    # The same logits with fp32-sized noise (as from another batch shape): the race keeps its token on
    # (nearly) every draw over the full vocabulary at T=1, where inverse-CDF sampling flipped 10 of these 1000.
    vocab, draws = SEED_VOCAB, 1000
    torch.manual_seed(8)
    base = torch.randn(draws, vocab) * 3
    noisy = base + torch.randn(draws, vocab) * 1e-5 * base.abs()
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(draws)]
    a = Sampler(0)(base, metadata(params, generators=seeded(params), vocab=vocab)).sampled_token_ids
    b = Sampler(0)(noisy, metadata(params, generators=seeded(params), vocab=vocab)).sampled_token_ids
    assert sum(x != y for x, y in zip(a, b)) <= 1


# ---- seeds -----------------------------------------------------------------------------------


SEED_VOCAB = 5000


def run_steps(sampler, params, steps, logits_per_step, row_of_interest):
    gens = seeded(params)
    md = metadata(params, generators=gens, vocab=SEED_VOCAB)
    return [sampler(logits_per_step(s, len(params)), md).sampled_token_ids[row_of_interest] for s in range(steps)]


def test_seeded_request_gives_same_tokens_alone_and_in_any_batch():
    target = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    torch.manual_seed(0)
    step_logits = [torch.randn(SEED_VOCAB) * 1.5 for _ in range(12)]

    def logits_for(target_row):
        def make(step, rows):
            x = torch.randn(rows, SEED_VOCAB)
            x[target_row] = step_logits[step]
            return x
        return make

    alone = run_steps(Sampler(0), [target], 12, logits_for(0), 0)
    neighbours = [SamplingParams(temperature=0.8), SamplingParams(temperature=0.0),
                  SamplingParams(temperature=1.0, top_k=5, seed=7), SamplingParams(top_p=0.5)]
    batch_a = neighbours[:2] + [target] + neighbours[2:]
    in_batch = run_steps(Sampler(99), batch_a, 12, logits_for(2), 2)
    batch_b = [target] + neighbours[::-1] * 3
    in_other_batch = run_steps(Sampler(5), batch_b, 12, logits_for(0), 0)
    assert alone == in_batch == in_other_batch


def test_different_seeds_give_different_tokens():
    torch.manual_seed(0)
    logits = torch.zeros(1, SEED_VOCAB)  # uniform: any two seeds collide on all 10 steps with prob ~0
    runs = []
    for seed in (1, 2):
        p = SamplingParams(temperature=1.0, seed=seed)
        runs.append(run_steps(Sampler(0), [p], 10, lambda s, n: logits, 0))
    assert runs[0] != runs[1]
    again = run_steps(Sampler(123), [SamplingParams(temperature=1.0, seed=1)], 10, lambda s, n: logits, 0)
    assert again == runs[0]


# ---- penalties -------------------------------------------------------------------------------


def test_repetition_penalty_equals_hf_processor_over_prompt_and_output():
    torch.manual_seed(2)
    prompts = [[5, 9, 9, 100, 7], [3], [11, 12]]
    outputs = [[7, 42, 42], [], [13, 11]]
    penalties = [1.3, 0.7, 2.0]
    logits = torch.randn(3, 1000) * 3
    params = [SamplingParams(temperature=0.0, repetition_penalty=r) for r in penalties]
    ours = process_logits(logits, metadata(params, prompts=prompts, outputs=outputs, vocab=1000))
    for i, r in enumerate(penalties):
        ids = torch.tensor([prompts[i] + outputs[i]])
        expected = RepetitionPenaltyLogitsProcessor(r)(ids, logits[i:i + 1].clone())[0]
        torch.testing.assert_close(ours[i], expected)


def test_presence_and_frequency_penalties_follow_openai_formula_over_output_only():
    torch.manual_seed(3)
    prompt = [1, 2, 3, 4]
    output = [4, 4, 4, 9, 10, 10]
    presence, frequency = 0.6, -0.3
    logits = torch.randn(2, 50)
    params = [SamplingParams(presence_penalty=presence, frequency_penalty=frequency),
              SamplingParams(temperature=0.5)]
    ours = process_logits(logits, metadata(params, prompts=[prompt, prompt], outputs=[output, output], vocab=50))
    expected = logits[0].clone()
    for tok in set(output):
        count = output.count(tok)
        expected[tok] -= frequency * count + presence * 1.0
    torch.testing.assert_close(ours[0], expected)
    torch.testing.assert_close(ours[1], logits[1])  # no penalty: untouched
    assert ours[0][1] == logits[0][1]  # prompt-only token: not penalised


def test_penalised_greedy_row_picks_argmax_of_penalised_logits():
    logits = torch.zeros(1, 10)
    logits[0, 4] = 2.0
    logits[0, 6] = 1.5
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    out = Sampler(0)(logits, metadata([p], prompts=[[4]], outputs=[[]], vocab=10))
    assert out.sampled_token_ids == [6]  # 2.0 / 2 = 1.0 < 1.5


# ---- min_tokens ------------------------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    logits = torch.zeros(4, 10)
    logits[:, EOS] = 10.0
    logits[:, 7] = 9.0
    logits[:, 5] = 8.0
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7])
    p_ignore = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)
    outputs = [[1], [1, 1, 1], [], [1]]
    out = Sampler(0)(logits, metadata([p, p, p_ignore, SamplingParams(temperature=0.0)], outputs=outputs, vocab=10))
    # 1 output < 3: EOS and 7 masked; 3 outputs: free; ignore_eos: EOS is no stop, so not masked.
    assert out.sampled_token_ids == [5, EOS, EOS, EOS]


def test_min_tokens_mask_applies_to_logprobs_too():
    logits = torch.zeros(1, 10)
    p = SamplingParams(temperature=0.0, min_tokens=2, logprobs=10)
    out = Sampler(0)(logits, metadata([p], outputs=[[]], vocab=10))
    top = out.logprobs[0].top_dict
    assert top[EOS] == float("-inf") and out.logprobs[0].top[-1][0] == EOS
    assert all(math.isclose(top[t], math.log(1 / 9), rel_tol=1e-6) for t in range(10) if t != EOS)


# ---- logprobs --------------------------------------------------------------------------------


def test_logprobs_equal_log_softmax_and_top_ids_equal_torch_topk():
    torch.manual_seed(4)
    logits = torch.randn(5, VOCAB) * 3
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.8, top_k=20, logprobs=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, top_p=0.9, logprobs=20, seed=3),
        SamplingParams(temperature=0.0, logprobs=1, presence_penalty=1.0),
    ]
    outputs = [[], [], [], [], [10, 11]]
    md = metadata(params, outputs=outputs, generators=seeded(params))
    out = Sampler(0)(logits, md)
    processed = process_logits(logits, md)
    assert out.logprobs[2] is None
    for row in (0, 1, 3, 4):
        lp = out.logprobs[row]
        n = params[row].logprobs
        ref = torch.log_softmax(processed[row], dim=-1)
        tok = out.sampled_token_ids[row]
        assert lp.token_id == tok
        assert math.isclose(lp.logprob, float(ref[tok]), rel_tol=1e-6, abs_tol=1e-6)
        assert lp.rank == int((ref > ref[tok]).sum()) + 1
        vals, ids = torch.topk(ref, n) if n else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(vals.tolist(), rel=1e-6)
    assert out.logprobs[0].rank == 1  # greedy picks the most likely
    # the penalised row reports the penalised distribution
    assert out.logprobs[4].top_dict.get(10) is None or out.logprobs[4].top_dict[10] < float(torch.log_softmax(logits[4], -1)[10])


def test_logprobs_are_taken_before_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    out = Sampler(0)(logits, metadata([SamplingParams(temperature=0.3, logprobs=4)], vocab=4))
    expected = torch.log_softmax(logits[0], -1).tolist()
    assert [v for _, v in out.logprobs[0].top] == pytest.approx(expected, rel=1e-6)


def test_penalties_touch_only_their_rows_and_tokens_and_leave_input_alone():
    torch.manual_seed(6)
    logits = torch.randn(4, 300) * 2
    before = logits.clone()
    params = [
        SamplingParams(presence_penalty=1.5, repetition_penalty=1.2),  # no output yet
        SamplingParams(temperature=0.9),
        SamplingParams(frequency_penalty=0.5, repetition_penalty=0.8),
        SamplingParams(presence_penalty=-1.0),
    ]
    prompts = [[5, 5, 6], [5], [], [7]]
    outputs = [[], [5, 6], [9, 9, 299], [299, 0, 0]]
    ours = process_logits(logits, metadata(params, prompts=prompts, outputs=outputs, vocab=300))
    assert torch.equal(logits, before)
    expected = logits.clone()
    for row, p in enumerate(params):
        seen = set(prompts[row] + outputs[row])
        for tok in seen:
            if p.repetition_penalty != 1.0:
                x = expected[row, tok]
                expected[row, tok] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for tok in set(outputs[row]):
            expected[row, tok] -= p.frequency_penalty * outputs[row].count(tok) + p.presence_penalty
    torch.testing.assert_close(ours, expected)


def test_padded_vocab_columns_are_never_sampled():
    logits = torch.zeros(3, 120)
    logits[:, 100:] = 50.0  # lm_head padding beyond the tokenizer's 100 tokens
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(top_k=3, logprobs=2)]
    out = Sampler(0)(logits, metadata(params, vocab=100))
    assert all(t < 100 for t in out.sampled_token_ids)


def test_empty_batch():
    out = Sampler(0)(torch.zeros(0, 50), metadata([], vocab=50))
    assert out.sampled_token_ids == [] and out.logprobs == []
