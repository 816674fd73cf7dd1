"""The router's one reader of its relay stream (``keys.relay_stream(router_id)``): one ``XREAD BLOCK`` brings every
pod's ``OutputBatch`` of a step, and the reader fans the events out to the relays of the requests they belong to.

Workers write one entry per step per router for all its requests (``OutputWriter``), so the router parses one
entry and one msgpack payload per step per pod instead of one Redis entry per token. ``RelayReader.xread`` has the
shape of ``redis.asyncio.Redis.xread`` so ``OutputRelay`` keeps its logic (dedup by ``completion_tokens``,
migration, idle and stall bounds, the Redis-outage retry): a relay asks for ``keys.output_stream(request_id)`` of
its requests, and gets ``[(name, [(id, OutputEvent), ...])]`` -- decoded events, with ids that count per request
(``"0-1"``, ``"0-2"``, ...), not Redis ids.

Events of a request no relay reads yet (its first event beat the relay's first read) wait ``unclaimed_s``; events
of a request whose relay ended (late events of an aborted request, a replay) wait as long and are dropped. Once a
second the reader trims the stream up to what it has read (``XTRIM MINID``), so Redis holds only unread entries.
A Redis error in the loop is raised in every relay waiting on it (which retries as for its own read); the loop
backs off and reads on from its cursor, so nothing written meanwhile is missed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from pdserve.shared.protocol import keys
from pdserve.shared.protocol.messages import MessageError, OutputBatch, OutputEvent

logger = logging.getLogger(__name__)

class _Request:
    __slots__ = ("seq", "buffer", "waiters")

    def __init__(self) -> None:
        self.seq = 0  # events handed to this request's buffer so far (its ids)
        self.buffer: list[tuple[str, OutputEvent]] = []
        self.waiters: set[asyncio.Future] = set()


class RelayReader:
    """Reads ``keys.relay_stream(router_id)`` for every relay of this router (see the module doc).

    ``xread(streams, block, count)``: ``streams`` maps ``keys.output_stream(request_id)`` to the last id its caller
    has; returns what arrived for those requests since the caller's previous call, or ``[]`` after ``block`` ms.
    ``release(names)`` ends the requests' subscriptions. Counters for tests and stats: ``loop_reads`` (XREADs),
    ``entries`` (batches read), ``events`` (events in them)."""

    per_request_streams = False  # the relay deletes no per-request stream: there is none

    def __init__(self, redis: Redis, router_id: str, block_ms: int = 1000, count: int = 1024,
                 retry_s: float = 0.5, unclaimed_s: float = 60.0, trim_every_s: float = 1.0) -> None:
        self.redis = redis
        self.stream = keys.relay_stream(router_id)
        self.block_ms, self.count, self.retry_s = block_ms, count, retry_s
        self.unclaimed_s, self.trim_every_s = unclaimed_s, trim_every_s
        self.cursor = "0-0"  # the last entry id read (a router incarnation's stream starts empty)
        self._requests: dict[str, _Request] = {}  # output stream name -> its subscription
        self._unclaimed: dict[str, tuple[float, list[OutputEvent]]] = {}  # name -> (first seen, events)
        self._task: asyncio.Task | None = None
        self._trimmed_at = time.monotonic()
        self._swept_at = time.monotonic()
        self.loop_reads = self.entries = self.events = 0
        self._closed = False

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def xread(self, streams: dict[str, Any], block: int | None = None, count: int | None = None) -> list:
        self.start()
        for name in streams:
            if name not in self._requests:
                self._subscribe(name)
        reply = self._take(streams, count or self.count)
        if reply or block is None:
            return reply
        waiter = asyncio.get_running_loop().create_future()
        for name in streams:
            self._requests[name].waiters.add(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), block / 1000)
        except asyncio.TimeoutError:
            pass
        finally:
            for name in streams:
                request = self._requests.get(name)
                if request is not None:
                    request.waiters.discard(waiter)
        if waiter.done() and not waiter.cancelled() and waiter.exception() is not None:
            raise waiter.exception()
        return self._take(streams, count or self.count)

    def release(self, names) -> None:
        """Stop relaying these requests; what arrives for them later is dropped after ``unclaimed_s``."""
        for name in names:
            request = self._requests.pop(name, None)
            if request is not None:
                for waiter in request.waiters:
                    if not waiter.done():
                        waiter.set_result(None)

    async def aclose(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                # a cancel that redis-py turns into an error mid-read must not leave us waiting on the loop
                await asyncio.wait({self._task}, timeout=2.0)
            self._task = None

    def _subscribe(self, name: str) -> None:
        request = self._requests[name] = _Request()
        held = self._unclaimed.pop(name, None)
        if held is not None:
            for event in held[1]:
                request.seq += 1
                request.buffer.append((f"0-{request.seq}", event))

    def _take(self, streams: dict[str, Any], count: int) -> list:
        reply = []
        for name in streams:
            request = self._requests.get(name)
            if request is not None and request.buffer:
                reply.append((name, request.buffer[:count]))
                del request.buffer[:count]
        return reply

    def _fan_out(self, entries: list) -> None:
        for entry_id, fields in entries:
            self.entries += 1
            try:
                batch = OutputBatch.decode(fields)
            except MessageError as exc:  # whose tokens they were is unknown: the relays' gap check fails them
                logger.error("bad output batch %s on %s: %s", entry_id, self.stream, exc)
                continue
            self.events += len(batch.events)
            now = time.monotonic()
            for event in batch.events:
                name = keys.output_stream(event.request_id)
                request = self._requests.get(name)
                if request is None:
                    self._unclaimed.setdefault(name, (now, []))[1].append(event)
                    continue
                request.seq += 1
                request.buffer.append((f"0-{request.seq}", event))
                for waiter in request.waiters:
                    if not waiter.done():
                        waiter.set_result(None)
        if entries:
            last = entries[-1][0]
            self.cursor = last.decode() if isinstance(last, bytes) else last

    async def _loop(self) -> None:
        while not self._closed:
            try:
                await self._read_once()
                await self._housekeeping()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not stop every relay: they time out of their waits and read again
                if self._closed:
                    return
                logger.exception("the relay-stream reader failed; restarting it")
                await asyncio.sleep(self.retry_s)

    async def _read_once(self) -> None:
        try:
            self.loop_reads += 1
            reply = await self.redis.xread({self.stream: self.cursor}, block=self.block_ms, count=self.count)
        except RedisError as exc:
            if self._closed:
                return
            for request in self._requests.values():
                for waiter in request.waiters:
                    if not waiter.done():
                        waiter.set_exception(exc)
            logger.warning("reading the relay stream %s failed (%s); retrying", self.stream, exc)
            await asyncio.sleep(self.retry_s)
            return
        for _, entries in reply or []:
            self._fan_out(entries)

    async def _housekeeping(self) -> None:
        """Once per ``trim_every_s``: trim what was read, drop unclaimed events older than ``unclaimed_s``."""
        now = time.monotonic()
        if now - self._swept_at >= self.trim_every_s:
            self._swept_at = now
            horizon = now - self.unclaimed_s
            for name in [n for n, (seen, _) in self._unclaimed.items() if seen < horizon]:
                del self._unclaimed[name]
        if now - self._trimmed_at >= self.trim_every_s and self.cursor != "0-0":
            self._trimmed_at = now
            try:
                await self.redis.xtrim(self.stream, minid=self.cursor, approximate=True)
            except RedisError as exc:  # the writers' MAXLEN still bounds it; the next round trims
                logger.debug("trimming %s failed: %s", self.stream, exc)
