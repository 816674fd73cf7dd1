"""The router's shared output-stream reader (``OutputStreams``) against a real redis-server: relays reading through it
get exactly what relays reading Redis themselves get, with a fraction of the XREADs.

Workers are played by this test writing ``OutputEvent``s with the real ``OutputWriter``, one engine step's events in
one pipeline as the decode pod writes them; the oracle is the token sequence written, and Redis's own count of the
XREAD commands it served (``INFO commandstats``)."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis

from pdserve.services.router.output_streams import OutputStreams, stream_id
from pdserve.services.router.relay import ChoiceRoute, OutputRelay
from pdserve.shared.protocol import keys
from pdserve.shared.protocol.messages import OutputEvent
from pdserve.shared.worker.output_writer import OutputWriter


async def xreads(redis: Redis) -> int:
    return (await redis.info("commandstats")).get("cmdstat_xread", {}).get("calls", 0)


async def relay_burst(redis_url: str, tag: str, shared: bool, n: int = 32, steps: int = 12, late: int = 4):
    """``n`` requests decoding together (``late`` of them join after the third step, as hand-overs do), each
    relayed by its own ``OutputRelay``; -> (tokens each relay yielded, XREADs Redis served, streams left)."""
    redis = Redis.from_url(redis_url)
    reader = OutputStreams(redis) if shared else None
    writer = OutputWriter(redis)
    rids = [f"{tag}-{i}" for i in range(n)]

    async def consume(rid: str) -> list[int]:
        got = []
        async for _, event in OutputRelay(redis, [ChoiceRoute(rid)], idle_timeout_s=30, reader=reader):
            got += event.token_ids
        return got

    async def decode() -> None:
        for step in range(steps + 3):
            async with redis.pipeline(transaction=False) as pipe:
                for i, rid in enumerate(rids):
                    first = 3 if i < late else 0  # the late ones start at step 3
                    if first <= step < first + steps:
                        k = step - first
                        await writer.write(OutputEvent(rid, token_ids=[1000 * i + k], text=f"<{k}>",
                                                       completion_tokens=k + 1,
                                                       finish_reason="length" if k == steps - 1 else None), client=pipe)
                await pipe.execute()
            await asyncio.sleep(0.05)  # a decode step

    before = await xreads(redis)
    results, _ = await asyncio.gather(asyncio.gather(*(consume(r) for r in rids)), decode())
    served = await xreads(redis) - before
    left = sum([await redis.exists(keys.output_stream(r)) for r in rids])
    if reader is not None:
        assert reader._streams == {}, "a finished relay left its stream subscribed"
        await reader.aclose()
    await redis.aclose()
    return results, served, left


def test_relays_through_the_shared_reader_get_every_token_once_with_a_fraction_of_the_xreads(redis_url):
    expected = [[1000 * i + k for k in range(12)] for i in range(32)]
    alone, alone_xreads, _ = asyncio.run(relay_burst(redis_url, "alone", shared=False))
    shared, shared_xreads, left = asyncio.run(relay_burst(redis_url, "shared", shared=True))
    assert alone == expected and shared == expected and left == 0
    # each relay reading for itself: about one XREAD per event (32 x 12 = 384); shared: about one per step
    assert alone_xreads >= 32 * 12 * 0.9, alone_xreads
    assert shared_xreads <= alone_xreads / 4, (shared_xreads, alone_xreads)


def test_the_shared_reader_raises_redis_errors_to_its_waiters_and_reads_again_after(redis_aof_server):
    """Redis away while relays wait: each wait ends in the connection error (the relay retries it as for its own
    read), and once Redis is back the same reader delivers the next event."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    async def scenario():
        redis = Redis.from_url(redis_aof_server.url)  # its own server: the test drops every other client
        admin = Redis.from_url(redis_aof_server.url)
        reader = OutputStreams(redis, block_ms=200, retry_s=0.2)
        name = keys.output_stream("outage")
        await admin.xadd(name, {"x": "1"})
        first = await reader.xread({name: "0-0"}, block=500)
        last = first[0][1][-1][0]
        await asyncio.sleep(0.3)  # the loop's XREAD covers the stream now: the next read waits on the loop
        waiting = asyncio.create_task(reader.xread({name: last}, block=5000))
        await asyncio.sleep(0.1)
        await admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        errors, later = [], []
        try:
            await waiting
        except (RedisConnectionError, OSError) as exc:
            errors.append(exc)
        await admin.xadd(name, {"x": "2"})
        for _ in range(20):  # as a relay does: read again after a connection error
            try:
                later = await reader.xread({name: last}, block=300)
            except (RedisConnectionError, OSError) as exc:
                errors.append(exc)
                continue
            if later:
                break
        await reader.aclose()
        await redis.aclose()
        await admin.aclose()
        return first, errors, later

    first, errors, later = asyncio.run(scenario())
    assert [f for _, f in first[0][1]] == [{b"x": b"1"}]
    assert errors and isinstance(errors[0], RedisConnectionError), errors
    assert [f for _, f in later[0][1]] == [{b"x": b"2"}]


def test_stream_ids_order_as_redis_orders_them():
    assert stream_id(b"1700000000000-10") > stream_id("1700000000000-9") > stream_id("0-0")
    assert stream_id("5") == (5, 0)
