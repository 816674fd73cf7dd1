"""Spans from the engine's step log (``pdserve.shared.engine.step_log``): one ``prefill_chunk`` span per chunk a
step computed for a request, a child of that request's span on this pod (prefill, or decode for a local
prefill), timed by the step; a ``preemption`` event on the request's span per preemption. The names follow no
GenAI convention (there is none for engine steps): ``pdserve.*``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pdserve.shared import tracing
from pdserve.shared.engine.step_log import StepRecord
from pdserve.shared.worker.tracked import Tracked


def trace_steps(requests: Mapping[str, Tracked], steps: Iterable[StepRecord]) -> None:
    """Record the spans and events of ``steps`` on the spans of ``requests`` (request id -> what the worker keeps
    about it). Requests gone meanwhile (finished, aborted) or not traced are skipped."""
    for step in steps:
        for request_id, first, tokens in step.chunks:
            info = requests.get(request_id)
            if info is not None and info.span is not None:
                tracing.record("prefill_chunk", info.span, step.start_s, step.end_s, {
                    "pdserve.chunk.first_token": first, "pdserve.chunk.tokens": tokens,
                    "pdserve.step.batched_tokens": step.num_batched_tokens})
        for request_id, mode, num_tokens in step.preempted:
            info = requests.get(request_id)
            if info is not None:
                tracing.event(info.span, "preemption", {"pdserve.preemption.mode": mode,
                                                        "pdserve.preemption.num_tokens": num_tokens},
                              at_s=step.start_s)
