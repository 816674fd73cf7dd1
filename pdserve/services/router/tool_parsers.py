"""Tool calls out of a model's text: vLLM's ``--tool-call-parser`` formats, whole (``extract``) and streamed
(``ToolCallStream``).

- ``hermes`` (NousResearch's Hermes 2 Pro format, vLLM's ``Hermes2ProToolParser``): each call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; the content is the text before the first
  ``<tool_call>``. A block left open at the end (``finish_reason`` length) is parsed too.
- ``llama3_json`` (Meta's Llama 3.1 JSON tool format, vLLM's ``Llama3JsonToolParser``): the text, after an
  optional ``<|python_tag|>``, is one or more ``{"name": ..., "parameters": {...}}`` objects separated by
  ``;``; a text that does not start so is plain content.

A text with no parseable call is content, whole. Calls come out in OpenAI's shape:
``{"id", "type": "function", "function": {"name", "arguments"}}`` with ``arguments`` a JSON string.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any


def tool_call_id() -> str:
    """A fresh call id in vLLM's form (``chatcmpl-tool-<hex>``)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def openai_call(name: str, arguments: Any) -> dict[str, Any]:
    """One OpenAI ``tool_calls`` entry; ``arguments`` (a JSON value or an already encoded string) as a string."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": tool_call_id(), "type": "function", "function": {"name": name, "arguments": args}}


@dataclass(slots=True)
class Extracted:
    """A model text split into what the client reads: ``content`` (None when only calls were made) and
    ``calls`` (OpenAI ``tool_calls`` entries, in the order the model wrote them)."""

    content: str | None
    calls: list[dict[str, Any]] = field(default_factory=list)


def _call_of(obj: Any, args_key: str) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return openai_call(obj["name"], obj.get(args_key, obj.get("arguments", obj.get("parameters", {}))))


class HermesToolParser:
    """``<tool_call>{json}</tool_call>`` blocks (see the module docstring). A call's ``arguments`` are the model's
    own text of them where the block reads ``{"name": ..., "arguments": ...}`` (so that streamed fragments of it
    add up to the same string), else re-encoded."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)
    _HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')

    def _call(self, block: str) -> dict[str, Any] | None:
        try:
            call = _call_of(json.loads(block), "arguments")
        except json.JSONDecodeError:
            return None
        head = self._HEAD.match(block)
        if call is not None and head is not None:
            try:
                value, end = json.JSONDecoder().raw_decode(block, head.end())
            except json.JSONDecodeError:
                return call
            if value == json.loads(call["function"]["arguments"]):
                call["function"]["arguments"] = block[head.end():end]
        return call

    def partial_call(self, text: str) -> tuple[str, str] | None:
        """The call being written at the end of ``text``: its name and the part of its arguments' text that is
        certainly theirs (up to the last ``}``, which may close the block's object, less trailing blanks); None
        before its name and ``"arguments":`` are out."""
        start = text.rfind(self.START)
        if start < 0 or self.END in text[start:]:
            return None
        block = text[start + len(self.START):]
        head = self._HEAD.match(block)
        if head is None:
            return None
        args = block[head.end():]
        cut = args.rfind("}")
        return json.loads(head.group(1)), (args[:cut] if cut >= 0 else args).rstrip()

    def extract(self, text: str) -> Extracted:
        calls = []
        for closed, open_ in self._BLOCK.findall(text):
            call = self._call(closed or open_)
            if call is not None:
                calls.append(call)
        if not calls:
            return Extracted(text)
        return Extracted(text[:text.find(self.START)] or None, calls)

    def content_end(self, text: str) -> int:
        """How much of a text still being generated is certainly content: up to the first ``<tool_call>``, less
        a tail that may be the start of one."""
        start = text.find(self.START)
        if start >= 0:
            return start
        for keep in range(min(len(self.START) - 1, len(text)), 0, -1):
            if self.START.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)

    def closed_calls(self, text: str) -> list[dict[str, Any]]:
        """The calls of the blocks already closed in a text still being generated."""
        closed = text[:text.rfind(self.END) + len(self.END)] if self.END in text else ""
        return self.extract(closed).calls


class Llama3JsonToolParser:
    """``<|python_tag|>``-optional JSON objects separated by ``;`` (see the module docstring)."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def _body(self, text: str) -> str | None:
        body = text.lstrip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].lstrip()
        return body if body.startswith("{") else None

    def extract(self, text: str) -> Extracted:
        body = self._body(text)
        if body is None:
            return Extracted(text)
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return Extracted(text)  # not (only) calls: the whole text is content, as vLLM does
            call = _call_of(obj, "parameters")
            if call is None:
                return Extracted(text)
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return Extracted(None, calls) if calls else Extracted(text)

    def content_end(self, text: str) -> int:
        """Content streams only once the text cannot be a call any more (it starts with neither ``{`` nor the
        tag, nor a prefix of the tag)."""
        head = text.lstrip()
        if not head or head.startswith("{") or head.startswith(self.TAG) or self.TAG.startswith(head):
            return 0
        return len(text)

    def closed_calls(self, text: str) -> list[dict[str, Any]]:
        return []  # a call's end is known only at the text's end

    def partial_call(self, text: str) -> None:
        return None


PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}
ToolParser = HermesToolParser | Llama3JsonToolParser


def call_delta(index: int, call: dict[str, Any]) -> list[dict[str, Any]]:
    """One call as OpenAI's streamed ``tool_calls`` deltas: its index, id, type and name (empty arguments),
    then its arguments."""
    fn = call["function"]
    return [{"index": index, "id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": ""}},
            {"index": index, "function": {"arguments": fn["arguments"]}}]


class ToolCallStream:
    """One streamed choice through a parser: ``feed(text_delta)`` and, at the end, ``finish()`` return
    ``(content_delta, tool_call_deltas)``. The content sent is always a prefix of ``extract``'s content and
    the calls sent are ``extract``'s calls. hermes: a call's id and name go out as soon as the model has written
    them, then its arguments in fragments as they come; llama3_json: the calls go out at the end."""

    def __init__(self, parser: ToolParser, parallel: bool = True) -> None:
        self.parser, self.parallel = parser, parallel
        self.text, self.sent_content, self.sent_calls = "", 0, 0
        self.partial: str | None = None  # the arguments sent so far of call ``sent_calls`` (still being written)

    def _calls(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        calls = calls if self.parallel else calls[:1]
        out = []
        for call in calls[self.sent_calls:]:
            if self.partial is None:
                out.extend(call_delta(self.sent_calls, call))
            else:  # its head and part of its arguments went out already
                args = call["function"]["arguments"]
                if args.startswith(self.partial) and len(args) > len(self.partial):
                    out.append({"index": self.sent_calls, "function": {"arguments": args[len(self.partial):]}})
                self.partial = None
            self.sent_calls += 1
        return out

    def _partial(self) -> list[dict[str, Any]]:
        partial = self.parser.partial_call(self.text)
        if partial is None or (not self.parallel and self.sent_calls):
            return []
        name, args = partial
        out = []
        if self.partial is None:
            out.append(call_delta(self.sent_calls, {"id": tool_call_id(),
                                                    "function": {"name": name, "arguments": ""}})[0])
            self.partial = ""
        if len(args) > len(self.partial):
            out.append({"index": self.sent_calls, "function": {"arguments": args[len(self.partial):]}})
            self.partial = args
        return out

    def _content(self, end: int) -> str:
        delta = self.text[self.sent_content:end] if end > self.sent_content else ""
        self.sent_content = max(self.sent_content, end)
        return delta

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        self.text += delta
        content = self._content(self.parser.content_end(self.text))
        return content, self._calls(self.parser.closed_calls(self.text)) + self._partial()

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        extracted = self.parser.extract(self.text)
        if not extracted.calls and not self.called:
            return self._content(len(self.text)), []
        # a call whose head went out but whose block does not parse (cut by max_tokens) stays as sent
        end = len(extracted.content or "") if extracted.calls else self.parser.content_end(self.text)
        return self._content(end), self._calls(extracted.calls)

    @property
    def called(self) -> bool:
        return self.sent_calls > 0 or self.partial is not None
