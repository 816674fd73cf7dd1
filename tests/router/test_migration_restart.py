"""A decode pod restarted under the same id (a container restart keeps the pod name in Kubernetes) lost the
requests it held: the router must tell the new incarnation from the old one by ``started_at`` — in the
registry's listing and on the pod's ``/health`` — and migrate, instead of waiting for output that never comes.
Real registry and Redis (tests/router/conftest.py); the pod's /health is a real HTTP server."""

from __future__ import annotations

import asyncio
import socket
import types

import httpx
from fastapi import FastAPI
from redis.asyncio import Redis
from router_harness import ThreadServer

from pdserve.services.router import pod_probe
from pdserve.services.router.dispatch import DispatchConfig, Dispatcher
from pdserve.services.router.errors import OpenAIError
from pdserve.services.router.migration import Migrator
from pdserve.services.router.relay import ChoiceRoute
from pdserve.shared.registry_client import RegistryClient
from pdserve.shared.protocol.sampling_params import SamplingParams


def health_server(started_at: float) -> ThreadServer:
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok", "pod_id": "decode-0", "started_at": started_at}

    return ThreadServer.start(app)


def check(redis_url: str, registry_url: str, route: ChoiceRoute, sent: list | None = None) -> bool:
    """``migrator.pod_alive(route)``; with ``sent``, through one shared probe client (the router's) that records
    each request it sends."""
    async def scenario() -> bool:
        redis = Redis.from_url(redis_url)
        registry = RegistryClient(registry_url)
        http = None
        if sent is not None:
            async def record(request: httpx.Request) -> None:
                sent.append(str(request.url))
            http = httpx.AsyncClient(event_hooks={"request": [record]})
        try:
            job = types.SimpleNamespace(request_ids=[route.request_id], pods=[route.pod_id])
            migrator = Migrator(redis, Dispatcher(redis, registry, DispatchConfig(cache_s=0.0)), job, 3, 1.0,
                                http=http)
            return await migrator.pod_alive(route)
        finally:
            if http is not None:
                await http.aclose()
            await registry.aclose()
            await redis.aclose()
    return asyncio.run(scenario())


def route(**kw) -> ChoiceRoute:
    return ChoiceRoute("cmpl-1", "decode-0", [1, 2, 3], SamplingParams(max_tokens=8), pod_started_at=100.0, **kw)


def test_a_listed_pod_is_alive_only_in_the_incarnation_that_got_the_request(redis_url, registry_url, pods,
                                                                             redis_client):
    pods.add("decode-0", started_at=100.0)
    assert check(redis_url, registry_url, route()) is True
    pods.add("decode-0", started_at=250.0)  # the same pod id, restarted
    assert check(redis_url, registry_url, route()) is False


def test_an_unlisted_pod_answering_health_is_alive_only_in_the_same_incarnation(redis_url, registry_url,
                                                                                redis_client):
    for started_at, alive in ((100.0, True), (250.0, False)):
        server = health_server(started_at)
        try:
            assert check(redis_url, registry_url, route(pod_health_url=server.url + "/health")) is alive
        finally:
            server.stop()


def test_the_health_probe_goes_through_the_routers_shared_client(redis_url, registry_url, redis_client):
    """A probe made per check costs a client (CA bundle loaded: ~58 ms of CPU) on the router's event loop; the
    router hands its one client to every Migrator (pdserve/services/router/pod_probe.py)."""
    server = health_server(100.0)
    sent: list[str] = []
    try:
        assert check(redis_url, registry_url, route(pod_health_url=server.url + "/health"), sent) is True
    finally:
        server.stop()
    assert sent == [server.url + "/health"]


def move(redis_url: str, registry_url: str, route: ChoiceRoute):
    """``migrator(0, route, "no output ...")`` with no decode pod in the registry: False (keep waiting) or the
    OpenAIError it raises."""
    async def scenario():
        redis = Redis.from_url(redis_url)
        registry = RegistryClient(registry_url)
        try:
            job = types.SimpleNamespace(request_ids=[route.request_id], pods=[route.pod_id])
            migrator = Migrator(redis, Dispatcher(redis, registry, DispatchConfig(cache_s=0.0)), job, 3, 1.0)
            return await migrator(0, route, "no output for 3.0 s")
        except OpenAIError as exc:
            return exc
        finally:
            await registry.aclose()
            await redis.aclose()
    return asyncio.run(scenario())


def test_the_only_decode_pod_stopped_is_waited_for_and_a_gone_one_gets_503(redis_url, registry_url, redis_client,
                                                                             monkeypatch):
    """A SIGSTOPped pod's port still takes connections (the kernel queues them) and answers nothing; a killed pod's
    port refuses them. With no other decode pod, a request on the stopped one waits for it (as for a pod that
    restarts), one on the gone one fails with the usual 503."""
    monkeypatch.setattr(pod_probe, "PROBE_TIMEOUT_S", 0.5)
    with socket.socket() as stopped, socket.socket() as gone:
        stopped.bind(("127.0.0.1", 0))
        stopped.listen(8)  # never accepted: a stopped process's listening socket
        gone.bind(("127.0.0.1", 0))  # bound, not listening: connection refused
        waiting = route(pod_health_url=f"http://127.0.0.1:{stopped.getsockname()[1]}/health")
        assert move(redis_url, registry_url, waiting) is False
        assert waiting.pod_stopped and waiting.migrations == 0 and waiting.request_id == "cmpl-1"
        failed = move(redis_url, registry_url, route(pod_health_url=f"http://127.0.0.1:{gone.getsockname()[1]}/health"))
    assert isinstance(failed, OpenAIError) and (failed.status, failed.message) == (
        503, "No decode pod is available; retry later")
