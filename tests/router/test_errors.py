"""Bad input gets OpenAI's error body naming the parameter, the right status, and the router stays healthy.

Each case sends one bad request over real HTTP and then a valid one, which must be answered normally (the
stand-in worker plays the backend; it stands in for the real workers, which have their own tests).
"""

from __future__ import annotations

import json

import httpx
import pytest

from pdserve.loadtest.sse import read_chunks
MODEL = "smollm2-135m-instruct"
MSGS = [{"role": "user", "content": "Hi"}]


def chat(**fields):
    return ("/v1/chat/completions", {"model": MODEL, "messages": MSGS, **fields})


def completion(**fields):
    return ("/v1/completions", {"model": MODEL, "prompt": "Hello", **fields})


def without(path_body, field):
    path, body = path_body
    return path, {k: v for k, v in body.items() if k != field}


BAD_400 = {
    "temperature negative": (chat(temperature=-0.5), "temperature"),
    "temperature not a number": (chat(temperature="hot"), "temperature"),
    "top_p above 1": (chat(top_p=1.5), "top_p"),
    "top_p zero": (chat(top_p=0), "top_p"),
    "n zero": (chat(n=0), "n"),
    "n not an integer": (chat(n=1.5), "n"),
    "max_tokens zero": (chat(max_tokens=0), "max_tokens"),
    "max_tokens a string": (chat(max_tokens="ten"), "max_tokens"),
    "max_completion_tokens zero": (chat(max_completion_tokens=0), "max_completion_tokens"),
    "top_k fractional": (chat(top_k=2.5), "top_k"),
    "top_k below -1": (chat(top_k=-2), "top_k"),
    "min_p above 1": (chat(min_p=1.5), "min_p"),
    "presence_penalty above 2": (chat(presence_penalty=3), "presence_penalty"),
    "frequency_penalty below -2": (chat(frequency_penalty=-3), "frequency_penalty"),
    "repetition_penalty zero": (chat(repetition_penalty=0), "repetition_penalty"),
    "seed a string": (chat(seed="abc"), "seed"),
    "logprobs not a bool": (chat(logprobs="yes"), "logprobs"),
    "top_logprobs above 20": (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    "top_logprobs without logprobs": (chat(top_logprobs=2), "top_logprobs"),
    "stop a number": (chat(stop=5), "stop"),
    "stop_token_ids negative": (chat(stop_token_ids=[-1]), "stop_token_ids"),
    "stream not a bool": (chat(stream="yes"), "stream"),
    "stream_options without stream": (chat(stream_options={"include_usage": True}), "stream_options"),
    "min_tokens above max_tokens": (chat(max_tokens=2, min_tokens=5), "min_tokens"),
    "prompt + max_tokens beyond the context": (chat(max_tokens=8190), "max_tokens"),
    "messages missing": (without(chat(), "messages"), "messages"),
    "messages empty": (chat(messages=[]), "messages"),
    "message role unknown": (chat(messages=[{"role": "wizard", "content": "hi"}]), "messages"),
    "message content a number": (chat(messages=[{"role": "user", "content": 5}]), "messages"),
    "message content an image": (chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), "messages"),
    "prompt empty string": (completion(prompt=""), "prompt"),
    "prompt empty list": (completion(prompt=[]), "prompt"),
    "prompt token id out of vocabulary": (completion(prompt=[1, 10**9]), "prompt"),
    "prompt missing": (without(completion(), "prompt"), "prompt"),
    "prompt of the whole context": (completion(prompt=[1] * 8192), "prompt"),
    "token prompt + max_tokens beyond the context": (completion(prompt=[1] * 8000, max_tokens=500), "max_tokens"),
    "completion logprobs above 20": (completion(logprobs=21), "logprobs"),
    "completion logprobs negative": (completion(logprobs=-1), "logprobs"),
    "max_tokens 0 without echo": (completion(max_tokens=0), "max_tokens"),
    "prompt_logprobs streamed": (completion(prompt_logprobs=1, stream=True), "prompt_logprobs"),
    "prompt_logprobs above 20": (completion(prompt_logprobs=21), "prompt_logprobs"),
    "tokenize prompt not a string": (("/tokenize", {"model": MODEL, "prompt": 5}), "prompt"),
    "detokenize token out of vocabulary": (("/detokenize", {"model": MODEL, "tokens": [10**9]}), "tokens"),
    "detokenize tokens negative": (("/detokenize", {"model": MODEL, "tokens": [-3]}), "tokens"),
    # Lone UTF-16 surrogates (JSON "\\ud800") are not text: the tokenizer and the encoders fail on them.
    "prompt with a lone surrogate": (completion(prompt="\ud800"), "prompt"),
    "prompt list with a lone surrogate": (completion(prompt=["ok", "a\udc00b"]), "prompt"),
    "message content with a lone surrogate": (chat(messages=[{"role": "user", "content": "hi \ud800"}]),
                                              "messages"),
    "content part with a lone surrogate": (chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "\udfff"}]}]), "messages"),
    "stop with a lone surrogate": (chat(stop=["\ud800"]), "stop"),
    "temperature a lone surrogate": (chat(temperature="\ud800"), "temperature"),
    "tokenize prompt with a lone surrogate": (("/tokenize", {"model": MODEL, "prompt": "\ud800"}), "prompt"),
    "tokenize messages with a lone surrogate": (("/tokenize", {"model": MODEL, "messages": [
        {"role": "user", "content": "\ud800"}]}), "messages"),
    "field name with a lone surrogate": (chat(**{"\ud800": 1}), None),
    # Parameters pdserve does not implement are refused, not ignored.
    "logit_bias key not a token id": (chat(logit_bias={"abc": 5}), "logit_bias"),
    "logit_bias key out of vocabulary": (chat(logit_bias={"49152": 5}), "logit_bias"),
    "logit_bias above 100": (chat(logit_bias={"5": 100.5}), "logit_bias"),
    "logit_bias not a number": (chat(logit_bias={"5": "x"}), "logit_bias"),
    "guided_json (vLLM extension)": (chat(guided_json={"type": "object"}), "guided_json"),
    "guided_choice (vLLM extension)": (completion(guided_choice=["yes", "no"]), "guided_choice"),
    "use_beam_search (vLLM extension)": (completion(use_beam_search=True), "use_beam_search"),
    "allowed_token_ids empty": (chat(allowed_token_ids=[]), "allowed_token_ids"),
    "allowed_token_ids out of vocabulary": (chat(allowed_token_ids=[1, 49152]), "allowed_token_ids"),
    "allowed_token_ids negative": (completion(allowed_token_ids=[-1]), "allowed_token_ids"),
    "bad_words not a list": (completion(bad_words="x"), "bad_words"),
    "bad_words blank": (completion(bad_words=[" "]), "bad_words"),
    "logit_bias out of vocabulary": (completion(logit_bias={"999999999": 500}), "logit_bias"),
    "logit_bias not an object": (completion(logit_bias=[1]), "logit_bias"),
    "best_of above n": (completion(best_of=2), "best_of"),
    "best_of zero": (completion(best_of=0), "best_of"),
    "chat best_of above n": (chat(n=2, best_of=3), "best_of"),
    "tools without a tool-call parser": (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]),
                                         "tool_choice"),
    "functions": (chat(functions=[{"name": "f", "parameters": {}}]), "functions"),
    "function_call forced": (chat(function_call={"name": "f"}), "function_call"),
    "tool_choice required": (chat(tool_choice="required"), "tool_choice"),
    "stop_token_ids out of vocabulary": (chat(stop_token_ids=[5, 49152]), "stop_token_ids"),
    "completion stop_token_ids out of vocabulary": (completion(stop_token_ids=[10**9]), "stop_token_ids"),
    "33 stop strings": (chat(stop=[f"s{i}" for i in range(33)]), "stop"),
    "stop string of 257 characters": (completion(stop=["x" * 257]), "stop"),
    # structured outputs: shape and JSON-schema validity are the router's checks, before queueing
    "response_format unknown type": (chat(response_format={"type": "yaml"}), "response_format"),
    "response_format json_schema without an object": (chat(response_format={"type": "json_schema",
                                                                            "json_schema": "x"}), "response_format"),
    "response_format invalid schema": (chat(response_format={"type": "json_schema", "json_schema": {
        "name": "p", "strict": True, "schema": {"type": "object", "properties": {"a": {"type": "wizard"}}}}}),
        "response_format"),
    "response_format and structured_outputs": (chat(response_format={"type": "json_object"},
                                                    structured_outputs={"regex": "a+"}), "response_format"),
    "structured_outputs two kinds": (chat(structured_outputs={"regex": "a+", "choice": ["a"]}),
                                     "structured_outputs"),
    "structured_outputs unknown kind": (completion(structured_outputs={"yaml": "a"}), "structured_outputs"),
    "structured_outputs invalid schema": (completion(structured_outputs={"json": {"minItems": -1}}),
                                          "structured_outputs"),
    "structured_outputs choice empty": (completion(structured_outputs={"choice": []}), "structured_outputs"),
    "response_format keyword the grammar cannot enforce": (chat(response_format={"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}),
        "response_format"),
}

# Exact bodies of the refusals above whose message is pdserve's own (not pydantic's).
EXACT_MESSAGE = {
    "prompt with a lone surrogate": "Invalid value for 'prompt': a string contains a lone UTF-16 surrogate, which "
                                    "is not valid Unicode (UTF-8) text",
    "stop with a lone surrogate": "Invalid value for 'stop': a string contains a lone UTF-16 surrogate, which is "
                                  "not valid Unicode (UTF-8) text",
    "field name with a lone surrogate": "A field name contains a lone UTF-16 surrogate, which is not valid Unicode "
                                        "(UTF-8) text",
    "logit_bias key not a token id": "logit_bias keys must be token ids (decimal integers), got 'abc'",
    "logit_bias key out of vocabulary": "logit_bias must be token ids below the vocabulary size 49152, got 49152",
    "logit_bias above 100": "logit_bias must be biases in [-100, 100], got 100.5 for token 5",
    "allowed_token_ids empty": "allowed_token_ids must be a non-empty list of non-negative integers, got []",
    "allowed_token_ids out of vocabulary": "allowed_token_ids must be token ids below the vocabulary size 49152, "
                                           "got 49152",
    "guided_json (vLLM extension)": "guided_json is not supported",
    "use_beam_search (vLLM extension)": "use_beam_search is not supported",
    "logit_bias out of vocabulary": "logit_bias must be biases in [-100, 100], got 500 for token 999999999",
    "best_of above n": "best_of is not supported (only null, 1 or equal to n)",
    "chat best_of above n": "best_of is not supported (only null, 1 or equal to n)",
    "tools without a tool-call parser": '"auto" tool choice requires --enable-auto-tool-choice and '
                                        '--tool-call-parser to be set',
    "functions": "functions is not supported (no tool-call parser)",
    "function_call forced": "function_call other than 'none' or 'auto' is not supported (no tool-call parser)",
    "stop_token_ids out of vocabulary": "Token id 49152 is out of vocabulary (size 49152)",
    "33 stop strings": "stop must be at most 32 strings, got 33",
    "stop string of 257 characters": "stop must be strings of at most 256 characters, got one of 257",
    "response_format unknown type": "response_format type must be 'text', 'json_object' or 'json_schema', got 'yaml'",
    "response_format invalid schema": "response_format holds an invalid JSON schema at properties/a/type: 'wizard' "
                                      "is not valid under any of the given schemas",
    "response_format and structured_outputs": "response_format and structured_outputs cannot both be set",
    "structured_outputs two kinds": "structured_outputs must set exactly one of json, regex, choice, grammar, "
                                    "json_object, got ['choice', 'regex']",
    "structured_outputs invalid schema": "structured_outputs holds an invalid JSON schema at minItems: -1 is less "
                                         "than the minimum of 0",
}


def assert_error(resp: httpx.Response, status: int, err_type: str, param: str | None) -> None:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == err_type
    assert body["error"]["param"] == param
    assert body["error"]["code"] == status
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]


def assert_next_request_works(router) -> None:
    resp = httpx.post(router.url + "/v1/chat/completions", timeout=30,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "What about France?"}]})
    assert resp.status_code == 200, resp.text
    assert "Paris" in resp.json()["choices"][0]["message"]["content"]


class TestBadParameter:
    """One router and stand-in worker for all the 400 cases (a router per case cost ~0.4 s of CPU, 72 times); a
    refused request leaves nothing behind (each case checks that), so the cases cannot disturb each other. The class
    scope stops both before the module's other tests, which flush Redis and start their own."""

    @pytest.fixture(scope="class")
    def shared_router(self, redis_url, registry_url, processor):
        import redis
        from router_harness import Pods, start_router
        from stand_in_worker import StandInWorker
        from pdserve.services.router.settings import RouterSettings

        client = redis.Redis.from_url(redis_url)
        client.flushdb()
        pods = Pods(registry_url)
        pods.add("decode-0")
        pods.add("prefill-0", role="prefill")
        worker = StandInWorker(redis_url, processor.tokenizer, pod_ids=["decode-0", "decode-1"])
        worker.start()
        server = start_router(RouterSettings(redis_url=redis_url, registry_url=registry_url,
                                             max_body_bytes=64 * 1024, registry_cache_s=0.0), processor, pods)
        yield server, worker
        server.stop()
        worker.stop()
        client.close()

    @pytest.mark.parametrize("case", list(BAD_400))
    def test_bad_parameter_gets_400_naming_it(self, shared_router, case):
        router, worker = shared_router
        worker.received.clear()  # the previous case's valid request
        (path, body), param = BAD_400[case]
        # json.dumps escapes lone surrogates as "\\ud800" (httpx's json= would fail to encode them)
        resp = httpx.post(router.url + path, content=json.dumps(body), timeout=30,
                          headers={"content-type": "application/json"})
        assert_error(resp, 400, "BadRequestError", param)
        if case in EXACT_MESSAGE:
            assert resp.json() == {"error": {"message": EXACT_MESSAGE[case], "type": "BadRequestError",
                                             "param": param, "code": 400}}
        assert worker.received == []  # nothing was queued
        assert_next_request_works(router)


def test_long_chat_prompt_is_rejected_naming_messages(router, worker, processor):
    content = "hello " * 9000
    assert len(processor.tokenizer.encode(content)) >= 8192
    resp = httpx.post(router.url + "/v1/chat/completions", timeout=30,
                      json={"model": MODEL, "messages": [{"role": "user", "content": content}]})
    assert_error(resp, 400, "BadRequestError", "messages")
    assert "maximum context length is 8192" in resp.json()["error"]["message"]
    assert_next_request_works(router)


@pytest.mark.parametrize("raw", [b'{"model": "smollm2-135m-instruct", "messages": [', b"not json", b"[1, 2]", b""])
def test_malformed_json_gets_400(router, worker, raw):
    resp = httpx.post(router.url + "/v1/chat/completions", content=raw, timeout=30,
                      headers={"content-type": "application/json"})
    assert_error(resp, 400, "BadRequestError", None)
    assert_next_request_works(router)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/tokenize"])
def test_unknown_model_gets_404_naming_model(router, worker, path):
    body = {"model": "gpt-17", "messages": MSGS} if "chat" in path else {"model": "gpt-17", "prompt": "Hi"}
    resp = httpx.post(router.url + path, json=body, timeout=30)
    assert_error(resp, 404, "NotFoundError", "model")
    assert "gpt-17" in resp.json()["error"]["message"]
    assert_next_request_works(router)


def test_body_over_the_limit_gets_413_by_content_length(router, worker):
    big = {"model": MODEL, "prompt": "x" * (router.settings.max_body_bytes + 10)}
    resp = httpx.post(router.url + "/v1/completions", json=big, timeout=30)
    assert_error(resp, 413, "RequestTooLargeError", None)
    assert_next_request_works(router)


def test_body_over_the_limit_gets_413_when_streamed_without_length(router, worker):
    def chunks():
        yield b'{"model": "smollm2-135m-instruct", "prompt": "'
        for _ in range(router.settings.max_body_bytes // 1000 + 2):
            yield b"x" * 1000
        yield b'"}'

    resp = httpx.post(router.url + "/v1/completions", content=chunks(), timeout=30,
                      headers={"content-type": "application/json"})
    assert "content-length" not in resp.request.headers
    assert_error(resp, 413, "RequestTooLargeError", None)
    assert_next_request_works(router)


def test_no_decode_pod_gets_503_with_retry_after(router, worker):
    router.pods.remove("decode-0")
    resp = httpx.post(router.url + "/v1/chat/completions", json=chat()[1], timeout=30)
    assert_error(resp, 503, "ServiceUnavailableError", None)
    assert int(resp.headers["retry-after"]) >= 1
    assert worker.received == []
    router.pods.add("decode-0")
    assert_next_request_works(router)


def test_unreachable_registry_gets_503(redis_url, processor, pods, worker):
    from router_harness import free_port, start_router
    from pdserve.services.router.settings import RouterSettings

    dead = start_router(RouterSettings(redis_url=redis_url, registry_url=f"http://127.0.0.1:{free_port()}"),
                        processor, pods)
    try:
        resp = httpx.post(dead.url + "/v1/chat/completions", json=chat()[1], timeout=30)
        assert_error(resp, 503, "ServiceUnavailableError", None)
        assert "registry" in resp.json()["error"]["message"]
    finally:
        dead.stop()


SUPPORTED = ["POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "GET /v1/models/{model}",
             "POST /tokenize", "POST /detokenize", "GET /health", "GET /metrics", "GET /version",
             "POST /v1/responses", "GET /v1/responses/{response_id}", "DELETE /v1/responses/{response_id}",
             "GET /v1/pdserve/requests"]


@pytest.mark.parametrize("method,path", [("GET", "/v1/nothing"), ("POST", "/v1/embeddings"),
                                         ("POST", "/v1/audio/speech"), ("GET", "/nowhere")])
def test_unknown_path_gets_openai_404_naming_it_and_listing_every_endpoint(router, method, path):
    resp = httpx.request(method, router.url + path, json={"model": MODEL, "input": "Hi"}, timeout=30)
    assert_error(resp, 404, "NotFoundError", None)
    message = resp.json()["error"]["message"]
    assert message.startswith(f"Unknown endpoint {method} {path}. Supported endpoints: ")
    listed = message.removeprefix(f"Unknown endpoint {method} {path}. Supported endpoints: ").rstrip(".").split(", ")
    assert sorted(listed) == sorted(SUPPORTED)


@pytest.mark.parametrize("method,path,allowed", [("GET", "/v1/chat/completions", "POST"),
                                                 ("DELETE", "/v1/completions", "POST"),
                                                 ("POST", "/v1/models", "GET")])
def test_wrong_method_on_a_known_path_gets_openai_405_naming_the_allowed_one(router, method, path, allowed):
    resp = httpx.request(method, router.url + path, timeout=30)
    assert_error(resp, 405, "MethodNotAllowedError", None)
    assert resp.json()["error"]["message"] == f"Method {method} is not allowed on {path}; allowed: {allowed}."
    assert resp.headers["allow"] == allowed


def test_redis_down_gets_503_and_unhealthy(registry_url, processor, pods, monkeypatch):
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from router_harness import free_port, start_router
    from pdserve.services.router.settings import RouterSettings
    from pdserve.shared import redis_client

    # Redis stays down whatever the retry policy: without the router's backoff (~7 s per command, to ride out a
    # restart) the 503 comes in a moment instead of after ~20 s of pauses (the fast tier's budget).
    monkeypatch.setattr(redis_client, "_retry_kwargs", lambda *a: {"retry": Retry(NoBackoff(), 1)})
    down = start_router(RouterSettings(redis_url=f"redis://127.0.0.1:{free_port()}/0", registry_url=registry_url),
                        processor, pods)
    try:
        resp = httpx.post(down.url + "/v1/chat/completions", json=chat()[1], timeout=30)
        assert_error(resp, 503, "ServiceUnavailableError", None)
        assert resp.headers["retry-after"] == "1"
        health = httpx.get(down.url + "/health", timeout=30)
        assert health.status_code == 503 and health.json()["status"] == "unavailable"
    finally:
        down.stop()


def test_tool_choice_is_refused_naming_it(router, worker):
    resp = httpx.post(router.url + "/v1/chat/completions", timeout=30,
                      json=chat(tool_choice={"type": "function", "function": {"name": "f"}})[1])
    assert_error(resp, 400, "BadRequestError", "tool_choice")
    assert_next_request_works(router)


@pytest.mark.parametrize("body, expected", [
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": True, "schema": {
        "type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}}}},
     {"json": '{"type":"object","properties":{"b":{"type":"integer"},"a":{"type":"string"}}}'}),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, {"choice": ["yes", "no"]}),
    ({"structured_outputs": {"json": None, "regex": "[0-9]+", "choice": None}}, {"regex": "[0-9]+"}),
])
def test_response_format_and_structured_outputs_reach_the_worker_as_one_field(router, worker, body, expected):
    # max_tokens: without it the stand-in worker streams the whole context's worth of filler (~10 s a case)
    resp = httpx.post(router.url + "/v1/chat/completions", timeout=30,
                      json={"model": MODEL, "messages": MSGS, "max_tokens": 4, **body})
    assert resp.status_code == 200, resp.text
    assert worker.received[-1].request.sampling_params.structured_outputs == expected


def test_bad_client_request_id_is_refused_and_a_reused_one_still_works(router, worker):
    resp = httpx.post(router.url + "/v1/chat/completions", json=chat(request_id="bad id with spaces")[1], timeout=30)
    assert_error(resp, 400, "BadRequestError", "request_id")
    for _ in range(2):  # the same client id twice: separate internal requests, same response id
        resp = httpx.post(router.url + "/v1/chat/completions", timeout=30, headers={"X-Request-Id": "my-id"},
                          json={"model": MODEL, "messages": [{"role": "user", "content": "France?"}]})
        assert resp.status_code == 200 and resp.json()["id"] == "chatcmpl-my-id"
    assert len({r.request.request_id for r in worker.received}) == 2


def test_request_over_the_concurrency_limit_gets_429_with_retry_after(redis_url, registry_url, processor, pods,
                                                                     worker):
    from router_harness import start_router
    from pdserve.services.router.settings import RouterSettings

    worker.delay_s = 0.05
    limited = start_router(RouterSettings(redis_url=redis_url, registry_url=registry_url,
                                          max_concurrent_requests=1), processor, pods)
    try:
        with httpx.stream("POST", limited.url + "/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "Hi", "max_tokens": 20, "stream": True}) as first:
            chunks = read_chunks(first.iter_lines())  # (dropping it would close the stream: a client disconnect)
            next(chunks)  # the first request is being served
            resp = httpx.post(limited.url + "/v1/completions", json=completion(max_tokens=5)[1], timeout=30)
            assert_error(resp, 429, "RateLimitError", None)
            assert int(resp.headers["retry-after"]) >= 1
            assert len(worker.received) == 1
            rest = list(chunks)  # read strictly to data: [DONE]
        assert rest[-1]["choices"][0]["finish_reason"] == "length"
        worker.delay_s = 0.0
        assert httpx.post(limited.url + "/v1/completions", json=completion(max_tokens=5)[1],
                          timeout=30).status_code == 200
    finally:
        limited.stop()


NO_OP_VALUES = {
    "logit_bias null": chat(logit_bias=None),
    "logit_bias empty": completion(logit_bias={}),
    "logit_bias at the bounds": chat(logit_bias={"0": -100, "49151": 100}),
    "allowed_token_ids": chat(allowed_token_ids=[1, 2]),
    "bad_words": completion(bad_words=["x", "hello world"]),
    "best_of 1": completion(best_of=1),
    "best_of equal to n": completion(n=2, best_of=2),
    "tools empty": chat(tools=[], tool_choice="none"),
    "tools null": chat(tools=None, tool_choice=None),
    "functions empty": chat(functions=[], function_call="none"),
    "stop_token_ids last in vocabulary": chat(stop_token_ids=[49151]),
    "32 stop strings of 256 characters": completion(stop=[f"{i:03d}" + "z" * 253 for i in range(32)]),
    "non-ASCII text and a surrogate pair": completion(prompt="caf\u00e9 \U0001F600", stop=["\U0001F600"]),
}


@pytest.mark.parametrize("case", list(NO_OP_VALUES))
def test_no_op_values_of_unsupported_parameters_are_accepted(router, worker, case):
    path, body = NO_OP_VALUES[case]
    body = {**body, "max_tokens": 5}  # the stand-in worker otherwise generates up to the context length
    resp = httpx.post(router.url + path, content=json.dumps(body), timeout=30,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"]) == body.get("n", 1)
    params = worker.received[0].request.sampling_params.to_dict()
    assert params["stop_token_ids"] == body.get("stop_token_ids", [])
    assert params["stop"] == body.get("stop", [])
    assert_next_request_works(router)


def test_logits_processor_parameters_reach_the_engine_typed_and_tokenized(router, worker, processor):
    """OpenAI's string-keyed ``logit_bias`` arrives keyed by token id; ``bad_words`` arrive with their token ids,
    each word as written and after a space (vLLM's rule), by the model's own tokenizer."""
    body = {**completion(logit_bias={"5": 100, "7": -3.5}, allowed_token_ids=[5, 7], bad_words=["hello"])[1],
            "max_tokens": 2}
    resp = httpx.post(router.url + "/v1/completions", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    params = worker.received[0].request.sampling_params
    assert params.logit_bias == {5: 100.0, 7: -3.5}
    assert params.allowed_token_ids == [5, 7]
    encode = processor.tokenizer.encode
    assert params.bad_words_token_ids == [encode("hello", add_special_tokens=False),
                                          encode(" hello", add_special_tokens=False)]
