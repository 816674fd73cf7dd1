"""How many draft tokens each request proposes this step (the adaptive policy).

Speculation pays while a decode step is memory- or overhead-bound (small batches: verifying k + 1 tokens
costs about one step) and costs once it is compute-bound (large batches: every draft token is paid for,
accepted or not). With ``adaptive`` (the default), per step:

- **per request**: each request keeps an exponential moving average of its accepted tokens per draft and
  proposes ``round(ema) + 1`` tokens at most (at least 1, at most k), so a request whose drafts keep
  failing guesses one token, not k. The average starts at k (optimistic).
- **per step, a cap that follows acceptance**: the engine keeps a moving average ``a`` of the fraction of
  draft tokens accepted (all requests, per step; it starts at 0.5) and lets the whole step carry at most
  ``round(base * a / (1 - a))`` draft tokens (``a`` clipped to [0.02, 0.95]; at least ``MIN_CAP``), where
  ``base = max_draft_tokens_per_step`` (32). ``a / (1 - a)`` is the number of accepted draft tokens per
  rejected one: the cap is ``base`` at a = 0.5, 4 x base at 0.8, 19 x base at 0.95, base / 4 at 0.2. Drafts
  that are mostly accepted are worth their verification even in a compute-bound step, drafts that mostly
  fail are not. The cap is shared out evenly over the requests that may speculate (a request that needs
  fewer leaves the rest to those after it), so each request's share shrinks as the batch grows.

Without ``adaptive`` every request proposes k. ``disable_by_batch_size`` (vLLM's rule) turns speculation off
while more requests than that run, in both modes.
"""

from __future__ import annotations

import math

EMA_WEIGHT = 0.5  # per request: weight of the newest step's accepted count
STEP_EMA_WEIGHT = 0.25  # engine-wide acceptance: weight of the newest step
START_ACCEPTANCE = 0.5  # engine-wide acceptance before anything is measured: the cap starts at base
MIN_CAP = 4  # keep a few drafts per step even when acceptance is low, so it is still measured
MAX_ACCEPTANCE = 0.95  # clip: the cap grows to 19 x base at most
MIN_ACCEPTANCE = 0.02
# The cap at acceptance 0.5. On 2 CPU cores a decode step stops being overhead-bound at a few dozen tokens
# (measured with `pdserve bench spec`, pdserve/loadtest/README.md#speculative-decoding).
DEFAULT_MAX_DRAFT_TOKENS_PER_STEP = 32


def draft_token_cap(acceptance: float, base: int) -> int:
    """Draft tokens one step may carry at engine-wide acceptance rate ``acceptance`` (0..1):
    ``max(MIN_CAP, round(base * a / (1 - a)))`` with ``a`` clipped to [MIN_ACCEPTANCE, MAX_ACCEPTANCE]."""
    a = min(MAX_ACCEPTANCE, max(MIN_ACCEPTANCE, acceptance))
    return max(MIN_CAP, round(base * a / (1 - a)))


class SpecPolicy:
    def __init__(self, k: int, adaptive: bool, disable_by_batch_size: int | None,
                 max_draft_tokens_per_step: int = DEFAULT_MAX_DRAFT_TOKENS_PER_STEP) -> None:
        self.k = k
        self.adaptive = adaptive
        self.disable_by_batch_size = disable_by_batch_size
        self.max_draft_tokens_per_step = max_draft_tokens_per_step
        self.ema: dict[str, float] = {}
        self.acceptance = START_ACCEPTANCE

    def step_budget(self, num_running: int) -> int:
        """Draft tokens the whole step may carry."""
        if self.disable_by_batch_size is not None and num_running > self.disable_by_batch_size:
            return 0
        if not self.adaptive:
            return self.k * num_running
        return draft_token_cap(self.acceptance, self.max_draft_tokens_per_step)

    @staticmethod
    def share(budget: int, num_candidates: int) -> int:
        """The most draft tokens the next of ``num_candidates`` requests may take from ``budget``: an even
        share, rounded up (what a request does not use stays for the ones after it)."""
        return math.ceil(budget / num_candidates) if num_candidates > 0 else 0

    def num_draft_tokens(self, request_id: str) -> int:
        if not self.adaptive:
            return self.k
        return max(1, min(self.k, round(self.ema.get(request_id, self.k)) + 1))

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        if num_drafts:
            old = self.ema.get(request_id, self.k)
            self.ema[request_id] = (1 - EMA_WEIGHT) * old + EMA_WEIGHT * num_accepted

    def record_step(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One step's totals over all requests: updates the engine-wide acceptance the cap follows."""
        if num_draft_tokens:
            rate = num_accepted / num_draft_tokens
            self.acceptance = (1 - STEP_EMA_WEIGHT) * self.acceptance + STEP_EMA_WEIGHT * rate

    def forget(self, request_id: str) -> None:
        self.ema.pop(request_id, None)
