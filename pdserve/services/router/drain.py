"""The router's graceful shutdown: SIGTERM drains, it does not cut.

On the first SIGTERM (or Ctrl-C) the router stops taking work: ``/health`` answers 503 ``draining`` (the
readiness probe fails, so a Service stops sending traffic) and every new request gets 503 with
``Retry-After`` (``DrainGate``), while the requests in flight keep streaming. When they are all done, or
when ``grace_s`` has passed, uvicorn shuts down; requests still running then end with an error chunk and
``data: [DONE]`` (a stream) or a 503 (a plain response), and their workers are told to abort them. A second
signal ends the grace period at once.

Kubernetes: ``terminationGracePeriodSeconds`` must exceed the ``preStop`` pause plus ``grace_s`` (the chart
derives it), or the kubelet's SIGKILL cuts the streams first.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Callable

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import OpenAIError

logger = logging.getLogger("pdserve.router")

# After the grace period, how long the streams still running get to send their error chunk (each notices
# within one output read, at most a second).
FAREWELL_S = 5.0


class Drain:
    """The router's shutdown state. ``active()``: requests in flight; ``expired`` is set when the rest must end."""

    def __init__(self, grace_s: float, retry_after_s: int, active: Callable[[], int] = lambda: 0) -> None:
        self.grace_s = grace_s
        self.retry_after_s = retry_after_s
        self.active = active
        self.draining = False
        self.expired = asyncio.Event()

    def error(self) -> OpenAIError:
        """What a request cut by the shutdown gets."""
        return OpenAIError(503, "The server is shutting down; retry the request",
                           headers={"Retry-After": str(max(self.retry_after_s, 1))})

    async def run(self) -> None:
        """Drain: returns once no request is in flight, or the grace period and the farewell are over."""
        self.draining = True
        logger.warning("shutting down: %d requests in flight get up to %g s to finish; new requests get 503",
                       self.active(), self.grace_s)
        deadline = time.monotonic() + self.grace_s
        while self.active() and time.monotonic() < deadline and not self.expired.is_set():
            await asyncio.sleep(0.1)
        if not self.active():
            logger.info("every request in flight finished")
            return
        logger.warning("shutting down: ending %d requests still in flight with an error", self.active())
        self.expired.set()
        deadline = time.monotonic() + FAREWELL_S
        while self.active() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


class DrainGate:
    """ASGI middleware: while draining, ``/health`` says so (503) and every other request but ``/metrics`` and
    ``/version`` gets 503 with ``Retry-After`` and an OpenAI error body."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not self.drain.draining or path in ("/metrics", "/version"):
            await self.app(scope, receive, send)
            return
        if path == "/health":
            body, headers = {"status": "draining"}, []
        else:
            exc = self.drain.error()
            body, headers = exc.body(), [(b"retry-after", exc.headers["Retry-After"].encode())]
        raw = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                                (b"connection", b"close"), *headers]})
        await send({"type": "http.response.body", "body": raw})


class DrainingServer(uvicorn.Server):
    """uvicorn whose first SIGTERM/SIGINT drains the app (``Drain.run``) before the usual shutdown; a second
    signal cuts the grace period short."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        self._draining = False

    def handle_exit(self, sig: int, frame: object) -> None:  # a signal handler: runs on the loop's thread
        loop = asyncio.get_running_loop()
        if self._draining:
            loop.call_soon_threadsafe(self.drain.expired.set)
            return
        self._draining = True

        async def drain_then_exit() -> None:
            try:
                await self.drain.run()
            finally:
                super(DrainingServer, self).handle_exit(sig, frame)

        self._task = None
        loop.call_soon_threadsafe(lambda: setattr(self, "_task", loop.create_task(drain_then_exit())))

