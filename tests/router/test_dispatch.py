"""Where requests go: the least loaded decode pod; the prefill queue, or the decode pod's own stream when it
prefills itself. Pods come from the real registry; the stand-in worker (standing in for the real workers,
which have their own tests) records which stream each request arrived on."""

from __future__ import annotations

import re
from collections import Counter
from types import SimpleNamespace
from typing import Iterator

import httpx
import pytest

from router_harness import RouterServer, start_router
from pdserve.services.router.dispatch import pick_decode_pod
from pdserve.services.router.settings import RouterSettings
from pdserve.shared.protocol import keys

CHAT = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "France?"}], "max_tokens": 4}


def post(router, body=CHAT) -> dict:
    resp = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()


def pod(pod_id, running=0, waiting=0, free=100):
    return SimpleNamespace(pod_id=pod_id, num_running=running, num_waiting=waiting, free_blocks=free)


def test_pick_prefers_fewest_requests_then_most_free_blocks():
    assert pick_decode_pod([pod("a", running=3), pod("b", running=1)], Counter()).pod_id == "b"
    assert pick_decode_pod([pod("a", free=10), pod("b", free=50)], Counter()).pod_id == "b"
    assert pick_decode_pod([pod("a", running=1, waiting=2), pod("b", running=2)], Counter()).pod_id == "b"


def test_pick_counts_requests_in_flight_that_heartbeats_do_not_show_yet():
    pods = [pod("a"), pod("b")]
    assert pick_decode_pod(pods, Counter({"a": 2})).pod_id == "b"
    assert pick_decode_pod(pods, Counter({"a": 2, "b": 3})).pod_id == "a"


def test_request_goes_to_the_least_loaded_decode_pod_through_the_prefill_queue(router, pods, worker):
    pods.add("decode-0", num_running=6)
    pods.add("decode-1", num_running=1)
    post(router)
    (got,) = worker.received
    assert got.stream == keys.PREFILL_STREAM
    assert got.request.decode_pod_id == "decode-1"
    assert (got.request.decode_host, got.request.decode_kv_port) == ("127.0.0.1", 9000)


def test_without_a_prefill_pod_the_decode_pod_prefills_itself(router, pods, worker):
    pods.remove("prefill-0")
    post(router)
    (got,) = worker.received
    assert got.stream == keys.decode_stream("decode-0")


def test_a_colocated_decode_pod_gets_requests_on_its_own_stream(router, pods, worker):
    pods.add("decode-0", colocated=True)
    post(router)
    assert worker.received[0].stream == keys.decode_stream("decode-0")


@pytest.fixture
def threshold_router(redis_url, registry_url, processor, pods) -> Iterator[RouterServer]:
    server = start_router(RouterSettings(redis_url=redis_url, registry_url=registry_url, registry_cache_s=0.0,
                                         local_prefill_threshold=100), processor, pods)
    yield server
    server.stop()


def test_short_prompts_prefill_locally_long_ones_remotely(threshold_router, worker):
    post(threshold_router)  # about 30 tokens
    completion = {"model": "smollm2-135m-instruct", "prompt": [1] * 200, "max_tokens": 2}
    assert httpx.post(threshold_router.url + "/v1/completions", json=completion, timeout=30).status_code == 200
    assert [r.stream for r in worker.received] == [keys.decode_stream("decode-0"), keys.PREFILL_STREAM]
    text = httpx.get(threshold_router.url + "/metrics", timeout=10).text
    assert decisions(text) == {("local", "threshold"): "1.0", ("remote", "ttft_slo_met"): "1.0"}


def decisions(metrics_text: str) -> dict[tuple[str, str], str]:
    """``pdserve:pd_decisions_total`` samples: (decision, reason) -> value."""
    sample = r'^pdserve:pd_decisions_total\{decision="(\w+)",model_name="[^"]+",reason="(\w+)"\} (\S+)$'
    return {(d, r): v for d, r, v in re.findall(sample, metrics_text, re.M)}


def test_a_prompt_behind_a_long_prefill_backlog_prefills_on_the_decode_pod(router, pods, worker):
    pods.add("prefill-0", role="prefill", queued_prefill_tokens=8192)  # its heartbeat: eight long prompts held
    completion = {"model": "smollm2-135m-instruct", "prompt": [1] * 200, "max_tokens": 2}
    assert httpx.post(router.url + "/v1/completions", json=completion, timeout=30).status_code == 200
    # TTFT ~0.2 s on the idle decode pod against ~8.4 s behind the queue (docs/routing.md, step 6)
    assert [r.stream for r in worker.received] == [keys.decode_stream("decode-0")]
    text = httpx.get(router.url + "/metrics", timeout=10).text
    assert decisions(text) == {("local", "lower_ttft"): "1.0"}


def test_queues_get_their_consumer_group_before_the_first_entry(router, pods, redis_client):
    """No worker has started yet: the entry must still reach the first one that joins the group."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(router.url + "/v1/chat/completions", json=CHAT, timeout=httpx.Timeout(30, read=0.5))
    (group,) = redis_client.xinfo_groups(keys.PREFILL_STREAM)
    assert group["name"] in (keys.PREFILL_GROUP, keys.PREFILL_GROUP.encode())
    assert redis_client.xreadgroup(keys.PREFILL_GROUP, "late-worker", {keys.PREFILL_STREAM: ">"})
