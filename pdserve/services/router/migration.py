"""Moving a choice off a dead decode pod: re-enqueue it to a live pod (the dispatcher's usual choice) as a
*resumed* request — its prompt, and as output the tokens (and characters of text) the client already has.
The engine continues it as if it had never moved (``LLMEngine.add_request``): ``max_tokens``/``min_tokens``
count those tokens, a stop string that spans the move is found, text a dead pod held back as a possible
stop-string prefix is sent once it cannot match, and a seeded generator resumes where it was.

A choice is migrated when its decode pod has left the registry (its heartbeats stopped: the pod died or
is cut off) while its output stalled, or when a worker reported that the pod is unreachable (503, e.g. the
KV transfer failed). The old internal request is aborted, so a pod that was only slow cannot write into
the client's stream as well. With greedy or seeded sampling the continuation equals an uninterrupted run's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx
from redis.exceptions import RedisError

from pdserve.shared import tracing
from pdserve.shared.protocol import keys

from .dispatch import ChoiceSpec
from .errors import OpenAIError
from .pod_probe import probe
from .prefill_watch import group_of
from .relay import ChoiceRoute, abort_requests


def health_url(pod: Any) -> str:
    port = getattr(pod, "http_port", None)
    return f"http://{pod.host}:{port}/health" if port else ""

logger = logging.getLogger(__name__)


def _restarted(route: ChoiceRoute, started_at: float | None) -> bool:
    """The pod now answering under the route's pod id is a later incarnation than the one given the request."""
    return bool(route.pod_started_at and started_at and float(started_at) != route.pod_started_at)


class Migrator:
    """``migrate(index, route, reason)`` for one job's ``OutputRelay``.

    ``job`` has ``request_ids`` and ``pods`` lists indexed by choice, kept current so that an abort or the
    dispatcher's in-flight counts follow the migrated request. ``pod_gone_wait_s`` bounds how long a worker's
    503 waits for the pod to leave the registry (a pod that stays is alive: the error is the client's).
    """

    def __init__(self, redis: Any, dispatcher: Any, job: Any, max_migrations: int, pod_gone_wait_s: float,
                 on_migrated: Any = None, http: httpx.AsyncClient | None = None) -> None:
        self.redis = redis
        self.http = http  # the router's probe client (pod_probe.py)
        self.dispatcher = dispatcher
        self.job = job
        self.max_migrations = max_migrations
        self.pod_gone_wait_s = pod_gone_wait_s
        self.on_migrated = on_migrated

    async def pod_alive(self, route: ChoiceRoute) -> bool:
        """The same incarnation of the pod is listed by the registry, or (heartbeats lost in a Redis outage)
        still answers its /health. A pod restarted under the same id (a container restart keeps the pod name)
        lost the request: its new ``started_at`` tells it apart."""
        try:
            pods = await self.dispatcher.pods("decode")
        except OpenAIError:
            return True  # registry unreachable: no evidence the pod died; keep waiting
        listed = next((p for p in pods if p.pod_id == route.pod_id), None)
        if listed is not None:
            return not _restarted(route, getattr(listed, "started_at", None))
        if not route.pod_health_url:
            return False
        try:
            resp = await probe(self.http, route.pod_health_url)
        except httpx.HTTPError as exc:
            # Connected but no answer: the process lives and does not run (SIGSTOP, stuck); refused: it is gone.
            route.pod_stopped = isinstance(exc, httpx.ReadTimeout)
            return False
        route.pod_stopped = False
        try:
            started_at = resp.json().get("started_at")
        except (ValueError, AttributeError):
            started_at = None
        return not _restarted(route, started_at)  # any answer, 503 included: the process lives

    async def _marked_unreachable(self, pod_id: str) -> bool:
        """A prefill pod found the pod's KV port unreachable (timed out or broke): its heartbeats may go on, but it
        cannot take requests, so a worker error moves the request at once (``Dispatcher.unreachable``)."""
        marks = getattr(self.dispatcher, "unreachable", None)
        return marks is not None and pod_id in await marks(fresh=True)

    async def _drop_entry(self, route: ChoiceRoute) -> None:
        """Take the old request's queue entry out of the queue (best effort: a worker that finds it aborted
        drops it anyway), so no worker reclaims a request that moved."""
        if not route.queue_entry:
            return
        try:
            await self.redis.xack(route.queue_stream, group_of(route.queue_stream), route.queue_entry)
            await self.redis.xdel(route.queue_stream, route.queue_entry)
        except RedisError as exc:
            logger.info("dropping queue entry %s of %s failed: %s", route.queue_entry, route.request_id, exc)

    async def __call__(self, index: int, route: ChoiceRoute, reason: str, check_pod: bool = True) -> bool:
        unreachable = False
        if not check_pod:
            pass  # the prefill side lost it (prefill_watch.py): move it wherever its decode pod stands
        elif reason.startswith("worker error"):
            unreachable = await self._marked_unreachable(route.pod_id)
            deadline = time.monotonic() + self.pod_gone_wait_s
            while not unreachable and await self.pod_alive(route):
                if time.monotonic() > deadline:
                    return False
                await asyncio.sleep(0.5)
        elif await self.pod_alive(route):
            return False
        if route.migrations >= self.max_migrations:
            what = "its decode pod" if check_pod else "its prefill"
            raise OpenAIError(503, f"The request lost {what} {route.migrations + 1} times ({reason}); giving up",
                              headers={"Retry-After": "1"})
        sent = len(route.token_ids)
        ids = list(route.prompt_token_ids) + list(route.token_ids)  # all of it needs KV on the new pod
        try:
            placement = await self.dispatcher.place(len(ids), ids, route.cache_salt)  # 503: no decode pod is left
        except OpenAIError as exc:
            if not (exc.status == 503 and check_pod and route.pod_stopped):
                raise
            # Its pod is stopped, not gone, and no other can take the request: wait for the pod, as for one that
            # restarts, within the request's own bound (--request-timeout-s without output: 504).
            if not route.pod_wait_logged:
                route.pod_wait_logged = True
                logger.warning("request %s: decode pod %s accepts connections but does not answer (stopped?) and no "
                               "other decode pod is available (%s); waiting for it", route.request_id, route.pod_id,
                               exc.message)
            return False
        if unreachable and placement.pod.pod_id == route.pod_id:
            raise OpenAIError(503, f"The decode pod is unreachable and no other decode pod is available "
                                   f"({reason.removeprefix('worker error: ')})", headers={"Retry-After": "1"})
        route.migrations += 1
        stem = self.job.request_ids[index].split("~m")[0]
        new_id = f"{stem}~m{route.migrations}"
        await abort_requests(self.redis, [route.request_id])
        await self._drop_entry(route)
        choice = ChoiceSpec(new_id, index, route.sampling_params, list(route.token_ids), route.text_len,
                            traceparent=tracing.traceparent(getattr(self.job, "span", None)))
        sent_to = await self.dispatcher.send(placement, list(route.prompt_token_ids), [choice],
                                             cache_salt=route.cache_salt, priority=route.priority)
        stream, (entry,) = sent_to.stream, sent_to.entries
        old_pod = self.job.pods[index] if index < len(self.job.pods) else route.pod_id
        self.dispatcher.finished(old_pod, 1)
        if index < len(self.job.pods):
            self.job.pods[index] = placement.pod.pod_id
        self.job.request_ids[index] = new_id
        logger.warning("request %s %s (%s); continuing on %s after %d tokens", route.request_id,
                       f"lost decode pod {route.pod_id}" if check_pod else "moved", reason, placement.pod.pod_id, sent)
        route.request_id, route.pod_id = new_id, placement.pod.pod_id
        route.pod_health_url = health_url(placement.pod)
        route.queue_stream, route.queue_entry, route.queued_at, route.vanished = stream, entry, time.monotonic(), False
        route.remote_prefill, route.placed_tokens = stream == keys.PREFILL_STREAM, sent
        route.pod_started_at = getattr(placement.pod, "started_at", None)
        route.pod_stopped = route.pod_wait_logged = False
        tracing.event(getattr(self.job, "span", None), "migration", {
            "pdserve.from_pod": old_pod, "pdserve.to_pod": placement.pod.pod_id, "pdserve.reason": reason,
            "gen_ai.usage.output_tokens": sent})
        if self.on_migrated is not None:
            self.on_migrated(reason)
        return True
