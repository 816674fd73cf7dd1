"""The router's relay against a real redis-server: what a client receives when workers replay or die.

Workers are played by this test writing ``OutputEvent``s with the real ``OutputWriter`` (the workers' own
write path); the oracle is the exact token sequence an uninterrupted worker would have written.
"""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from pdserve.services.router.errors import OpenAIError
from pdserve.services.router.relay import ChoiceRoute, OutputRelay, accept
from pdserve.shared.protocol import keys
from pdserve.shared.protocol.messages import OutputEvent
from pdserve.shared.protocol.sampling_params import SamplingParams
from pdserve.shared.worker.output_writer import OutputWriter


def ev(rid: str, tokens: list[int], completion: int, finish: str | None = None, **kw) -> OutputEvent:
    return OutputEvent(request_id=rid, token_ids=tokens, text="".join(f"<{t}>" for t in tokens),
                       completion_tokens=completion, finish_reason=finish, prompt_tokens=5, **kw)


def test_accept_drops_a_replayed_first_token_and_continues_after_migration():
    route = ChoiceRoute("r", prompt_token_ids=[1, 2, 3, 4, 5])
    assert accept(route, ev("r", [10], 1)).token_ids == [10]
    assert accept(route, ev("r", [10], 1)) is None  # the reclaiming prefill worker's replay
    assert accept(route, ev("r", [11], 2)).completion_tokens == 2
    assert route.text_len == len("<10><11>")
    # migrated: the new request resumes with [10, 11] as its output, so it counts on from 2
    got = accept(route, ev("r~m1", [12], 3))
    assert (got.token_ids, got.completion_tokens, got.prompt_tokens) == ([12], 3, 5)
    assert accept(route, ev("r~m1", [12], 3)) is None  # its own reclaimed prefill's replay
    final = accept(route, ev("r~m1", [13], 4, "length"))
    assert (final.token_ids, final.completion_tokens, final.finish_reason) == ([13], 4, "length")
    assert route.token_ids == [10, 11, 12, 13] and route.text_len == len("<10><11><12><13>")


def test_accept_keeps_a_replayed_final_event_without_its_tokens():
    route = ChoiceRoute("r")
    accept(route, ev("r", [10], 1))
    final = accept(route, ev("r", [10], 1, "stop"))  # first token also finished it, replayed
    assert final is not None and final.finish_reason == "stop" and final.token_ids == [] and final.text == ""


def run(coro):
    return asyncio.run(coro)


def test_relay_replay_then_migration_gives_each_token_once(redis_url):
    async def scenario():
        redis = Redis.from_url(redis_url)
        writer = OutputWriter(redis)
        route = ChoiceRoute("req", "pod-a", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0))
        migrations = []

        async def migrate(index, r, reason):
            migrations.append(reason)
            r.request_id, r.pod_id = "req~m1", "pod-b"
            # the new pod resumes after the two tokens the client has
            assert (r.token_ids, r.text_len) == ([10, 11], len("<10><11>"))
            await writer.write(ev("req~m1", [12], 3))
            await writer.write(ev("req~m1", [13], 4))
            await writer.write(ev("req~m1", [14], 5, "length"))
            return True

        # a prefill worker emitted the first token and died; the reclaiming one emits it again; decode goes on
        # for one token and its pod dies (nothing more on this stream)
        for e in (ev("req", [10], 1), ev("req", [10], 1), ev("req", [11], 2)):
            await writer.write(e)
        got = [e async for _, e in OutputRelay(redis, [route], 30, stall_s=0.3, migrate=migrate, block_ms=100)]
        assert [t for e in got for t in e.token_ids] == [10, 11, 12, 13, 14]
        assert [e.completion_tokens for e in got] == [1, 2, 3, 4, 5]
        assert got[-1].finish_reason == "length"
        assert len(migrations) == 1 and migrations[0].startswith("no output")
        assert not await redis.exists(keys.output_stream("req~m1"))  # deleted once read
        await redis.aclose()

    run(scenario())


def test_relay_surfaces_a_worker_503_it_cannot_migrate(redis_url):
    async def scenario():
        redis = Redis.from_url(redis_url)
        writer = OutputWriter(redis)

        async def migrate(index, r, reason):
            raise OpenAIError(503, "No decode pod is available; retry later")

        await writer.write(OutputEvent("x", error={"message": "KV transfer failed", "type": "ServiceUnavailableError",
                                                   "code": 503}))
        with pytest.raises(OpenAIError) as info:
            async for _ in OutputRelay(redis, [ChoiceRoute("x", "p")], 30, stall_s=5, migrate=migrate):
                pass
        assert info.value.status == 503 and "No decode pod" in info.value.message
        await redis.aclose()

    run(scenario())


def test_relay_times_out_with_504_when_nothing_arrives(redis_url):
    async def scenario():
        redis = Redis.from_url(redis_url)
        with pytest.raises(OpenAIError) as info:
            async for _ in OutputRelay(redis, [ChoiceRoute("silent")], 0.5, block_ms=100):
                pass
        assert info.value.status == 504
        await redis.aclose()

    run(scenario())


def test_keepalive_events_hold_off_the_silence_bound_and_reach_no_client(redis_url):
    """A request waiting for decode KV blocks: its first token, then only keep-alive events for
    three times the relay's silence bound, then the rest. Nothing times out and the client gets exactly the tokens."""
    async def scenario():
        redis = Redis.from_url(redis_url)
        writer = OutputWriter(redis)

        async def worker():
            await writer.write(ev("w", [10], 1))
            for _ in range(15):  # 1.5 s of keep-alives against a 0.5 s silence bound
                await asyncio.sleep(0.1)
                await writer.write(OutputEvent("w", keepalive=True))
            await writer.write(ev("w", [11], 2))
            await writer.write(ev("w", [12], 3, "length"))

        task = asyncio.create_task(worker())
        got = [e async for _, e in OutputRelay(redis, [ChoiceRoute("w")], 0.5, block_ms=100)]
        await task
        assert [(e.token_ids, e.completion_tokens) for e in got] == [([10], 1), ([11], 2), ([12], 3)]
        assert got[-1].finish_reason == "length"
        await redis.aclose()

    run(scenario())


def test_relay_stream_replay_then_migration_gives_each_token_once(redis_url):
    """The same fault sequence on a router's relay stream (one ``OutputBatch`` per step, ``RelayReader``): a
    replayed first token, a dead decode pod, a migrated request that resumes, and a late event of the old request
    after the move -- the client gets each token once."""
    from pdserve.services.router.relay_reader import RelayReader
    from pdserve.shared.worker.events import publish

    async def scenario():
        redis = Redis.from_url(redis_url)
        reader = RelayReader(redis, "chaos-router", block_ms=100)
        writer = OutputWriter(redis, pod_id="decode-a")
        for rid in ("rs", "rs~m1"):
            writer.route(rid, "chaos-router")
        route = ChoiceRoute("rs", "pod-a", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0))

        async def migrate(index, r, reason):
            r.request_id, r.pod_id = "rs~m1", "pod-b"
            assert r.token_ids == [10, 11]
            await publish(writer, redis, [ev("rs", [12], 3), ev("rs~m1", [12], 3)])  # the old pod woke up
            await publish(writer, redis, [ev("rs~m1", [13], 4)])
            await publish(writer, redis, [ev("rs~m1", [13], 4)])  # a retried pipeline landed twice
            await publish(writer, redis, [ev("rs~m1", [14], 5, "length")])
            return True

        for step in ([ev("rs", [10], 1)], [ev("rs", [10], 1)], [ev("rs", [11], 2)]):
            await publish(writer, redis, step)
        got = [e async for _, e in OutputRelay(redis, [route], 30, stall_s=0.3, migrate=migrate, block_ms=100,
                                               reader=reader)]
        await reader.aclose()
        await redis.aclose()
        return got

    got = run(scenario())
    assert [t for e in got for t in e.token_ids] == [10, 11, 12, 13, 14]
    assert [e.completion_tokens for e in got] == [1, 2, 3, 4, 5] and got[-1].finish_reason == "length"
