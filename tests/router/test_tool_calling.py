"""Tool calling and the Responses API through the router, with the official ``openai`` client and the stand-in
worker scripted to write the model's text (a Hermes ``<tool_call>`` block, then an answer): the client sees
OpenAI-shaped ``tool_calls`` (whole and as streamed deltas), a ``role: tool`` message reaches the next prompt
through the chat template, and ``/v1/responses`` serves, streams, stores and continues a conversation."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from pdserve.services.router import templates
from pdserve.services.router.settings import RouterSettings
from router_harness import start_router

TEMPLATE = Path(templates.__path__[0]) / "hermes_tools.jinja"
MODEL = "smollm2-135m-instruct"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def tool_router(redis_url, registry_url, processor, pods, monkeypatch):
    monkeypatch.setattr(processor, "chat_template", TEMPLATE.read_text())
    settings = RouterSettings(redis_url=redis_url, registry_url=registry_url, registry_cache_s=0.0,
                              tool_call_parser="hermes", enable_auto_tool_choice=True, responses_ttl_s=60)
    server = start_router(settings, processor, pods)
    yield server
    server.stop()


@pytest.fixture
def client(tool_router, worker) -> openai.OpenAI:
    worker.replies.update({"weather in Paris": CALL, "<tool_response>": "It is 22 C and sunny in Paris."})
    return openai.OpenAI(base_url=tool_router.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_tool_call_round_trip_with_the_sdk(client, worker, processor):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # the tools were rendered into the prompt by the template
    assert '"name": "get_weather"' in processor.decode(worker.received[0].request.prompt_token_ids)

    messages = ASK + [choice.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "22 C, sunny"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    assert second.choices[0].message.content == "It is 22 C and sunny in Paris."
    assert second.choices[0].finish_reason == "stop" and not second.choices[0].message.tool_calls
    prompt = processor.decode(worker.received[1].request.prompt_token_ids)
    assert prompt.endswith(f"<|im_start|>assistant\n{CALL}<|im_end|>\n<|im_start|>user\n<tool_response>\n"
                           "22 C, sunny\n</tool_response>\n<|im_end|>\n<|im_start|>assistant\n")


def test_streamed_tool_call_deltas_are_openai_shaped(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], stream=True))
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].index == 0 and deltas[0].id.startswith("chatcmpl-tool-")
    assert deltas[0].function.name == "get_weather" and deltas[0].function.arguments == ""
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert json.loads("".join(d.function.arguments for d in deltas)) == {"city": "Paris"}
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]


def test_tool_choice_none_answers_in_text(client):
    resp = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none")
    assert resp.choices[0].message.content == CALL and resp.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, param, message", [
    ({"tool_choice": "auto"}, "tool_choice", "When using `tool_choice`, `tools` must be set."),
    ({"tools": [WEATHER], "tool_choice": "any"}, "tool_choice",
     'Invalid value for `tool_choice`: any! Only named tools, "none", "auto" or "required" are supported.'),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "The tool specified in `tool_choice` does not match any of the specified `tools`"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice",
     'Invalid value for `function`: `None` in `tool_choice`! Correct usage: `{"type": "function", "function": '
     '{"name": "my_function"}}`'),
])
def test_bad_tool_choice_gets_vllms_400(tool_router, body, param, message):
    r = httpx.post(tool_router.url + "/v1/chat/completions", json={"model": MODEL, "messages": ASK, **body}, timeout=30)
    assert r.status_code == 400
    assert r.json() == {"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}


@pytest.mark.parametrize("tool, message", [
    ({"type": "function", "function": {}}, "'tools.0.function.name': Field required"),
    ({"type": "retrieval"}, "Invalid value for 'tools.0.type': Input should be 'function' (got 'retrieval')"),
    ({"type": "function", "function": {"name": "get weather"}},
     "Invalid value for 'tools.0.function.name': String should match pattern '^[A-Za-z0-9_-]+$' (got 'get weather')"),
])
def test_bad_tool_spec_gets_a_400_naming_tools(tool_router, tool, message):
    r = httpx.post(tool_router.url + "/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": ASK, "tools": [tool]})
    assert r.status_code == 400
    assert r.json() == {"error": {"message": message, "type": "BadRequestError", "param": "tools", "code": 400}}


def test_auto_without_a_parser_gets_vllms_400(router):
    r = httpx.post(router.url + "/v1/chat/completions", json={"model": MODEL, "messages": ASK, "tools": [WEATHER]},
                   timeout=30)
    assert r.status_code == 400
    assert r.json()["error"] == {"message": '"auto" tool choice requires --enable-auto-tool-choice and '
                                            "--tool-call-parser to be set", "type": "BadRequestError",
                                 "param": "tool_choice", "code": 400}


# ---- Responses API ----------------------------------------------------------------------------------------

def test_responses_create_then_continue_with_previous_response_id(client, worker, processor):
    first = client.responses.create(model=MODEL, input="What is the capital of France?", instructions="Be brief.")
    assert first.status == "completed" and first.output_text == " The capital of France is Paris."
    assert first.usage.input_tokens == len(worker.received[0].request.prompt_token_ids)
    assert client.responses.retrieve(first.id).output_text == first.output_text

    second = client.responses.create(model=MODEL, input="And of Italy?", previous_response_id=first.id)
    prompt = processor.decode(worker.received[1].request.prompt_token_ids)
    # the stored input and output come first; the first request's instructions are not carried over
    assert "Be brief." not in prompt
    assert prompt.index("What is the capital of France?") < prompt.index("Paris.") < prompt.index("And of Italy?")
    assert second.previous_response_id == first.id

    assert client.responses.delete(first.id) is None
    with pytest.raises(openai.NotFoundError) as exc:
        client.responses.retrieve(first.id)
    assert exc.value.body == {"message": f"Response with id '{first.id}' not found.", "type": "NotFoundError",
                              "param": None, "code": 404}


def test_responses_stream_sends_typed_events_in_order(client):
    events = list(client.responses.create(model=MODEL, input="What is the capital of France?", stream=True))
    kinds = [e.type for e in events]
    n_delta = kinds.count("response.output_text.delta")
    assert n_delta > 1
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * n_delta + \
        ["response.output_text.done", "response.content_part.done", "response.output_item.done",
         "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == " The capital of France is Paris." == events[-1].response.output_text
    assert client.responses.retrieve(events[-1].response.id).output_text == text
    # the SDK's own accumulator (responses.stream) follows the events to the same final response
    with client.responses.stream(model=MODEL, input="What is the capital of France?") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == text


def test_responses_function_call_round_trip(client):
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}]
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=tools)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    events = list(client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=tools,
                                          stream=True))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris"}
    with client.responses.stream(model=MODEL, input="What is the weather in Paris?", tools=tools) as stream:
        final = stream.get_final_response()
    assert [(o.type, o.name, json.loads(o.arguments)) for o in final.output] == [
        ("function_call", "get_weather", {"city": "Paris"})]
    answer = client.responses.create(model=MODEL, previous_response_id=first.id, tools=tools, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "22 C"}])
    assert answer.output_text == "It is 22 C and sunny in Paris."


def test_unknown_previous_response_id_gets_404(client):
    with pytest.raises(openai.NotFoundError) as exc:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_missing")
    assert exc.value.body["message"] == "Previous response with id 'resp_missing' not found."
    assert exc.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_and_named_choices_ask_for_guided_decoding(tool_router, worker, tool_choice):
    """Their schema goes to the engine as ``structured_outputs={"json": schema}`` (on the wire: the schema's compact
    JSON text, SamplingParams' normal form), so the arguments always parse."""
    r = httpx.post(tool_router.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": ASK, "tools": [WEATHER], "tool_choice": tool_choice, "max_tokens": 5})
    assert r.status_code == 200, r.text
    want = WEATHER["function"]["parameters"] if isinstance(tool_choice, dict) else None
    got = json.loads(worker.received[0].request.sampling_params.structured_outputs["json"])
    assert got == want or (want is None and got["type"] == "array")


def test_a_forced_tool_call_and_response_format_together_get_400_naming_tool_choice(tool_router):
    """One grammar per request: the forced call's schema must not silently replace the client's own format."""
    r = httpx.post(tool_router.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": ASK, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 5,
        "response_format": {"type": "json_object"}})
    assert r.status_code == 400
    assert r.json()["error"] == {"message": "tool_choice cannot be combined with response_format or "
                                            "structured_outputs", "type": "BadRequestError",
                                 "param": "tool_choice", "code": 400}


def test_responses_text_format_json_schema_asks_for_guided_decoding(tool_router, worker):
    schema = {"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"]}
    r = httpx.post(tool_router.url + "/v1/responses", timeout=30, json={
        "model": MODEL, "input": "What is the capital of France?", "max_output_tokens": 5,
        "text": {"format": {"type": "json_schema", "name": "capital", "schema": schema}}})
    assert r.status_code == 200, r.text
    got = worker.received[0].request.sampling_params.structured_outputs
    assert list(got) == ["json"] and json.loads(got["json"]) == schema


def test_responses_refuses_what_it_does_not_serve_naming_the_field(tool_router):
    for body, param, message in [
        ({"input": [{"type": "reasoning", "summary": []}]}, "input", "input[0]: items of type 'reasoning' are not "
                                                                     "supported"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools", "tools[0]: tools of type 'web_search' are not "
                                                                      "supported (only 'function')"),
    ]:
        r = httpx.post(tool_router.url + "/v1/responses", json={"model": MODEL, **body}, timeout=30)
        assert r.status_code == 400
        assert r.json()["error"] == {"message": message, "type": "BadRequestError", "param": param, "code": 400}
    r = httpx.delete(tool_router.url + "/v1/responses/resp_gone", timeout=30)
    assert r.status_code == 404 and r.json()["error"] == {"message": "Response with id 'resp_gone' not found.",
                                                          "type": "NotFoundError", "param": None, "code": 404}
