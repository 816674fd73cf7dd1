"""The router's table of the jobs it is serving, and each choice's phase, for ``GET /v1/pdserve/requests``
(what ``pdserve top`` lists). A job enters at admission and leaves when it finishes; the table holds references
only, so keeping it costs a dict insert and delete per request. Phases are worked out when asked, from what the
router already knows (tokens relayed so far) and, for a choice with no token yet, its queue entry's state in
Redis (one pipelined round trip for the whole table).

A choice's phase, counted from its last placement (a migration places it again):

* ``queued``: its entry waits in the stream; no worker has taken it.
* ``prefill``: a worker holds the entry (pending in the consumer group: ``pod`` names that worker), or the
  decode pod that prefills it itself has taken it into its engine.
* ``transfer``: remote prefill only: the prefill pod acknowledged the entry or sent the first token; the KV
  hand-over and the decode pod's first step are under way.
* ``decode``: tokens stream from the decode pod (its second token on, or its first after a local prefill).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from pdserve.shared.protocol import keys

PHASES = ("queued", "prefill", "transfer", "decode")


@dataclass(slots=True)
class InflightChoice:
    """One choice in flight, as ``GET /v1/pdserve/requests`` lists it. ``age_s``: seconds since the router
    received the request; ``output_tokens``: completion tokens relayed to the client so far; ``decode_pod``: where
    its output comes from; ``pod``: the pod working on it now (the prefill worker holding its entry while it
    prefills remotely, else the decode pod)."""

    id: str
    request_id: str
    index: int
    phase: str
    age_s: float
    prompt_tokens: int
    output_tokens: int
    prefill: str
    decode_pod: str
    pod: str
    migrations: int


def phase_of(remote: bool, new_tokens: int, holder: str | None, entry_waiting: bool) -> str:
    """The phase of a choice (module docstring). ``remote``: prefilled by the prefill tier; ``new_tokens``:
    tokens relayed since its last placement; ``holder``: the consumer its queue entry is pending with (None: not
    pending); ``entry_waiting``: the entry is still in the stream."""
    if new_tokens >= (2 if remote else 1):
        return "decode"
    if new_tokens == 1:
        return "transfer"
    if holder is not None:
        return "prefill"
    if entry_waiting:
        return "queued"
    return "transfer" if remote else "prefill"


class JobTable:
    """The jobs between admission and finish (``CompletionService.submit`` adds, ``finish`` removes)."""

    def __init__(self) -> None:
        self.jobs: dict[int, Any] = {}

    def add(self, job: Any) -> None:
        self.jobs[id(job)] = job

    def remove(self, job: Any) -> None:
        self.jobs.pop(id(job), None)

    def __len__(self) -> int:
        return len(self.jobs)

    async def snapshot(self, redis: Any) -> list[InflightChoice]:
        """Every unfinished choice of every job, oldest first. Raises Redis errors (the route answers 503)."""
        now = time.monotonic()
        choices = [(job, i, route) for job in list(self.jobs.values()) for i, route in enumerate(job.routes)
                   if not route.done]
        asking = [route for _, _, route in choices
                  if route.queue_entry and len(route.token_ids) == route.placed_tokens]
        states: dict[int, tuple[str | None, bool]] = {}
        if asking:
            async with redis.pipeline(transaction=False) as pipe:
                for route in asking:
                    group = keys.PREFILL_GROUP if route.queue_stream == keys.PREFILL_STREAM else keys.DECODE_GROUP
                    pipe.xpending_range(route.queue_stream, group, route.queue_entry, route.queue_entry, 1)
                    pipe.xrange(route.queue_stream, route.queue_entry, route.queue_entry, count=1)
                replies = await pipe.execute(raise_on_error=False)
            for n, route in enumerate(asking):
                pending, entry = replies[2 * n], replies[2 * n + 1]
                holder = _text(pending[0]["consumer"]) if isinstance(pending, list) and pending else None
                states[id(route)] = (holder, bool(entry) and isinstance(entry, list))
        out = []
        for job, i, route in sorted(choices, key=lambda c: c[0].arrival):
            holder, waiting = states.get(id(route), (None, False))
            phase = phase_of(route.remote_prefill, len(route.token_ids) - route.placed_tokens, holder, waiting)
            pod = holder if phase == "prefill" and holder else route.pod_id
            out.append(InflightChoice(job.response_id, route.request_id, i, phase, round(now - job.arrival, 3),
                                      len(route.prompt_token_ids), len(route.token_ids),
                                      "remote" if route.remote_prefill else "local", route.pod_id, pod,
                                      route.migrations))
        return out


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def as_json(choices: list[InflightChoice]) -> dict[str, Any]:
    """The body of ``GET /v1/pdserve/requests``."""
    return {"object": "list", "data": [asdict(c) for c in choices]}
