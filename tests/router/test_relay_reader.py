"""The router's relay-stream reader (``RelayReader``) and the workers' batched writes (``OutputWriter``, ``publish``)
against a real redis-server: every relay gets exactly the tokens written, with one XADD per step and about one XREAD
per step for all requests together.

Workers are played by this test writing one engine step's events with ``publish``, the decode pod's own write path;
the oracles are the token sequences written and Redis's own count of the commands it served
(``INFO commandstats``)."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis

from pdserve.services.router.relay import ChoiceRoute, OutputRelay
from pdserve.services.router.relay_reader import RelayReader
from pdserve.shared.protocol import keys
from pdserve.shared.protocol.messages import OutputBatch, OutputEvent
from pdserve.shared.worker.events import publish
from pdserve.shared.worker.output_writer import OutputWriter


async def calls(redis: Redis) -> dict[str, int]:
    stats = await redis.info("commandstats")
    return {name.removeprefix("cmdstat_"): v["calls"] for name, v in stats.items()}


def test_relay_stream_key_is_hash_tagged_by_router():
    assert keys.relay_stream("abc") == "pdserve:{r-abc}:relay"


async def relay_burst(redis_url: str, router: str, n: int = 32, steps: int = 12, late: int = 4):
    """``n`` requests decoding together on one pod (``late`` of them join after the third step, as hand-overs do),
    each relayed by its own ``OutputRelay`` through one ``RelayReader``; -> (tokens per relay, commands served)."""
    redis = Redis.from_url(redis_url)
    reader = RelayReader(redis, router, block_ms=200)
    writer = OutputWriter(redis, pod_id="decode-0")
    rids = [f"{router}-{i}" for i in range(n)]
    for rid in rids:
        writer.route(rid, router)

    async def consume(rid: str) -> list[int]:
        got = []
        async for _, event in OutputRelay(redis, [ChoiceRoute(rid)], idle_timeout_s=30, reader=reader):
            got += event.token_ids
        return got

    async def decode() -> None:
        for step in range(steps + 3):
            events = []
            for i, rid in enumerate(rids):
                first = 3 if i < late else 0
                if first <= step < first + steps:
                    k = step - first
                    events.append(OutputEvent(rid, token_ids=[1000 * i + k], text=f"<{k}>", completion_tokens=k + 1,
                                              finish_reason="length" if k == steps - 1 else None))
            await publish(writer, redis, events)
            await asyncio.sleep(0.05)  # a decode step

    before = await calls(redis)
    results, _ = await asyncio.gather(asyncio.gather(*(consume(r) for r in rids)), decode())
    after = await calls(redis)
    assert reader._requests == {}, "a finished relay left its request subscribed"
    await reader.aclose()
    await redis.aclose()
    return results, {k: n for k in after if (n := after[k] - before.get(k, 0))}


def test_relays_get_every_token_once_from_one_xadd_per_step(redis_url):
    results, served = asyncio.run(relay_burst(redis_url, "burst"))
    assert results == [[1000 * i + k for k in range(12)] for i in range(32)]
    assert served["xadd"] == 15  # one per step, for all 32 requests
    assert "evalsha" not in served and "exists" not in served  # no per-token script, no abort check
    assert served.get("expire", 0) == 1  # the TTL once per stream, not per token
    assert served["xread"] <= 15 * 2 + 10, served["xread"]  # about one per step (plus idle wake-ups)
    assert "del" not in served  # no per-request stream to delete


def test_events_that_arrive_before_the_relay_reads_are_kept_for_it(redis_url):
    """The first token can beat the relay's first read (a fast prefill): it waits for its relay."""
    async def scenario():
        redis = Redis.from_url(redis_url)
        reader = RelayReader(redis, "early", block_ms=100)
        reader.start()
        writer = OutputWriter(redis)
        writer.route("e", "early")
        await publish(writer, redis, [OutputEvent("e", token_ids=[7], text="a", completion_tokens=1)])
        await asyncio.sleep(0.3)  # the reader has read it; no relay yet
        await publish(writer, redis, [OutputEvent("e", token_ids=[8], text="b", completion_tokens=2,
                                                  finish_reason="stop")])
        got = [e async for _, e in OutputRelay(redis, [ChoiceRoute("e")], 5, reader=reader)]
        await reader.aclose()
        await redis.aclose()
        return got

    got = asyncio.run(scenario())
    assert [(e.token_ids, e.text, e.finish_reason) for e in got] == [([7], "a", None), ([8], "b", "stop")]


def test_the_reader_trims_what_it_read(redis_url):
    async def scenario():
        redis = Redis.from_url(redis_url)
        reader = RelayReader(redis, "trim", block_ms=100, trim_every_s=0.1)
        writer = OutputWriter(redis)
        writer.route("t", "trim")
        for k in range(300):
            await publish(writer, redis, [OutputEvent("t", token_ids=[k], completion_tokens=k + 1,
                                                      finish_reason="length" if k == 299 else None)])
        got = [t async for _, e in OutputRelay(redis, [ChoiceRoute("t")], 5, reader=reader) for t in e.token_ids]
        await asyncio.sleep(0.5)
        left = await redis.xlen(keys.relay_stream("trim"))
        ttl = await redis.ttl(keys.relay_stream("trim"))
        await reader.aclose()
        await redis.aclose()
        return got, left, ttl

    got, left, ttl = asyncio.run(scenario())
    assert got == list(range(300))
    assert left < 300, left  # approximate trimming keeps at most a node's worth of read entries
    assert 0 < ttl <= keys.RELAY_TTL_S


def test_batch_codec_round_trips_every_event_field():
    from pdserve.shared.protocol.messages import TokenLogprob
    full = OutputEvent("r", 1, [5, 6], "xy", "stop", [TokenLogprob(5, -0.1, [(5, -0.1), (9, -2.0)]),
                                                     TokenLogprob(6, -0.2, [])], 7, 9,
                       {"message": "m", "type": "T", "code": 503}, "END", 12.5, 4, [None, [[1, -0.5, 1]]], False)
    bare = OutputEvent("s", keepalive=True)
    batch = OutputBatch.decode(OutputBatch([full, bare], "pod").encode())
    assert batch.pod_id == "pod" and batch.events == [full, bare]


def test_the_reader_raises_redis_errors_to_its_waiters_and_reads_on_after(redis_aof_server):
    """Redis away while relays wait: each wait ends in the connection error (the relay retries it as for its own
    read), and once Redis is back the same reader delivers what was written, from its cursor."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    async def scenario():
        redis = Redis.from_url(redis_aof_server.url)  # its own server: the test drops every other client
        admin = Redis.from_url(redis_aof_server.url)
        reader = RelayReader(redis, "outage", block_ms=200, retry_s=0.2)
        writer = OutputWriter(admin)
        writer.route("o", "outage")
        name = keys.output_stream("o")
        await publish(writer, admin, [OutputEvent("o", token_ids=[1], completion_tokens=1)])
        first = await reader.xread({name: "0-0"}, block=1000)
        waiting = asyncio.create_task(reader.xread({name: "0-1"}, block=5000))
        await asyncio.sleep(0.1)
        await admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        errors, later = [], []
        try:
            await waiting
        except (RedisConnectionError, OSError) as exc:
            errors.append(exc)
        await publish(writer, admin, [OutputEvent("o", token_ids=[2], completion_tokens=2)])
        for _ in range(20):
            try:
                later = await reader.xread({name: "0-1"}, block=300)
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
    assert [e.token_ids for _, e in first[0][1]] == [[1]]
    assert errors and isinstance(errors[0], RedisConnectionError), errors
    assert [e.token_ids for _, e in later[0][1]] == [[2]]
