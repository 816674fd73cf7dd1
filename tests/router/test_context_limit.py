"""The context length the router enforces follows the decode pods' engines: a worker whose KV cache holds less
than the model's context reports its ``max_model_len`` in its heartbeat, and the router answers 400 (and fills
``max_tokens``, and reports ``/v1/models``) by it, instead of queueing a request a worker must refuse."""

from __future__ import annotations

import httpx


def test_the_smallest_decode_pods_context_length_is_enforced(router, worker, pods, processor):
    pods.add("decode-0", max_model_len=100)
    pods.add("decode-1", max_model_len=300)
    models = httpx.get(router.url + "/v1/models", timeout=30).json()
    assert models["data"][0]["max_model_len"] == 100
    prompt = processor.tokenizer.encode("word " * 120)[:110]
    resp = httpx.post(router.url + "/v1/completions", timeout=30,
                      json={"model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": 5})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "prompt" and "maximum context length is 100 tokens" in error["message"]
    ok = httpx.post(router.url + "/v1/completions", timeout=30,
                    json={"model": "smollm2-135m-instruct", "prompt": prompt[:90]})
    assert ok.status_code == 200
    assert worker.received[-1].request.sampling_params.max_tokens == 10  # up to the pods' context length
