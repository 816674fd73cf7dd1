"""What a worker keeps about each request it publishes output for (``Worker.requests``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Tracked:
    """One request this worker publishes output for. Times are unix seconds (``time.time()``).

    ``arrival_time``: when the router received it. ``num_logprobs``: the request's ``logprobs`` (None: none).
    ``admitted``: when it was taken from a queue here (TTFT = queue wait + prefill); None when it arrived by
    KV hand-over. ``committed``: when its KV hand-over was committed here (the first decode step is timed from
    it; cleared once timed). ``router_id``: the router incarnation that owns it (None: none named).
    ``sent_first``: its first token was published. ``last``: when its last event was published.
    ``span``: its span on this pod (``pdserve.shared.tracing``: prefill or decode); None when not traced.
    """

    arrival_time: float
    num_logprobs: int | None = None
    admitted: float | None = None
    committed: float | None = None
    router_id: str | None = None
    sent_first: bool = False
    last: float | None = None
    span: Any = None
