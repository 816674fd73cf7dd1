"""The registry app against a real redis-server (tests/support/redis_server.py), in-process HTTP (ASGI)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import pytest_asyncio

from pdserve.services.registry.app import create_app
from pdserve.services.registry.settings import RegistrySettings
from pdserve.shared.protocol.registry import PodInfo
from pdserve.shared.registry_client import RegistryClient, RegistryError
from pdserve.shared.protocol import keys
from pdserve.shared.worker.heartbeat import Heartbeater

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


def pod(pod_id: str = "decode-0", role: str = "decode", **kw) -> PodInfo:
    base = dict(pod_id=pod_id, role=role, host="10.0.0.7", http_port=8003, kv_port=9000 if role == "decode" else 0,
                model="smollm2-135m-instruct", block_size=16, total_blocks=1000, free_blocks=900, num_running=3,
                num_waiting=1, queued_prefill_tokens=0, started_at=1_700_000_000.0)
    return PodInfo(**{**base, **kw})


class Registry:
    """One registry app on the test's Redis, reached over ASGI."""

    def __init__(self, redis_url: str, pod_ttl_s: float = 5.0) -> None:
        self.app = create_app(RegistrySettings(redis_url=redis_url, pod_ttl_s=pod_ttl_s))
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://registry")
        self.client = RegistryClient("http://registry", transport=httpx.ASGITransport(app=self.app))

    async def close(self) -> None:
        await self.http.aclose()
        await self.client.aclose()
        await self.app.state.store.redis.aclose()


@pytest_asyncio.fixture
async def registry(redis_url):
    r = Registry(redis_url)
    yield r
    await r.close()


async def until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


async def test_heartbeat_registers_the_pod_with_the_redis_clock(registry):
    before = time.time()
    stored = await registry.client.heartbeat(pod(last_heartbeat=1.0))
    assert stored == pod(last_heartbeat=stored.last_heartbeat)
    assert before - 1 < stored.last_heartbeat < time.time() + 1  # stamped by Redis, not by the pod
    assert await registry.client.list_pods("decode") == [stored]
    assert await registry.client.list_pods("prefill") == []
    assert await registry.client.get_pod("decode-0") == stored
    assert await registry.client.get_pod("nope") is None


async def test_list_filters_by_role_and_sorts_by_pod_id(registry):
    for p in [pod("decode-b"), pod("prefill-0", "prefill"), pod("decode-a")]:
        await registry.client.heartbeat(p)
    assert [p.pod_id for p in await registry.client.list_pods("decode")] == ["decode-a", "decode-b"]
    assert [p.pod_id for p in await registry.client.list_pods("prefill")] == ["prefill-0"]
    assert [p.pod_id for p in await registry.client.list_pods()] == ["decode-a", "decode-b", "prefill-0"]
    # a pod that changes role is listed under its new role only
    await registry.client.heartbeat(pod("decode-a", "prefill"))
    assert [p.pod_id for p in await registry.client.list_pods("decode")] == ["decode-b"]


async def test_a_silent_pod_drops_out_after_its_ttl(redis_url, redis_server):
    import redis
    r = Registry(redis_url, pod_ttl_s=0.3)
    try:
        await r.client.heartbeat(pod())
        assert len(await r.client.list_pods("decode")) == 1

        async def gone() -> bool:
            return await r.client.list_pods("decode") == []
        await until(gone)
        assert await r.client.get_pod("decode-0") is None
        sync = redis.Redis.from_url(redis_url)
        await until(lambda: asyncio.sleep(0, not sync.exists(keys.pod_key("decode-0"))))
        sync.close()
    finally:
        await r.close()


async def test_a_dead_decode_pods_own_request_stream_leaves_redis(redis_url):
    """The decode pod's local-prefill stream (with its consumer group and an entry nobody will read) lives
    10 x pod TTL past the last beat, then is gone; a prefill pod's beat leaves other keys alone."""
    import redis

    from pdserve.shared.protocol import keys
    r = Registry(redis_url, pod_ttl_s=0.1)
    sync = redis.Redis.from_url(redis_url)
    stream = keys.decode_stream("decode-0")
    try:
        sync.xgroup_create(stream, keys.DECODE_GROUP, id="0", mkstream=True)
        sync.xadd(stream, {"data": b"x"})
        sync.xadd(keys.decode_stream("prefill-0"), {"data": b"x"})
        await r.client.heartbeat(pod())
        await r.client.heartbeat(pod("prefill-0", "prefill"))
        assert 500 < sync.pttl(stream) <= 1000
        assert sync.pttl(keys.decode_stream("prefill-0")) == -1  # not a decode pod: untouched
        await until(lambda: asyncio.sleep(0, not sync.exists(stream)), timeout_s=10)
    finally:
        sync.delete(keys.decode_stream("prefill-0"))
        sync.close()
        await r.close()


async def test_deregister_removes_at_once_and_then_404s(registry):
    await registry.client.heartbeat(pod())
    assert await registry.client.deregister("decode-0") is True
    assert await registry.client.list_pods("decode") == []
    assert await registry.client.deregister("decode-0") is False
    r = await registry.http.delete("/v1/pods/decode-0")
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "no pod 'decode-0' is registered", "type": "not_found_error",
                                  "param": "pod_id", "code": None}}


async def test_bad_input_gets_a_400_naming_the_parameter(registry):
    r = await registry.http.post("/v1/pods", json={**pod().model_dump(mode="json"), "http_port": 0})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "http_port" and r.json()["error"]["type"] == "invalid_request_error"
    r = await registry.http.post("/v1/pods", json={**pod().model_dump(mode="json"), "pod_id": "../etc"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "pod_id"
    r = await registry.http.get("/v1/pods", params={"role": "router"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "role"
    assert (await registry.http.get("/health")).json() == {"status": "ok"}


async def test_redis_outage_shows_in_health_and_errors_then_recovers(registry, redis_server):
    await registry.client.heartbeat(pod())
    redis_server.stop()
    r = await registry.http.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "unavailable" and r.json()["reason"].startswith("redis: ")
    r = await registry.http.get("/v1/pods")
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "redis_unavailable"
    with pytest.raises(RegistryError) as info:
        await registry.client.list_pods("decode")
    assert info.value.status == 503
    redis_server.start()  # same port, no persistence: pods come back with their next heartbeat
    assert (await registry.http.get("/health")).status_code == 200
    await registry.client.heartbeat(pod())
    assert [p.pod_id for p in await registry.client.list_pods("decode")] == ["decode-0"]


async def test_metrics_count_alive_pods_and_heartbeats(registry):
    await registry.client.heartbeat(pod("d0"))
    await registry.client.heartbeat(pod("d0"))
    await registry.client.heartbeat(pod("p0", "prefill", free_blocks=10))
    text = (await registry.http.get("/metrics")).text
    assert 'pdserve:registry_pods{role="decode"} 1.0' in text
    assert 'pdserve:registry_pods{role="prefill"} 1.0' in text
    assert 'pdserve:registry_heartbeats_total{role="decode"} 2.0' in text
    assert 'pdserve:registry_free_blocks{role="prefill"} 10.0' in text


async def test_client_raises_registry_error_when_unreachable():
    from support.redis_server import free_port
    client = RegistryClient(f"http://127.0.0.1:{free_port()}", timeout_s=1)
    with pytest.raises(RegistryError, match="unreachable"):
        await client.list_pods("decode")
    assert await client.health() is False
    await client.aclose()


async def test_heartbeater_keeps_the_pod_registered_and_deregisters_on_stop(registry):
    load = {"free": 500}
    beater = Heartbeater(registry.client, lambda: pod(free_blocks=load["free"]), interval_s=0.05)
    beater.start()

    async def registered_with(free: int):
        async def check() -> bool:
            p = await registry.client.get_pod("decode-0")
            return p is not None and p.free_blocks == free
        return check
    await until(await registered_with(500))
    load["free"] = 123  # the next beat reports the new load
    await until(await registered_with(123))
    await beater.stop()
    assert await registry.client.get_pod("decode-0") is None
    assert beater.beats >= 2 and beater.failures == 0


async def test_heartbeater_survives_a_registry_outage(registry, redis_server):
    async def info() -> PodInfo:  # async info_fn is allowed too
        return pod()
    beater = Heartbeater(registry.client, info, interval_s=0.05, max_backoff_s=0.2)
    redis_server.stop()
    beater.start()

    async def failed() -> bool:
        return beater.failures >= 2
    await until(failed)
    assert beater.last_error.startswith("RegistryError: registry POST /v1/pods -> 503")
    redis_server.start()

    async def back() -> bool:
        return await registry.client.get_pod("decode-0") is not None
    await until(back)
    await beater.stop()
    assert beater.last_error is None
