"""Stand-in decode pods for the control-plane bench: N real ``DecodeWorker``s in one process, each on a
``StubEngine`` (``stub_engine.py``) instead of a model.

Each pod is the real worker: it registers and heartbeats through the registry (``Heartbeater``), takes requests
from its own Redis stream (``_consume_local``: the router sends a request there when no prefill pod is alive),
publishes every step's outputs through ``publish``/``OutputWriter`` on its routers' relay streams, listens for
aborts, reaps orphans, and sends its KV events to the registry (``KVEventPublisher``). Only the engine is a stub,
and the pods share one process and one event loop (a 2-core machine cannot give 128 pods a process each), so
their HTTP side is one small app for all of them on ``--port``: ``/health``, the router's
``/v1/requests/{id}`` probe, and ``/fleet/stats`` (steps, tokens and how late the stubs' steps ran since the last
call).

    python -m pdserve.loadtest.fleet --pods 8 --port 8100 --redis-url redis://127.0.0.1:6379/0 \\
        --registry-url http://127.0.0.1:8200 --step-ms 25
"""

from __future__ import annotations

import asyncio
import logging
import signal

import click
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from pdserve.loadtest.stub_engine import StubEngine
from pdserve.services.decode.settings import DecodeSettings
from pdserve.services.decode.worker import DecodeWorker


class StubDecodeWorker(DecodeWorker):
    """A ``DecodeWorker`` whose engine is a ``StubEngine`` stepping every ``step_s`` seconds."""

    def __init__(self, settings: DecodeSettings, step_s: float, max_num_seqs: int, stamp: bool = False) -> None:
        super().__init__(settings)
        self.step_s, self.max_num_seqs, self.stamp = step_s, max_num_seqs, stamp

    def build_engine(self) -> StubEngine:
        return StubEngine(self.step_s, self.max_num_seqs, self.settings.block_size,
                          enable_kv_events=self.settings.enable_kv_events, stamp=self.stamp)


class Fleet:
    """``pods`` stub decode workers started and stopped together, and their shared HTTP app."""

    def __init__(self, pods: int, port: int, step_s: float, max_num_seqs: int = 256, stamp: bool = False,
                 **settings: object) -> None:
        self.port = port
        self.workers = [StubDecodeWorker(DecodeSettings(pod_id=f"stub-{i}", kv_port=0, colocated=True, port=port,
                                                        **settings), step_s, max_num_seqs, stamp) for i in range(pods)]
        for w in self.workers:
            w.http_port = port

    async def start(self) -> None:
        await asyncio.gather(*(w.start() for w in self.workers))

    async def stop(self) -> None:
        await asyncio.gather(*(w.stop() for w in self.workers), return_exceptions=True)

    def stats(self) -> dict:
        """Steps and tokens so far, and the stubs' step lateness (ms) since the last call."""
        late = sorted(x for w in self.workers for x in w.engine.step_lateness)
        for w in self.workers:
            w.engine.step_lateness = []

        def q(p: float) -> float:
            return 1e3 * late[min(len(late) - 1, int(p * len(late)))] if late else 0.0

        return {"pods": len(self.workers), "steps": sum(w.engine.num_steps for w in self.workers),
                "tokens": sum(w.engine.generation_tokens for w in self.workers),
                "step_late_p50_ms": q(0.50), "step_late_p99_ms": q(0.99)}

    def create_app(self) -> FastAPI:
        app = FastAPI(title="pdserve stand-in decode pods", docs_url=None, redoc_url=None)

        @app.get("/health")
        async def health():
            ready = all(w.ready for w in self.workers)
            return JSONResponse({"status": "ok" if ready else "starting"}, status_code=200 if ready else 503)

        @app.get("/v1/requests/{request_id}")
        async def request_state(request_id: str):
            held = any(w.holds(request_id) for w in self.workers)
            return JSONResponse({"request_id": request_id, "held": held}, status_code=200 if held else 404)

        @app.get("/fleet/stats")
        async def stats():
            return self.stats()

        return app


async def serve(fleet: Fleet) -> None:
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(fleet.create_app(), host="127.0.0.1", port=fleet.port,
                                           log_level="warning", access_log=False, lifespan="off"))
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    serving = asyncio.create_task(server.serve())
    try:
        await fleet.start()
        await stop.wait()
    finally:
        server.should_exit = True
        await asyncio.gather(serving, return_exceptions=True)
        await fleet.stop()


@click.command()
@click.option("--pods", default=8, show_default=True)
@click.option("--port", required=True, type=int, help="The pods' shared HTTP port.")
@click.option("--redis-url", required=True)
@click.option("--registry-url", required=True)
@click.option("--registry-token", default=None)
@click.option("--model", default="smollm2-135m-instruct", show_default=True, help="The model the pods register.")
@click.option("--step-ms", default=25.0, show_default=True, help="The stubs' decode step interval.")
@click.option("--max-num-seqs", default=256, show_default=True, help="Batch cap per pod.")
@click.option("--heartbeat-s", default=1.0, show_default=True, help="Seconds between each pod's heartbeats.")
@click.option("--stamp", is_flag=True, help="Each token's text carries its step's wall-clock time (stub_engine.py).")
def main(pods, port, redis_url, registry_url, registry_token, model, step_ms, max_num_seqs, heartbeat_s,
         stamp) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    fleet = Fleet(pods, port, step_ms / 1e3, max_num_seqs, stamp, redis_url=redis_url, registry_url=registry_url,
                  registry_token=registry_token, model=model, heartbeat_interval_s=heartbeat_s, host="127.0.0.1", advertise_host="127.0.0.1")
    asyncio.run(serve(fleet))


if __name__ == "__main__":
    main()
