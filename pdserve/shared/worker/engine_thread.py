"""Runs an ``LLMEngine`` on its own thread for an asyncio service.

The engine loop is synchronous and owns its thread (STYLE.md); asyncio code talks to it only through
``call`` (a function run on the engine thread between two steps, its result awaited as a future) and
receives every step's outputs through ``on_outputs`` (called on the engine thread; hand them over
with ``loop.call_soon_threadsafe``). The thread sleeps when there is no work and wakes on the next call.

Liveness never waits for the engine: ``stalled_s()`` says how long the loop has gone without finishing an
iteration (a step, or an idle wait of at most 0.5 s), read without a call into the thread, so a long
step on a loaded CPU is told from a stuck engine by a bound much longer than any step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class EngineThread:
    def __init__(self, engine, on_outputs: Callable[[list], None], name: str = "engine") -> None:
        self.engine = engine
        self.on_outputs = on_outputs
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.error: BaseException | None = None
        self.progress_at = time.monotonic()  # when the loop last finished an iteration (monotonic s)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._calls.put(None)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def stalled_s(self) -> float:
        """Seconds since the engine loop last finished a step or an idle wait (0.0 for a loop that runs)."""
        return max(0.0, time.monotonic() - self.progress_at)

    def call(self, fn: Callable[..., Any], *args, **kwargs) -> concurrent.futures.Future:
        """Run ``fn(*args, **kwargs)`` on the engine thread before its next step."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, args, kwargs, fut))
        return fut

    async def acall(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        return await asyncio.wrap_future(self.call(fn, *args, **kwargs))

    def _drain(self, block: bool) -> None:
        try:
            item = self._calls.get(timeout=0.5) if block else self._calls.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, args, kwargs, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # handed to the awaiting coroutine
                    fut.set_exception(exc)
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                busy = self.engine.has_unfinished_requests()
                self._drain(block=not busy)
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    if outputs:
                        self.on_outputs(outputs)
                self.progress_at = time.monotonic()
        except BaseException as exc:
            self.error = exc
            logger.exception("engine thread died")
            raise
        finally:
            # fail whatever is still queued so no caller waits forever
            while True:
                try:
                    item = self._calls.get_nowait()
                except queue.Empty:
                    break
                if item is not None and not item[3].done():
                    item[3].set_exception(RuntimeError("engine stopped"))
