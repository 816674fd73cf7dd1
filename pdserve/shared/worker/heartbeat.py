"""The task a worker runs to stay registered: a heartbeat to the registry every ``interval_s`` seconds."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable

from pdserve.shared.protocol.registry import PodInfo
from pdserve.shared.registry_client import RegistryAuthError, RegistryClient, RegistryError

log = logging.getLogger("pdserve.registry")


class Heartbeater:
    """Background task: ``client.heartbeat(info_fn())`` every ``interval_s`` seconds.

    ``info_fn`` may be sync or async. Failures are logged (once per outage, then at DEBUG) and
    retried with a backoff up to ``max_backoff_s``, except a :class:`RegistryAuthError` (wrong or
    missing token): no retry can fix that, so it is logged as an error, kept in ``refused`` and ends the
    task. ``stop()`` ends it and, with ``deregister_on_stop``, removes the pod at once rather than
    waiting for its TTL.
    """

    def __init__(self, client: RegistryClient, info_fn: Callable[[], PodInfo | Awaitable[PodInfo]],
                 interval_s: float = 1.0, *, deregister_on_stop: bool = True, max_backoff_s: float = 5.0) -> None:
        self.client = client
        self.info_fn = info_fn
        self.interval_s = interval_s
        self.deregister_on_stop = deregister_on_stop
        self.max_backoff_s = max(max_backoff_s, interval_s)
        self.beats = 0
        self.failures = 0
        self.last_error: str | None = None
        self.refused: RegistryAuthError | None = None
        self._pod_id: str | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Starts beating (first beat immediately); call from inside the running event loop."""
        if self._task is None:
            self._stop.clear()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="pdserve-heartbeat")

    async def beat(self) -> PodInfo:
        """One heartbeat now; raises what the client raises."""
        info = self.info_fn()
        if inspect.isawaitable(info):
            info = await info
        self._pod_id = info.pod_id
        stored = await self.client.heartbeat(info)
        self.beats += 1
        return stored

    async def _run(self) -> None:
        delay = self.interval_s
        while not self._stop.is_set():
            try:
                await self.beat()
                if self.last_error is not None:
                    log.info("registry heartbeat of %s recovered", self._pod_id)
                self.last_error, delay = None, self.interval_s
            except RegistryAuthError as e:
                self.failures += 1
                self.last_error = f"{type(e).__name__}: {e}"
                self.refused = e
                log.error("registry heartbeat of %s refused, not retrying (this pod stays unregistered): %s",
                          self._pod_id, e)
                return
            except Exception as e:
                self.failures += 1
                if self.last_error is None:
                    log.warning("registry heartbeat of %s failed (retrying): %s", self._pod_id, e)
                else:
                    log.debug("registry heartbeat of %s failed again: %s", self._pod_id, e)
                self.last_error = f"{type(e).__name__}: {e}"
                delay = min(max(delay * 2, self.interval_s), self.max_backoff_s)
            try:
                await asyncio.wait_for(self._stop.wait(), delay)
            except (asyncio.TimeoutError, TimeoutError):
                pass

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self.deregister_on_stop and self._pod_id is not None:
            try:
                await self.client.deregister(self._pod_id)
            except RegistryError as e:
                log.warning("could not deregister %s: %s", self._pod_id, e)
