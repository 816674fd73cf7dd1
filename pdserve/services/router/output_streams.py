"""One ``XREAD BLOCK`` for the output streams of every request a router relays, instead of one per request.

A decode step writes one event to each running request's output stream. With a blocking ``XREAD`` per request, a
router relaying 32 streams issued 32 ``XREAD`` round trips per step, each parsed by redis-py and served by Redis
(about 1.7 ms of router CPU per generated token in ``pdserve bench ensemble-cpu``). ``OutputStreams`` keeps one
reading loop per router: it reads every subscribed stream from its own cursor in one ``XREAD BLOCK`` (``COUNT`` per
stream), buffers the entries per stream, and wakes the relays whose streams got entries. A relay calls ``xread`` as it
called Redis's: the same arguments and reply shape, so ``OutputRelay`` keeps its logic (dedup by
``completion_tokens``, migration, idle and stall bounds, the Redis-outage retry).

A stream is subscribed by its first ``xread`` and read by the loop from the id given there. Until the loop's next
``XREAD`` includes it (the one in flight was sent before it existed), that relay reads Redis directly, as before; the
loop's ``XREAD`` returns at the next event of any stream it covers, or after ``block_ms``, and then covers every
subscribed stream. ``release`` drops streams a relay no longer reads (finished, migrated away, client gone). A Redis
error in the loop is raised in every relay waiting on it (which retries as for its own read); the loop backs off and
reads again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

logger = logging.getLogger(__name__)

Entry = tuple[Any, dict]


def stream_id(value: bytes | str) -> tuple[int, int]:
    """A stream entry id (``b"1733000000000-3"`` or ``"0-0"``) as a tuple that orders like Redis's ids."""
    text = value.decode() if isinstance(value, bytes) else value
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


class _Stream:
    __slots__ = ("cursor", "buffer", "waiters", "used")

    def __init__(self, cursor: str) -> None:
        self.cursor = cursor  # the last id the loop (or a direct read) got from Redis
        self.buffer: list[Entry] = []  # entries read, not yet handed to the relay
        self.waiters: set[asyncio.Future] = set()
        self.used = time.monotonic()  # its relay's last xread


class OutputStreams:
    """Shared blocking reads of output streams (see the module doc). ``xread(streams, block, count)`` mirrors
    ``redis.asyncio.Redis.xread``: ``streams`` maps a stream name to the last id its caller has; the reply is
    ``[(name, [(id, fields), ...]), ...]`` with only entries past those ids, or ``[]`` after ``block`` ms without
    any. Raises the loop's ``RedisError`` while Redis is away."""

    def __init__(self, redis: Redis, block_ms: int = 1000, count: int = 256, retry_s: float = 0.5,
                 unused_s: float = 120.0) -> None:
        self.redis = redis
        self.unused_s = unused_s  # a stream no xread asked for this long is dropped (a relay that never released it)
        self.block_ms = block_ms
        self.count = count
        self.retry_s = retry_s
        self._streams: dict[str, _Stream] = {}
        self._covered: frozenset[str] = frozenset()  # the streams of the XREAD in flight
        self._wake = asyncio.Event()  # a first stream to read
        self._task: asyncio.Task | None = None
        self.loop_reads = 0  # XREADs the loop sent (tests, stats)

    async def xread(self, streams: dict[str, str], block: int | None = None, count: int | None = None) -> list:
        self._ensure_loop()
        now = time.monotonic()
        for name, last in streams.items():
            if name not in self._streams:
                self._streams[name] = _Stream(last if isinstance(last, str) else last.decode())
                self._wake.set()
            self._streams[name].used = now
        reply = self._take(streams, count or self.count)
        if reply or block is None:
            return reply
        if not all(name in self._covered for name in streams):
            reply = await self.redis.xread(streams, block=block, count=count or self.count)
            self._advance(reply or [])
            return self._take(streams, count or self.count)
        waiter = asyncio.get_running_loop().create_future()
        for name in streams:
            self._streams[name].waiters.add(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), block / 1000)
        except asyncio.TimeoutError:
            pass
        finally:
            for name in streams:
                if name in self._streams:
                    self._streams[name].waiters.discard(waiter)
        if waiter.done() and not waiter.cancelled() and waiter.exception() is not None:
            raise waiter.exception()
        return self._take(streams, count or self.count)

    def release(self, names) -> None:
        """Stop reading these streams (their entries not yet taken are dropped)."""
        for name in names:
            stream = self._streams.pop(name, None)
            if stream is not None:
                for waiter in stream.waiters:
                    if not waiter.done():
                        waiter.set_result(None)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    def _take(self, streams: dict[str, str], count: int) -> list:
        reply = []
        for name, last in streams.items():
            stream = self._streams.get(name)
            if stream is None or not stream.buffer:
                continue
            after = stream_id(last)
            stream.buffer = [e for e in stream.buffer if stream_id(e[0]) > after]
            if stream.buffer:
                reply.append((name, stream.buffer[:count]))
        return reply

    def _advance(self, reply: list) -> None:
        """Buffer what a read returned (the loop's or a direct one), past each stream's cursor, and move it."""
        for raw_name, entries in reply:
            name = raw_name.decode() if isinstance(raw_name, bytes) else raw_name
            stream = self._streams.get(name)
            if stream is None or not entries:
                continue
            cursor = stream_id(stream.cursor)
            new = [e for e in entries if stream_id(e[0]) > cursor]
            if not new:
                continue
            stream.buffer.extend(new)
            last = new[-1][0]
            stream.cursor = last.decode() if isinstance(last, bytes) else last
            for waiter in stream.waiters:
                if not waiter.done():
                    waiter.set_result(None)

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            try:
                await self._read_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not stop every relay: they time out of their waits and read again
                logger.exception("the output-stream reader failed; restarting it")
                self._covered = frozenset()
                await asyncio.sleep(self.retry_s)

    async def _read_once(self) -> None:
        stale = time.monotonic() - self.unused_s
        self.release([name for name, s in self._streams.items() if s.used < stale and not s.waiters])
        if not self._streams:
            self._wake.clear()
            await self._wake.wait()
        names = {name: s.cursor for name, s in self._streams.items()}
        self._covered = frozenset(names)
        try:
            self.loop_reads += 1
            reply = await self.redis.xread(names, block=self.block_ms, count=self.count)
        except RedisError as exc:
            self._covered = frozenset()
            for stream in self._streams.values():
                for waiter in stream.waiters:
                    if not waiter.done():
                        waiter.set_exception(exc)
            logger.warning("reading the output streams failed (%s); retrying", exc)
            await asyncio.sleep(self.retry_s)
            return
        self._advance(reply or [])
