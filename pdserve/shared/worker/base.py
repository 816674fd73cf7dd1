"""What prefill and decode workers share: the engine thread, Redis, the registry heartbeat, the HTTP
side (``/health``, ``/metrics``, ``/v1/stats``), aborts, and publishing outputs.

A worker is one asyncio process: uvicorn serves the HTTP app on the same loop as the worker's tasks;
the engine runs on its own thread (``EngineThread``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import os
import signal
import time
from collections import OrderedDict
from collections.abc import Callable

import torch
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from pdserve.shared import redis_client, tracing
from pdserve.shared.engine.llm_engine import LLMEngine
from pdserve.shared.engine.step_log import StepLog
from pdserve.shared.models.tensor_parallel import TPShard
from pdserve.shared.protocol import keys
from pdserve.shared.protocol.messages import OutputEvent
from pdserve.shared.protocol.registry import PodInfo
from pdserve.shared.registry_client import RegistryAuthError, RegistryClient
from pdserve.shared.transport.layout import KVLayout
from pdserve.shared.worker.engine_thread import EngineThread
from pdserve.shared.worker.events import UnpublishableOutput, error_event, publish, to_event
from pdserve.shared.worker.heartbeat import Heartbeater
from pdserve.shared.worker.keepalive import keepalive_loop
from pdserve.shared.worker.kv_publisher import KVEventPublisher
from pdserve.shared.engine.stats import EngineStats
from pdserve.shared.worker.metrics import WorkerMetrics
from pdserve.shared.worker.output_writer import OutputWriter
from pdserve.shared.worker.settings import WorkerSettings
from pdserve.shared.worker.step_spans import trace_steps
from pdserve.shared.worker.tracked import Tracked

logger = logging.getLogger(__name__)

ABORT_MEMORY = 4096  # aborted request ids a worker remembers (Worker.aborted)


def finish_attributes(out, event: OutputEvent) -> dict:
    """A finished request's span attributes (GenAI conventions): output tokens, finish reason, preemptions."""
    return {"gen_ai.usage.output_tokens": event.completion_tokens,
            "gen_ai.response.finish_reasons": [event.finish_reason or "error"],
            "pdserve.num_preemptions": (out.metrics or {}).get("num_preemptions", 0)}


def exit_on_rank_death(error: Exception) -> None:
    """A tensor-parallel rank died (called from the rank watchdog): no step can complete any more, so the pod exits
    now with the reason (Kubernetes restarts it; its requests migrate as when a decode pod dies) instead of hanging
    in a collective."""
    logger.critical("%s: exiting", error)
    logging.shutdown()
    os._exit(3)


class Worker:
    """A worker process's shared parts. A subclass sets ``role`` (``"prefill"``/``"decode"``), starts its own
    tasks in ``start_role`` and adds its registration fields in ``pod_fields``."""

    role: str

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.metrics = WorkerMetrics(self.role, settings.pod_id)
        self.engine: LLMEngine | None = None
        self.engine_thread: EngineThread | None = None
        # Every command retries connection errors with backoff (~6 s in all): a Redis restart costs a pause,
        # not a failed request; longer outages surface as errors the loops below retry on their own.
        self.redis = redis_client.connect(settings.redis_url, retries=6)
        self.writer = OutputWriter(self.redis, pod_id=settings.pod_id)
        self.registry = RegistryClient(settings.registry_url, token=settings.registry_token)
        self.heartbeater: Heartbeater | None = None
        self.kv_events: KVEventPublisher | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stats: EngineStats | None = None  # the last snapshot; None until the engine is built
        self.tasks: list[asyncio.Task] = []
        self.ready = False
        self.requests: dict[str, Tracked] = {}  # the requests this worker publishes output for
        # This process's incarnation: a pod restarted under the same id (a container restart in Kubernetes keeps
        # the pod name) lost its requests, and the router tells it from the old one by this
        self.started_at = time.time()
        self._outputs: asyncio.Queue = asyncio.Queue()
        # what a worker loop cannot do right now (loop name -> error), cleared when it succeeds again; /health
        # answers 503 with them, so an operator sees e.g. a lost consumer group while it lasts
        self.faults: dict[str, str] = {}
        self.unpublishable: set[str] = set()  # requests whose output could not become an event: to fail and abort
        # the last ABORT_MEMORY request ids aborted here (loop thread only): an abort that arrives while a request is
        # between its queue entry and the engine (its abort marker already checked) must still stop it there
        self.aborted: OrderedDict[str, None] = OrderedDict()
        # only a worker that owns its process (run_worker) freezes the heap: in a test process it would keep other
        # tests' garbage cycles forever
        self.freeze_gc_after_start = False
        # called once the engine is built, before anything is registered: ``serve`` switches SIGINT/SIGTERM from
        # "exit now" to a graceful stop there
        self.on_engine_built: Callable[[], None] = lambda: None

    # lifecycle
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        if self.settings.num_threads:  # process-wide: the engine thread's ops use it too
            torch.set_num_threads(self.settings.num_threads)
        self.engine = await asyncio.to_thread(self.build_engine)
        self.on_engine_built()
        if tracing.enabled():  # prefill chunks and preemptions become spans and events (step_spans.py)
            self.engine.step_log = StepLog()
        if self.freeze_gc_after_start:
            # What start-up built (torch, transformers, the model, the tokenizer) lives as long as the process: keep
            # it out of the collector's generations, as vLLM does after start-up. Full collections while serving
            # then skip it (shorter GC pauses inside steps), and so does the interpreter's final collection, which
            # took ~3 s of a worker's exit after SIGTERM.
            gc.collect()
            gc.freeze()
        if self.engine.tp is not None:
            self.engine.tp.on_death = exit_on_rank_death
        self.stats = self.engine.get_stats()
        self.engine_thread = EngineThread(self.engine, self._on_outputs, name=f"{self.role}-engine")
        self.engine_thread.start()
        if self.engine.config.enable_kv_events:
            self.kv_events = KVEventPublisher(self.registry.publish_kv_events, self.registry.publish_kv_snapshot,
                                              self.settings.pod_id, self._kv_snapshot)
            self.tasks.append(self.kv_events.start())
        await self.start_role()
        self.tasks += [asyncio.create_task(self._publish_loop()), asyncio.create_task(self._abort_loop()),
                       asyncio.create_task(keepalive_loop(self))]
        self.heartbeater = Heartbeater(self.registry, self.pod_info, self.settings.heartbeat_interval_s)
        try:
            await self.heartbeater.beat()  # routable before it reports healthy
        except RegistryAuthError:
            raise  # a wrong or missing registry token: exit now (crash-loop in Kubernetes), never serve unlisted
        except Exception as exc:  # the heartbeater keeps trying with backoff
            logger.warning("first registry heartbeat failed: %s", exc)
        self.heartbeater.start()
        self.ready = True
        logger.info("%s worker %s ready", self.role, self.settings.pod_id)

    def build_engine(self) -> LLMEngine:
        """The engine this worker serves (called on a thread at start); the control-plane bench's stand-in pods
        return a stub here (``pdserve/loadtest/stub_engine.py``)."""
        return LLMEngine(self.settings.engine_config())

    async def start_role(self) -> None:
        """Role-specific tasks (queue consumers, the KV-transfer server)."""

    async def stop(self) -> None:
        self.ready = False
        if self.heartbeater is not None:
            await self.heartbeater.stop()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.engine_thread is not None:
            await asyncio.to_thread(self.engine_thread.stop)
        if getattr(self.engine, "tp", None) is not None:
            await asyncio.to_thread(self.engine.tp.close)
        await self.registry.aclose()
        await self.redis.aclose()

    # engine
    def kv_layout(self) -> KVLayout:
        spec = self.engine.kv_spec
        workers = getattr(self.engine, "tp", None)  # rank 0's handle on the other ranks; None at TP=1
        tp = 1 if workers is None else workers.size
        ranges = tuple(TPShard(r, tp).kv_heads(spec.num_kv_heads) for r in range(tp)) if tp > 1 else ()
        return KVLayout(spec.block_size, str(spec.dtype).removeprefix("torch."), spec.num_layers, spec.num_kv_heads,
                        spec.head_dim, self.settings.model, tp, ranges)

    def _on_outputs(self, outputs) -> None:
        # engine thread: take a stats snapshot with the outputs, hand both to the loop
        stats = self.engine.get_stats()
        extra = self.on_outputs_engine_thread(outputs)
        self._drain_kv_events()
        log = getattr(self.engine, "step_log", None)
        steps = log.take() if log is not None else ()
        self.loop.call_soon_threadsafe(self._outputs.put_nowait, (outputs, stats, extra, steps))

    def _drain_kv_events(self) -> None:
        # engine thread; also called from the heartbeat, since reserve/commit/abort change the cache between steps
        if self.kv_events is not None:
            self.kv_events.record(self.engine.kv_events())

    def _stats_and_kv_events(self) -> EngineStats:
        self._drain_kv_events()
        return self.engine.get_stats()

    async def _kv_snapshot(self) -> tuple[int, list[bytes], dict[str, list[bytes]]]:
        def state() -> tuple[int, list[bytes], dict[str, list[bytes]]]:
            self._drain_kv_events()
            return self.kv_events.last_seq, self.engine.cached_block_hashes(), self.engine.offloaded_block_hashes()
        return await self.engine_thread.acall(state)

    def silent_requests(self, before: float) -> list[str]:
        """Requests held here with no output event since ``before`` (unix s): preempted or queued until KV blocks
        free up, or behind long steps. They get keep-alive events (``pdserve/shared/worker/keepalive.py``)."""
        return [rid for rid, info in self.requests.items()
                if (info.last or info.committed or info.admitted or info.arrival_time) < before]

    def on_outputs_engine_thread(self, outputs) -> object:
        """Hook for work that must happen on the engine thread right after a step."""
        return None

    async def _publish_loop(self) -> None:
        while True:
            outputs, stats, extra, steps = await self._outputs.get()
            self.stats = stats
            self.metrics.update_from_stats(stats)
            try:
                if steps:  # before the outputs: a request's last chunk ends its span's step there
                    trace_steps(self.requests, steps)
                await self.handle_outputs(outputs, extra)
            except Exception:
                logger.exception("handling outputs failed")

    async def handle_outputs(self, outputs, extra) -> None:
        await self.publish_outputs(outputs)

    async def publish_outputs(self, outputs) -> None:
        """Publish a step's events. A request whose output cannot become an event, or whose events could not be
        written, gets an error event (where Redis allows) and is aborted here: a client's stream ends with an
        error, never with tokens missing."""
        try:
            await publish(self.writer, self.redis, self.events_for(outputs))
        except Exception as exc:
            logger.exception("publishing outputs failed")
            await self._fail_outputs(outputs, exc)
        while self.unpublishable:
            await self.abort(self.unpublishable.pop())

    async def _fail_outputs(self, outputs, exc: Exception) -> None:
        """A step's events were lost (Redis gone past the retry window): those requests can never be complete,
        so each one gets an error event where possible and stops here -- never a stream that silently skips."""
        ids = {out.request_id for out in outputs}
        self.metrics.requests_failed.inc(len(ids))
        try:
            await publish(self.writer, self.redis, [
                error_event(rid, f"The worker could not publish this request's output: {type(exc).__name__}: {exc}",
                            500, "InternalServerError") for rid in ids], retry_s=5.0)
        except Exception as exc2:  # the router's gap check or its idle timeout reports these requests then
            logger.error("could not publish the error of %d requests: %s", len(ids), exc2)
        for rid in ids:
            try:
                await self.abort(rid)
            except Exception:
                logger.exception("aborting request %s failed", rid)

    def events_for(self, outputs) -> list[OutputEvent]:
        now = time.time()
        events = []
        for out in outputs:
            info = self.requests.get(out.request_id)
            if info is None:  # aborted meanwhile
                continue
            first = not info.sent_first
            try:
                event = to_event(out, info.num_logprobs, first)
            except UnpublishableOutput as exc:
                logger.error("request %s: output cannot be published (%s); failing the request", out.request_id, exc)
                self.metrics.requests_failed.inc()
                events.append(error_event(out.request_id, f"The worker could not publish this request's output: "
                                          f"{exc}", 500, "InternalServerError"))
                self.unpublishable.add(out.request_id)
                continue
            events.append(event)
            if first:
                self.metrics.ttft.observe(now - info.arrival_time)
                if info.admitted is not None:  # taken from a queue here: TTFT = queue wait + prefill
                    self.metrics.queue_time.observe(info.admitted - info.arrival_time)
                    self.metrics.prefill_time.observe(now - info.admitted)
                info.sent_first = True
            elif info.committed is not None:  # first step after a KV hand-over
                self.metrics.first_decode_step.observe(now - info.committed)
                tracing.event(info.span, "join_batch")
                info.committed = None
            elif info.last is not None:
                self.metrics.itl.observe(now - info.last)
            info.last = now
            if event.finished:
                self.metrics.e2e.observe(now - info.arrival_time)
                self.requests.pop(out.request_id, None)
                if info.span is not None:
                    tracing.end(info.span, finish_attributes(out, event))
        return events

    # aborts
    async def _abort_loop(self) -> None:
        """Listen for aborts; resubscribe with backoff when Redis goes away (aborts published meanwhile are
        still seen: ``is_aborted`` checks the marker key before work starts)."""
        delay = 0.1
        while True:
            pubsub = self.redis.pubsub()
            try:
                await pubsub.subscribe(keys.ABORT_CHANNEL)
                delay = 0.1
                async for message in pubsub.listen():
                    if message.get("type") != "message":
                        continue
                    data = message["data"]
                    await self.abort(data.decode() if isinstance(data, bytes) else data)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # RedisError, OSError: Redis restarted
                logger.warning("abort subscription lost (%s); resubscribing in %.1f s", exc, delay)
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)
            finally:
                try:
                    await pubsub.aclose()
                except Exception:
                    pass

    async def abort(self, request_id: str) -> None:
        self.aborted[request_id] = None
        if len(self.aborted) > ABORT_MEMORY:
            self.aborted.popitem(last=False)
        info = self.requests.pop(request_id, None)
        if info is not None:
            tracing.end(info.span, error="aborted")
        if info is not None or self.engine.owns(request_id):
            found = await self.engine_thread.acall(self.engine.abort_request, request_id)
            if found:
                logger.info("request %s aborted", request_id)

    def track(self, request_id: str, tracked: Tracked) -> None:
        """Publish ``request_id``'s output from now on: its events go to the relay stream of its router
        (``tracked.router_id``; none: to its own output stream)."""
        self.requests[request_id] = tracked
        self.writer.route(request_id, tracked.router_id)

    async def is_aborted(self, request_id: str) -> bool:
        return bool(await self.redis.exists(keys.aborted_key(request_id)))

    # registry
    async def pod_info(self) -> PodInfo:
        """This pod's registration, from the worker's own loop: it never waits for the engine, so a long step (a
        big prefill on a busy CPU) cannot make the pod look dead. Stats are the last the engine reported (after
        each step; a refresh is asked for here and read by a later beat). Raises ``RuntimeError`` -- no beat, the
        pod leaves the registry -- when the engine thread died or made no progress for ``engine_stall_s``."""
        if self.engine_thread is not None:
            if not self.engine_thread.alive:
                raise RuntimeError(f"engine thread stopped: {self.engine_thread.error!r}")
            stalled = self.engine_stalled()
            if stalled:
                raise RuntimeError(stalled)
            if self._stats_call is None or self._stats_call.done():
                self._stats_call = asyncio.ensure_future(self.engine_thread.acall(self._stats_and_kv_events))
                self._stats_call.add_done_callback(self._took_stats)
        s = self.stats or EngineStats(block_size=self.settings.block_size)
        return PodInfo(
            pod_id=self.settings.pod_id, role=self.role, host=self.settings.advertise_host,
            http_port=self.http_port, model=self.settings.model,
            block_size=s.block_size, total_blocks=s.kv_blocks_total, free_blocks=s.kv_blocks_total - s.kv_blocks_used,
            num_running=s.num_running, num_waiting=s.num_waiting, started_at=self.started_at,
            max_model_len=s.max_model_len, **self.pod_fields(),
        )

    def pod_fields(self) -> dict:
        """The role's own ``PodInfo`` fields (e.g. a decode pod's ``kv_port``)."""
        return {}

    http_port = 0  # set by ``serve`` once the HTTP server is configured
    _stats_call: asyncio.Future | None = None

    def _took_stats(self, fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.stats = fut.result()
            self.metrics.update_from_stats(self.stats)

    def engine_stalled(self) -> str | None:
        """Why the engine counts as stuck (no finished step or idle wait for ``engine_stall_s``), or None."""
        if self.engine_thread is None:
            return None
        stalled = self.engine_thread.stalled_s()
        if stalled > self.settings.engine_stall_s:
            return (f"engine made no progress for {stalled:.0f} s (one step or call still running; "
                    f"--engine-stall-s {self.settings.engine_stall_s:g})")
        return None

    # HTTP
    def create_app(self) -> FastAPI:
        app = FastAPI(title=f"pdserve {self.role} worker", docs_url=None, redoc_url=None)

        @app.get("/health")
        async def health():
            if not self.ready:
                return JSONResponse({"status": "starting"}, status_code=503)
            if self.heartbeater is not None and self.heartbeater.refused is not None:
                return JSONResponse({"status": "registry refused this pod", "error": str(self.heartbeater.refused)},
                                    status_code=503)
            if not self.engine_thread.alive:
                return JSONResponse({"status": "engine stopped", "error": repr(self.engine_thread.error)}, status_code=503)
            stalled = self.engine_stalled()
            if stalled:
                return JSONResponse({"status": "engine stalled", "error": stalled}, status_code=503)
            if self.faults:
                return JSONResponse({"status": "degraded", "error": "; ".join(f"{k}: {v}" for k, v in
                                                                              sorted(self.faults.items()))},
                                    status_code=503)
            try:
                await asyncio.wait_for(self.redis.ping(), 2.0)
            except Exception as exc:
                return JSONResponse({"status": "redis unreachable", "error": str(exc)}, status_code=503)
            return {"status": "ok", "pod_id": self.settings.pod_id, "started_at": self.started_at}

        @app.get("/metrics")
        async def metrics():
            return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

        @app.get("/v1/requests/{request_id}")
        async def request_state(request_id: str):
            """Whether this pod holds the request (queued, running or reserved here); internal: the router asks it
            when a request goes silent and its queue entry is gone, to tell a hand-over from a loss."""
            if not self.holds(request_id):
                return JSONResponse({"request_id": request_id, "held": False}, status_code=404)
            return {"request_id": request_id, "held": True}

        @app.get("/v1/stats")
        async def stats():
            """Engine counters (``LLMEngine.get_stats``) plus the worker's own; internal, for operators and tests."""
            if self.ready and self.engine_thread.alive:
                self.stats = await self.engine_thread.acall(self.engine.get_stats)
            return {**(self.stats.as_dict() if self.stats is not None else {}), **self.worker_stats()}

        return app

    def holds(self, request_id: str) -> bool:
        """The request is this pod's: tracked for output, or blocks reserved for its hand-over."""
        return request_id in self.requests or (self.engine is not None and self.engine.owns(request_id))

    def set_fault(self, loop: str, error: object | None) -> None:
        """Record (or with None clear) what ``loop`` cannot do; logged once when it starts and when it ends."""
        if error is None:
            if self.faults.pop(loop, None) is not None:
                logger.info("%s recovered", loop)
        elif loop not in self.faults:
            self.faults[loop] = str(error)
            logger.warning("%s failing: %s", loop, error)
        else:
            self.faults[loop] = str(error)

    def worker_stats(self) -> dict:
        return {"pod_id": self.settings.pod_id, "role": self.role, "requests_tracked": len(self.requests),
                "num_threads": torch.get_num_threads(),
                "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}


SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_while_loading(owner: int) -> Callable[[int, object], None]:
    """The SIGINT/SIGTERM handler before the engine is built: process ``owner`` exits now (status 128 + signum),
    taking along the tensor-parallel ranks it forked so far. Nothing is registered or held yet, and a graceful stop
    would wait for the whole load: the thread building the engine cannot be interrupted and ``asyncio.run`` joins
    it at exit (10 s and more). A rank forked meanwhile inherits the handler and ignores the signal there, as it
    ignored uvicorn's before: its leader kills it here, or stops it after a graceful stop."""
    def handler(signum: int, frame: object) -> None:
        if os.getpid() != owner:
            return
        os.write(2, f"{signal.Signals(signum).name} while loading the model: exiting\n".encode())
        for child in multiprocessing.active_children():
            child.kill()
        os._exit(128 + signum)

    return handler


async def serve(worker: Worker) -> None:
    """Run the worker and its HTTP app until SIGINT/SIGTERM, then ``worker.stop()`` (a decode pod hands its requests
    over there) and return. A signal that arrives before the engine is built ends the process at once
    (``exit_while_loading``); after it, uvicorn's handler stops the app and ``worker.stop()`` runs."""
    import contextlib

    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # ``serve`` owns the handlers: uvicorn's own re-raises the signal once the HTTP side has shut down, which
            # killed the worker before ``worker.stop()`` ran (the pod stayed registered, its requests were dropped)
            yield

    def graceful() -> None:
        for sig in SIGNALS:
            signal.signal(sig, server.handle_exit)

    settings = worker.settings
    config = uvicorn.Config(worker.create_app(), host=settings.host, port=settings.port,
                            log_level=settings.log_level.lower(), access_log=False, lifespan="off")
    server = Server(config)
    worker.http_port = settings.port
    previous = {sig: signal.signal(sig, exit_while_loading(os.getpid())) for sig in SIGNALS}
    worker.on_engine_built = graceful
    server_task = asyncio.create_task(server.serve())
    start = asyncio.create_task(worker.start())
    try:
        done, _ = await asyncio.wait({start, server_task}, return_when=asyncio.FIRST_COMPLETED)
        if start in done and start.exception() is None:
            await server_task  # until SIGINT/SIGTERM
    finally:
        if not start.done():
            start.cancel()
        server.should_exit = True
        await asyncio.gather(server_task, return_exceptions=True)
        for sig, handler in previous.items():  # a second signal now interrupts the hand-over, as uvicorn's did
            signal.signal(sig, handler)
        await worker.stop()
    if start.done() and not start.cancelled() and start.exception() is not None:
        raise start.exception()  # a failed start (model missing, port taken) exits non-zero
