"""The router's HTTP edge under clients that misbehave or differ: slow clients (slowloris), HTTP/1.0, ambiguous
credentials, bodies that are not JSON or lack ``model``, prompt lists against admission, and the OpenAI
client's ``models.retrieve``. Raw sockets where the bytes on the wire are the point."""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest

from pdserve.loadtest.sse import read_chunks
from pdserve.services.router.settings import RouterSettings
from router_harness import start_router

MODEL = "smollm2-135m-instruct"


@pytest.fixture
def guarded(redis_url, registry_url, processor, pods):
    """A router with short HTTP timeouts and an API key."""
    server = start_router(RouterSettings(redis_url=redis_url, registry_url=registry_url, api_key="k1",
                                         http_header_timeout_s=1.0, http_body_timeout_s=1.0), processor, pods)
    yield server
    server.stop()


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def dribble(sock: socket.socket, pieces: list[bytes], every_s: float) -> tuple[bytes, float]:
    """Send ``pieces`` one at a time until the server closes; return what it answered and when (s)."""
    start = time.monotonic()
    sock.settimeout(every_s)
    answer = b""
    for piece in pieces:
        try:
            sock.sendall(piece)
        except OSError:
            break
        try:
            data = sock.recv(65536)
        except socket.timeout:
            continue
        except OSError:
            break
        answer += data
        if not data:
            break
    sock.settimeout(5)
    try:
        while data := sock.recv(65536):
            answer += data
    except OSError:
        pass
    return answer, time.monotonic() - start


def test_a_request_head_that_never_ends_is_cut_off_with_408(guarded):
    sock = connect(guarded.url)
    pieces = [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"] + [b"X-Slow: %d\r\n" % i for i in range(40)]
    answer, took = dribble(sock, pieces, 0.2)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert took < 5.0  # 40 pieces at 0.2 s would take 8 s


def test_a_request_body_that_never_ends_is_cut_off_with_408(guarded):
    sock = connect(guarded.url)
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 200\r\n\r\n{")
    answer, took = dribble(sock, [head] + [b" "] * 40, 0.2)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408 ")
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == 408 and "did not arrive within 1 s" in body["error"]["message"]
    assert took < 5.0


def test_a_stream_to_an_http_1_0_client_is_close_delimited_not_chunked(router, worker):
    body = json.dumps({"model": MODEL, "prompt": "What about France?", "stream": True}).encode()
    sock = connect(router.url)
    sock.sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    raw = b""
    while data := sock.recv(65536):  # HTTP/1.0: the body ends when the server closes
        raw += data
    sock.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding" not in head.lower()
    text = "".join(c["choices"][0]["text"] for c in read_chunks(payload.decode().split("\n")))
    assert text == " The capital of France is Paris."


def test_two_authorization_headers_are_refused(guarded, worker):
    headers = [("Authorization", "Bearer wrong"), ("Authorization", "Bearer k1")]  # the last one is valid
    resp = httpx.post(guarded.url + "/v1/completions", headers=headers, timeout=30,
                      json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == "The request has 2 Authorization headers; send exactly one"
    assert worker.received == []


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_not_sent_as_json_is_415_naming_content_type(router, worker, content_type):
    headers = {"content-type": content_type} if content_type else {}
    resp = httpx.post(router.url + "/v1/completions", content=json.dumps({"model": MODEL, "prompt": "Hi"}),
                      headers=headers, timeout=30)
    assert resp.status_code == 415
    error = resp.json()["error"]
    assert error["type"] == "UnsupportedMediaTypeError" and "Content-Type: application/json" in error["message"]
    assert (repr(content_type) if content_type else "no Content-Type") in error["message"]
    ok = httpx.post(router.url + "/v1/completions", content=json.dumps({"model": MODEL, "prompt": "Hi",
                                                                      "max_tokens": 1}),
                    headers={"content-type": "application/json; charset=utf-8"}, timeout=30)
    assert ok.status_code == 200


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "Hi"}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})])
def test_a_request_without_model_is_400_naming_model(router, worker, path, body):
    resp = httpx.post(router.url + path, json=body, timeout=30)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "model"
    assert worker.received == []


def test_openai_client_retrieves_the_served_model_and_404s_an_unknown_one(router, pods):
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    pods.add("decode-0", max_model_len=768)
    model = client.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "pdserve")
    assert model.model_extra["max_model_len"] == 768
    assert model.model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.body == {"message": "The model `no-such-model` does not exist.", "type": "NotFoundError",
                               "param": "model", "code": 404}


def test_tokenize_reports_the_context_limit_requests_are_held_to(router, pods):
    pods.add("decode-0", max_model_len=768)
    models = httpx.get(router.url + "/v1/models", timeout=30).json()
    tok = httpx.post(router.url + "/tokenize", json={"model": MODEL, "prompt": "Hello"}, timeout=30).json()
    assert tok["max_model_len"] == models["data"][0]["max_model_len"] == 768


def test_every_prompt_of_a_list_counts_in_admission(redis_url, registry_url, processor, pods):
    """No worker: nothing leaves the queue, so what is admitted stays counted."""
    server = start_router(RouterSettings(redis_url=redis_url, registry_url=registry_url, max_queued_requests=4,
                                         max_prompts_per_request=8), processor, pods)
    url = server.url + "/v1/completions"

    def body(prompts: int, n: int = 1) -> dict:
        return {"model": MODEL, "prompt": [f"Prompt {i}" for i in range(prompts)], "n": n, "max_tokens": 2,
                "stream": True}

    try:
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", url, json=body(3)) as first:  # 3 choices queued
                assert first.status_code == 200
                with http.stream("POST", url, json=body(2)) as second:  # 3 + 2 > 4
                    assert second.status_code == 429
                    second.read()
                    assert "limit 4" in second.json()["error"]["message"]
                    assert int(second.headers["retry-after"]) >= 1
            # one request that can never fit is a 400, not a 429 to retry for ever
            resp = http.post(url, json={**body(3, n=2), "stream": False})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"
            assert "6 choices" in resp.json()["error"]["message"]
            resp = http.post(url, json={**body(9), "stream": False})  # over --max-prompts-per-request
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"
            assert "9 prompts" in resp.json()["error"]["message"]
    finally:
        server.stop()
