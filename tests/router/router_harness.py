"""Helpers for the router tests (a uniquely named module: several test folders have a conftest.py)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from dataclasses import dataclass

import httpx
import uvicorn

from pdserve.services.router.app import create_app
from pdserve.services.router.prompts import PromptProcessor
from pdserve.services.router.server import server_config
from pdserve.services.router.settings import RouterSettings
from pdserve.shared.protocol.registry import PodInfo


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PromptServer(uvicorn.Server):
    """uvicorn's server, which stops as soon as ``ThreadServer.stop`` asks instead of at its next 0.1 s tick (a test
    run stops hundreds of servers). The loop is uvicorn's ``main_loop`` with the tick's sleep made wakeable."""

    wake: asyncio.Event | None = None
    loop: asyncio.AbstractEventLoop | None = None

    async def main_loop(self) -> None:
        self.wake, self.loop = asyncio.Event(), asyncio.get_running_loop()
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), 0.1)

    async def shutdown(self, sockets=None) -> None:
        """uvicorn's shutdown, less its fixed 0.1 s sleep when no connection is open (the sleep gives open
        connections time to act on their shutdown; a test's clients have closed theirs by now). With a connection
        open it is uvicorn's own, sleep included."""
        if self.server_state.connections:
            await super().shutdown(sockets)
            return
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        try:
            async with asyncio.timeout(self.config.timeout_graceful_shutdown):
                await self._wait_tasks_to_complete()
        except TimeoutError:
            for t in self.server_state.tasks:
                t.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")
        if not self.force_exit:
            await self.lifespan.shutdown()

    def exit_now(self) -> None:
        """Thread-safe: ``should_exit`` first, so a loop that starts after this call sees it at its first tick."""
        self.should_exit = True
        if self.loop is not None and self.wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed already
                self.loop.call_soon_threadsafe(self.wake.set)


@dataclass
class ThreadServer:
    """An ASGI app under a real uvicorn on a free loopback port, in a thread of the test process."""

    url: str
    server: PromptServer
    thread: threading.Thread

    @classmethod
    def start(cls, app, config: uvicorn.Config | None = None) -> ThreadServer:
        """``config``: a ready ``uvicorn.Config`` for ``app`` (default: uvicorn's defaults)."""
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = PromptServer(config or uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
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
        self.server.exit_now()
        self.thread.join(15)


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


@dataclass
class RouterServer:
    url: str
    settings: RouterSettings
    pods: Pods
    http: ThreadServer

    def stop(self) -> None:
        self.http.stop()


def start_router(settings: RouterSettings, processor: PromptProcessor, pods: Pods) -> RouterServer:
    """The router (its real RegistryClient, Redis client and uvicorn, configured as ``pdserve router`` does) on
    a free loopback port."""
    app = create_app(settings, processor=processor)
    http = ThreadServer.start(app, server_config(app, settings, log_level="warning", timeout_graceful_shutdown=2))
    return RouterServer(http.url, settings, pods, http)
