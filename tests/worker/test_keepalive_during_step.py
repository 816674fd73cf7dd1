"""Keep-alives never wait for an engine step, and an abort reaches a request wherever it waits on a prefill pod.

A prefill worker against a real redis-server, its engine played by a stand-in whose step blocks until the test
lets it go (a long step: a cold first prefill, a big batch on a loaded CPU). Requests queued during that step
must be read and kept alive toward the router (before: the queue reader waited for the step inside the engine
call of the previous batch, and entries queued meanwhile stayed unread and silent for as long as the step
lasted); a request aborted while it waits for the engine is never added to it; one aborted while its hand-over
asked a full decode pod for blocks never joins the line for them."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from pdserve.shared.engine.stats import EngineStats
from pdserve.services.prefill.worker import PrefillSettings, PrefillWorker, RequestAborted
from pdserve.shared.protocol import keys
from pdserve.shared.protocol.messages import OutputEvent, PrefillRequest
from pdserve.shared.protocol.sampling_params import SamplingParams
from pdserve.shared.transport.frames import Reserve
from pdserve.shared.worker.engine_thread import EngineThread
from pdserve.shared.worker.keepalive import keepalive_loop


class BlockingEngine:
    """The engine calls a prefill worker makes; ``step`` blocks until ``release`` is set."""

    def __init__(self) -> None:
        self.added: list[str] = []
        self.in_step = threading.Event()
        self.release = threading.Event()

    def add_request(self, request_id, *args, **kwargs) -> None:
        self.added.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.added) and not self.release.is_set()

    def step(self) -> list:
        self.in_step.set()
        self.release.wait(30)
        return []

    def owns(self, request_id: str) -> bool:
        return False

    def abort_request(self, request_id: str) -> bool:
        return False

    def get_stats(self) -> EngineStats:
        return EngineStats(block_size=16)

    def take_exports(self) -> dict:
        return {}


def queued(rid: str) -> dict:
    return PrefillRequest(rid, "m", [1, 2, 3], SamplingParams(max_tokens=4), "decode-0", "127.0.0.1", 9,
                          arrival_time=time.time()).encode()


async def wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def keepalives(worker: PrefillWorker, rid: str) -> int:
    entries = await worker.redis.xrange(keys.output_stream(rid))
    return sum(OutputEvent.decode(fields).keepalive for _, fields in entries)


def run_blocked(redis_url: str, scenario):
    """``scenario(worker, engine)`` while request ``first`` holds the engine in a step that does not end."""
    async def main():
        worker = PrefillWorker(PrefillSettings(redis_url=redis_url, pod_id="prefill-0", output_keepalive_s=0.2))
        engine = BlockingEngine()
        worker.loop, worker.engine = asyncio.get_running_loop(), engine
        worker.engine_thread = EngineThread(engine, worker._on_outputs)
        worker.engine_thread.start()
        await worker._ensure_group()
        tasks = [asyncio.create_task(worker._consume()), asyncio.create_task(keepalive_loop(worker)),
                 asyncio.create_task(worker._abort_loop())]
        try:
            await worker.redis.xadd(keys.PREFILL_STREAM, queued("first"))
            await wait_for(engine.in_step.is_set)
            return await asyncio.wait_for(scenario(worker, engine), 20)
        finally:
            engine.release.set()
            for task in (*tasks, *worker.admissions):
                task.cancel()
            await asyncio.wait([*tasks, *worker.admissions], timeout=5)
            worker.engine_thread.stop()
            await worker.redis.aclose()
            await worker.registry.aclose()
    return asyncio.run(main())


def test_requests_queued_during_a_long_step_are_read_and_kept_alive_while_it_runs(redis_url):
    async def scenario(worker, engine):
        await worker.redis.xadd(keys.PREFILL_STREAM, queued("second"))  # its engine call waits for the step
        await wait_for(lambda: "second" in worker.requests)
        await worker.redis.xadd(keys.PREFILL_STREAM, queued("third"))  # queued behind that call
        await asyncio.sleep(1.0)  # five keep-alive intervals, all inside the step
        assert engine.in_step.is_set() and not engine.release.is_set()
        return {rid: await keepalives(worker, rid) for rid in ("first", "second", "third")}

    counts = run_blocked(redis_url, scenario)
    assert all(n >= 2 for n in counts.values()), counts


def test_a_request_aborted_while_it_waits_for_the_engine_is_never_added(redis_url):
    async def scenario(worker, engine):
        await worker.redis.xadd(keys.PREFILL_STREAM, queued("doomed"))
        await wait_for(lambda: "doomed" in worker.requests)  # read, its marker checked, its engine call queued
        await worker.redis.set(keys.aborted_key("doomed"), b"1")
        await worker.redis.publish(keys.ABORT_CHANNEL, "doomed")  # what the router's abort_requests does
        await wait_for(lambda: "doomed" not in worker.requests)
        engine.release.set()  # the step ends; the queued calls run
        await wait_for(lambda: not worker.admissions)
        pending = (await worker.redis.xpending(keys.PREFILL_STREAM, keys.PREFILL_GROUP))["pending"]
        return engine.added, pending

    added, pending = run_blocked(redis_url, scenario)
    assert added == ["first"]
    assert pending == 1  # only "first", still held; the aborted entry was acknowledged


def test_a_request_aborted_during_its_first_ask_for_blocks_never_joins_the_line(redis_url):
    async def scenario(worker, engine):
        req = PrefillRequest.decode(queued("late"))
        worker.inflight["late"] = ("0-1", req)
        asked = []

        async def reserve(msg):  # the decode pod is full; the router aborts while the answer is on its way
            asked.append(msg.request_id)
            await worker.abort("late")
            return SimpleNamespace(full=True, ok=False)

        client = SimpleNamespace(reserve=reserve)
        try:
            await asyncio.wait_for(worker.handover.reserve(client, req, Reserve("late", [1, 2, 3], 3, [], None)), 5)
        except RequestAborted:
            return asked, dict(worker.handover.waiting)
        raise AssertionError("the reservation did not end with RequestAborted")

    asked, waiting = run_blocked(redis_url, scenario)
    assert asked == ["late"] and waiting == {}
