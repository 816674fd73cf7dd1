"""A client that goes away aborts its request everywhere: abort published, aborted key set, output dropped.

The backend is the stand-in worker (it stands in for the real workers, which have their own tests): it
generates slowly here, so the request is still running when the client leaves, and it stops when it hears
the abort on ``pdserve:abort``.
"""

from __future__ import annotations

import re
import time

import httpx
import pytest

from pdserve.loadtest.sse import read_chunks
from pdserve.shared.protocol import keys

MODEL = "smollm2-135m-instruct"
LONG = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 2000}


def wait_until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def aborted_count(router) -> float:
    text = httpx.get(router.url + "/metrics", timeout=10).text
    found = re.findall(r'^pdserve:requests_aborted_total\{[^}]*reason="client_disconnected"[^}]*\} (\S+)$', text,
                       re.M)
    return sum(float(v) for v in found)


@pytest.fixture
def slow_worker(worker):
    worker.delay_s = 0.02
    return worker


def test_streaming_client_disconnect_aborts_the_request(router, slow_worker, redis_client):
    with httpx.stream("POST", router.url + "/v1/chat/completions", json={**LONG, "stream": True},
                      timeout=30) as resp:
        assert resp.status_code == 200
        for chunk in read_chunks(resp.iter_lines()):
            if chunk["choices"][0]["delta"].get("content"):
                break  # the first text chunk: leave now
    (received,) = slow_worker.received
    rid = received.request.request_id

    assert slow_worker.abort_seen.wait(5), "no abort was published"
    assert rid in slow_worker.aborted
    assert redis_client.exists(keys.aborted_key(rid))
    assert 0 < redis_client.ttl(keys.aborted_key(rid)) <= keys.ABORTED_TTL_S
    assert wait_until(lambda: not redis_client.exists(keys.output_stream(rid)))
    assert rid not in slow_worker.finished
    assert aborted_count(router) == 1
    running = re.search(r"^pdserve:num_requests_running\{[^}]*\} (\S+)$",
                        httpx.get(router.url + "/metrics", timeout=10).text, re.M)
    assert float(running.group(1)) == 0


def test_non_streaming_client_disconnect_aborts_the_request(router, slow_worker, redis_client):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(router.url + "/v1/chat/completions", json=LONG, timeout=httpx.Timeout(30, read=1.0))
    (received,) = slow_worker.received
    rid = received.request.request_id

    assert slow_worker.abort_seen.wait(5), "no abort was published"
    assert rid in slow_worker.aborted
    assert redis_client.exists(keys.aborted_key(rid))
    assert wait_until(lambda: not redis_client.exists(keys.output_stream(rid)))
    assert aborted_count(router) == 1


def test_disconnect_aborts_every_choice_of_an_n_request(router, slow_worker, redis_client):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(router.url + "/v1/chat/completions", json={**LONG, "n": 3},
                   timeout=httpx.Timeout(30, read=1.0))
    rids = {r.request.request_id for r in slow_worker.received}
    assert len(rids) == 3
    assert wait_until(lambda: rids <= slow_worker.aborted)
    assert all(redis_client.exists(keys.aborted_key(rid)) for rid in rids)


def test_router_serves_the_next_request_after_a_disconnect(router, worker):
    worker.delay_s = 0.02
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(router.url + "/v1/chat/completions", json=LONG, timeout=httpx.Timeout(30, read=0.5))
    worker.delay_s = 0.0
    resp = httpx.post(router.url + "/v1/chat/completions", timeout=30,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "And France?"}]})
    assert resp.status_code == 200
    assert "Paris" in resp.json()["choices"][0]["message"]["content"]
