"""The planner process: the planning loop on its own thread, and GET /health and /metrics over HTTP."""

from __future__ import annotations

import logging
import threading
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from .planner import Planner

logger = logging.getLogger(__name__)


class PlannerLoop:
    """Runs ``planner.run_once`` every ``interval_s`` until stopped; remembers how the last round went."""

    def __init__(self, planner: Planner, interval_s: float, health_grace_s: float | None = None) -> None:
        self.planner = planner
        self.interval_s = interval_s
        # How long without a successful round before /health says 503 (default: three intervals + 30 s).
        self.health_grace_s = health_grace_s if health_grace_s is not None else 3 * interval_s + 30
        self.started_at = time.monotonic()
        self.last_success: float | None = None
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="planner-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.planner.run_once()
                self.last_success, self.last_error = time.monotonic(), None
            except Exception as exc:  # a bad round must not end the loop
                self.last_error = f"{type(exc).__name__}: {exc}"
                logger.exception("planning round failed")
            self._stop.wait(self.interval_s)

    def health(self) -> tuple[bool, str]:
        """Healthy while the loop runs and a round succeeded within the last few intervals."""
        if not self._thread.is_alive():
            return False, "planning loop is not running"
        grace = self.health_grace_s
        last = self.last_success if self.last_success is not None else self.started_at
        if time.monotonic() - last > grace:
            return False, f"no successful round for {time.monotonic() - last:.0f}s: {self.last_error or 'running'}"
        return True, "ok"


def create_app(loop: PlannerLoop) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loop.start()
        try:
            yield
        finally:
            loop.stop()

    app = FastAPI(title="pdserve planner", lifespan=lifespan)

    @app.get("/health")
    def health() -> JSONResponse:
        ok, reason = loop.health()
        return JSONResponse({"status": "ok"} if ok else {"status": "error", "reason": reason},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(loop.planner.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
