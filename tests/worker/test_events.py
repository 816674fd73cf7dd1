"""Worker output publishing against a real redis-server: events land on their request's stream, a
final event arms the stream's TTL, and an aborted request's stream is never recreated."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from pdserve.shared.protocol import keys
from pdserve.shared.protocol.messages import OutputEvent, OutputWriter
from pdserve.shared.worker.events import publish


def test_publish_writes_events_and_skips_aborted(redis_url):
    async def scenario():
        r = aioredis.from_url(redis_url)
        writer = OutputWriter(r)
        await r.set(keys.aborted_key("gone"), 1)
        await publish(writer, r, [
            OutputEvent("a", token_ids=[1], text="x"),
            OutputEvent("a", token_ids=[2], text="y", finish_reason="stop", completion_tokens=2),
            OutputEvent("gone", token_ids=[3], text="z"),
        ])
        entries = await r.xrange(keys.output_stream("a"))
        ttl = await r.ttl(keys.output_stream("a"))
        exists = await r.exists(keys.output_stream("gone"))
        await r.aclose()
        return entries, ttl, exists

    entries, ttl, exists = asyncio.run(scenario())
    events = [OutputEvent.decode(fields) for _, fields in entries]
    assert [e.text for e in events] == ["x", "y"]
    assert events[-1].finish_reason == "stop" and events[-1].completion_tokens == 2
    assert 0 < ttl <= keys.OUTPUT_TTL_S
    assert exists == 0
