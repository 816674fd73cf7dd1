"""What each engine step ran, kept for tracing: per step its wall-clock interval, the prefill chunks it computed
and the requests it preempted. A worker turns it on only when tracing is on (``LLMEngine.step_log``); off, the
engine pays one attribute test per step.

Rule: a scheduled request runs a prefill chunk when it has more than one uncomputed token, or has not computed
its whole prompt yet (a one-token prompt); otherwise it decodes (its last sampled token). A recompute after a
preemption is a prefill again, over prompt and output alike. Decode-only steps are not kept.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pdserve.shared.engine.request import RequestStatus

MAX_RECORDS = 1024  # kept between two takes at most (the oldest go first): bounded when nobody takes them


@dataclass(slots=True)
class StepRecord:
    """One step. Times in unix seconds. ``chunks``: ``(request id, first token position, tokens)`` per prefill
    chunk; ``preempted``: ``(request id, mode "recompute" or "swap", tokens it had)`` per victim."""

    start_s: float
    end_s: float = 0.0
    num_batched_tokens: int = 0
    chunks: list[tuple[str, int, int]] = field(default_factory=list)
    preempted: list[tuple[str, str, int]] = field(default_factory=list)


class StepLog:
    """``begin(out)`` after scheduling, ``end()`` after the step; ``take()`` the records since the last take. Every
    call runs on the engine thread."""

    def __init__(self) -> None:
        self.records: deque[StepRecord] = deque(maxlen=MAX_RECORDS)
        self.current: StepRecord | None = None

    def begin(self, out) -> None:
        """Note what the ``SchedulerOutput`` ``out`` runs, before the step computes anything."""
        chunks = [(r.request_id, r.num_computed_tokens, n) for r, n in out.scheduled
                  if r.num_computed_tokens < max(r.num_tokens - 1, r.num_prompt_tokens)]
        preempted = [(r.request_id, "swap" if r.status == RequestStatus.SWAPPED else "recompute", r.num_tokens)
                     for r in out.preempted]
        self.current = StepRecord(time.time(), num_batched_tokens=out.num_scheduled_tokens, chunks=chunks,
                                  preempted=preempted) if chunks or preempted else None

    def end(self) -> None:
        """The step is over: keep its record (when it ran a prefill chunk or preempted)."""
        if self.current is not None:
            self.current.end_s = time.time()
            self.records.append(self.current)
            self.current = None

    def take(self) -> list[StepRecord]:
        records = list(self.records)
        self.records.clear()
        return records
