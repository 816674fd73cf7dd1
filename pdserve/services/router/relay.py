"""Reading the per-request output streams back, and aborting requests everywhere.

One ``XREAD BLOCK`` covers all choices of a request (their streams side by side), so n > 1 costs one
round trip per batch of events. Reading starts at id ``0``: events written before the router started
reading are not lost.

``OutputRelay`` also makes the stream the client sees exactly-once when workers fail:
  * events are deduplicated by their cumulative ``completion_tokens``: a prefill worker that died after
    emitting the first token has its queue entry reclaimed by another, which emits that token again —
    the client gets it once;
  * a keep-alive event (``OutputEvent.keepalive``: the request waits for a decode pod's KV blocks) counts as output
    for the silence bounds (``idle_timeout_s``, ``stall_s``) and is not relayed;
  * a choice whose output stalls (no event for ``stall_s``) while it still has a queue entry is asked about
    (``prefill_watch.py``): a prefill worker that stopped touching it, or an entry Redis lost, moves it; so does
    a decode pod that, alive, no longer holds a choice silent for the watch's ``stall_s``;
  * a choice whose output stalls (no event for ``stall_s``) or whose worker reports a retryable 503 is
    handed to ``migrate`` (the app re-enqueues it, under a new internal request id, resuming from the tokens
    and text already relayed); the relay then reads the new stream, whose ``completion_tokens`` continue
    where the client is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pdserve.shared import redis_client
from pdserve.shared.protocol import keys
from pdserve.shared.protocol.messages import MessageError, OutputEvent
from pdserve.shared.protocol.sampling_params import SamplingParams

from .errors import OpenAIError

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ChoiceRoute:
    """Where one choice's output comes from now, and what its client already received.

    ``request_id``/``pod_id``: the current internal request and its decode pod (both change on migration).
    ``token_ids``: completion tokens relayed so far; ``text_len``: characters of their text relayed (less
    than their full text while a possible stop-string prefix is held back).
    """

    request_id: str
    pod_id: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str | None = None
    priority: int = 0
    token_ids: list[int] = field(default_factory=list)
    text_len: int = 0
    migrations: int = 0
    pod_health_url: str = ""  # the decode pod's /health, probed before declaring it dead
    pod_started_at: float | None = None  # the decode pod's incarnation (PodInfo.started_at) when it got the request
    queue_stream: str = ""  # where its request waits for a worker (cleared once a decode pod holds it)
    queue_entry: str = ""  # its entry id there
    queued_at: float = field(default_factory=time.monotonic)
    remote_prefill: bool = True  # its current placement prefills on the prefill tier (else on its decode pod)
    placed_tokens: int = 0  # len(token_ids) when it was last placed (0, or the tokens relayed before a migration)
    vanished: bool = False  # the watch found its entry and state gone once (prefill_watch.py)
    pod_stopped: bool = False  # its decode pod's /health took the connection and did not answer (migration.py)
    pod_wait_logged: bool = False  # the migrator said once that it waits for that pod
    last_event: float = field(default_factory=time.monotonic)
    last_check: float = field(default_factory=time.monotonic)
    done: bool = False


# migrate(choice_index, route, reason, check_pod) -> True when the route now points at a new request; may raise
# OpenAIError. ``check_pod=False``: move it whatever its decode pod's state (the prefill side lost it).
Migrate = Callable[..., Awaitable[bool]]


def is_retryable(error: dict[str, Any] | None) -> bool:
    """A worker error worth migrating for: the decode pod it needed is unreachable (503)."""
    return bool(error) and int(error.get("code") or 0) == 503


def accept(route: ChoiceRoute, event: OutputEvent) -> OutputEvent | None:
    """``event`` without tokens the client already got (``completion_tokens`` counts from the choice's start,
    across migrations); None to drop it. Raises ``OpenAIError(500)`` when the event starts past the tokens the
    client has: tokens were lost on the way, and a stream with a hole in it is a wrong answer."""
    n_new = len(event.token_ids)
    total = event.completion_tokens or len(route.token_ids) + n_new
    before = total - n_new  # completion tokens that preceded this event's
    have = len(route.token_ids)
    if before > have:
        logger.error("request %s: output skips tokens %d..%d; failing the request", route.request_id, have,
                     before - 1)
        raise OpenAIError(500, f"The output of this request lost tokens {have}..{before - 1} on the way from its "
                          "worker; the request was aborted")
    skip = max(0, have - before)
    if skip:
        if skip >= n_new and not event.finished:
            return None  # a replay (reclaimed prefill re-emitting its first token)
        event.token_ids = event.token_ids[skip:]
        if event.logprobs is not None:
            event.logprobs = event.logprobs[skip:]
        if not event.token_ids:
            event.text = ""
    route.token_ids.extend(event.token_ids)
    route.text_len += len(event.text)
    event.completion_tokens = max(total, len(route.token_ids))
    event.prompt_tokens = len(route.prompt_token_ids) or event.prompt_tokens
    return event


class OutputRelay:
    """Yields ``(choice_index, event)`` until every choice has its final event (see the module doc).

    Raises ``OpenAIError(504)`` when no event arrives for ``idle_timeout_s``, ``stop``'s error once its event is set, ``OpenAIError(500)`` for an entry
    that is not an ``OutputEvent``; Redis connection errors are retried for ``redis_retry_s`` (a restart),
    then raised. Deletes each output stream once its final event is read.
    """

    def __init__(self, redis: Redis, routes: list[ChoiceRoute], idle_timeout_s: float, stall_s: float = 0.0,
                 migrate: Migrate | None = None, block_ms: int = 1000, redis_retry_s: float = 30.0,
                 stop: tuple[asyncio.Event, Callable[[], Exception]] | None = None,
                 watch: Any = None, reader: Any = None) -> None:
        self.watch = watch  # a PrefillWatch, or None
        # what XREADs the output streams: the router's RelayReader (one XREAD of its relay stream for all relays), or Redis
        self.reader = reader if reader is not None else redis
        # a per-request stream is deleted once read; a relay stream (RelayReader) is trimmed by its reader instead
        self._delete_streams = getattr(self.reader, "per_request_streams", True)
        self.redis_retry_s = redis_retry_s
        self.stop = stop  # (event, error): once the event is set, the next read raises the error (shutdown)
        self.redis = redis
        self.routes = routes
        self.idle_timeout_s = idle_timeout_s
        self.stall_s = stall_s
        self.migrate = migrate
        self.block_ms = block_ms

    async def _try_migrate(self, index: int, route: ChoiceRoute, reason: str,
                           last_ids: dict[int, tuple[str, str]], check_pod: bool = True) -> bool:
        if self.migrate is None:
            return False
        old = route.request_id
        if not await (self.migrate(index, route, reason) if check_pod else
                      self.migrate(index, route, reason, check_pod=False)):
            return False
        logger.info("request %s (choice %d) migrated to %s on pod %s after %d tokens (%s)", old, index,
                    route.request_id, route.pod_id, len(route.token_ids), reason)
        route.last_event = route.last_check = time.monotonic()
        last_ids[index] = (keys.output_stream(route.request_id), "0-0")
        return True

    async def __aiter__(self) -> AsyncIterator[tuple[int, OutputEvent]]:
        last_ids = {i: (keys.output_stream(r.request_id), "0-0") for i, r in enumerate(self.routes) if not r.done}
        read: set[str] = set()  # every stream this relay read: released from a shared reader when it ends
        relay = self._relay(last_ids, read)
        try:
            async for item in relay:
                yield item
        finally:
            await relay.aclose()
            if self.reader is not self.redis:
                self.reader.release(read)

    async def _relay(self, last_ids: dict[int, tuple[str, str]], read: set[str]
                     ) -> AsyncIterator[tuple[int, OutputEvent]]:
        last_any = time.monotonic()
        outage: float | None = None
        block_ms = self.block_ms if not self.stall_s else max(50, min(self.block_ms, int(self.stall_s * 500)))
        while last_ids:
            if self.stop is not None and self.stop[0].is_set():
                raise self.stop[1]()
            by_name = {name: i for i, (name, _) in last_ids.items()}
            read.update(by_name)
            try:
                reply = await self.reader.xread({name: last for name, last in last_ids.values()}, block=block_ms,
                                               count=256)
                outage = None
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                # Redis restarting: the streams survive (AOF), keep reading once it is back
                outage = outage or time.monotonic()
                if time.monotonic() - outage > self.redis_retry_s:
                    raise
                logger.warning("reading output streams failed (%s); retrying", exc)
                await asyncio.sleep(0.5)
                last_any = time.monotonic()
                continue
            now = time.monotonic()
            if reply:
                last_any = now
            elif now - last_any > self.idle_timeout_s:
                raise OpenAIError(504, f"No output for {self.idle_timeout_s:g} s; the request was aborted")
            for stream, entries in reply or []:
                name = stream.decode() if isinstance(stream, bytes) else stream
                index = by_name.get(name)
                if index is None or index not in last_ids or last_ids[index][0] != name:
                    continue
                route = self.routes[index]
                route.last_event = route.last_check = now
                for entry_id, fields in entries:
                    last_ids[index] = (name, entry_id)
                    try:
                        event = fields if isinstance(fields, OutputEvent) else OutputEvent.decode(fields)
                    except MessageError as exc:
                        logger.error("bad output event on %s: %s", name, exc)
                        raise OpenAIError(500, "A worker sent an unreadable output event") from exc
                    if event.keepalive:  # the request waits for its hand-over: alive, nothing to send
                        continue
                    if event.error is not None and is_retryable(event.error):
                        await self._drop(name)
                        if await self._try_migrate(index, route, "worker error: " + str(event.error.get("message")),
                                                   last_ids):
                            break
                    accepted = accept(route, event)
                    if accepted is None:
                        continue
                    yield index, accepted
                    if accepted.finished:
                        route.done = True
                        del last_ids[index]
                        await self._drop(name)
                        break
            if self.stall_s and self.migrate is not None:
                for index in list(last_ids):
                    route = self.routes[index]
                    if now - route.last_check >= self.stall_s:
                        route.last_check = now
                        reason = await self._lost_reason(route, now)
                        if reason is not None and await self._try_migrate(index, route, reason, last_ids,
                                                                          check_pod=False):
                            continue
                        await self._try_migrate(index, route, f"no output for {now - route.last_event:.1f} s",
                                                last_ids)

    async def _drop(self, name: str) -> None:
        if self._delete_streams:
            await self.redis.delete(name)

    async def _lost_reason(self, route: ChoiceRoute, now: float) -> str | None:
        """Why a silent choice is lost whatever its decode pod's health (``PrefillWatch``: its queue entry, or the
        pod it was handed to no longer holding it), or None."""
        if self.watch is None:
            return None
        try:
            if route.queue_entry:
                return await self.watch.check(route)
            return await self.watch.check_held(route, now - route.last_event)
        except RedisError as exc:  # Redis away: ask again at the next check
            logger.warning("checking the queue entry of %s failed: %s", route.request_id, exc)
            return None


async def read_outputs(redis: Redis, request_ids: list[str], idle_timeout_s: float,
                       block_ms: int = 1000) -> AsyncIterator[tuple[int, OutputEvent]]:
    """``OutputRelay`` without migration: ``(choice_index, event)`` until every request sent its final event."""
    relay = OutputRelay(redis, [ChoiceRoute(rid) for rid in request_ids], idle_timeout_s, block_ms=block_ms)
    async for item in relay:
        yield item


async def abort_requests(redis: Redis, request_ids: list[str]) -> None:
    """Tell every worker to drop these requests (pub/sub + a marker key for late readers); drop their output."""
    if not request_ids:
        return
    cluster = redis_client.is_cluster(redis)  # a cluster pipeline refuses PUBLISH (not a key command)
    async with redis.pipeline(transaction=False) as pipe:
        for rid in request_ids:
            pipe.set(keys.aborted_key(rid), b"1", ex=keys.ABORTED_TTL_S)
            if not cluster:
                pipe.publish(keys.ABORT_CHANNEL, rid)
            pipe.delete(keys.output_stream(rid))
        await pipe.execute()
    if cluster:
        await asyncio.gather(*(redis.publish(keys.ABORT_CHANNEL, rid) for rid in request_ids))
