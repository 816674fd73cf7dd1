"""Reading the per-request output streams back, and aborting requests everywhere.

One ``XREAD BLOCK`` covers all choices of a request (their streams side by side), so n > 1 costs one
round trip per batch of events. Reading starts at id ``0``: events written before the router started
reading are not lost.
"""

from __future__ import annotations

import logging
import time
from typing import AsyncIterator

from redis.asyncio import Redis

from pdserve.shared.protocol import keys
from pdserve.shared.protocol.messages import MessageError, OutputEvent

from .errors import OpenAIError

logger = logging.getLogger(__name__)


async def read_outputs(redis: Redis, request_ids: list[str], idle_timeout_s: float,
                       block_ms: int = 1000) -> AsyncIterator[tuple[int, OutputEvent]]:
    """Yield ``(choice_index, event)`` until every request has sent its final event.

    Raises ``OpenAIError(504)`` when no event arrives for ``idle_timeout_s`` seconds, and ``OpenAIError(500)``
    for an entry that is not an ``OutputEvent``. Deletes each output stream once its final event is read.
    """
    streams = {keys.output_stream(rid): i for i, rid in enumerate(request_ids)}
    last_ids = {name: "0-0" for name in streams}
    last_event = time.monotonic()
    while last_ids:
        reply = await redis.xread(last_ids, block=block_ms, count=256)
        if not reply:
            if time.monotonic() - last_event > idle_timeout_s:
                raise OpenAIError(504, f"No output for {idle_timeout_s:g} s; the request was aborted")
            continue
        last_event = time.monotonic()
        for stream, entries in reply:
            name = stream.decode() if isinstance(stream, bytes) else stream
            if name not in last_ids:
                continue
            for entry_id, fields in entries:
                last_ids[name] = entry_id
                try:
                    event = OutputEvent.decode(fields)
                except MessageError as exc:
                    logger.error("bad output event on %s: %s", name, exc)
                    raise OpenAIError(500, "A worker sent an unreadable output event") from exc
                yield streams[name], event
                if event.finished:
                    del last_ids[name]
                    await redis.delete(name)
                    break


async def abort_requests(redis: Redis, request_ids: list[str]) -> None:
    """Tell every worker to drop these requests (pub/sub + a marker key for late readers); drop their output."""
    if not request_ids:
        return
    async with redis.pipeline(transaction=False) as pipe:
        for rid in request_ids:
            pipe.set(keys.aborted_key(rid), b"1", ex=keys.ABORTED_TTL_S)
            pipe.publish(keys.ABORT_CHANNEL, rid)
            pipe.delete(keys.output_stream(rid))
        await pipe.execute()
