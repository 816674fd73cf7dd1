"""Watching a silent request until a pod holds it: the queue entry's state tells a slow prefill from a stopped
prefill worker, and from a request that Redis lost.

The relay asks ``PrefillWatch.check`` about a choice that has had no output event for a while and still has a
queue entry (``ChoiceRoute.queue_stream``/``queue_entry``). Its answer:

  * entry pending with a consumer, idle less than ``stall_s``: the worker is on it (workers touch the entries
    they hold every second while their engine makes progress) -> wait;
  * prefill queue entry pending, idle ``stall_s`` or more: the worker stopped (SIGSTOP, a stuck engine, a dead process whose
    entries nobody reclaimed yet) -> a reason: the relay moves the request (re-placed under a new id; the old one
    is aborted, so a worker that wakes up cannot write into the client's stream);
  * entry still in the stream, not delivered: waiting for a worker -> wait, unless it is the prefill queue and
    no prefill pod is alive (all stopped or gone): a prompt short enough for a decode pod's local prefill (the
    placement's no-prefill-pod rule) -> a reason: the relay moves it there at once; a longer one -> 503
    ``OpenAIError`` once it has waited ``stall_s`` (a long prompt never falls back to a decode pod's local
    prefill, see ``placement.py``);
  * entry gone: handed over (or ended) -- then the decode pod holds the request (``GET /v1/requests/{id}``), and
    the watch is done with it -- or lost: taken by a pod that then died (the usual cause) or with Redis's data
    (restarted empty, FLUSHALL) -> a reason naming the likelier of the two: move it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx
from redis.exceptions import RedisError, ResponseError

from pdserve.shared.protocol import keys
from pdserve.shared.streams import is_nogroup

from .errors import OpenAIError
from .pod_probe import probe

logger = logging.getLogger(__name__)


def group_of(stream: str) -> str:
    return keys.PREFILL_GROUP if stream == keys.PREFILL_STREAM else keys.DECODE_GROUP


class PrefillWatch:
    """``stall_s``: how long a queue entry may sit with a worker that does not touch it, or wait with no prefill
    pod alive, before the request moves (or fails with 503)."""

    def __init__(self, redis: Any, dispatcher: Any, stall_s: float, retry_after_s: int = 1,
                 http: httpx.AsyncClient | None = None) -> None:
        self.redis = redis
        self.http = http  # the router's probe client (pod_probe.py)
        self.dispatcher = dispatcher
        self.stall_s = stall_s
        self.retry_after_s = retry_after_s

    async def check(self, route: Any) -> str | None:
        """A reason to move ``route``'s request, or None to keep waiting. Raises ``OpenAIError(503)`` for a request
        no prefill pod came for. Redis errors propagate (the relay treats them as an outage)."""
        stream, entry = route.queue_stream, route.queue_entry
        group_gone = False
        try:
            pending = await self.redis.xpending_range(stream, group_of(stream), entry, entry, 1)
        except ResponseError as exc:
            if not is_nogroup(exc):
                raise
            pending, group_gone = [], True  # Redis lost its data (the worker makes the group again)
        if pending:
            idle_s = int(pending[0]["time_since_delivered"]) / 1000
            if idle_s < self.stall_s or stream != keys.PREFILL_STREAM:
                return None  # (a decode pod admits its own entries at once: its stall check covers it)
            consumer = pending[0]["consumer"]
            consumer = consumer.decode() if isinstance(consumer, bytes) else consumer
            return f"prefill stalled: worker {consumer} has not touched it for {idle_s:.0f} s"
        if await self.redis.xrange(stream, entry, entry, count=1):
            if stream == keys.PREFILL_STREAM and not await self._prefill_pods():
                return self._no_prefill_pod(route)
            return None  # waiting in the queue
        held = await self._decode_pod_holds(route)
        if held is None:
            return None  # the decode pod does not answer: the decode stall check decides
        if held:
            route.queue_stream = route.queue_entry = ""  # handed over: the decode pod has it
            return None
        # Seen twice, a check apart, before it counts: pods that Redis's data loss dropped from the registry have
        # heartbeated again by then, so the move finds a decode pod.
        if not route.vanished:
            route.vanished = True
            return None
        return f"its queue entry and its state vanished ({await self._vanished_cause(route, group_gone)})"

    def _no_prefill_pod(self, route: Any) -> str | None:
        """A request waiting in the prefill queue while no prefill pod is alive (all stopped or gone: the registry
        dropped them): one short enough for a decode pod's local prefill (the placement's no-prefill-pod rule,
        ``--local-prefill-fallback-max-tokens``) moves there at once, as a new request of its size would go; a
        longer one keeps waiting for a prefill pod, and gets 503 once it has waited ``stall_s``."""
        tokens = len(route.prompt_token_ids) + len(route.token_ids)
        if tokens <= int(getattr(self.dispatcher, "fallback_max_tokens", 0) or 0):
            return f"no prefill pod is alive: {tokens} tokens fit a decode pod's local prefill"
        if time.monotonic() - route.queued_at >= self.stall_s:
            raise OpenAIError(503, f"No prefill pod took the request within {self.stall_s:g} s; retry later",
                              headers={"Retry-After": str(self.retry_after_s)})
        return None

    async def _vanished_cause(self, route: Any, group_gone: bool) -> str:
        """The likely cause of a vanished request, for the log line an operator reads. Entries leave a queue when
        a pod takes them, so after a pod's death the usual cause is that pod (it took the request, then died and
        restarted empty); only a missing consumer group, or a Redis restarted since the request was queued, points
        at Redis."""
        if group_gone:
            return "the queue's consumer group was gone too: Redis lost its data (restarted empty, FLUSHALL)"
        try:
            uptime_s = float((await self.redis.info("server")).get("uptime_in_seconds", 1e9))
        except (RedisError, OSError, ValueError, AttributeError):
            uptime_s = 1e9
        if uptime_s + 1 < time.monotonic() - route.queued_at:  # (Redis reports whole seconds)
            return f"Redis restarted {uptime_s:.0f} s ago, after it was queued: the entry went with its data"
        return (f"decode pod {route.pod_id or '?'} does not hold it: it most likely took it and then died or "
                "restarted; else Redis lost the entry (FLUSHALL, a restart without persistence)")

    async def check_held(self, route: Any, silent_s: float) -> str | None:
        """A reason to move a request its decode pod took over (no queue entry left) and that has been silent for
        ``silent_s``, or None. Asked only past ``stall_s`` of silence: a live pod that no longer holds the request
        (dropped it as an orphan while Redis had lost the router's key, or lost it any other way) would otherwise
        leave the client waiting for the request timeout; a pod that holds it (a long step, preempted) is waited
        for. Like ``check``: a pod that does not answer is the decode stall check's, and it must say so twice."""
        if route.queue_entry or silent_s < self.stall_s:
            return None
        held = await self._decode_pod_holds(route)
        if held is None or held:
            route.vanished = False
            return None
        if not route.vanished:
            route.vanished = True
            return None
        return f"decode pod {route.pod_id} no longer holds it after {silent_s:.0f} s without output"

    async def _prefill_pods(self) -> bool:
        try:
            return bool(await self.dispatcher.pods("prefill"))
        except OpenAIError:
            return True  # registry unreachable: no evidence

    async def _decode_pod_holds(self, route: Any) -> bool | None:
        base = route.pod_health_url.removesuffix("/health")
        if not base:
            return None
        try:
            resp = await probe(self.http, f"{base}/v1/requests/{route.request_id}")
        except httpx.HTTPError:
            return None
        try:
            held = resp.json().get("held")
        except (ValueError, AttributeError):
            return None  # not a pdserve worker's answer: no evidence either way
        return held if isinstance(held, bool) else None
