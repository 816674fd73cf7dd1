"""The cause the router logs for a request whose queue entry vanished and whose decode pod does not hold it
(``PrefillWatch.check``): after a decode pod's death it must point at the pod, not at Redis; a missing
consumer group or a Redis restarted since the request was queued point at Redis. Real redis-server; the decode
pod's ``GET /v1/requests/{id}`` answer (``{"held": false}``) is served by an httpx transport."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import httpx
import pytest
import redis.asyncio as aioredis

from pdserve.services.router.errors import OpenAIError
from pdserve.services.router.prefill_watch import PrefillWatch
from pdserve.shared.protocol import keys
from support.redis_server import RedisServer

pytestmark = pytest.mark.slow  # starts redis-server


def not_held(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"held": False})


def route(queued_s_ago: float) -> SimpleNamespace:
    return SimpleNamespace(queue_stream=keys.PREFILL_STREAM, queue_entry="1-0", request_id="req-1",
                           pod_id="decode-3", pod_health_url="http://decode-3.invalid:1/health", vanished=False,
                           queued_at=time.monotonic() - queued_s_ago)


async def reason(url: str, r: SimpleNamespace, make_group: bool) -> str | None:
    client = aioredis.Redis.from_url(url)
    try:
        if make_group:  # the queue as a live ensemble has it: its group exists, the entry was taken and deleted
            await client.xgroup_create(keys.PREFILL_STREAM, keys.PREFILL_GROUP, id="0", mkstream=True)
        async with httpx.AsyncClient(transport=httpx.MockTransport(not_held)) as http:
            watch = PrefillWatch(client, dispatcher=None, stall_s=30, http=http)
            first = await watch.check(r)  # it must say so twice
            assert first is None
            return await watch.check(r)
    finally:
        await client.aclose()


def test_a_vanished_request_with_its_queue_intact_names_the_decode_pod_not_redis():
    with RedisServer() as server:
        got = asyncio.run(reason(server.url, route(0), make_group=True))
    assert got is not None and got.startswith("its queue entry and its state vanished"), got
    assert "decode pod decode-3" in got and "died or restarted" in got, got


def test_a_missing_consumer_group_names_redis_data_loss():
    with RedisServer() as server:
        got = asyncio.run(reason(server.url, route(0), make_group=False))
    assert got is not None and "consumer group was gone too: Redis lost its data" in got, got


def test_a_redis_restarted_since_the_request_was_queued_is_named():
    with RedisServer() as server:  # just started: up less than the request has been queued
        got = asyncio.run(reason(server.url, route(120), make_group=True))
    assert got is not None and "Redis restarted" in got and "after it was queued" in got, got


class NoPrefillPods:
    """The dispatcher as the watch sees it when the registry lists no prefill pod (all stopped or gone)."""

    fallback_max_tokens = 256

    async def pods(self, role: str) -> list:
        return []


async def queued_verdicts(url: str) -> list:
    """The watch's answer for requests still waiting in the prefill queue (not delivered) with no prefill pod alive:
    a 40-token prompt, a 300-token one queued just now, the same queued ``stall_s`` ago."""
    client = aioredis.Redis.from_url(url)
    try:
        await client.xgroup_create(keys.PREFILL_STREAM, keys.PREFILL_GROUP, id="0", mkstream=True)
        entry = (await client.xadd(keys.PREFILL_STREAM, {"data": b"x"})).decode()
        watch = PrefillWatch(client, NoPrefillPods(), stall_s=30, retry_after_s=2)
        verdicts = []
        for tokens, queued_s_ago in ((40, 0), (300, 0), (300, 31)):
            r = route(queued_s_ago)
            r.queue_entry, r.prompt_token_ids, r.token_ids = entry, list(range(tokens - 1)), [5]
            try:
                verdicts.append(await watch.check(r))
            except OpenAIError as exc:
                verdicts.append((exc.status, exc.message, exc.headers))
        return verdicts
    finally:
        await client.aclose()


def test_with_no_prefill_pod_alive_a_queued_short_prompt_moves_to_local_prefill_and_a_long_one_waits_then_503():
    with RedisServer() as server:
        short, long_now, long_late = asyncio.run(queued_verdicts(server.url))
    assert short == "no prefill pod is alive: 40 tokens fit a decode pod's local prefill"
    assert long_now is None
    assert long_late == (503, "No prefill pod took the request within 30 s; retry later", {"Retry-After": "2"})
