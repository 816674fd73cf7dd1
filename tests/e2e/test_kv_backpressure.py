"""A decode pod that cannot take a request right now: its KV cache is full (requests wait in line
for blocks, kept alive toward the router however long the wait, and complete), or its KV port accepts connections
and never answers (item 10). Real processes: ``pdserve up`` (redis-server, registry,
router, one prefill and one decode worker, the real model) with the decode pod's KV pool shrunk so that a
handful of concurrent requests oversubscribe it, and a real TCP server that accepts and stays silent,
registered as a second decode pod.

Oracles: the offline ``LLM`` (greedy, fp32) for every answer's text; the strict SSE rule (every non-empty line
is ``data: <json>`` or ``data: [DONE]``, no error chunk); the prefill pod's log and Redis for why a pod is
avoided; the silent server's own count of connections for whether the router stopped choosing it.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time

import httpx
import pytest

from pdserve.shared.protocol import keys

from pdserve.loadtest.cluster import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 64
PROMPT_LEN = 32
ENV = {
    "PDSERVE_DTYPE": "float32",
    # 8 MiB of fp32 KV for this model is 11 blocks of 16 tokens: one request of 32 + 64 tokens (6 blocks) at a time
    "PDSERVE_KV_CACHE_MEMORY": "8MiB",
    "PDSERVE_MAX_MODEL_LEN": "160",
    "PDSERVE_KV_TRANSFER_TIMEOUT_S": "3",
    "PDSERVE_KV_UNREACHABLE_COOLDOWN_S": "600",
    "PDSERVE_MIGRATION_STALL_S": "1",
    # The router ends a request silent for this long (600 s by default). The requests at the back of the line wait
    # for decode blocks longer than that (on the prefill pod, and preempted on the decode pod): only the workers'
    # keep-alive events (every 1 s here) keep them alive.
    "PDSERVE_REQUEST_TIMEOUT_S": "6",
    "PDSERVE_OUTPUT_KEEPALIVE_S": "1",
}
SILENCE_S = 6.0


@pytest.fixture(scope="module")
def ensemble(tmp_path_factory):
    with Cluster("--prefill", "1", "--decode", "1", log_dir=tmp_path_factory.mktemp("up"), env=ENV,
                 process=True) as ens:
        yield ens


@pytest.fixture(scope="module")
def offline():
    from pdserve import LLM

    return LLM(MODEL, dtype="float32")


def expected(offline, prompts) -> list[tuple[str, str]]:
    """(text, finish_reason) of each prompt's greedy answer from the offline engine."""
    from pdserve import SamplingParams

    outs = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


async def stream_one(client: httpx.AsyncClient, url: str, prompt: list[int]) -> dict:
    """One streamed completion, parsed strictly; ``text``, ``finish``, ``errors`` (error chunks), ``status``."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    text, finish, errors = "", None, []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return {"status": resp.status_code, "text": "", "finish": None, "errors": [await resp.aread()]}
        async for line in resp.aiter_lines():
            if not line or line.startswith(":"):  # an SSE comment (keep-alive ping) carries no event
                continue
            assert line.startswith("data: "), line
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                errors.append(chunk["error"])
                continue
            for choice in chunk["choices"]:
                text += choice["text"]
                finish = choice["finish_reason"] or finish
    return {"status": 200, "text": text, "finish": finish, "errors": errors}


async def stream_all(url: str, prompts: list[list[int]]) -> list[dict]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30)) as client:
        return await asyncio.gather(*(stream_one(client, url, p) for p in prompts))


def test_a_full_decode_kv_cache_makes_requests_wait_not_fail(ensemble, offline, prompt_of):
    prompts = [prompt_of(PROMPT_LEN, offset=5 * i) for i in range(12)]
    want = expected(offline, prompts)
    got = asyncio.run(stream_all(ensemble.router_url, prompts))
    for i, (g, w) in enumerate(zip(got, want)):
        assert g["status"] == 200 and not g["errors"], (i, g)
        assert (g["text"], g["finish"]) == w, (i, g, w)
    # the pool really was oversubscribed: requests waited for blocks on the prefill pod
    log = (ensemble.log_dir / "prefill-0.log").read_text()
    assert "has no free KV blocks for request" in log and "got its KV blocks" in log
    # ... for longer than the router's silence bound: without keep-alives those requests would have got 504
    waits = [float(w) for w in re.findall(r"got its KV blocks on \S+ after waiting ([0-9.]+) s", log)]
    assert max(waits) > SILENCE_S, waits
    # and everything was given back: no reservation, no request, no block left on the decode pod
    deadline = time.monotonic() + 30
    while True:
        stats = ensemble.stats(ensemble.pods("decode")[0])
        if stats["kv_active_leases"] == 0 and stats["num_running"] == 0 and stats["requests_tracked"] == 0:
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.5)


class SilentKVPort:
    """A TCP server that accepts every connection and never sends a byte (a hung decode pod's KV port)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted.append(conn)

    def close(self) -> None:
        self._stop.set()
        for conn in self.accepted:
            conn.close()
        self.sock.close()


def register_forever(ensemble: Cluster, info: dict, stop: threading.Event) -> None:
    """Heartbeats for a decode pod that only exists as a silent KV port (its HTTP side is never asked)."""
    while not stop.is_set():
        try:
            httpx.post(f"{ensemble.registry_url}/v1/pods", json=info, headers=ensemble.registry_headers, timeout=5)
        except httpx.HTTPError:
            pass
        stop.wait(1.0)


def test_a_decode_pod_whose_kv_port_never_answers_is_avoided_and_requests_move(ensemble, offline, prompt_of):
    real = ensemble.pods("decode")[0]
    silent = SilentKVPort()
    stop = threading.Event()
    info = {"pod_id": "decode-silent", "role": "decode", "host": "127.0.0.1", "http_port": 9, "kv_port": silent.port,
            "model": real["model"], "block_size": real["block_size"], "total_blocks": 10_000, "free_blocks": 10_000,
            "max_model_len": real.get("max_model_len", 0), "started_at": time.time()}
    beat = threading.Thread(target=register_forever, args=(ensemble, info, stop), daemon=True)
    beat.start()
    try:
        deadline = time.monotonic() + 20
        while "decode-silent" not in {p["pod_id"] for p in ensemble.pods("decode")}:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        time.sleep(1.0)  # routers' pod caches see it
        prompts = [prompt_of(PROMPT_LEN, offset=3 + 5 * i) for i in range(5)]
        want = expected(offline, prompts)
        got = asyncio.run(stream_all(ensemble.router_url, prompts))
        for i, (g, w) in enumerate(zip(got, want)):
            assert g["status"] == 200 and not g["errors"], (i, g)
            assert (g["text"], g["finish"]) == w, (i, g, w)
        assert silent.accepted, "the silent pod was never chosen: the test proves nothing"
        log = (ensemble.log_dir / "prefill-0.log").read_text()
        assert "accepted the connection but did not answer the KV-transfer handshake within 3 s" in log, log[-3000:]
        import redis

        marks = redis.Redis.from_url(ensemble.redis_url).hgetall(keys.KV_UNREACHABLE)
        assert b"decode-silent" in marks, marks
        # marked: the router no longer sends it anything
        tried = len(silent.accepted)
        got = asyncio.run(stream_all(ensemble.router_url, prompts[:3]))
        assert [(g["text"], g["finish"]) for g in got] == want[:3] and not any(g["errors"] for g in got), got
        assert len(silent.accepted) == tried
    finally:
        stop.set()
        beat.join(5)
        httpx.delete(f"{ensemble.registry_url}/v1/pods/decode-silent", headers=ensemble.registry_headers, timeout=5)
        silent.close()
