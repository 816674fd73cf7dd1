"""OpenAI's Responses API (``POST/GET/DELETE /v1/responses``) over the chat path (vLLM's ``OpenAIServingResponses``).

A request becomes a chat request (``to_chat``): ``instructions`` as the system message, then the stored
conversation of ``previous_response_id`` (its input and output; the instructions are not carried over, as
OpenAI does), then ``input`` (a string, or message / ``function_call`` / ``function_call_output`` items);
``max_output_tokens``, ``temperature`` and ``top_p`` as the chat fields; function ``tools`` and ``tool_choice``
in chat's form (tool_calls.py); ``text.format`` json_schema as guided decoding's ``structured_outputs``.
It runs through ``CompletionService`` as any chat request (admission, dispatch, migration, abort) and its chat
output becomes the response's ``output`` items: a ``message`` with ``output_text``, and one ``function_call``
per tool call. Streamed, it is the API's typed events (``ResponseEvents``) in the order the openai SDK reads
them. With ``store`` (the default) the response and its conversation are kept in Redis (``keys.response_key``,
TTL ``--responses-ttl-s``); the prefix cache makes a continued conversation's shared prefix cheap.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Annotated, Any, AsyncIterator, Awaitable, Callable

from fastapi.responses import JSONResponse
from pydantic import Field, StrictBool, StrictStr
from starlette.responses import Response

from pdserve.shared.protocol import keys

from . import delivery
from .errors import OpenAIError, bad_request
from .params import with_structured_outputs
from .schemas import ChatCompletionRequest, _Body

if TYPE_CHECKING:
    from .serving import CompletionService


class ResponsesRequest(_Body):
    """The fields of OpenAI's ``responses.create`` that pdserve serves (others are accepted and ignored)."""

    model: str
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = True
    store: StrictBool = True
    previous_response_id: StrictStr | None = None
    stream: StrictBool = False
    metadata: dict[str, Any] | None = None


def not_found(response_id: str, param: str | None = None) -> OpenAIError:
    what = "Previous response" if param else "Response"
    return OpenAIError(404, f"{what} with id '{response_id}' not found.", param)


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content or [] if isinstance(part, dict))


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat messages: a string is one user message; ``function_call`` items become an assistant's
    ``tool_calls``, ``function_call_output`` items ``tool`` messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item.get("role", "user"), "content": _text_of(item.get("content"))})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": _text_of(item.get("output"))})
        else:
            raise bad_request(f"input[{i}]: items of type {kind!r} are not supported", "input")
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools (``{"type": "function", "name", "parameters"}``) in chat's form."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise bad_request(f"tools[{i}]: tools of type {tool.get('type')!r} are not supported (only 'function')",
                              "tools")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters",
                                                                            "strict") if tool.get(k) is not None}})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def to_chat(req: ResponsesRequest, history: list[dict[str, Any]], response_id: str) -> ChatCompletionRequest:
    """The chat request that serves ``req`` after the stored conversation ``history``; 400 naming the field."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history + \
        input_messages(req.input)
    fields: dict[str, Any] = dict(
        model=req.model, messages=messages, max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, tools=chat_tools(req.tools),
        tool_choice=chat_tool_choice(req.tool_choice), parallel_tool_calls=req.parallel_tool_calls,
        stream=req.stream, stream_options={"include_usage": True} if req.stream else None,
        request_id=response_id.removeprefix("resp_"))
    fmt = (req.text or {}).get("format") or {}
    if fmt.get("type") == "json_schema":
        with_structured_outputs({}, {"json": fmt.get("schema")}, "text.format")  # 400 without guided decoding
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "response"), "schema": fmt.get("schema"), "strict": fmt.get("strict")}}
    elif fmt.get("type") not in (None, "text"):
        raise bad_request(f"text.format of type {fmt.get('type')!r} is not supported", "text.format")
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValueError as exc:
        raise bad_request(f"Invalid request: {exc}", None) from exc


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text else []}


def call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"], "status": status,
            "name": call["function"]["name"], "arguments": call["function"]["arguments"]}


def usage_of(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def response_object(req: ResponsesRequest, response_id: str, created: int, status: str,
                    output: list[dict[str, Any]], usage: dict[str, Any] | None,
                    finish_reason: str | None = None) -> dict[str, Any]:
    """The ``response`` object (OpenAI's shape); ``finish_reason`` length makes it ``incomplete``."""
    incomplete = status == "completed" and finish_reason == "length"
    return {"id": response_id, "object": "response", "created_at": created, "model": req.model,
            "status": "incomplete" if incomplete else status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "tools": req.tools or [],
            "tool_choice": req.tool_choice or "auto", "parallel_tool_calls": req.parallel_tool_calls is not False,
            "text": req.text or {"format": {"type": "text"}}, "previous_response_id": req.previous_response_id,
            "store": req.store, "metadata": req.metadata or {}, "output": output, "usage": usage}


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as chat messages (what a continuation's prompt holds)."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in output if i["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return [message]


class ResponsesService:
    """``create``, ``retrieve`` and ``delete`` of ``/v1/responses`` over a ``CompletionService``."""

    def __init__(self, service: CompletionService) -> None:
        self.service = service
        self.redis = service.state.redis
        self.ttl_s = service.settings.responses_ttl_s

    async def load(self, response_id: str, param: str | None = None) -> dict[str, Any]:
        raw = await self.redis.get(keys.response_key(response_id))
        if raw is None:
            raise not_found(response_id, param)
        return json.loads(raw)

    async def retrieve(self, response_id: str) -> dict[str, Any]:
        return (await self.load(response_id))["response"]

    async def delete(self, response_id: str) -> dict[str, Any]:
        if not await self.redis.delete(keys.response_key(response_id)):
            raise not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def save(self, req: ResponsesRequest, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        if req.store:
            record = {"response": response, "messages": conversation + output_messages(response["output"])}
            await self.redis.set(keys.response_key(response["id"]), json.dumps(record), ex=self.ttl_s)

    async def create(self, req: ResponsesRequest, api_key_id: str | None = None,
                     is_disconnected: Callable[[], Awaitable[bool]] | None = None,
                     traceparent: str | None = None) -> Response:
        """Serve one Responses request as a chat completion (``traceparent``: the client's W3C trace context, which
        the request's trace joins, as on ``/v1/chat/completions``)."""
        response_id, created = f"resp_{uuid.uuid4().hex}", int(time.time())
        history = (await self.load(req.previous_response_id, "previous_response_id"))["messages"] \
            if req.previous_response_id else []
        chat = to_chat(req, history, response_id)
        conversation = [m.model_dump(exclude_none=True) for m in chat.messages
                        if not (req.instructions and m is chat.messages[0])]
        job = await self.service.submit(chat, "chat", api_key_id=api_key_id, traceparent=traceparent)
        if req.stream:
            events = ResponseEvents(req, response_id, created)
            return delivery.ClosingEventSource(
                self._stream(events, delivery.stream_chunks(self.service, job), conversation),
                lambda: self.service.finish(job, aborted=True), sep="\n", ping=self.service.settings.sse_ping_s)
        full = await delivery.full_response(self.service, job, is_disconnected)
        if full.status_code != 200:
            return full
        choice = json.loads(full.body)["choices"][0]
        message = choice["message"]
        output = ([message_item(message["content"])] if message.get("content") else []) + \
            [call_item(c) for c in message.get("tool_calls") or []]
        response = response_object(req, response_id, created, "completed", output,
                                   usage_of(json.loads(full.body)["usage"]), choice["finish_reason"])
        await self.save(req, response, conversation)
        return JSONResponse(response)

    async def _stream(self, events: ResponseEvents, chunks: AsyncIterator[str],
                      conversation: list[dict[str, Any]]) -> AsyncIterator[dict[str, str]]:
        for event in events.opening():
            yield event
        async for line in chunks:
            if line == "[DONE]":
                break
            for event in events.on_chunk(json.loads(line)):
                yield event
        if events.failed:
            return
        closing = events.closing()
        await self.save(events.req, events.response, conversation)
        for event in closing:
            yield event


class ResponseEvents:
    """Chat chunks -> the Responses API's typed SSE events, each ``{"event": type, "data": json}`` with its
    ``sequence_number``: ``response.created``, ``response.in_progress``; per output item
    ``response.output_item.added``, then (a message) ``response.content_part.added``,
    ``response.output_text.delta``..., ``response.output_text.done``, ``response.content_part.done`` or (a
    function call) ``response.function_call_arguments.delta``, ``.done``; ``response.output_item.done``; last
    ``response.completed`` (or ``error`` when the request failed)."""

    def __init__(self, req: ResponsesRequest, response_id: str, created: int) -> None:
        self.req, self.id, self.created = req, response_id, created
        self.seq, self.output, self.open = 0, [], None
        self.usage, self.finish_reason, self.failed = None, None, False
        self.response: dict[str, Any] = {}

    def _event(self, kind: str, **data: Any) -> dict[str, str]:
        body = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return {"event": kind, "data": json.dumps(body, ensure_ascii=False)}

    def _snapshot(self, status: str) -> dict[str, Any]:
        return response_object(self.req, self.id, self.created, status, self.output, self.usage, self.finish_reason)

    def opening(self) -> list[dict[str, str]]:
        return [self._event("response.created", response=self._snapshot("in_progress")),
                self._event("response.in_progress", response=self._snapshot("in_progress"))]

    def _close(self) -> list[dict[str, str]]:
        item, self.open = self.open, None
        if item is None:
            return []
        index, out = self.output.index(item), []
        item["status"] = "completed"
        if item["type"] == "message":
            part = item["content"][0]
            out += [self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                                text=part["text"], logprobs=[]),
                    self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                content_index=0, part=part)]
        else:
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   name=item["name"], arguments=item["arguments"]))
        return out + [self._event("response.output_item.done", output_index=index, item=item)]

    def _open(self, item: dict[str, Any]) -> list[dict[str, str]]:
        out = self._close()
        self.output.append(item)
        self.open = item
        index = len(self.output) - 1
        out.append(self._event("response.output_item.added", output_index=index, item=item))
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"] = [part]
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                   content_index=0, part=part))
        return out

    def on_chunk(self, chunk: dict[str, Any]) -> list[dict[str, str]]:
        if "error" in chunk:
            self.failed = True
            err = chunk["error"]
            return [self._event("error", code=str(err.get("code")), message=err.get("message"), param=err.get("param"))]
        if chunk.get("usage") and not chunk.get("choices"):
            self.usage = usage_of(chunk["usage"])
        out: list[dict[str, str]] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self.open is None or self.open["type"] != "message":
                    out += self._open(message_item("", "in_progress"))
                self.open["content"][0]["text"] += delta["content"]
                out.append(self._event("response.output_text.delta", item_id=self.open["id"],
                                       output_index=len(self.output) - 1, content_index=0, delta=delta["content"],
                                       logprobs=[]))
            for call in delta.get("tool_calls") or []:
                out += self._on_call(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return out

    def _on_call(self, call: dict[str, Any]) -> list[dict[str, str]]:
        fn = call.get("function") or {}
        out = []
        if call.get("id"):
            out += self._open(call_item({"id": call["id"], "function": {"name": fn.get("name"), "arguments": ""}},
                                        "in_progress"))
        if fn.get("arguments") and self.open is not None and self.open["type"] == "function_call":
            self.open["arguments"] += fn["arguments"]
            out.append(self._event("response.function_call_arguments.delta", item_id=self.open["id"],
                                   output_index=len(self.output) - 1, delta=fn["arguments"]))
        return out

    def closing(self) -> list[dict[str, str]]:
        out = self._close()
        self.response = self._snapshot("completed")
        return out + [self._event("response.completed", response=self.response)]
