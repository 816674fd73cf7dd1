"""/health and /metrics of the router (Prometheus text, vLLM's metric names with the pdserve: prefix)."""

from __future__ import annotations

import re

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from pdserve.shared.protocol import keys


def samples(router) -> dict[tuple[str, str], float]:
    text = httpx.get(router.url + "/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[(s.name, labels)] = s.value
    return out


def test_health_is_ok_with_redis(router):
    resp = httpx.get(router.url + "/health", timeout=10)
    assert resp.status_code == 200 and resp.json() == {"status": "ok"}


def test_metrics_count_a_finished_request(router, worker, redis_client):
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    resp = client.chat.completions.create(model="smollm2-135m-instruct",
                                          messages=[{"role": "user", "content": "France?"}])
    m = samples(router)
    assert m[("pdserve:time_to_first_token_seconds_count", "")] == 1
    assert m[("pdserve:e2e_request_latency_seconds_count", "")] == 1
    # one gap per token after the first
    assert m[("pdserve:inter_token_latency_seconds_count", "")] == resp.usage.completion_tokens - 1
    assert m[("pdserve:prompt_tokens_total", "")] == resp.usage.prompt_tokens
    assert m[("pdserve:generation_tokens_total", "")] == resp.usage.completion_tokens
    assert m[("pdserve:request_success_total", "finished_reason=stop")] == 1
    assert m[("pdserve:num_requests_running", "")] == 0
    assert m[("pdserve:prefill_queue_depth", "")] == 0  # the stand-in worker deleted its entry


def test_queue_depth_is_the_prefill_stream_length(router, redis_client):
    for _ in range(3):
        redis_client.xadd(keys.PREFILL_STREAM, {"x": "1"})
    assert samples(router)[("pdserve:prefill_queue_depth", "")] == 3
    text = httpx.get(router.url + "/metrics", timeout=10).text
    assert re.search(r'^pdserve:prefill_queue_depth\{model_name="smollm2-135m-instruct"\} 3\.0$', text, re.M)


def test_failed_and_aborted_requests_leave_no_running_request(router, worker):
    router.pods.remove("decode-0")
    assert httpx.post(router.url + "/v1/completions", timeout=30,
                      json={"model": "smollm2-135m-instruct", "prompt": "Hi"}).status_code == 503
    router.pods.add("decode-0")
    assert httpx.post(router.url + "/v1/completions", timeout=30,
                      json={"model": "smollm2-135m-instruct", "prompt": "TRIGGER_WORKER_ERROR"}).status_code == 500
    m = samples(router)
    assert m[("pdserve:num_requests_running", "")] == 0
    assert m[("pdserve:requests_aborted_total", "reason=InternalServerError")] == 1


def test_responses_are_counted_by_endpoint_and_status(router):
    httpx.get(router.url + "/v1/models", timeout=10)
    httpx.post(router.url + "/v1/completions", json={"prompt": "x", "top_p": 7}, timeout=10)
    httpx.get(router.url + "/no/such/path", timeout=10)
    m = samples(router)
    assert m[("pdserve:router_requests_total", "endpoint=/v1/models,status=200")] == 1
    assert m[("pdserve:router_requests_total", "endpoint=/v1/completions,status=400")] == 1
    assert m[("pdserve:router_requests_total", "endpoint=other,status=404")] == 1
    assert m[("process_cpu_seconds_total", "")] > 0
