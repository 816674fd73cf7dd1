"""Schemathesis against the router's own OpenAPI schema: generated bodies, headers and paths for every
operation; the router must never answer 5xx (a bad input is the client's 4xx).

The router runs for real (uvicorn on a free port, real redis-server, real tokenizer). Behind it a stand-in
decode pod answers every queued request at once with one token (the real workers cannot keep up with
generated ``max_tokens`` in CI, and the property under test is the router's input handling); the pod list
comes from a fixed directory instead of the registry service (both have their own tests).
Needs ``pip install schemathesis`` (CI installs it). The example count is kept small for CI time.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import pytest
import redis
import uvicorn
from hypothesis import HealthCheck, settings

from pdserve.services.router.app import create_app
from pdserve.services.router.prompts import PromptProcessor
from pdserve.services.router.settings import RouterSettings
from pdserve.shared.models.resolve import resolve_model
from pdserve.shared.protocol import keys
from pdserve.shared.protocol.messages import MessageError, OutputEvent, PrefillRequest
from pdserve.shared.worker.output_writer import OutputWriter
from support.redis_server import RedisServer

schemathesis = pytest.importorskip("schemathesis")

pytestmark = pytest.mark.slow

POD = "fuzz-decode"


@dataclass
class Pod:
    pod_id: str = POD
    role: str = "decode"
    host: str = "127.0.0.1"
    http_port: int = 1
    kv_port: int = 1
    block_size: int = 16
    free_blocks: int = 1000
    num_running: int = 0
    num_waiting: int = 0
    colocated: bool = True


class Directory:
    async def list_pods(self, role: str):
        return [Pod()] if role == "decode" else []


def stand_in_decode(url: str, stop: threading.Event) -> None:
    """Answers each request on the pod's own stream with one token and finish_reason "length"."""
    r = redis.Redis.from_url(url)
    writer = OutputWriter(r)
    stream = keys.decode_stream(POD)
    try:
        r.xgroup_create(stream, keys.DECODE_GROUP, id="0", mkstream=True)
    except redis.ResponseError:
        pass
    while not stop.is_set():
        for _, entries in r.xreadgroup(keys.DECODE_GROUP, POD, {stream: ">"}, count=64, block=200) or []:
            for msg_id, fields in entries:
                r.xack(stream, keys.DECODE_GROUP, msg_id)
                try:
                    req = PrefillRequest.decode(fields)
                except MessageError:
                    continue
                writer.write(OutputEvent(req.request_id, token_ids=[42], text="x", finish_reason="length",
                                         prompt_tokens=len(req.prompt_token_ids), completion_tokens=1))
    r.close()


@pytest.fixture(scope="module")
def router_url():
    with RedisServer() as server:
        port = socket.socket()
        port.bind(("127.0.0.1", 0))
        number = port.getsockname()[1]
        port.close()
        app = create_app(RouterSettings(redis_url=server.url, routing_mode="least_loaded", registry_cache_s=0.0,
                                        max_body_bytes=256 * 1024, request_timeout_s=20),
                         PromptProcessor(resolve_model("smollm2-135m-instruct")), Directory())
        uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=number, log_level="warning"))
        thread = threading.Thread(target=uv.run, daemon=True)
        thread.start()
        stop = threading.Event()
        worker = threading.Thread(target=stand_in_decode, args=(server.url, stop), daemon=True)
        worker.start()
        deadline = time.monotonic() + 60
        while not uv.started and time.monotonic() < deadline:
            time.sleep(0.05)
        yield f"http://127.0.0.1:{number}"
        stop.set()
        uv.should_exit = True
        thread.join(10)
        worker.join(5)


@pytest.fixture(scope="module")
def api_schema(router_url):
    return schemathesis.openapi.from_url(f"{router_url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_5xx_for_any_generated_input(case):
    response = case.call(timeout=30)
    assert response.status_code < 500, (response.status_code, response.text[:500], case.body)
