"""A worker's liveness never waits for its engine: the registry heartbeat is built on the worker's
own loop while one engine step runs for as long as it must; only an engine that makes no progress for
``engine_stall_s`` stops the heartbeat and turns ``/health`` to 503 -- and it comes back when the step ends.

The engine is a stand-in whose ``step`` blocks until the test releases it (a long prefill on a loaded CPU); the
engine thread, the worker, its settings and its HTTP app are the real ones, against a real redis-server."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from pdserve.shared.engine.stats import EngineStats
from pdserve.shared.worker.engine_thread import EngineThread
from pdserve.services.decode.worker import DecodeSettings, DecodeWorker
from support.tiny_llama import make_tiny_llama


class SlowEngine:
    """One request whose single step lasts until ``release`` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.steps = 0

    def owns(self, request_id: str) -> bool:
        return False

    def has_unfinished_requests(self) -> bool:
        return not self.release.is_set()

    def step(self) -> list:
        self.release.wait()
        self.steps += 1
        return []

    def get_stats(self) -> EngineStats:
        return EngineStats(kv_blocks_total=100, num_running=1, num_steps=self.steps, block_size=16)


def test_heartbeat_does_not_wait_for_a_long_step_and_a_stuck_engine_stops_it(redis_url):
    async def scenario():
        # heartbeat_interval_s 5: the old heartbeat waited that long for the engine before beating
        worker = DecodeWorker(DecodeSettings(redis_url=redis_url, pod_id="slow-0", heartbeat_interval_s=5.0,
                                             engine_stall_s=1.5))
        worker.loop = asyncio.get_running_loop()
        worker.http_port = 8003
        engine = SlowEngine()
        worker.engine = engine
        worker.engine_thread = EngineThread(engine, lambda outputs: None, name="slow-engine")
        worker.engine_thread.start()
        worker.ready = True
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=worker.create_app()), base_url="http://w")
        try:
            await asyncio.sleep(0.2)  # the step has begun
            started = time.monotonic()
            info = await asyncio.wait_for(worker.pod_info(), 1.0)
            beat_s = time.monotonic() - started
            assert (info.pod_id, info.role, info.kv_port) == ("slow-0", "decode", 9000)
            assert (await http.get("/health")).status_code == 200

            await asyncio.sleep(1.6)  # past engine_stall_s with the step still running: stuck
            try:
                await asyncio.wait_for(worker.pod_info(), 1.0)
                stuck_error = None
            except RuntimeError as exc:
                stuck_error = str(exc)
            stuck_health = await http.get("/health")

            engine.release.set()  # the step ends: the engine progresses again
            await asyncio.sleep(0.8)
            recovered = await asyncio.wait_for(worker.pod_info(), 1.0)
            recovered_health = await http.get("/health")
            return beat_s, stuck_error, stuck_health, recovered, recovered_health
        finally:
            engine.release.set()
            await http.aclose()
            await asyncio.to_thread(worker.engine_thread.stop)
            await worker.redis.aclose()
            await worker.registry.aclose()

    beat_s, stuck_error, stuck_health, recovered, recovered_health = asyncio.run(scenario())
    assert beat_s < 0.5, f"the heartbeat waited {beat_s:.2f} s for the engine"
    assert stuck_error is not None and "engine made no progress for" in stuck_error, stuck_error
    assert stuck_health.status_code == 503
    assert stuck_health.json()["status"] == "engine stalled", stuck_health.text
    assert recovered.pod_id == "slow-0"
    assert recovered_health.status_code == 200, recovered_health.text


@pytest.mark.slow
def test_a_prefill_pod_prefills_a_long_prompt_in_bounded_steps_and_an_abort_between_them_frees_it(
        model_dir, tmp_path):
    """The prefill pod's default long-prompt threshold bounds what an abort (or a stats call, or a new request)
    waits for: one 256-token chunk, not the 2048-token budget nor a whole long prompt. A random 2-layer Llama keeps
    the chunk cheap; the threshold, not the model, bounds the step."""
    from pdserve.services.prefill.worker import PrefillSettings
    from pdserve.shared.engine.llm_engine import LLMEngine
    from pdserve.shared.protocol.sampling_params import SamplingParams

    settings = PrefillSettings(kv_cache_memory="16MiB", max_model_len=4096,
                               model=make_tiny_llama(tmp_path, model_dir, max_position_embeddings=4096))
    assert (settings.max_num_batched_tokens, settings.long_prefill_token_threshold) == (2048, 256)
    chunk = settings.long_prefill_token_threshold
    engine = LLMEngine(settings.engine_config())
    ids = [100 + i % 1000 for i in range(3000)]
    engine.add_request("long", ids, SamplingParams(max_tokens=1), prefill_only=True)
    engine.step()  # one chunk: no first token yet
    (request,) = engine.output.states["long"].members
    assert request.num_computed_tokens == chunk and not request.is_finished
    assert engine.abort_request("long")  # what the worker's abort runs between two steps
    assert not engine.has_unfinished_requests()
    assert engine.get_stats().kv_blocks_used == 0
