"""How many draft tokens each request proposes this step (the adaptive policy).

Speculation pays while a decode step is memory- or overhead-bound (small batches: verifying k + 1 tokens
costs about one step) and costs once it is compute-bound (large batches: every draft token is paid for,
accepted or not). Two rules, per step:

- batch: no drafts while more than ``disable_by_batch_size`` requests run (vLLM's rule), and with
  ``adaptive``, at most ``max_draft_tokens_per_step`` draft tokens in the whole step (shared out
  first-come), so a large batch stops paying for guesses;
- acceptance: with ``adaptive``, each request keeps an exponential moving average of its accepted tokens
  per draft and proposes ``round(ema) + 1`` tokens at most (at least 1), so a request whose drafts keep
  failing guesses one token, not k. The average starts at k (optimistic).
"""

from __future__ import annotations

EMA_WEIGHT = 0.5
# On 2 CPU cores a decode step stops being overhead-bound at a few dozen tokens: drafts past this many
# per step slow the batch down more than acceptance gains (measured with `pdserve bench spec`).
DEFAULT_MAX_DRAFT_TOKENS_PER_STEP = 32


class SpecPolicy:
    def __init__(self, k: int, adaptive: bool, disable_by_batch_size: int | None,
                 max_draft_tokens_per_step: int = DEFAULT_MAX_DRAFT_TOKENS_PER_STEP) -> None:
        self.k = k
        self.adaptive = adaptive
        self.disable_by_batch_size = disable_by_batch_size
        self.max_draft_tokens_per_step = max_draft_tokens_per_step
        self.ema: dict[str, float] = {}

    def step_budget(self, num_running: int) -> int:
        """Draft tokens the whole step may carry."""
        if self.disable_by_batch_size is not None and num_running > self.disable_by_batch_size:
            return 0
        return self.max_draft_tokens_per_step if self.adaptive else self.k * num_running

    def num_draft_tokens(self, request_id: str) -> int:
        if not self.adaptive:
            return self.k
        return max(1, min(self.k, round(self.ema.get(request_id, self.k)) + 1))

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        if num_drafts:
            old = self.ema.get(request_id, self.k)
            self.ema[request_id] = (1 - EMA_WEIGHT) * old + EMA_WEIGHT * num_accepted

    def forget(self, request_id: str) -> None:
        self.ema.pop(request_id, None)
