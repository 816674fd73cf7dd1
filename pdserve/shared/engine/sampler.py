"""Turn one step's logits into next tokens (and logprobs), one row per sampling request.

Order of processing, as vLLM v1's ``Sampler``:

1. Logits processors that can change the argmax (``logits_processors.py``), on rows that use them:
   ``allowed_token_ids``, ``bad_words``, ``min_tokens`` (while a request has fewer than ``min_tokens``
   outputs, its EOS ids, unless ``ignore_eos``, and ``stop_token_ids`` get ``-inf``), ``logit_bias``.
2. Penalties: repetition (HF ``RepetitionPenaltyLogitsProcessor`` / CTRL, arXiv:1909.05858: divide a
   positive logit, multiply a negative one, for every token seen in prompt or output), then frequency
   and presence over output tokens only (OpenAI: ``logit -= f * count + p * (count > 0)``).
3. Logprobs, when asked, are ``log_softmax`` of these processed logits: after steps 1 and 2, before
   temperature and truncation. This is vLLM's "raw logprobs" (the model's distribution as the
   request shaped it, independent of how it chose to sample).
4. Greedy rows (temperature < 1e-5): ``argmax``.
5. Random rows: temperature, then the argmax-invariant processors (``min_p``, vLLM's place for it), then
   top-k and top-p, then one draw.

Top-k keeps the ``k`` most likely tokens (ties at the k-th value are kept if they fall inside the
candidate window of ``k + 16``). Top-p keeps the smallest most-likely-first set whose mass reaches
``p`` (a token stays if the mass strictly above it is below ``p``: HF's rule, which removes tokens
whose ascending cumulative mass is ``<= 1 - p``). Min-p keeps tokens with ``prob >= min_p *
max_prob`` before top-k and top-p see them (vLLM's order; HF applies it last, which differs only when top-p
is set too: there top-p measures its mass over the tokens min-p kept).

Costs on CPU are whole passes over ``[rows, vocab]``, so the sampler makes as few as it can: one
``argmax`` for an all-greedy batch; penalties gather and scatter only the seen ids; truncation
searches a ``topk`` window instead of sorting (a 64 x 49152 sort is ~50x a softmax), and top-p
widens its window (512, 2048, 8192, all) only for rows whose window holds less than ``p`` (with
SmolLM2 at T=1, p=0.95 keeps at most ~1300 tokens).

The draw is vLLM's exponential race (``probs / q`` then ``argmax``, ``q ~ Exp(1)`` i.i.d. per token: the
winner is token ``i`` with probability ``p_i / sum(p)``; the Gumbel-max trick in ratio form). Every random row
draws one vocabulary-sized ``q`` per token from its own ``torch.Generator`` (the seeded request's, else the
sampler's, shared by unseeded rows), before and independent of truncation, so a seeded request's tokens do not
depend on its batch neighbours and a resumed request skips a token by one such draw
(:func:`advance_generator`). Unlike inverse-CDF sampling (one uniform per row against a cumulative sum over
the vocabulary), the race only flips when the two best ratios are within float noise of each other, so the
fp32 noise of another batch shape or a prefix-cache hit leaves seeded output unchanged (in practice: inverse
CDF flipped ~1% of draws at T=1 over the full vocabulary, since a tail token's slice of the CDF is narrower
than the noise summed over the tokens before it).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from pdserve.shared.engine.logits_processors import LogitsProcessor, ProcessorBatch, build_logits_processors
from pdserve.shared.protocol.sampling_params import SamplingParams

_TOP_K_TIE_SLACK = 16
_TOP_P_WINDOWS = (512, 2048, 8192)
_ADVANCE_CHUNK = 64  # rows per draw when skipping tokens: bounds the scratch memory


@dataclass(slots=True)
class SampleLogprobs:
    """Logprob of the sampled token, its rank and the ``top`` alternatives (natural log).

    ``rank`` is 1 + the number of tokens with a strictly higher logprob. ``top`` holds
    ``(token_id, logprob)`` pairs, most likely first, as many as the request's ``logprobs``.
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
    A feature's tensors are ``None`` when no row uses it, so the common case costs nothing.
    """

    num_rows: int
    vocab_size: int
    greedy_rows: list[int]
    random_rows: list[int]
    # random rows only, in random_rows order
    temperature: torch.Tensor | None  # [R] float32; None when all are 1.0
    top_k: torch.Tensor | None  # [R] int64, vocab_size where disabled; None when none use it
    top_p: torch.Tensor | None  # [R] float32; None when none use it
    generators: list[torch.Generator | None]
    # argmax-invariant processors over the random rows (their row i is random_rows[i]); usually empty
    random_row_processors: list[LogitsProcessor]
    # the other processors, over every row, in order; usually empty
    logits_processors: list[LogitsProcessor]
    # penalties, for every row (neutral values where a row has none). Id lists are padded by
    # repeating the row's first id, so duplicate scatter writes agree; a row without ids uses id 0
    # with a neutral value.
    presence_penalty: torch.Tensor | None  # [N, 1]
    frequency_penalty: torch.Tensor | None  # [N, 1]
    repetition_penalty: torch.Tensor | None  # [N, 1], 1.0 where a row has no penalty or no ids
    seen_token_ids: torch.Tensor | None  # [N, Ls] prompt + output; None: no repetition penalty
    output_token_ids: torch.Tensor | None  # [N, Lo]; None: no presence/frequency penalty
    output_valid: torch.Tensor | None  # [N, Lo] 1.0 for real entries, 0.0 for padding
    output_nonempty: torch.Tensor | None  # [N, 1] 1.0 if the row has any output
    # logprobs
    logprob_rows: list[int]
    num_logprobs: list[int]

    @property
    def all_greedy(self) -> bool:
        return not self.random_rows

    @property
    def no_processing(self) -> bool:
        return (not self.logits_processors and self.seen_token_ids is None
                and self.output_token_ids is None)

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
        grammars: Sequence = (),
    ) -> SamplingMetadata:
        """Build the step's metadata; every sequence has one entry per logits row.

        ``generators[i]``: the seeded request's ``torch.Generator().manual_seed(seed)`` (CPU, kept by
        the engine across steps), or ``None`` for the sampler's own generator. ``eos_token_ids``:
        the model's EOS ids (``ignore_eos`` requests are exempt). ``prompt_token_ids`` is only read
        for rows with a repetition penalty. ``grammars[i]``: the row's ``RequestGrammar`` or ``None`` (may be
        empty when no row has one).
        """
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        batch = ProcessorBatch(params, output_token_ids, tuple(eos_token_ids), vocab_size, device, grammars)
        return cls(
            num_rows=len(params),
            vocab_size=vocab_size,
            **_random_row_tensors(batch, generators),
            logits_processors=build_logits_processors(batch, argmax_invariant=False),
            **_penalty_tensors(params, prompt_token_ids, output_token_ids, device),
            logprob_rows=logprob_rows,
            num_logprobs=[params[i].logprobs for i in logprob_rows],
        )


def _random_row_tensors(batch: ProcessorBatch, generators: Sequence[torch.Generator | None]) -> dict:
    """Greedy and random row lists, and the random rows' temperature, truncation, processors and generators."""
    params, vocab_size, device = batch.params, batch.vocab_size, batch.device
    greedy = [i for i, p in enumerate(params) if p.temperature < 1e-5]
    random = [i for i, p in enumerate(params) if p.temperature >= 1e-5]
    chosen = [params[i] for i in random]
    top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in chosen]

    def floats(values: list[float], skip_if: float) -> torch.Tensor | None:
        if all(v == skip_if for v in values):
            return None
        return torch.tensor(values, dtype=torch.float32, device=device)

    random_batch = ProcessorBatch(chosen, [batch.output_token_ids[i] for i in random], batch.eos_token_ids,
                                  vocab_size, device)
    return dict(
        greedy_rows=greedy,
        random_rows=random,
        temperature=floats([p.temperature for p in chosen], 1.0),
        top_k=None if all(k == vocab_size for k in top_ks) else torch.tensor(top_ks, dtype=torch.int64, device=device),
        top_p=floats([p.top_p for p in chosen], 1.0),
        random_row_processors=build_logits_processors(random_batch, argmax_invariant=True) if chosen else [],
        generators=[generators[i] for i in random],
    )


def _penalty_tensors(params: Sequence[SamplingParams], prompt_token_ids: Sequence[Sequence[int]],
                     output_token_ids: Sequence[Sequence[int]], device: torch.device | str) -> dict:
    """Penalty columns and padded id lists for every row (see ``SamplingMetadata``); ``None`` if unused."""

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

    pen: dict[str, torch.Tensor | None] = dict.fromkeys(
        ("presence_penalty", "frequency_penalty", "repetition_penalty", "seen_token_ids",
         "output_token_ids", "output_valid", "output_nonempty"))
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = [
            list(prompt_token_ids[i]) + list(output_token_ids[i]) if p.repetition_penalty != 1.0 else []
            for i, p in enumerate(params)
        ]
        pen["seen_token_ids"], _ = _pad_repeating(seen, device)
        pen["repetition_penalty"] = column([p.repetition_penalty if s else 1.0 for p, s in zip(params, seen)])
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        outs = [output_token_ids[i] if p.presence_penalty or p.frequency_penalty else ()
                for i, p in enumerate(params)]
        pen["output_token_ids"], pen["output_valid"] = _pad_repeating(outs, device)
        pen["presence_penalty"] = column([p.presence_penalty for p in params])
        pen["frequency_penalty"] = column([p.frequency_penalty for p in params])
        pen["output_nonempty"] = column([1.0 if o else 0.0 for o in outs])
    return pen


def _pad_repeating(rows: Sequence[Sequence[int]], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, max_len]`` int64 ids, each row padded with its own first id (0 if empty), and a
    float32 mask that is 1.0 on real entries."""
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    width = max(1, int(lengths.max()))
    valid = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    ids[valid] = torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=torch.int64)
    ids = torch.where(valid, ids, ids[:, :1])
    return ids.to(device), valid.to(device=device, dtype=torch.float32)


class Sampler:
    """Stateless apart from the generator that unseeded random rows draw from."""

    def __init__(self, seed: int | None = None):
        self.generator = torch.Generator()
        self.generator.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """``logits``: ``[md.num_rows, vocab]`` (any float dtype, any device) -> one token per row."""
        assert logits.dim() == 2 and logits.shape[0] == md.num_rows, (logits.shape, md.num_rows)
        if logits.shape[1] > md.vocab_size:
            logits = logits[:, : md.vocab_size]  # padded lm_head columns are not tokens
        if md.all_greedy and md.no_processing and not md.logprob_rows:
            return SamplerOutput(_argmax(logits).tolist(), [None] * md.num_rows)

        logits = process_logits(logits, md)
        if md.all_greedy:
            sampled = _argmax(logits)
        else:
            all_random = len(md.random_rows) == md.num_rows
            drawn = self._sample_random(logits if all_random else logits[md.random_rows], md)
            if all_random:
                sampled = drawn
            else:
                sampled = torch.empty(md.num_rows, dtype=torch.int64, device=logits.device)
                sampled[md.greedy_rows] = _argmax(logits[md.greedy_rows])
                sampled[md.random_rows] = drawn

        logprobs: list[SampleLogprobs | None] = [None] * md.num_rows
        if md.logprob_rows:
            for row, lp in zip(md.logprob_rows, _logprobs(logits, sampled, md)):
                logprobs[row] = lp
        return SamplerOutput(sampled.tolist(), logprobs)

    def _exponentials(self, md: SamplingMetadata) -> torch.Tensor:
        """``q``: ``[len(md.random_rows), md.vocab_size]`` float32 Exp(1) draws (CPU), one vocabulary-sized
        draw per random row: seeded rows from their own generator, the others from the sampler's."""
        gens = md.generators
        unseeded = [i for i, g in enumerate(gens) if g is None]
        q = torch.empty(len(gens), md.vocab_size, dtype=torch.float32)
        if len(unseeded) == len(gens):
            return exponential_(q, self.generator)
        if unseeded:
            q[unseeded] = exponential_(torch.empty(len(unseeded), md.vocab_size), self.generator)
        for i, g in enumerate(gens):
            if g is not None:
                exponential_(q[i], g)
        return q

    def _sample_random(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        q = self._exponentials(md).to(logits.device)
        logits = _apply_temperature(logits, md)
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        for rows, w, ids in _candidates(logits, md.top_k, md.top_p):
            q_rows = q if len(rows) == len(q) else q[rows]
            if ids is None:
                out[rows] = exponential_race(w, q_rows)
            else:
                out[rows] = ids.gather(1, exponential_race(w, q_rows.gather(1, ids)).unsqueeze(1)).squeeze(1)
        return out


def exponential_(out: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Fill CPU float32 ``out`` in place with Exp(1) draws ``-log(U)``, ``U ~ U[0, 1)`` from ``generator``.

    Rows are drawn in order, so filling ``[n, V]`` consumes the generator exactly as ``n`` fills of ``[V]``
    (what :func:`advance_generator` relies on). ``U = 0`` gives ``q = inf``: that token cannot win, the
    right limit. ``-log(U)`` rather than ``Tensor.exponential_``: the same law, half the CPU time.
    """
    return out.uniform_(generator=generator).log_().neg_()


def advance_generator(generator: torch.Generator | None, num_tokens: int, vocab_size: int) -> None:
    """Move a seeded request's generator past ``num_tokens`` sampled tokens: one ``[vocab_size]``
    :func:`exponential_` draw each, as the sampler consumes. A request resumed on another engine then samples
    what one engine would have."""
    if generator is None:
        return
    scratch = torch.empty(min(num_tokens, _ADVANCE_CHUNK), vocab_size, dtype=torch.float32)
    while num_tokens > 0:
        rows = min(num_tokens, _ADVANCE_CHUNK)
        scratch[:rows].uniform_(generator=generator)
        num_tokens -= rows


def exponential_race(weights: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Index ``i`` of each row with probability ``weights[r, i] / weights[r].sum()``: ``argmax(weights / q)``.

    ``weights``: ``[R, N]`` non-negative, at least one positive per row; ``q``: ``[R, N]`` Exp(1) draws
    (:func:`exponential_`). A zero weight never wins (its ratio is 0). Source: vLLM v1's ``random_sample``.
    """
    return (weights / q).max(dim=-1).indices


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    # Same first-index tie rule as argmax; on CPU max(dim) is ~2x (fp32) to 4x (bf16) faster.
    return logits.max(dim=-1).indices


def process_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """float32 logits after the logits processors that can change the argmax and penalties (a copy when
    anything changes)."""
    if md.no_processing:
        return logits.float()
    logits = logits.to(torch.float32, copy=True)
    for processor in md.logits_processors:
        processor.apply(logits)
    apply_penalties(logits, md)
    return logits


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> None:
    """Repetition, then frequency and presence penalties, in place on ``logits [N, V]``.

    Only the listed ids are gathered and scattered, never a ``[N, V]`` mask; duplicate ids in one
    scatter carry identical values, so the write order does not matter.
    """
    if md.seen_token_ids is not None:
        ids = md.seen_token_ids
        seen = logits.gather(1, ids)
        r = md.repetition_penalty
        logits.scatter_(1, ids, torch.where(seen > 0, seen / r, seen * r))
    if md.output_token_ids is not None:
        ids = md.output_token_ids
        logits.scatter_add_(1, ids, -md.frequency_penalty * md.output_valid)
        logits.scatter_(1, ids, logits.gather(1, ids) - md.presence_penalty * md.output_nonempty)


def _apply_temperature(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Random rows' logits divided by temperature, then their argmax-invariant processors (min-p)."""
    logits = logits if md.temperature is None else logits / md.temperature.unsqueeze(1)
    for processor in md.random_row_processors:
        logits = processor.apply(logits)
    return logits


def _candidates(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Split temperature-scaled ``logits [R, V]`` into groups ``(rows, weights, token_ids)``.

    ``weights`` are the kept probabilities (unnormalised) after top-k and top-p;
    ``token_ids`` maps their columns to vocabulary ids (``None``: the columns are the vocabulary).
    """
    num_rows, vocab = logits.shape
    device = logits.device
    no = torch.zeros(num_rows, dtype=torch.bool, device=device)
    has_k = top_k < vocab if top_k is not None else no
    p_only = ~has_k & (top_p < 1) if top_p is not None else no
    full = ~has_k & ~p_only
    for group, kind in ((full, "full"), (has_k, "top_k"), (p_only, "top_p")):
        if not bool(group.any()):
            continue
        rows = torch.arange(num_rows, device=device) if bool(group.all()) else group.nonzero().squeeze(1)
        x = logits if len(rows) == num_rows else logits[rows]
        sub = (lambda t: None if t is None else t[rows])  # noqa: E731
        if kind == "full":
            yield rows, torch.softmax(x, dim=-1), None
        elif kind == "top_k":
            yield rows, *_top_k_candidates(x, sub(top_k), sub(top_p))
        else:
            yield from _top_p_candidates(rows, torch.softmax(x, dim=-1), top_p[rows])


def _top_k_candidates(logits, top_k, top_p) -> tuple[torch.Tensor, torch.Tensor]:
    k = min(logits.shape[1], int(top_k.max()) + _TOP_K_TIE_SLACK)
    vals, ids = logits.topk(k, dim=-1)
    kth = vals.gather(1, top_k.clamp(max=k).unsqueeze(1) - 1)
    probs = torch.softmax(torch.where(vals >= kth, vals, float("-inf")), dim=-1)
    if top_p is not None:
        probs = _keep_top_p(probs, top_p.unsqueeze(1))[0]
    return probs, ids


def _top_p_candidates(rows, probs, top_p) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Top-p without top-k: search each row's most likely 512, 2048, 8192, then all tokens."""
    vocab = probs.shape[1]
    pending = torch.arange(len(rows), device=probs.device)
    for window in (*_TOP_P_WINDOWS, vocab):
        window = min(window, vocab)
        source = probs if len(pending) == len(rows) else probs[pending]
        vals, ids = source.topk(window, dim=-1)
        vals, window_mass = _keep_top_p(vals, top_p[pending].unsqueeze(1))
        # A row is decided in this window only if the window's mass reached p.
        done = window_mass >= top_p[pending] if window < vocab else torch.ones_like(pending, dtype=torch.bool)
        if bool(done.all()):
            yield rows[pending], vals, ids
            return
        if bool(done.any()):
            yield rows[pending[done]], vals[done], ids[done]
        pending = pending[~done]


def _keep_top_p(sorted_probs: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero the tail of descending ``sorted_probs`` beyond mass ``p``; also return each row's mass."""
    cum = sorted_probs.cumsum(dim=-1, dtype=torch.float64)
    p = p.double()
    keep = ((cum - sorted_probs) < p) | (p >= 1)
    return sorted_probs * keep, cum[:, -1]


def sampling_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The distribution each random row is drawn from, ``[len(md.random_rows), V]`` float32.

    ``logits`` are the random rows' processed logits (``process_logits``). The
    sampler draws from exactly these weights; tests compare them with HF's warpers.
    """
    logits = _apply_temperature(logits.float(), md)
    out = torch.zeros_like(logits)
    for rows, w, ids in _candidates(logits, md.top_k, md.top_p):
        w = w / w.sum(dim=-1, keepdim=True)
        out[rows] = w if ids is None else torch.zeros_like(out[rows]).scatter_(1, ids, w)
    return out


def _logprobs(logits: torch.Tensor, sampled: torch.Tensor, md: SamplingMetadata) -> list[SampleLogprobs]:
    rows = md.logprob_rows
    every_row = len(rows) == md.num_rows
    lp = torch.log_softmax(logits if every_row else logits[rows], dim=-1)
    tokens = sampled if every_row else sampled[rows]
    chosen = lp.gather(1, tokens.unsqueeze(1))
    max_n = max(md.num_logprobs)
    top_vals, top_ids = lp.topk(max(max_n, 1), dim=-1)
    # Most sampled tokens are among the top few: their rank needs no pass over the vocabulary.
    in_top = (top_ids == tokens.unsqueeze(1)).any(dim=-1)
    ranks = (top_vals > chosen).sum(dim=-1) + 1
    if not bool(in_top.all()):
        far = (~in_top).nonzero().squeeze(1)
        ranks[far] = (lp[far] > chosen[far]).sum(dim=-1) + 1
    return [
        SampleLogprobs(tok, lp_tok, rank, list(zip(ids[:n], vals[:n])))
        for tok, lp_tok, rank, n, vals, ids in zip(
            tokens.tolist(), chosen.squeeze(1).tolist(), ranks.tolist(), md.num_logprobs,
            top_vals.tolist(), top_ids.tolist(),
        )
    ]
