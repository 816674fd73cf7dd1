"""Turn one step's logits into next tokens (and logprobs), one row per sampling request.

Order of processing, as vLLM v1's ``Sampler``:

1. ``min_tokens``: while a request has fewer than ``min_tokens`` outputs, its EOS ids (unless
   ``ignore_eos``) and ``stop_token_ids`` get ``-inf``.
2. Penalties: repetition (HF ``RepetitionPenaltyLogitsProcessor`` / CTRL, arXiv:1909.05858: divide a
   positive logit, multiply a negative one, for every token seen in prompt or output), then frequency
   and presence over output tokens only (OpenAI: ``logit -= f * count + p * (count > 0)``).
3. Logprobs, when asked, are ``log_softmax`` of these processed logits: after min_tokens and
   penalties, before temperature and truncation. This is vLLM's "raw logprobs" (the model's
   distribution as the request shaped it, independent of how it chose to sample).
4. Greedy rows (temperature < 1e-5): ``argmax``.
5. Random rows: temperature, then top-k, top-p, min-p in HF's warper order, then one draw.

Top-k keeps the ``k`` most likely tokens (ties at the k-th value are kept if they fall inside the
candidate window of ``k + 16``). Top-p keeps the smallest most-likely-first set whose mass reaches
``p`` (a token stays if the mass strictly above it is below ``p``, which is HF's ascending-cumsum rule
``cumsum <= 1 - p`` removed). Min-p keeps tokens with ``prob >= min_p * max_prob``; renormalisation
does not change that ratio, so it is applied on the same candidate set.

Candidates come from ``topk`` rather than a full sort (a 64 x 49152 sort costs ~200 ms on 2 CPU
cores): top-p first tries the top 256 tokens and widens only for rows whose mass has not reached
``p``. The draw is inverse-CDF sampling with one uniform number per row from that row's own
``torch.Generator`` (the seeded request's, else the sampler's), so a seeded request's tokens do not
depend on its batch neighbours. Over the full vocabulary the CDF is searched in two levels (blocks of
256, then within the block) so no ``[rows, vocab]`` float64 cumsum is needed.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from pdserve.shared.engine.sampling_params import SamplingParams

_TOP_K_TIE_SLACK = 16
_TOP_P_WINDOWS = (256, 4096)
_CDF_BLOCK = 256


@dataclass(slots=True)
class SampleLogprobs:
    """Logprob of the sampled token, its rank (1 = most likely) and the ``top`` alternatives.

    ``top`` holds ``(token_id, logprob)`` pairs, most likely first, as many as the request's
    ``logprobs`` (possibly none). Natural log.
    """

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]

    @property
    def top_dict(self) -> dict[int, float]:
        return dict(self.top)


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: list[int]  # one per row
    logprobs: list[SampleLogprobs | None]  # one per row; None where the request did not ask


@dataclass(slots=True)
class SamplingMetadata:
    """Everything the sampler needs for one step, built once by the model runner.

    Row ``i`` of the logits belongs to request ``i`` of the lists given to :meth:`from_requests`.
    Tensors for a feature are ``None`` when no row uses it, so the common case costs nothing.
    """

    num_rows: int
    vocab_size: int
    all_greedy: bool
    greedy_rows: list[int]
    random_rows: list[int]
    # random rows only, in random_rows order
    temperature: torch.Tensor | None  # [R] float32; None when all are 1.0
    top_k: torch.Tensor | None  # [R] int64, vocab_size where disabled; None when none use it
    top_p: torch.Tensor | None  # [R] float32; None when none use it
    min_p: torch.Tensor | None  # [R] float32; None when none use it
    generators: list[torch.Generator | None]
    # min_tokens: (row, token) pairs to mask this step
    min_tokens_rows: torch.Tensor | None
    min_tokens_ids: torch.Tensor | None
    # penalties, for penalty_rows only
    penalty_rows: torch.Tensor | None  # [P] int64
    presence_penalty: torch.Tensor | None  # [P, 1]
    frequency_penalty: torch.Tensor | None  # [P, 1]
    repetition_penalty: torch.Tensor | None  # [P, 1]
    prompt_token_ids: torch.Tensor | None  # [P, Lp] padded with vocab_size
    output_token_ids: torch.Tensor | None  # [P, Lo] padded with vocab_size
    # logprobs
    logprob_rows: list[int]
    num_logprobs: list[int]

    @property
    def no_processing(self) -> bool:
        return self.min_tokens_rows is None and self.penalty_rows is None

    @classmethod
    def from_requests(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        eos_token_ids: Iterable[int],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        """Build the step's metadata; all sequences have one entry per logits row.

        ``generators[i]`` is the seeded request's ``torch.Generator().manual_seed(seed)`` (kept by the
        engine across steps, CPU), or ``None`` to use the sampler's own generator.
        ``eos_token_ids`` is the model's EOS set (``ignore_eos`` requests are exempt).
        """
        eos = tuple(eos_token_ids)
        greedy_rows: list[int] = []
        random_rows: list[int] = []
        temps: list[float] = []
        top_ks: list[int] = []
        top_ps: list[float] = []
        min_ps: list[float] = []
        gens: list[torch.Generator | None] = []
        mt_rows: list[int] = []
        mt_ids: list[int] = []
        pen_rows: list[int] = []
        logprob_rows: list[int] = []
        num_logprobs: list[int] = []
        for i, p in enumerate(params):
            if p.temperature < 1e-5:
                greedy_rows.append(i)
            else:
                random_rows.append(i)
                temps.append(p.temperature)
                top_ks.append(p.top_k if p.top_k > 0 else vocab_size)
                top_ps.append(p.top_p)
                min_ps.append(p.min_p)
                gens.append(generators[i])
            if p.min_tokens and len(output_token_ids[i]) < p.min_tokens:
                stops = set(p.stop_token_ids)
                if not p.ignore_eos:
                    stops.update(eos)
                stops = [t for t in stops if t < vocab_size]
                mt_rows.extend([i] * len(stops))
                mt_ids.extend(stops)
            if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
                pen_rows.append(i)
            if p.logprobs is not None:
                logprob_rows.append(i)
                num_logprobs.append(p.logprobs)

        def f32(values: list[float], skip_if: float) -> torch.Tensor | None:
            if all(v == skip_if for v in values):
                return None
            return torch.tensor(values, dtype=torch.float32, device=device)

        pen = dict.fromkeys(
            ("penalty_rows", "presence_penalty", "frequency_penalty", "repetition_penalty",
             "prompt_token_ids", "output_token_ids"))
        if pen_rows:
            ps = [params[i] for i in pen_rows]
            pen["penalty_rows"] = torch.tensor(pen_rows, dtype=torch.int64, device=device)
            for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
                pen[name] = torch.tensor([getattr(p, name) for p in ps], dtype=torch.float32,
                                         device=device).unsqueeze(1)
            if any(p.repetition_penalty != 1.0 for p in ps):
                pen["prompt_token_ids"] = _pad([prompt_token_ids[i] for i in pen_rows], vocab_size, device)
            pen["output_token_ids"] = _pad([output_token_ids[i] for i in pen_rows], vocab_size, device)

        return cls(
            num_rows=len(params),
            vocab_size=vocab_size,
            all_greedy=not random_rows,
            greedy_rows=greedy_rows,
            random_rows=random_rows,
            temperature=f32(temps, 1.0),
            top_k=None if all(k >= vocab_size for k in top_ks)
            else torch.tensor(top_ks, dtype=torch.int64, device=device),
            top_p=f32(top_ps, 1.0),
            min_p=f32(min_ps, 0.0),
            generators=gens,
            min_tokens_rows=torch.tensor(mt_rows, dtype=torch.int64, device=device) if mt_rows else None,
            min_tokens_ids=torch.tensor(mt_ids, dtype=torch.int64, device=device) if mt_rows else None,
            logprob_rows=logprob_rows,
            num_logprobs=num_logprobs,
            **pen,
        )


def _pad(rows: list[Sequence[int]], pad: int, device: torch.device | str) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([list(r) + [pad] * (width - len(r)) for r in rows], dtype=torch.int64,
                        device=device)


class Sampler:
    """Stateless apart from the generator used by unseeded random rows."""

    def __init__(self, seed: int | None = None):
        self.generator = torch.Generator()
        self.generator.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """``logits``: ``[md.num_rows, vocab]`` (any float dtype, any device) -> one token per row."""
        assert logits.dim() == 2 and logits.shape[0] == md.num_rows, (logits.shape, md.num_rows)
        if md.all_greedy and md.no_processing and not md.logprob_rows:
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * md.num_rows)

        logits = process_logits(logits, md)

        if md.all_greedy:
            sampled = logits.argmax(dim=-1)
        else:
            random = logits if len(md.random_rows) == md.num_rows else logits[md.random_rows]
            drawn = self._sample_random(random, md)
            if md.greedy_rows:
                sampled = logits.argmax(dim=-1)
                sampled[md.random_rows] = drawn
            else:
                sampled = drawn

        logprobs: list[SampleLogprobs | None] = [None] * md.num_rows
        if md.logprob_rows:
            for row, lp in zip(md.logprob_rows, _logprobs(logits, sampled, md)):
                logprobs[row] = lp
        return SamplerOutput(sampled.tolist(), logprobs)

    def _uniforms(self, md: SamplingMetadata) -> torch.Tensor:
        """One U[0,1) float64 per random row, each from that row's own generator."""
        gens = md.generators
        unseeded = [i for i, g in enumerate(gens) if g is None]
        if len(unseeded) == len(gens):
            return torch.rand(len(gens), dtype=torch.float64, generator=self.generator)
        u = torch.empty(len(gens), dtype=torch.float64)
        if unseeded:
            u[unseeded] = torch.rand(len(unseeded), dtype=torch.float64, generator=self.generator)
        for i, g in enumerate(gens):
            if g is not None:
                u[i] = torch.rand(1, dtype=torch.float64, generator=g)
        return u

    def _sample_random(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        u = self._uniforms(md).to(logits.device)
        if md.temperature is not None:
            logits = logits / md.temperature.unsqueeze(1)
        probs = torch.softmax(logits, dim=-1)
        out = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
        for rows, w, ids in _candidates(probs, md.top_k, md.top_p, md.min_p):
            idx = inverse_cdf_sample(w, u[rows])
            out[rows] = idx if ids is None else ids.gather(1, idx.unsqueeze(1)).squeeze(1)
        return out


def process_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """float32 logits after min_tokens masking and penalties (a copy when anything changes)."""
    if md.no_processing:
        return logits.float()
    logits = logits.to(torch.float32, copy=True)
    if md.min_tokens_rows is not None:
        logits[md.min_tokens_rows, md.min_tokens_ids] = float("-inf")
    if md.penalty_rows is not None:
        logits[md.penalty_rows] = apply_penalties(logits[md.penalty_rows], md)
    return logits


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Repetition, then frequency and presence penalties on the penalty rows' logits ``[P, V]``."""
    num_rows, vocab = logits.shape
    if md.prompt_token_ids is not None:
        seen = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=logits.device)
        seen.scatter_(1, md.prompt_token_ids, True)
        seen.scatter_(1, md.output_token_ids, True)
        seen = seen[:, :vocab]
        r = md.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    if bool((md.presence_penalty != 0).any() or (md.frequency_penalty != 0).any()):
        counts = torch.zeros(num_rows, vocab + 1, dtype=torch.float32, device=logits.device)
        ids = md.output_token_ids
        counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float32, device=logits.device))
        counts = counts[:, :vocab]
        logits = logits - md.frequency_penalty * counts - md.presence_penalty * (counts > 0)
    return logits


def _candidates(
    probs: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Split ``probs [R, V]`` (after temperature) into groups ``(rows, weights, token_ids)``.

    ``weights`` are the unnormalised kept probabilities after top-k, top-p and min-p; ``token_ids``
    maps their columns to vocabulary ids (``None``: the columns are the vocabulary). Only a
    candidate window from ``topk`` is searched; top-p rows whose window mass falls short of ``p`` are
    retried with a wider window.
    """
    num_rows, vocab = probs.shape
    device = probs.device
    no = torch.zeros(num_rows, dtype=torch.bool, device=device)
    has_k = top_k < vocab if top_k is not None else no
    p_only = ~has_k & (top_p < 1) if top_p is not None else no
    full = ~has_k & ~p_only
    if bool(full.any()):
        rows = full.nonzero().squeeze(1)
        w = probs[rows]
        if min_p is not None:
            w = w * (w >= min_p[rows].unsqueeze(1) * w.amax(dim=-1, keepdim=True))
        yield rows, w, None
    pending = (~full).nonzero().squeeze(1)
    max_k = int(top_k[has_k].max()) + _TOP_K_TIE_SLACK if bool(has_k.any()) else 0
    for window in (*_TOP_P_WINDOWS, vocab):
        if pending.numel() == 0:
            return
        k = min(vocab, max(window, max_k))
        vals, ids = probs[pending].topk(k, dim=-1)
        done = torch.ones_like(pending, dtype=torch.bool)
        if top_k is not None:
            kth = top_k[pending].clamp(max=k).unsqueeze(1) - 1
            vals = vals * (vals >= vals.gather(1, kth))
        if top_p is not None:
            p = top_p[pending].unsqueeze(1)
            p = p.double()
            cum = vals.cumsum(dim=-1, dtype=torch.float64)
            mass = torch.where(has_k[pending].unsqueeze(1), cum[:, -1:], torch.ones_like(p))
            vals = vals * (((cum - vals) < p * mass) | (p >= 1))
            if k < vocab:
                # A p-only row is decided inside the window only if the window's mass reached p.
                done = ~(p_only[pending] & (cum[:, -1] < top_p[pending]))
        if min_p is not None:
            vals = vals * (vals >= min_p[pending].unsqueeze(1) * vals[:, :1])
        if bool(done.all()):
            yield pending, vals, ids
            return
        if bool(done.any()):
            yield pending[done], vals[done], ids[done]
        pending = pending[~done]


def sampling_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The distribution each random row is drawn from, ``[len(md.random_rows), V]`` float32.

    ``logits`` are the random rows' processed logits (after min_tokens and penalties). Used by
    tests as the bridge to HF's warpers; the sampler draws from exactly these weights.
    """
    if md.temperature is not None:
        logits = logits / md.temperature.unsqueeze(1)
    probs = torch.softmax(logits.float(), dim=-1)
    out = torch.zeros_like(probs)
    for rows, w, ids in _candidates(probs, md.top_k, md.top_p, md.min_p):
        w = w / w.sum(dim=-1, keepdim=True)
        out[rows] = w if ids is None else torch.zeros_like(out[rows]).scatter_(1, ids, w)
    return out


def inverse_cdf_sample(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index ``i`` of each row with probability ``weights[r, i] / weights[r].sum()``.

    ``weights``: ``[R, N]`` non-negative, at least one positive per row; ``u``: ``[R]`` float64 in
    [0, 1). Picks the first index whose cumulative weight exceeds ``u * total``; never a zero weight.
    """
    num_rows, n = weights.shape
    if n <= 2 * _CDF_BLOCK:
        return _search(weights, u)
    nb = -(-n // _CDF_BLOCK)
    if nb * _CDF_BLOCK != n:
        weights = torch.nn.functional.pad(weights, (0, nb * _CDF_BLOCK - n))
    blocks = weights.view(num_rows, nb, _CDF_BLOCK)
    block_sums = blocks.sum(dim=-1, dtype=torch.float64)
    cum = block_sums.cumsum(dim=-1)
    target = _below_total(u * cum[:, -1], cum[:, -1])
    b = torch.searchsorted(cum, target.unsqueeze(1), right=True).squeeze(1).clamp_(max=nb - 1)
    before = torch.where(b > 0, cum.gather(1, (b - 1).clamp(min=0).unsqueeze(1)).squeeze(1),
                         torch.zeros_like(target))
    inner = blocks[torch.arange(num_rows, device=weights.device), b]
    rem = (target - before) / block_sums.gather(1, b.unsqueeze(1)).squeeze(1)
    return b * _CDF_BLOCK + _search(inner, rem.clamp_(0.0, 1.0))


def _search(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    cum = weights.cumsum(dim=-1, dtype=torch.float64)
    total = cum[:, -1]
    target = _below_total(u * total, total)
    idx = torch.searchsorted(cum, target.unsqueeze(1), right=True).squeeze(1)
    # Rounding can push the target past the last positive weight: take that weight instead.
    last_positive = weights.shape[1] - 1 - (weights.flip(-1) > 0).to(torch.int8).argmax(dim=-1)
    return torch.minimum(idx, last_positive)


def _below_total(target: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    return torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))


def _logprobs(logits: torch.Tensor, sampled: torch.Tensor, md: SamplingMetadata) -> list[SampleLogprobs]:
    rows = md.logprob_rows
    lp = torch.log_softmax(logits[rows], dim=-1)
    tokens = sampled[rows]
    chosen = lp.gather(1, tokens.unsqueeze(1))
    ranks = (lp >= chosen).sum(dim=-1)
    top_vals, top_ids = lp.topk(max(md.num_logprobs), dim=-1)
    return [
        SampleLogprobs(tok, lp_tok, rank, list(zip(ids[:n], vals[:n])))
        for tok, lp_tok, rank, n, vals, ids in zip(
            tokens.tolist(), chosen.squeeze(1).tolist(), ranks.tolist(), md.num_logprobs,
            top_vals.tolist(), top_ids.tolist(),
        )
    ]
