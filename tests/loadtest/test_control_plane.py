"""The control-plane bench's stand-in pods serve streamed requests end to end: the real router app and registry app
over real HTTP, a real redis-server, and the fleet's ``DecodeWorker``s on ``StubEngine``s, all in this process
(the bench runs each as its own process, as the slow test below does)."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
import uvicorn

from pdserve.loadtest.control_plane import Counters, Streams, ceiling, per_token_by_name, ramp, stream_one
from pdserve.loadtest.fleet import Fleet
from pdserve.loadtest.stub_engine import token_text
from pdserve.services.registry.app import create_app as create_registry_app
from pdserve.services.registry.settings import RegistrySettings
from pdserve.services.router.app import create_app as create_router_app
from pdserve.services.router.prompts import PromptProcessor
from pdserve.services.router.settings import RouterSettings

from support.tokenizer_dirs import make_llama2_style_tokenizer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def serve(app, port: int) -> uvicorn.Server:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    server.install_signal_handlers = lambda: None
    server.task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    return server


async def stop(server: uvicorn.Server) -> None:
    server.should_exit = True
    await server.task


def test_stand_in_pods_stream_every_token_of_each_request_through_a_real_router(redis_url, tmp_path):
    model = str(make_llama2_style_tokenizer(tmp_path / "tok"))  # a tokenizer in milliseconds: the pods need no model
    processor = PromptProcessor(model)

    async def scenario():
        reg_port, fleet_port = free_port(), free_port()
        registry = await serve(create_registry_app(RegistrySettings(redis_url=redis_url)), reg_port)
        fleet = Fleet(2, fleet_port, 0.005, redis_url=redis_url, registry_url=f"http://127.0.0.1:{reg_port}",
                      model=model, host="127.0.0.1", log_level="warning")
        pods = await serve(fleet.create_app(), fleet_port)
        await fleet.start()
        router_port = free_port()  # after the pods' KV-transfer servers took theirs
        router = await serve(create_router_app(RouterSettings(
            redis_url=redis_url, registry_url=f"http://127.0.0.1:{reg_port}", model=model), processor), router_port)
        try:
            seen = Streams()
            url = f"http://127.0.0.1:{router_port}/v1/completions"
            async with httpx.AsyncClient(timeout=20) as client:
                texts = await asyncio.gather(*(stream_one(client, url, {
                    "model": model, "prompt": list(range(10, 30 + i)), "max_tokens": 5 + i, "stream": True,
                    "ignore_eos": True}, seen) for i in range(4)))
                stats = (await client.get(f"http://127.0.0.1:{fleet_port}/fleet/stats")).json()
            return texts, seen, stats
        finally:
            await stop(router)
            await fleet.stop()
            await stop(pods)
            await stop(registry)

    texts, seen, stats = asyncio.run(scenario())
    assert texts == ["".join(token_text(j) for j in range(5 + i)) for i in range(4)]
    assert (seen.errors, seen.tokens, len(seen.gaps)) == (0, 5 + 6 + 7 + 8, 5 + 6 + 7 + 8 - 4)
    assert stats["tokens"] == 26 and stats["pods"] == 2


def test_the_command_breakdown_counts_each_command_a_client_sent_and_sums_to_the_total(redis_server):
    import redis

    counters = Counters({}, [redis_server.port])
    client = redis.Redis.from_url(redis_server.url)
    client.ping()  # the client's start-up (HELLO, CLIENT SETINFO, ...) before the first reading, as the bench's
    before = counters.read()
    for i in range(6):
        client.xadd("cp-test", {"i": i})
    client.set("cp-test-k", 1, px=1000)
    client.set("cp-test-k", 2, px=1000)
    client.eval("redis.call('EXISTS', KEYS[1]); return 1", 1, "cp-test-k")  # a script's commands count too
    after = counters.read()
    client.delete("cp-test", "cp-test-k")
    deltas = {k: after[k] - before.get(k, 0) for k in after}
    by_name = per_token_by_name(deltas, tokens=4)
    assert by_name == {"xadd": 1.5, "set": 0.5, "eval": 0.25, "exists": 0.25}  # per token; INFO itself left out
    assert sum(by_name.values()) * 4 == deltas["redis_calls"] == 10


@pytest.mark.slow
def test_the_bench_ramps_through_real_processes_and_reports_cpu_per_token():
    levels = ramp(2, [1, 2], step_ms=20.0, output_len=16, warmup_s=1.0, seconds=2.0, max_added_ms=1e9,
                  echo=lambda line: None)
    assert [r.streams for r in levels] == [2, 4]
    assert all(r.errors == 0 and r.tok_s > 0 for r in levels)
    assert {"router", "registry", "redis", "pods", "clients"} <= set(levels[0].cpu_us_per_token)
    assert ceiling(levels) is levels[-1]
    assert all(r.delivery_p50_ms > 0 for r in levels)  # the stubs stamp each token's step
