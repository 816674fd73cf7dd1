"""The router through the official ``openai`` client and raw SSE, with the stand-in worker as the backend.

The decode/prefill side is ``StandInWorker``: it stands in for the real workers (which have their own tests);
what is checked here is the router's side of the contract: requests queued as the worker expects, and the
worker's events turned into OpenAI responses and SSE chunks.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from pdserve.loadtest.sse import DONE, parse_line, read_chunks
from pdserve.shared.protocol import keys
from stand_in_worker import PARIS

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def client(router, worker) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_chat_completion_answers_paris_with_exact_usage(client, processor, worker):
    resp = client.chat.completions.create(model="smollm2-135m-instruct", messages=FRANCE, temperature=0)
    prompt_ids = processor.tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=True)
    prompt_ids = prompt_ids["input_ids"] if isinstance(prompt_ids, dict) or hasattr(prompt_ids, "keys") else prompt_ids
    completion_ids = processor.tokenizer.encode(PARIS, add_special_tokens=False) + [processor.tokenizer.eos_token_id]

    assert resp.choices[0].message.content == PARIS
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason == "stop"
    assert resp.object == "chat.completion"
    assert resp.id.startswith("chatcmpl-")
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.completion_tokens == len(completion_ids)
    assert resp.usage.total_tokens == len(prompt_ids) + len(completion_ids)
    # The queued request is what the workers expect: the chat-templated prompt, greedy, room up to the context.
    (received,) = worker.received
    assert received.stream == keys.PREFILL_STREAM
    assert received.request.prompt_token_ids == list(prompt_ids)
    assert received.request.sampling_params.temperature == 0
    assert received.request.sampling_params.max_tokens == 8192 - len(prompt_ids)
    assert received.request.decode_pod_id == "decode-0"


def test_streamed_and_non_streamed_chat_are_identical(client):
    whole = client.chat.completions.create(model="smollm2-135m-instruct", messages=FRANCE, temperature=0)
    chunks = list(client.chat.completions.create(model="smollm2-135m-instruct", messages=FRANCE, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    # include_usage: every chunk has usage null except the last, which has no choices and the usage.
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_completions_stream_and_whole_agree_and_finish_by_length(client, processor):
    prompt = "Once upon a time"
    whole = client.completions.create(model="smollm2-135m-instruct", prompt=prompt, max_tokens=7)
    chunks = list(client.completions.create(model="smollm2-135m-instruct", prompt=prompt, max_tokens=7,
                                            stream=True))
    assert whole.object == "text_completion"
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text != ""
    assert whole.choices[0].finish_reason == "length"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(processor.tokenizer.encode(prompt))
    assert whole.usage.completion_tokens == 7


def test_n_choices_are_fanned_out_and_usage_counts_the_prompt_once(client, worker):
    resp = client.completions.create(model="smollm2-135m-instruct", prompt=[1, 2, 3, 4], max_tokens=3, n=3,
                                     seed=10)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert resp.usage.prompt_tokens == 4 and resp.usage.completion_tokens == 9
    requests = sorted((r.request for r in worker.received), key=lambda r: r.choice_index)
    assert [r.choice_index for r in requests] == [0, 1, 2]
    assert [r.sampling_params.seed for r in requests] == [10, 11, 12]
    assert len({r.request_id for r in requests}) == 3


def test_batch_of_prompts_gets_one_choice_each(client):
    resp = client.completions.create(model="smollm2-135m-instruct", prompt=["Hello", "What about France?"],
                                     max_tokens=20)
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.choices[1].text == PARIS


def test_chat_logprobs_in_openai_format(client, processor):
    resp = client.chat.completions.create(model="smollm2-135m-instruct", messages=FRANCE, max_tokens=3,
                                          logprobs=True, top_logprobs=2)
    content = resp.choices[0].logprobs.content
    assert len(content) == 3
    first_id = processor.tokenizer.encode(PARIS, add_special_tokens=False)[0]
    assert content[0].token == processor.tokenizer.decode([first_id])
    assert content[0].logprob == -0.25
    assert content[0].bytes == list(content[0].token.encode())
    assert [t.logprob for t in content[0].top_logprobs] == [-0.25, -1.5]


def test_completion_logprobs_in_legacy_format(client):
    resp = client.completions.create(model="smollm2-135m-instruct", prompt="What about France?", max_tokens=3,
                                     logprobs=1)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    assert lp.top_logprobs[0] == {lp.tokens[0]: -0.25}


def test_raw_sse_stream_format(router, worker):
    body = {"model": "smollm2-135m-instruct", "messages": FRANCE, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        chunks = list(read_chunks(resp.iter_lines()))  # only data lines, ending with data: [DONE]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


def test_output_streams_are_removed_after_the_response(client, redis_client):
    client.chat.completions.create(model="smollm2-135m-instruct", messages=FRANCE)
    assert list(redis_client.scan_iter(match=keys.OUTPUT_STREAMS_MATCH)) == []


def test_worker_error_reaches_the_client_and_the_next_request_works(client):
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model="smollm2-135m-instruct", prompt="TRIGGER_WORKER_ERROR", max_tokens=3)
    assert info.value.body["message"] == "the stand-in worker failed"
    assert client.chat.completions.create(model="smollm2-135m-instruct",
                                          messages=FRANCE).choices[0].message.content == PARIS


GAP = "The output of this request lost tokens 2..2 on the way from its worker; the request was aborted"


def test_output_that_skips_a_token_fails_the_request_and_aborts_it(client, worker):
    """A lost event (the third token's) is never papered over: the client gets a 500 saying which tokens were lost,
    not a 200 with a hole in the text, and the worker is told to stop."""
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model="smollm2-135m-instruct", prompt="TRIGGER_OUTPUT_GAP", max_tokens=8,
                                  logprobs=1)
    assert info.value.body == {"message": GAP, "type": "InternalServerError", "param": None, "code": 500}
    assert worker.abort_seen.wait(5)


def test_streamed_output_that_skips_a_token_ends_with_an_error_event(router, worker):
    body = {"model": "smollm2-135m-instruct", "prompt": "TRIGGER_OUTPUT_GAP", "stream": True, "max_tokens": 8}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as resp:
        events = [e for e in map(parse_line, resp.iter_lines()) if e is not None]  # strict: data lines only
    assert events[-1] == DONE
    assert events[-2] == {"error": {"message": GAP, "type": "InternalServerError", "param": None, "code": 500}}
    assert len(events) == 4  # the two tokens before the gap, the error, [DONE]


def test_models_lists_the_served_model_with_its_context_length(client):
    (model,) = client.models.list().data
    assert model.id == "smollm2-135m-instruct"
    assert model.model_extra["max_model_len"] == 8192


def test_worker_error_mid_stream_is_an_sse_error_event_then_done(router, worker):
    body = {"model": "smollm2-135m-instruct", "prompt": "TRIGGER_WORKER_ERROR", "stream": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as resp:
        chunks = list(read_chunks(resp.iter_lines()))
    assert chunks[-1] == {"error": {"message": "the stand-in worker failed",
                                                   "type": "InternalServerError", "param": None, "code": 500}}


def test_request_without_output_times_out_with_504_and_is_aborted(redis_url, registry_url, processor, pods,
                                                                  redis_client):
    """No worker at all: the router gives up after request_timeout_s and aborts the queued request."""
    from router_harness import start_router
    from pdserve.services.router.settings import RouterSettings

    server = start_router(RouterSettings(redis_url=redis_url, registry_url=registry_url, request_timeout_s=1.0,
                                         output_keepalive_s=0.5),
                          processor, pods)
    try:
        resp = httpx.post(server.url + "/v1/completions", timeout=30,
                          json={"model": "smollm2-135m-instruct", "prompt": "Hi", "max_tokens": 2})
        assert resp.status_code == 504
        assert resp.json()["error"]["type"] == "TimeoutError" and resp.json()["error"]["param"] is None
        (entry,) = redis_client.xrange(keys.PREFILL_STREAM)
        rid = entry[1][b"request_id"].decode()
        assert redis_client.exists(keys.aborted_key(rid))
    finally:
        server.stop()


def test_endpoints_pdserve_lacks_raise_not_found_naming_the_path(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.embeddings.create(model="smollm2-135m-instruct", input="Hi")
    assert info.value.body["type"] == "NotFoundError" and info.value.body["code"] == 404
    assert info.value.body["message"].startswith("Unknown endpoint POST /v1/embeddings. Supported endpoints: ")
    assert "POST /v1/chat/completions" in info.value.body["message"]
    with pytest.raises(openai.NotFoundError) as info:
        client.audio.speech.create(model="smollm2-135m-instruct", input="Hi", voice="alloy")
    assert info.value.body["message"].startswith("Unknown endpoint POST /v1/audio/speech. ")
