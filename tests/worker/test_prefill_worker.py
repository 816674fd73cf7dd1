"""The prefill worker on its own, against a real redis-server: without an engine, the queue paths that end before the
engine runs (a bad entry, a duplicate entry, Redis losing the consumer group) and what it reports to the registry;
with the real engine (slow), how a burst of queued prompts is batched. The other engine paths (chunked prefill, abort
between chunks) are in test_liveness.py; the hand-over in tests/e2e."""

from __future__ import annotations

import asyncio
import socket
import time

import msgpack
import pytest

from pdserve.services.prefill.worker import PrefillSettings, PrefillWorker
from pdserve.shared.protocol import keys
from pdserve.shared.protocol.messages import OutputEvent, PrefillRequest
from pdserve.shared.protocol.sampling_params import SamplingParams
from support.tiny_llama import make_tiny_llama


def request(rid: str, n_tokens: int = 3) -> PrefillRequest:
    return PrefillRequest(rid, "m", list(range(1, n_tokens + 1)), SamplingParams(max_tokens=4), "decode-0",
                          "127.0.0.1", 9000, arrival_time=0.0)


def run(redis_url: str, scenario):
    """``scenario(worker)`` on a fresh prefill worker whose queue group exists; closes its clients after."""
    async def main():
        worker = PrefillWorker(PrefillSettings(redis_url=redis_url, pod_id="prefill-0"))
        try:
            await worker._ensure_group()
            return await scenario(worker)
        finally:
            await worker.redis.aclose()
            await worker.registry.aclose()
    return asyncio.run(main())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def deliver(worker: PrefillWorker) -> list[tuple[bytes, dict]]:
    reply = await worker.redis.xreadgroup(keys.PREFILL_GROUP, "prefill-0", {keys.PREFILL_STREAM: ">"}, count=10)
    return [m for _, messages in reply for m in messages]


def test_an_entry_with_invalid_sampling_params_fails_its_request_with_a_400_and_leaves_the_queue(redis_url):
    fields = request("cmpl-1-0").encode()
    payload = msgpack.unpackb(fields["data"])
    payload["sampling_params"]["top_p"] = 2.0
    fields["data"] = msgpack.packb(payload)

    async def scenario(w: PrefillWorker):
        await w.redis.xadd(keys.PREFILL_STREAM, fields)
        for msg_id, got in await deliver(w):
            await w._admit(msg_id, got)
        out = await w.redis.xrange(keys.output_stream("cmpl-1-0"))
        pending = await w.redis.xpending(keys.PREFILL_STREAM, keys.PREFILL_GROUP)
        return out, pending["pending"], await w.redis.xlen(keys.PREFILL_STREAM), dict(w.requests), dict(w.inflight)

    out, pending, queue_len, tracked, inflight = run(redis_url, scenario)
    ((_, event_fields),) = out
    event = OutputEvent.decode(event_fields)
    assert event.request_id == "cmpl-1-0"
    assert (event.error["code"], event.error["type"]) == (400, "BadRequestError")
    assert event.error["message"].startswith("bad sampling_params: top_p must be"), event.error
    assert (pending, queue_len, tracked, inflight) == (0, 0, {}, {})


def test_a_second_entry_for_a_request_running_here_is_acknowledged_and_dropped(redis_url):
    async def scenario(w: PrefillWorker):
        await w.redis.xadd(keys.PREFILL_STREAM, request("cmpl-2-0").encode())
        await w.redis.xadd(keys.PREFILL_STREAM, request("cmpl-2-0").encode())  # at-least-once: queued twice
        (first_id, _), (second_id, second) = await deliver(w)
        w.inflight["cmpl-2-0"] = (first_id, request("cmpl-2-0"))  # the first one is being prefilled here
        await w._admit(second_id, second)
        left = [msg_id for msg_id, _ in await w.redis.xrange(keys.PREFILL_STREAM)]
        pending = await w.redis.xpending_range(keys.PREFILL_STREAM, keys.PREFILL_GROUP, "-", "+", 10)
        out = await w.redis.exists(keys.output_stream("cmpl-2-0"))
        return first_id, left, [p["message_id"] for p in pending], out, w.inflight["cmpl-2-0"][0]

    first_id, left, pending, out, held = run(redis_url, scenario)
    assert left == [first_id] and pending == [first_id]  # only the duplicate is gone
    assert out == 0 and held == first_id  # no event: the first entry answers for the request


def test_after_redis_lost_its_data_an_ack_is_a_no_op_and_the_group_is_made_again_at_id_0(redis_url):
    async def scenario(w: PrefillWorker):
        await w.redis.xadd(keys.PREFILL_STREAM, request("cmpl-3-0").encode())
        ((held_id, _),) = await deliver(w)
        again_existing = await w._ensure_group()
        await w.redis.flushall()  # Redis restarted empty: the group and the entry are gone
        await w._ack(held_id, retry_s=1.0)  # NOGROUP: nothing to acknowledge, and no error
        await w.redis.xadd(keys.PREFILL_STREAM, request("cmpl-4-0").encode())  # a router queued meanwhile
        made = await w._ensure_group()
        delivered = [PrefillRequest.decode(f).request_id for _, f in await deliver(w)]
        return again_existing, made, delivered

    again_existing, made, delivered = run(redis_url, scenario)
    assert (again_existing, made) == (False, True)
    assert delivered == ["cmpl-4-0"]  # made at id 0: the entry queued before the group is delivered


def test_the_registration_reports_the_prompt_tokens_still_to_prefill_the_long_ones_and_no_kv_port(redis_url):
    async def scenario(w: PrefillWorker):
        w.http_port = 8002
        w.inflight = {"a": ("1-0", request("a", 3)), "b": ("2-0", request("b", 5)), "c": ("3-0", request("c", 300)),
                      "d": ("4-0", request("d", 700))}
        w.prefilled.add("d")  # its first token is out: it waits for its hand-over, the prefill tier is done with it
        return await w.pod_info()

    info = run(redis_url, scenario)
    assert (info.role, info.pod_id, info.queued_prefill_tokens, info.kv_port, info.colocated) == \
        ("prefill", "prefill-0", 308, 0, False)
    # c is over the default threshold of 256 tokens: it prefills in chunks while shorter prompts pass it
    assert (info.queued_long_prefill_tokens, info.long_prefill_token_threshold, info.prefill_tokens_per_s) == \
        (300, 256, 0.0)  # no engine ran here: nothing measured, routers use --prefill-tokens-per-s


@pytest.mark.slow
def test_prompts_that_arrive_together_are_prefilled_together_and_each_gets_its_own_first_token(
        redis_url, model_dir, tmp_path):
    """32 prompts of the benchmarks' lengths (16-256 tokens, 4,390 in all: ``pdserve bench ensemble-cpu``'s) queued
    at once reach the engine together and, with the prefill pod's default step budget, run together: peak batch >= 16
    in <= 4 steps (before: one entry admitted per step, peak 2; then the 512-token budget, peak 6 in 9 steps). Every
    entry is acknowledged, and each request's first token is the one the same engine samples for that prompt alone
    (batching mixes no rows). A random 2-layer Llama keeps the 4,390 prompt tokens (twice: batch and oracle) cheap;
    the budget, not the model, decides the batch."""
    from pdserve.loadtest.offline_throughput import make_workload
    from pdserve.shared.protocol.sampling_params import SamplingParams as SP

    n = 32
    prompts, _ = make_workload(n, 0, 49152)
    assert sum(map(len, prompts)) == 4390 and max(map(len, prompts)) <= 256
    settings = PrefillSettings(redis_url=redis_url, pod_id="prefill-batch", kv_cache_memory="32MiB",
                               model=make_tiny_llama(tmp_path, model_dir, max_position_embeddings=512),
                               max_model_len=512, enable_kv_events=False,
                               registry_url=f"http://127.0.0.1:{free_port()}")  # no registry: beats just fail

    async def main():
        worker = PrefillWorker(settings)
        worker.http_port = 8002
        for i, ids in enumerate(prompts):  # all queued before the worker reads its first entry
            req = PrefillRequest(f"cmpl-b{i}-0", "m", ids, SP(max_tokens=1, temperature=0.0), "decode-0",
                                 "127.0.0.1", 9, arrival_time=time.time())
            await worker.redis.xadd(keys.PREFILL_STREAM, req.encode())
        await worker.start()
        try:
            deadline = time.monotonic() + 300
            while await worker.redis.xlen(keys.PREFILL_STREAM) and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            stats = await worker.engine_thread.acall(worker.engine.get_stats)
            firsts = []
            for i in range(n):
                events = [OutputEvent.decode(f) for _, f in await worker.redis.xrange(keys.output_stream(f"cmpl-b{i}-0"))]
                firsts.append([t for e in events for t in e.token_ids])
            pending = (await worker.redis.xpending(keys.PREFILL_STREAM, keys.PREFILL_GROUP))["pending"]
            return worker, stats, firsts, pending
        finally:
            await worker.stop()

    worker, stats, firsts, pending = asyncio.run(main())
    assert pending == 0 and all(len(f) == 1 for f in firsts), (pending, firsts)
    assert stats.peak_num_running >= 16, stats
    assert stats.num_steps <= 4, stats
    engine = worker.engine  # its thread has stopped: the oracle runs each prompt alone on the same weights
    alone = []
    for i, ids in enumerate(prompts):
        engine.add_request(f"alone-{i}", ids, SP(max_tokens=1, temperature=0.0))
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        alone.append(outs[-1].outputs[0].token_ids)
    assert firsts == alone


@pytest.mark.slow
def test_queued_prompts_are_prefilled_shortest_remaining_first_aged_by_their_wait_in_redis(
        redis_url, model_dir, tmp_path):
    """The prefill queue's rule (``scheduling_policy`` srpt, A = 200 tok/s) on a real queue: entries XADDed in arrival
    order (FIFO would prefill them so) come out of the engine in the aged order computed here from their prompt
    lengths and the router's arrival times that travel in the entries: the old short prompt, the two short ones
    that arrived within (48 - 16) / A = 0.16 s after the long one, the long one, then the short one that arrived
    0.2 s after it and so may not overtake it (the starvation bound). One 16-token step budget and one sequence
    at a time make each step prefill exactly one request (or one chunk of the long one)."""
    from pdserve.shared.protocol.sampling_params import SamplingParams as SP

    t0 = time.time()
    queued = [("old", 16, t0 - 1.0), ("long", 48, t0), ("s1", 16, t0 + 0.1), ("s2", 16, t0 + 0.15),
              ("late", 16, t0 + 0.2)]
    aging = 200.0
    oracle = [rid for rid, n, at in sorted(queued, key=lambda q: q[1] - aging * (t0 + 10 - q[2]))]
    assert oracle == ["old", "s1", "s2", "long", "late"] and oracle != [q[0] for q in queued]
    settings = PrefillSettings(redis_url=redis_url, pod_id="prefill-srpt", kv_cache_memory="8MiB",
                               model=make_tiny_llama(tmp_path, model_dir, max_position_embeddings=128),
                               max_model_len=128, enable_kv_events=False, max_num_batched_tokens=16,
                               max_num_seqs=64, srpt_aging_tokens_per_s=aging,
                               registry_url=f"http://127.0.0.1:{free_port()}")
    order: list[str] = []

    async def main():
        worker = PrefillWorker(settings)
        worker.http_port = 8002
        handle = worker.handle_outputs

        async def record(outputs, exported):  # the order first tokens come out of the engine
            order.extend(o.request_id.removeprefix("cmpl-").removesuffix("-0") for o in outputs)
            await handle(outputs, exported)
        worker.handle_outputs = record
        for i, (rid, n, at) in enumerate(queued):  # distinct tokens: no prefix-cache hit shortens one
            req = PrefillRequest(f"cmpl-{rid}-0", "m", [1000 + 64 * i + k for k in range(n)],
                                 SP(max_tokens=2, temperature=0.0), "decode-0", "127.0.0.1", 9, arrival_time=at)
            await worker.redis.xadd(keys.PREFILL_STREAM, req.encode())
        await worker.start()
        try:
            deadline = time.monotonic() + 120
            while len(order) < len(queued) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
        finally:
            await worker.stop()

    asyncio.run(main())
    assert order == oracle
