"""The decode worker on its own, against a real redis-server and a recording stand-in for the engine: the
hand-over's receiving side (reserve, commit, the at-most-once rule), its local queue's bad entries, and what it
reports to the registry. The real engine behind it is covered end to end in tests/e2e."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import msgpack
import torch

from pdserve.services.decode.worker import DecodeReceiver, DecodeSettings, DecodeWorker
from pdserve.shared.protocol import keys
from pdserve.shared.protocol.messages import OutputEvent, PrefillRequest
from pdserve.shared.protocol.sampling_params import SamplingParams
from pdserve.shared.transport.frames import Commit, Reserve
from pdserve.shared.worker.tracked import Tracked


class RecordingEngine:
    """What the worker asks of the engine, recorded; ``reserve`` always has room."""

    kv_spec = SimpleNamespace(block_size=16, dtype=torch.float32, num_layers=2, num_kv_heads=1, head_dim=4)

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.reserved: dict = {}
        self.scheduler = SimpleNamespace(num_waiting=0)
        self.num_waiting = 0  # the facade's count of requests waiting for blocks (none here)

    def reserve(self, request_id, prompt_token_ids, cache_salt=None):
        self.calls.append(("reserve", request_id))
        self.reserved[request_id] = prompt_token_ids
        return len(prompt_token_ids), 0

    def commit(self, request_id, first_token_id, params, **kwargs):
        self.calls.append(("commit", request_id, first_token_id, params, kwargs))
        self.reserved.pop(request_id)

    def add_request(self, request_id, prompt_token_ids, params, **kwargs):
        self.calls.append(("add", request_id))


class InlineThread:
    """``EngineThread.acall`` run inline (the recording engine never blocks)."""

    alive = True

    def __init__(self) -> None:
        self.calls = 0  # engine-thread calls: each one waits for the running step to end

    async def acall(self, fn, *args, **kwargs):
        self.calls += 1
        return fn(*args, **kwargs)


def run(redis_url: str, scenario):
    async def main():
        worker = DecodeWorker(DecodeSettings(redis_url=redis_url, pod_id="decode-0", kv_port=9123))
        worker.engine, worker.engine_thread = RecordingEngine(), InlineThread()
        try:
            return await scenario(worker, DecodeReceiver(worker))
        finally:
            await worker.redis.aclose()
            await worker.registry.aclose()
    return asyncio.run(main())


def commit_of(rid: str, **kw) -> Commit:
    return Commit(rid, 42, SamplingParams(temperature=0.0, max_tokens=8, logprobs=2), [1, 2, 3], 100.0,
                  router_id="router-1", **kw)


def test_a_committed_request_is_tracked_and_joins_the_engine_with_typed_params_once(redis_url):
    async def scenario(w: DecodeWorker, rx: DecodeReceiver):
        reserved = await rx.reserve(Reserve("cmpl-1-0", [1, 2, 3], 3, [], None))
        before = time.time()
        committed = await rx.commit(commit_of("cmpl-1-0"))
        again = await rx.reserve(Reserve("cmpl-1-0", [1, 2, 3], 3, [], None))  # a reclaimed entry's second try
        return reserved, committed, again, before, w.requests["cmpl-1-0"], w.engine.calls

    reserved, committed, again, before, tracked, calls = run(redis_url, scenario)
    assert reserved.ok and committed.ok
    assert (again.ok, again.duplicate) == (False, True)
    assert calls[0] == ("reserve", "cmpl-1-0") and len(calls) == 2  # the duplicate never reached the engine
    _, rid, first, params, kwargs = calls[1]
    assert (rid, first, params, kwargs["arrival_time"]) == \
        ("cmpl-1-0", 42, SamplingParams(temperature=0.0, max_tokens=8, logprobs=2), 100.0)
    assert before <= tracked.committed <= time.time()
    assert tracked == Tracked(100.0, 2, committed=tracked.committed, router_id="router-1", sent_first=True)


def test_a_commit_for_an_aborted_request_is_refused_before_the_engine(redis_url):
    async def scenario(w: DecodeWorker, rx: DecodeReceiver):
        await rx.reserve(Reserve("cmpl-2-0", [1, 2, 3], 3, [], None))
        await w.redis.set(keys.aborted_key("cmpl-2-0"), 1)
        return await rx.commit(commit_of("cmpl-2-0")), dict(w.requests), w.engine.calls

    reply, tracked, calls = run(redis_url, scenario)
    assert (reply.ok, reply.error) == (False, "request was aborted")
    assert tracked == {} and [c[0] for c in calls] == ["reserve"]


def test_a_local_queue_entry_with_invalid_sampling_params_fails_with_a_400(redis_url):
    fields = PrefillRequest("cmpl-3-0", "m", [1, 2], SamplingParams(), "decode-0", "127.0.0.1", 9123, 0.0).encode()
    payload = msgpack.unpackb(fields["data"])
    payload["sampling_params"]["max_tokens"] = 0
    fields["data"] = msgpack.packb(payload)

    async def scenario(w: DecodeWorker, rx: DecodeReceiver):
        await w._admit(fields)
        return await w.redis.xrange(keys.output_stream("cmpl-3-0")), dict(w.requests), w.engine.calls

    out, tracked, calls = run(redis_url, scenario)
    ((_, event_fields),) = out
    error = OutputEvent.decode(event_fields).error
    assert (error["code"], error["type"]) == (400, "BadRequestError")
    assert error["message"].startswith("bad sampling_params: max_tokens must be"), error
    assert tracked == {} and calls == []


def test_the_registration_reports_the_kv_port_and_colocation(redis_url):
    async def scenario(w: DecodeWorker, rx: DecodeReceiver):
        w.http_port, w.colocated = 8003, True
        w.engine_thread = None  # stats as last reported: no engine checks
        return await w.pod_info()

    info = run(redis_url, scenario)
    assert (info.role, info.kv_port, info.colocated, info.queued_prefill_tokens) == ("decode", 9123, True, 0)


def test_local_queue_entries_that_arrive_together_reach_the_engine_in_one_call(redis_url):
    """A colocated pod admits every waiting entry of its local queue in one engine call (one step boundary), not one
    per entry (each call waits for a running step: 32 queued prompts took 32 steps to join the batch); aborted
    entries are skipped and every entry leaves the stream."""
    async def scenario(w: DecodeWorker, rx: DecodeReceiver):
        stream = keys.decode_stream("decode-0")
        for i in range(32):
            await w.redis.xadd(stream, PrefillRequest(f"cmpl-{i}-0", "m", [1, 2, 3], SamplingParams(), "decode-0",
                                                      "127.0.0.1", 9123, time.time()).encode())
        await w.redis.set(keys.aborted_key("cmpl-5-0"), 1)
        consumer = asyncio.create_task(w._consume_local())
        try:
            for _ in range(100):
                await asyncio.sleep(0.05)
                if len(w.engine.calls) == 31 and not await w.redis.xlen(stream):
                    break
        finally:
            consumer.cancel()
        return w.engine.calls, w.engine_thread.calls, set(w.requests), await w.redis.xlen(stream)

    calls, engine_calls, tracked, left = run(redis_url, scenario)
    assert [c[1] for c in calls] == [f"cmpl-{i}-0" for i in range(32) if i != 5]
    assert engine_calls == 1
    assert tracked == {f"cmpl-{i}-0" for i in range(32) if i != 5} and left == 0
