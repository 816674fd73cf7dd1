"""Tool calls read out of fixed model texts (hermes, llama3_json), whole and streamed, and the JSON schema that
guided decoding enforces for tool_choice required / a named function (vLLM's ``_get_json_schema_from_tool``),
checked with ``jsonschema`` against valid and invalid calls."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve.services.router.errors import OpenAIError
from pdserve.services.router.tool_calls import ToolPlan, extract_output, guided_schema, tool_plan
from pdserve.services.router.tool_parsers import HermesToolParser, Llama3JsonToolParser, ToolCallStream

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}}, "required": ["zone"],
    "$defs": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}}}}
NO_ARGS = {"type": "function", "function": {"name": "ping"}}

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {"zone": "CET"}}'


def names_args(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("parser, text", [(HermesToolParser(), HERMES), (Llama3JsonToolParser(), LLAMA)])
def test_parser_finds_every_call_with_its_arguments(parser, text):
    out = parser.extract(text)
    assert names_args(out.calls) == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    assert out.content == ("Let me check.\n" if parser.name == "hermes" else None)
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in out.calls)


@pytest.mark.parametrize("parser, text", [
    (HermesToolParser(), "Paris is sunny."), (HermesToolParser(), "<tool_call>{not json</tool_call>"),
    (Llama3JsonToolParser(), "Paris is sunny."), (Llama3JsonToolParser(), '{"name": "x", "parameters": {}} and text'),
])
def test_text_without_a_parseable_call_is_content_whole(parser, text):
    out = parser.extract(text)
    assert out.content == text and out.calls == []


def test_hermes_block_left_open_at_the_end_is_still_a_call():
    out = HermesToolParser().extract('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert names_args(out.calls) == [("get_weather", {"city": "Oslo"})]


@pytest.mark.parametrize("parser, text", [(HermesToolParser(), HERMES), (Llama3JsonToolParser(), LLAMA),
                                          (HermesToolParser(), "No <tool plain text <tool_call"),
                                          (Llama3JsonToolParser(), "Plain {answer}")])
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_deltas_add_up_to_the_whole_extraction(parser, text, step):
    stream, content, calls = ToolCallStream(parser), "", {}
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    results = [stream.feed(p) for p in pieces] + [stream.finish()]
    for c, deltas in results:
        content += c
        for d in deltas:
            entry = calls.setdefault(d["index"], {"name": None, "arguments": ""})
            if "id" in d:
                assert entry["name"] is None  # id and name come first, once
                entry["name"] = d["function"]["name"]
            entry["arguments"] += d["function"]["arguments"]
    whole = parser.extract(text)
    assert content == (whole.content or "")
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == names_args(whole.calls)


def test_required_schema_is_vllms_and_accepts_only_valid_calls():
    schema = guided_schema([WEATHER, TIME, NO_ARGS], ToolPlan("required"))
    assert schema == {
        "type": "array", "minItems": 1,
        "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": ["get_weather"]},
                            "parameters": WEATHER["function"]["parameters"]}, "required": ["name", "parameters"]},
            {"properties": {"name": {"type": "string", "enum": ["get_time"]},
                            "parameters": {k: v for k, v in TIME["function"]["parameters"].items() if k != "$defs"}},
             "required": ["name", "parameters"]},
            {"properties": {"name": {"type": "string", "enum": ["ping"]},
                            "parameters": {"type": "object", "properties": {}}}, "required": ["name", "parameters"]},
        ]},
        "$defs": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}}
    assert "$defs" in TIME["function"]["parameters"]  # the request's tools are left as they were
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Paris"}},
                         {"name": "get_time", "parameters": {"zone": "CET"}}, {"name": "ping", "parameters": {}}],
                        schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "nope", "parameters": {}}],
                [{"name": "get_time", "parameters": {"zone": "cet"}}], {"name": "ping", "parameters": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_named_schema_is_the_functions_parameters():
    plan = tool_plan([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, True, None, False)
    schema = guided_schema([WEATHER, TIME], plan)
    assert schema == WEATHER["function"]["parameters"]
    jsonschema.validate({"city": "Paris", "unit": "c"}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"unit": "k"}, schema)
    assert guided_schema([WEATHER], ToolPlan("auto")) is None and guided_schema([WEATHER], ToolPlan("none")) is None


def test_two_tools_defining_one_def_differently_are_refused():
    other = {"type": "function", "function": {"name": "f", "parameters": {"$defs": {"zone": {"type": "integer"}}}}}
    with pytest.raises(OpenAIError) as exc:
        guided_schema([TIME, other], ToolPlan("required"))
    assert exc.value.message == "Tool definition 'zone' has multiple schemas, which is not supported."


def test_required_and_named_outputs_become_tool_calls():
    out, finish = extract_output(ToolPlan("required"), '[{"name": "get_weather", "parameters": {"city": "Rome"}}]',
                                 "stop")
    assert names_args(out.calls) == [("get_weather", {"city": "Rome"})] and finish == "tool_calls"
    out, finish = extract_output(ToolPlan("named", "get_weather"), '{"city": "Rome"}', "stop")
    assert names_args(out.calls) == [("get_weather", {"city": "Rome"})] and out.content is None and finish == "stop"
    out, finish = extract_output(ToolPlan("auto", parser=HermesToolParser(), parallel=False), HERMES, "stop")
    assert names_args(out.calls) == [("get_weather", {"city": "Paris"})] and finish == "tool_calls"


def test_hermes_streams_a_calls_name_first_then_its_arguments_in_fragments():
    stream = ToolCallStream(HermesToolParser())
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
    out = [stream.feed(text[i:i + 4]) for i in range(0, len(text), 4)] + [stream.finish()]
    deltas = [d for _, ds in out for d in ds]
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""} and "id" in deltas[0]
    fragments = [d["function"]["arguments"] for d in deltas[1:]]
    assert len(fragments) > 3 and all("id" not in d for d in deltas[1:])
    assert "".join(fragments) == '{"city": "Paris", "unit": "c"}'


def test_hermes_call_cut_by_max_tokens_keeps_what_was_sent():
    stream = ToolCallStream(HermesToolParser())
    _, first = stream.feed('Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Pa')
    content, rest = stream.finish()
    assert first[0]["function"]["name"] == "get_weather" and first[1]["function"]["arguments"] == '{"city": "Pa'
    assert content == "" and rest == [] and stream.called
