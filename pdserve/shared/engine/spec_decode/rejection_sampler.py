"""Verify draft tokens against the target model: exact speculative sampling.

The rule is Leviathan et al. (ICML 2023) and Chen et al. (2023), as vLLM's ``RejectionSampler``: with target
distribution ``p`` and draft distribution ``q`` at draft position j, accept draft token d with probability
``min(1, p(d) / q(d))``; at the first rejection emit a token drawn from ``norm(max(0, p - q))`` and stop;
when every draft is accepted emit a bonus token drawn from ``p`` at position k. A draft without
probabilities (n-gram) has ``q`` one-hot on d: accept with probability ``p(d)``, recover from ``p`` with d
removed. Each emitted token is then distributed exactly as ``p`` would draw it one step at a time.
Greedy rows (temperature < 1e-5) accept while the draft equals the target's argmax, then emit the argmax:
token for token what plain greedy decoding gives.

``p`` is what the plain sampler draws from (``sampling_probs``: after min_tokens, penalties, temperature,
top-k/top-p/min-p); row j's penalties and min_tokens see the drafts before it as output, as they would
if accepted. Randomness comes from the request's own ``torch.Generator`` (the seeded request's, else the
sampler's): one Exp(1) vector over the vocabulary per emitted token, as plain sampling draws (see
``verify_random``); tokens are chosen by the exponential race ``argmax(w / E)`` (the Gumbel-max trick's twin:
index i wins with probability ``w_i / sum(w)``). A request's draws never depend on its neighbours.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.shared.engine import sampler as _sampler
from pdserve.shared.engine.sampler import (SampleLogprobs, SamplingMetadata, exponential_, process_logits,
                                           sampling_probs)

GREEDY_EPS = 1e-5


@dataclass(slots=True)
class VerifyOutput:
    """Per request: the emitted tokens (accepted drafts, then one recovered or bonus token) and, per emitted
    token, the target's logprobs (``None`` entries where the request did not ask). ``num_accepted`` counts
    accepted drafts."""

    token_ids: list[list[int]]
    logprobs: list[list[SampleLogprobs | None]]
    num_accepted: list[int]


def residual_probs(p: torch.Tensor, q: torch.Tensor | None, draft_token: int) -> torch.Tensor:
    """``max(0, p - q)`` (unnormalised) for a rejected draft; ``q=None``: q one-hot on ``draft_token``."""
    if q is None:
        r = p.clone()
        r[draft_token] = 0.0
        return r
    return (p - q).clamp_(min=0.0)


def race(weights: torch.Tensor, exp: torch.Tensor) -> int:
    """Index i with probability ``weights[i] / weights.sum()`` given ``exp`` ~ Exp(1) i.i.d. (same shape)."""
    return int((weights / exp).argmax())


def verify_random(p: torch.Tensor, draft: Sequence[int], q: torch.Tensor | None,
                  generator: torch.Generator) -> list[int]:
    """One request's sampled verification. ``p``: ``[k+1, V]`` target probabilities (rows sum to 1);
    ``draft``: k token ids; ``q``: ``[k, V]`` draft probabilities or ``None`` (one-hot drafts).
    Returns the emitted tokens (1..k+1).

    Draws one ``[V]`` Exp(1) vector per emitted token, as the plain sampler does, so a seeded request's
    generator is where ``advance_generator`` puts it after any number of tokens (a resumed request continues
    from the right state). One-hot drafts (``q=None``): the row's token is the one plain sampling draws,
    ``race(p[j], E_j)``, and the draft is accepted iff it equals it: the same law as accepting with ``p(d)`` and
    recovering from ``norm(p - onehot(d))``, and token for token the plain seeded output. Drafts with ``q``:
    accept iff ``U_j[d] < p(d) / q(d)`` with ``U_j = exp(-E_j)``; a rejection has ``p(d) < q(d)``, so the
    residual is 0 at d and the recovery race over the other (independent) entries of ``E_j`` is exact."""
    out: list[int] = []
    for j, d in enumerate(draft):
        exp = _exponential_row(p, generator)
        if q is None:
            token = race(p[j], exp)
            out.append(token)
            if token != d:
                return out
            continue
        pd, qd = float(p[j, d]), float(q[j, d])
        if qd > 0 and math.exp(-float(exp[d])) < pd / qd:
            out.append(d)
            continue
        out.append(race(residual_probs(p[j], q[j], d), exp))
        return out
    out.append(race(p[len(draft)], _exponential_row(p, generator)))
    return out


def _exponential_row(p: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return exponential_(torch.empty(p.shape[1], dtype=torch.float32), generator).to(p.device)


def verify_greedy(argmax: Sequence[int], draft: Sequence[int]) -> list[int]:
    """Accepted drafts while each equals the target's argmax, then the argmax at the first mismatch (or bonus)."""
    out = []
    for j, d in enumerate(draft):
        if d != argmax[j]:
            break
        out.append(d)
    out.append(argmax[len(out)])
    return out


class RejectionSampler:
    """Batch front end: one logits row per verified position, requests in order."""

    def __init__(self, fallback_generator: torch.Generator) -> None:
        self.fallback = fallback_generator  # unseeded requests draw from the engine sampler's generator

    def __call__(self, logits: torch.Tensor, drafts: Sequence[Sequence[int]], md: SamplingMetadata,
                 generators: Sequence[torch.Generator | None],
                 draft_probs: Sequence[torch.Tensor | None] | None = None) -> VerifyOutput:
        """``logits``: ``[sum(k_i + 1), V]``, rows of request i are its positions 0..k_i (``md`` built per row,
        see ``spec_metadata``); ``drafts[i]``: its k_i draft ids; ``generators[i]``: its seeded generator or
        None; ``draft_probs[i]``: ``[k_i, V]`` or None (n-gram)."""
        if logits.shape[1] > md.vocab_size:
            logits = logits[:, : md.vocab_size]
        logits = process_logits(logits, md)
        greedy = set(md.greedy_rows)
        argmax = logits.max(dim=-1).indices.tolist() if greedy else None
        probs = sampling_probs(logits[md.random_rows], md) if md.random_rows else None
        prob_row = {r: i for i, r in enumerate(md.random_rows)}
        tokens, accepted, start = [], [], 0
        for i, draft in enumerate(drafts):
            k = len(draft)
            if start in greedy:
                emitted = verify_greedy(argmax[start:start + k + 1], draft)
            else:
                p = probs[prob_row[start]:prob_row[start] + k + 1]
                q = draft_probs[i] if draft_probs is not None else None
                emitted = verify_random(p, draft, q, generators[i] or self.fallback)
            tokens.append(emitted)
            accepted.append(len(emitted) - 1)
            start += k + 1
        return VerifyOutput(tokens, self._logprobs(logits, drafts, tokens, md), accepted)

    @staticmethod
    def _logprobs(logits, drafts, tokens, md) -> list[list[SampleLogprobs | None]]:
        out = [[None] * len(t) for t in tokens]
        if not md.logprob_rows:
            return out
        chosen, where, start = [], {}, 0
        for i, (draft, emitted) in enumerate(zip(drafts, tokens)):
            for j in range(len(draft) + 1):
                chosen.append(emitted[j] if j < len(emitted) else 0)  # rows past the last emitted: unused
                where[start + j] = (i, j)
            start += len(draft) + 1
        rows = _sampler._logprobs(logits, torch.tensor(chosen, dtype=torch.int64, device=logits.device), md)
        for row, lp in zip(md.logprob_rows, rows):
            i, j = where[row]
            if j < len(tokens[i]):
                out[i][j] = lp
        return out


def spec_metadata(params, prompts, outputs, drafts, eos_token_ids, vocab_size, grammars=()) -> SamplingMetadata:
    """``SamplingMetadata`` with one row per verified position: request i's row j sees ``outputs[i] +
    drafts[i][:j]`` as its output (penalties, min_tokens, the grammar ``grammars[i]`` if any), as if the drafts
    before it were accepted. A request's rows are consecutive and in order, so its matcher advances one draft
    a row."""
    p_rows, prompt_rows, out_rows, grammar_rows = [], [], [], []
    grammars = grammars or [None] * len(params)
    for sp, prompt, output, draft, grammar in zip(params, prompts, outputs, drafts, grammars):
        for j in range(len(draft) + 1):
            p_rows.append(sp)
            prompt_rows.append(prompt)
            out_rows.append(list(output) + list(draft[:j]))
            grammar_rows.append(grammar)
    return SamplingMetadata.from_requests(p_rows, prompt_rows, out_rows, [None] * len(p_rows), eos_token_ids,
                                          vocab_size, grammars=grammar_rows if any(grammar_rows) else ())
