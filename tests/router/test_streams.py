"""Streams that clients nobody here wrote can read: only ``data:`` lines (vLLM's benchmark json-decodes every
non-empty line), and a chat stream that opens with the assistant role only once the first token exists (a
client measures time to first token at its first chunk). Read through the strict parser
``pdserve.loadtest.sse``, which pdserve's load generator uses too."""

from __future__ import annotations

import time

import httpx
import pytest

from pdserve.loadtest.sse import SSEProtocolError, read_chunks
from pdserve.services.router.settings import RouterSettings
from router_harness import start_router

MODEL = "smollm2-135m-instruct"


@pytest.mark.parametrize("line", [": ping - 2026-01-01 00:00:00", "event: message", "data: {not json",
                                  "data: [1, 2]", "id: 3"])
def test_strict_parser_refuses_every_line_but_data_json_and_done(line):
    with pytest.raises(SSEProtocolError):
        list(read_chunks(['data: {"a": 1}', "", line, "", "data: [DONE]"]))


def test_strict_parser_reads_data_lines_and_needs_done():
    assert list(read_chunks(['data: {"a": 1}', "", "data:{\"b\": 2}", "", "data: [DONE]", ""])) == [{"a": 1},
                                                                                                     {"b": 2}]
    with pytest.raises(SSEProtocolError, match="without data: \\[DONE\\]"):
        list(read_chunks(['data: {"a": 1}', ""]))
    with pytest.raises(SSEProtocolError, match="after"):
        list(read_chunks(["data: [DONE]", 'data: {"a": 1}']))


@pytest.mark.slow
def test_a_stream_longer_than_the_old_ping_interval_has_only_data_lines(router, worker):
    """sse-starlette's default ping (15 s) used to put ``: ping - <time>`` into every stream this long."""
    worker.delay_s = 0.25
    body = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": 70, "stream": True, "ignore_eos": True}
    start = time.monotonic()
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        chunks = list(read_chunks(resp.iter_lines()))
    assert time.monotonic() - start > 16.0
    assert sum(1 for c in chunks if c["choices"][0]["text"]) == 70


def test_keep_alive_pings_are_opt_in_and_the_strict_parser_catches_them(redis_url, registry_url, processor,
                                                                         pods, worker):
    worker.delay_s = 0.1  # 12 tokens: ~1.1 s, five ping intervals
    server = start_router(RouterSettings(redis_url=redis_url, registry_url=registry_url, sse_ping_s=0.2),
                          processor, pods)
    body = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": 12, "stream": True}
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as resp:
            lines = list(resp.iter_lines())
    finally:
        server.stop()
    assert any(line.startswith(": ping") for line in lines)
    with pytest.raises(SSEProtocolError, match="not a data line"):
        list(read_chunks(lines))


def test_chat_stream_opens_with_the_role_only_when_the_first_token_exists(router, worker):
    worker.prefill_s = 0.5  # the prompt's prefill: no token exists before it ends
    body = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "stream": True, "n": 2}
    start = time.monotonic()
    arrivals = []
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        for chunk in read_chunks(resp.iter_lines()):
            arrivals.append((time.monotonic() - start, chunk["choices"][0]))
    first_at, first = arrivals[0]
    assert first_at >= 0.5
    assert first == {"index": first["index"], "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None}
    for index in (0, 1):  # vLLM's shape per choice: the role chunk, then the first token's chunk
        mine = [c for _, c in arrivals if c["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[1]["delta"]["content"] and "role" not in mine[1]["delta"]
        assert all("role" not in c["delta"] for c in mine[1:])
