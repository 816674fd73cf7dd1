"""Tool calling on ``/v1/chat/completions``: ``tools``, ``tool_choice`` and ``parallel_tool_calls``, vLLM's rules.

- ``tool_choice`` defaults to ``auto`` when ``tools`` are given, else ``none``; ``none`` answers in text (the
  tools are still rendered into the prompt, as vLLM does by default).
- ``auto`` needs ``--enable-auto-tool-choice`` and ``--tool-call-parser`` (vLLM's 400 otherwise); the parser
  (tool_parsers.py) finds the calls in the model's text, and a choice that made calls ends with
  ``finish_reason: "tool_calls"``.
- ``required`` and a named function are enforced by guided decoding: the request's sampling params get
  ``structured_outputs={"json": schema}`` with vLLM's schema (``guided_schema``). For ``required`` the model
  writes a JSON array of ``{"name", "parameters"}`` objects (``finish_reason: "tool_calls"``); for a named
  function, the function's arguments (``finish_reason`` as the engine says, ``stop``).
- ``parallel_tool_calls: false`` keeps the first call.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from .errors import bad_request
from .tool_parsers import PARSERS, Extracted, ToolCallStream, ToolParser, call_delta, openai_call, tool_call_id

NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


@dataclass(slots=True)
class ToolPlan:
    """How a chat request's output is read: ``mode`` none | auto | required | named; ``name`` the named
    function; ``parser`` (auto) the configured tool-call parser."""

    mode: str
    name: str | None = None
    parser: ToolParser | None = None
    parallel: bool = True


def tool_plan(tools: list[Any] | None, tool_choice: str | dict[str, Any] | None, parallel: bool | None,
              parser_name: str | None, enable_auto: bool) -> ToolPlan:
    """Check ``tools``/``tool_choice`` as vLLM does; raise a 400 naming ``tool_choice`` (vLLM's wording)."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return ToolPlan("none")
    if tools is None:
        raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if tool_choice == "required" and not tools:
        return ToolPlan("none")  # OpenAI's behaviour for an empty list
    keep_all = parallel is not False
    if isinstance(tool_choice, dict):
        return ToolPlan("named", _named(tools, tool_choice), parallel=keep_all)
    if tool_choice == "required":
        return ToolPlan("required", parallel=keep_all)
    if tool_choice != "auto":
        raise bad_request(f"Invalid value for `tool_choice`: {tool_choice}! Only named tools, \"none\", \"auto\" "
                          "or \"required\" are supported.", "tool_choice")
    if not enable_auto or parser_name is None:
        raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                          "tool_choice")
    return ToolPlan("auto", parser=PARSERS[parser_name](), parallel=keep_all)


def _named(tools: list[Any], tool_choice: dict[str, Any]) -> str:
    function = tool_choice.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"Invalid value for `function`: `{function}` in `tool_choice`! {NAMED_USAGE}", "tool_choice")
    if "name" not in function:
        raise bad_request(f"Expected field `name` in `function` in `tool_choice`! {NAMED_USAGE}", "tool_choice")
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise bad_request(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {NAMED_USAGE}", "tool_choice")
    if name not in {_function(t)["name"] for t in tools}:
        raise bad_request("The tool specified in `tool_choice` does not match any of the specified `tools`",
                          "tool_choice")
    return name


def _function(tool: Any) -> dict[str, Any]:
    return tool["function"] if isinstance(tool, dict) else tool.function.model_dump(exclude_none=True)


def guided_schema(tools: list[Any], plan: ToolPlan) -> dict[str, Any] | None:
    """The JSON schema guided decoding enforces for ``plan`` (vLLM's ``_get_json_schema_from_tool``), None for
    none/auto. Named: the function's ``parameters``. Required: an array (at least one item) of objects, each
    ``{"name": <one of the tools>, "parameters": <its schema>}``, with every tool's ``$defs`` hoisted to the
    top (two tools defining one name differently: 400)."""
    functions = [copy.deepcopy(_function(t)) for t in tools]
    if plan.mode == "named":
        fn = next(f for f in functions if f["name"] == plan.name)
        return fn.get("parameters") or {"type": "object", "properties": {}}
    if plan.mode != "required":
        return None
    defs: dict[str, Any] = {}
    for fn in functions:
        for name, schema in (fn.get("parameters") or {}).pop("$defs", {}).items():
            if defs.get(name, schema) != schema:
                raise bad_request(f"Tool definition '{name}' has multiple schemas, which is not supported.", "tools")
            defs[name] = schema
    items = [{"properties": {"name": {"type": "string", "enum": [fn["name"]]},
                             "parameters": fn.get("parameters") or {"type": "object", "properties": {}}},
              "required": ["name", "parameters"]} for fn in functions]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if defs:
        schema["$defs"] = defs
    return schema


def _required_calls(text: str) -> list[dict[str, Any]] | None:
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(items, list) or not all(isinstance(i, dict) and isinstance(i.get("name"), str) for i in items):
        return None
    return [openai_call(i["name"], i.get("parameters", {})) for i in items]


def extract_output(plan: ToolPlan, text: str, finish_reason: str | None) -> tuple[Extracted, str | None]:
    """A finished choice's text as ``message.content`` and ``message.tool_calls``, and its finish reason."""
    if plan.mode == "named":
        return Extracted(None, [openai_call(plan.name, text)]), finish_reason
    if plan.mode == "required":
        calls = _required_calls(text)
        out = Extracted(None, calls) if calls else Extracted(text)
    elif plan.mode == "auto":
        out = plan.parser.extract(text)
    else:
        return Extracted(text), finish_reason
    if not plan.parallel:
        out.calls = out.calls[:1]
    return out, ("tool_calls" if out.calls else finish_reason)


class ToolDeltas:
    """A streamed chat choice under ``plan``: ``feed(text)`` and ``finish()`` give ``(content, tool_call deltas)``;
    ``called`` tells whether the choice ends with ``tool_calls``. Named: the arguments stream as the model
    writes them; required: the calls go out at the end; auto: ``ToolCallStream``."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.stream = ToolCallStream(plan.parser, plan.parallel) if plan.mode == "auto" else None
        self.text, self.opened = "", False

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        if self.stream is not None:
            return self.stream.feed(delta)
        if self.plan.mode == "named":
            out = [] if self.opened else call_delta(0, {"id": tool_call_id(),
                                                        "function": {"name": self.plan.name, "arguments": ""}})[:1]
            self.opened = True
            return "", out + ([{"index": 0, "function": {"arguments": delta}}] if delta else [])
        if self.plan.mode == "required":
            self.text += delta
            return "", []
        return delta, []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        if self.stream is not None:
            return self.stream.finish()
        if self.plan.mode == "required":
            out, _ = extract_output(self.plan, self.text, None)
            if not out.calls:
                return self.text, []
            self.opened = True
            return "", [d for i, c in enumerate(out.calls) for d in call_delta(i, c)]
        return "", []

    @property
    def called(self) -> bool:
        if self.stream is not None:
            return self.stream.called
        return self.plan.mode == "required" and self.opened
