"""Keep-alive events: a worker writes one to each request it holds that has been silent for
``output_keepalive_s``, none while its engine counts as stuck; the router's relay skips them (tests/chaos/
test_relay_exactly_once.py). Real redis-server; the worker is played by the few attributes the loop reads."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from redis.asyncio import Redis

from pdserve.shared.protocol import keys
from pdserve.shared.protocol.messages import OutputEvent
from pdserve.shared.worker.base import Worker
from pdserve.shared.worker.keepalive import keepalive_loop
from pdserve.shared.worker.output_writer import OutputWriter
from pdserve.shared.worker.tracked import Tracked


def test_silent_requests_get_keepalives_and_a_stuck_engine_sends_none(redis_url):
    async def scenario():
        redis = Redis.from_url(redis_url)
        now = time.time()
        worker = SimpleNamespace(settings=SimpleNamespace(output_keepalive_s=0.2), redis=redis,
                                 writer=OutputWriter(redis), stalled=None)
        worker.engine_stalled = lambda: worker.stalled
        worker.requests = {"quiet": Tracked(now - 60, admitted=now - 30, last=now - 10),  # silent for 10 s
                           "busy": Tracked(now - 60, admitted=now - 30, last=now + 60)}  # an event just now
        worker.silent_requests = lambda before: Worker.silent_requests(worker, before)
        task = asyncio.create_task(keepalive_loop(worker))
        await asyncio.sleep(0.75)
        worker.stalled = "engine made no progress for 300 s"
        await asyncio.sleep(0.1)
        sent = await redis.xlen(keys.output_stream("quiet"))
        await asyncio.sleep(0.5)
        assert await redis.xlen(keys.output_stream("quiet")) == sent  # nothing while stuck
        task.cancel()
        assert sent >= 2 and not await redis.exists(keys.output_stream("busy"))
        entries = await redis.xrange(keys.output_stream("quiet"))
        events = [OutputEvent.decode(fields) for _, fields in entries]
        assert all(e.keepalive and not e.finished and not e.token_ids for e in events)
        await redis.aclose()

    asyncio.run(scenario())
