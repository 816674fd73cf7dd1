"""OpenAI response bodies and SSE chunks built from ``OutputEvent``s (no HTTP here).

Shapes are OpenAI's (and vLLM's): ``chat.completion`` / ``chat.completion.chunk`` and ``text_completion``;
streamed chat opens each choice with a ``{"role": "assistant", "content": ""}`` delta, sent when the choice's
first token arrives (as vLLM does: a client measures time to first token at its first chunk); with
``stream_options.include_usage`` every chunk carries ``"usage": null`` and a last chunk has empty ``choices``
and the usage. ``usage.prompt_tokens`` counts each prompt once (not once per choice); ``completion_tokens``
sums the choices.

``echo`` (vLLM's): a completion choice's text (and, with ``logprobs``, its logprobs: the prompt's first token
has ``null`` for its logprob and top logprobs) starts with the prompt; a chat answer starts with the last
message's content. ``prompt_logprobs`` (vLLM's extension) is a per-choice list for completions and a
response-level one for chat: ``null`` for the first prompt token, then ``{token_id: {"logprob", "rank",
"decoded_token"}}``.
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from pdserve.shared.protocol.messages import OutputEvent, TokenLogprob

from .tool_calls import ToolDeltas, ToolPlan, extract_output

# Compact JSON (no spaces after separators): what every SSE chunk and body is encoded with
encode_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_TEXT_MARK = "\u2063pdserve-text\u2063"  # stands for a delta's text while a chunk template is made

TokenStr = Callable[[int], str]
TokenBytes = Callable[[int], bytes]


def _utf8_bytes(token_str: TokenStr) -> TokenBytes:
    return lambda token_id: token_str(token_id).encode("utf-8")


def _logprob_entry(token_str: TokenStr, token_bytes: TokenBytes, token_id: int, logprob: float) -> dict[str, Any]:
    return {"token": token_str(token_id), "logprob": max(logprob, -9999.0), "bytes": list(token_bytes(token_id))}


def chat_logprobs(token_str: TokenStr, lps: list[TokenLogprob], token_bytes: TokenBytes | None = None) -> dict[str, Any]:
    """OpenAI chat ``logprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``.
    ``bytes`` are each token's own bytes (``token_bytes``; default: its string's UTF-8), so that joining them gives
    the text's bytes even where a token is only part of a character."""
    token_bytes = token_bytes or _utf8_bytes(token_str)
    content = []
    for lp in lps:
        entry = _logprob_entry(token_str, token_bytes, lp.token_id, lp.logprob)
        entry["top_logprobs"] = [_logprob_entry(token_str, token_bytes, t, v) for t, v in lp.top]
        content.append(entry)
    return {"content": content}


def completion_logprobs(token_str: TokenStr, lps: list[TokenLogprob], text_offset: int,
                        token_bytes: TokenBytes | None = None, decoder: codecs.IncrementalDecoder | None = None
                        ) -> dict[str, Any]:
    """Legacy completions ``logprobs``: parallel lists ``tokens``, ``token_logprobs``, ``top_logprobs``
    (one ``{token: logprob}`` map per position) and ``text_offset`` (character offsets into the choice's text,
    starting at ``text_offset``).

    A token that is part of a character counts no characters until the character is complete (``decoder`` carries
    such a partial character from earlier calls). Two alternatives with the same string (a byte-fallback piece
    and a whole token, say) keep distinct keys: the less likely one is keyed ``token_id:<id>``, vLLM's form.
    """
    return _completion_logprobs(token_str, lps, text_offset, token_bytes or _utf8_bytes(token_str),
                                decoder or codecs.getincrementaldecoder("utf-8")(errors="replace"))[0]


def _completion_logprobs(token_str: TokenStr, lps: list[TokenLogprob], text_offset: int, token_bytes: TokenBytes,
                         decoder: codecs.IncrementalDecoder) -> tuple[dict[str, Any], int]:
    """``completion_logprobs`` and the offset after its last token."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = text_offset
    for lp in lps:
        tokens.append(token_str(lp.token_id))
        token_logprobs.append(max(lp.logprob, -9999.0))
        top = None
        if lp.top:
            keys, taken = {lp.token_id: token_str(lp.token_id)}, {token_str(lp.token_id)}  # the chosen one first
            for t, _ in lp.top:
                if t not in keys:
                    key = token_str(t)
                    keys[t] = key if key not in taken else f"token_id:{t}"
                    taken.add(keys[t])
            top = {keys[t]: max(v, -9999.0) for t, v in lp.top}
        tops.append(top)
        offsets.append(offset)
        offset += len(decoder.decode(token_bytes(lp.token_id)))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}, offset


def _keep_top(entry: list[list], k: int) -> list[list]:
    """A prompt position's ``[[token_id, logprob, rank], ...]`` (the prompt token first) cut to what ``k`` asks:
    the prompt token and the ``k`` most likely (the engine computed the most any field of the request wants)."""
    return [item for i, item in enumerate(entry) if i == 0 or item[2] <= k]


def echo_logprobs(token_str: TokenStr, prompt_ids: list[int], entries: list[list[list] | None] | None,
                  k: int) -> dict[str, Any]:
    """Legacy completions ``logprobs`` of an echoed prompt (vLLM's shape): the first token's logprob and top
    logprobs are ``null``; ``top_logprobs`` of the others hold the prompt token and the ``k`` most likely.
    ``text_offset`` counts token lengths from 0."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = 0
    for i, token_id in enumerate(prompt_ids):
        entry = entries[i] if entries is not None and i < len(entries) else None
        text = token_str(token_id)
        tokens.append(text)
        if entry is None:
            token_logprobs.append(None)
            tops.append(None)
        else:
            token_logprobs.append(max(entry[0][1], -9999.0))
            tops.append({token_str(t): max(v, -9999.0) for t, v, _ in _keep_top(entry, k)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def join_logprobs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    return {key: first[key] + second[key] for key in first}


def prompt_logprobs_body(token_str: TokenStr, entries: list[list[list] | None] | None,
                         k: int) -> list[dict[str, Any] | None] | None:
    """vLLM's ``prompt_logprobs`` field: per prompt token ``null`` (the first) or
    ``{"<token_id>": {"logprob", "rank", "decoded_token"}}``, the prompt token first."""
    if entries is None:
        return None
    return [None if entry is None else
            {str(t): {"logprob": max(v, -9999.0), "rank": rank, "decoded_token": token_str(t)}
             for t, v, rank in _keep_top(entry, k)} for entry in entries]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's ``usage``; ``cached_tokens`` (prompt tokens served from the prefix cache) adds
    ``prompt_tokens_details`` as OpenAI and vLLM (``--enable-prompt-tokens-details``) report it."""
    body: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                            "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


@dataclass(slots=True)
class ChoiceState:
    """What has arrived for one choice so far."""

    index: int
    prompt_tokens: int
    text: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text_len: int = 0
    # streamed text_offset: characters of the tokens' bytes so far, carrying a partial character between chunks
    offset_decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"))
    logprob_chars: int = 0
    finished: bool = False
    cached_tokens: int | None = None  # the prompt's prefix-cache hit where it was prefilled (first event)
    prompt_logprobs: list | None = None  # from the pod that computed the prompt (OutputEvent.prompt_logprobs)
    echoed: bool = False

    def add(self, event: OutputEvent) -> None:
        if self.cached_tokens is None:
            self.cached_tokens = event.num_cached_tokens
        if self.prompt_logprobs is None and event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs  # a migrated request's second prefill sends them again
        self.text.append(event.text)
        self.text_len += len(event.text)
        self.completion_tokens = max(self.completion_tokens, event.completion_tokens)
        if event.logprobs:
            self.logprobs.extend(event.logprobs)
        if event.finished:
            self.finished = True
            self.finish_reason = event.finish_reason
            self.stop_reason = event.stop_reason


class ResponseBuilder:
    """Builds one request's chunks or final body. ``kind`` is "chat" or "completion"."""

    def __init__(self, kind: str, response_id: str, model: str, created: int, token_str: TokenStr,
                 prompt_lens: list[int], n: int, want_logprobs: bool,
                 include_usage: bool = False, continuous_usage: bool = False,
                 prompt_tokens_details: bool = False, echo: list[tuple[str, list[int]]] | None = None,
                 echo_only: bool = False, num_logprobs: int = 0, prompt_logprobs: int | None = None,
                 token_bytes: TokenBytes | None = None, tools: ToolPlan | None = None) -> None:
        """``echo``: per prompt, the text and token ids each of its choices starts with (completions: the prompt;
        chat: the last message's content, no ids). ``echo_only``: the request scores its prompt (``max_tokens=0``):
        the one token generated is left out. ``num_logprobs``: completions' ``logprobs`` (top entries of echoed
        prompt positions). ``prompt_logprobs``: vLLM's field, when asked. ``token_bytes``: a token's own bytes
        (logprobs' ``bytes`` and ``text_offset``; default: its string's UTF-8). ``tools``: chat's tool-call plan
        (tool_calls.py): the text becomes ``tool_calls`` as it says."""
        self.kind = kind
        self.id = response_id
        self.model = model
        self.created = created
        self.token_str = token_str
        self.token_bytes = token_bytes or _utf8_bytes(token_str)
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage and include_usage
        self.prompt_tokens_details = prompt_tokens_details
        self.n = n
        self.prompt_lens = prompt_lens
        self.echo = echo
        self.echo_only = echo_only
        self.num_logprobs = num_logprobs
        self.prompt_logprobs = prompt_logprobs
        self.choices = [ChoiceState(index=i, prompt_tokens=prompt_lens[i // n])
                        for i in range(len(prompt_lens) * n)]
        self._opened: set[int] = set()  # chat choices whose role chunk went out
        self.tools = tools if tools is not None and tools.mode != "none" and kind == "chat" else None
        self._tool_deltas: dict[int, ToolDeltas] = {}
        self._templates: dict[int, tuple[str, str]] = {}  # choice -> its text chunk's JSON before / after the text

    @property
    def object_chunk(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from a prefix cache: each prompt once, as prompt_tokens (its first choice's hit)."""
        return sum(self.choices[p * self.n].cached_tokens or 0 for p in range(len(self.prompt_lens)))

    def usage(self) -> dict[str, Any]:
        cached = self.cached_tokens if self.prompt_tokens_details else None
        return usage(sum(self.prompt_lens), sum(c.completion_tokens for c in self.choices), cached)

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {"id": self.id, "object": self.object_chunk, "created": self.created,
                                 "model": self.model, "choices": choices}
        if self.include_usage:
            chunk["usage"] = self.usage() if self.continuous_usage else None
        return chunk

    # ---- streaming ---------------------------------------------------------------------------

    def role_chunk(self, choice_index: int) -> dict[str, Any]:
        """Chat: the opening chunk of one choice (the assistant role, empty content)."""
        return self._chunk([{"index": choice_index, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}])

    def stream_chunks(self, choice_index: int, event: OutputEvent) -> list[dict[str, Any]]:
        """The chunks ``event`` adds to the stream: on chat, the choice's role chunk before its first event's
        (never earlier: that chunk would arrive before the prompt was processed), then ``on_event``'s."""
        out = []
        if self.kind == "chat" and choice_index not in self._opened:
            self._opened.add(choice_index)
            out.append(self.role_chunk(choice_index))
        chunk = self.on_event(choice_index, event)
        if chunk is not None:
            out.append(chunk)
            if self.tools is not None:
                out[-1:] = self._tool_chunks(choice_index, chunk, event.finished)
        return out

    def stream_json(self, choice_index: int, event: OutputEvent) -> list[str]:
        """``stream_chunks`` encoded as compact JSON. A plain text delta (most of a stream: no logprobs, not the
        first or last event, no echo, tools or continuous usage) costs one ``json`` string encoding spliced into the
        choice's chunk template instead of building and encoding the chunk's dict: the same bytes, a twentieth of
        the CPU (``pdserve bench token-cost``, pdserve/loadtest/README.md)."""
        if not self._plain(choice_index, event):
            return [encode_json(chunk) for chunk in self.stream_chunks(choice_index, event)]
        self.choices[choice_index].add(event)
        if not event.text:
            return []
        template = self._templates.get(choice_index)
        if template is None:
            body = ({"index": choice_index, "delta": {"content": _TEXT_MARK}, "logprobs": None, "finish_reason": None}
                    if self.kind == "chat" else
                    {"index": choice_index, "text": _TEXT_MARK, "logprobs": None, "finish_reason": None})
            before, _, after = encode_json(self._chunk([body])).partition(encode_json(_TEXT_MARK))
            template = self._templates[choice_index] = (before, after)
        return [template[0] + encode_json(event.text) + template[1]]

    def _plain(self, choice_index: int, event: OutputEvent) -> bool:
        """``event`` is a text delta whose chunk is the choice's text template filled in (``stream_json``)."""
        return (not event.finished and not event.logprobs and self.tools is None and not self.echo_only
                and not self.continuous_usage and (self.echo is None or self.choices[choice_index].echoed)
                and (self.kind != "chat" or choice_index in self._opened))

    def _tool_chunks(self, choice_index: int, chunk: dict[str, Any], finished: bool) -> list[dict[str, Any]]:
        """``chunk``'s text through the choice's tool-call reader: the content it lets through, then one chunk
        per ``tool_calls`` delta, then the finish (``tool_calls`` when the choice made calls)."""
        deltas = self._tool_deltas.setdefault(choice_index, ToolDeltas(self.tools))
        body = chunk["choices"][0]
        content, calls = deltas.feed(body["delta"].get("content", ""))
        if finished:
            rest, more = deltas.finish()
            content, calls = content + rest, calls + more
        finish = body["finish_reason"]
        out = []
        if content or body["logprobs"] or (not calls and finish is None):
            out.append(self._chunk([{**body, "delta": {"content": content}, "finish_reason": None}]))
            out[-1]["choices"][0].pop("stop_reason", None)
        out.extend(self._chunk([{"index": choice_index, "delta": {"tool_calls": [d]}, "logprobs": None,
                                 "finish_reason": None}]) for d in calls)
        if finish is not None:
            reason = "tool_calls" if deltas.called and finish != "abort" else finish
            out.append(self._chunk([{"index": choice_index, "delta": {}, "logprobs": None, "finish_reason": reason,
                                     "stop_reason": body.get("stop_reason")}]))
        return out

    def on_event(self, choice_index: int, event: OutputEvent) -> dict[str, Any] | None:
        """Record ``event`` for the choice and return its chunk (None when there is nothing to send)."""
        choice = self.choices[choice_index]
        if self.echo_only:  # the token generated to finish the request is not part of the answer
            event.token_ids, event.text, event.logprobs, event.completion_tokens = [], "", None, 0
            if event.finished and event.error is None:
                event.finish_reason, event.stop_reason = "length", None
        echo_lps = None
        if self.echo is not None and not choice.echoed:  # the first event of the choice carries the echo
            choice.echoed = True
            text, ids = self.echo[choice_index // self.n]
            event.text = text + event.text
            if self.want_logprobs and self.kind != "chat":
                echo_lps = echo_logprobs(self.token_str, ids, event.prompt_logprobs, self.num_logprobs)
        choice.add(event)
        if not event.text and not event.finished and not event.logprobs and echo_lps is None:
            return None
        logprobs = None
        if self.want_logprobs and (event.logprobs or echo_lps):
            if self.kind == "chat":
                logprobs = chat_logprobs(self.token_str, event.logprobs or [], self.token_bytes)
            else:
                start = choice.logprob_chars
                if echo_lps is not None:  # one pass of offsets over the prompt and this event's tokens, as vLLM
                    start = echo_lps["text_offset"][-1] + len(echo_lps["tokens"][-1]) if echo_lps["tokens"] else 0
                logprobs, choice.logprob_chars = _completion_logprobs(
                    self.token_str, event.logprobs or [], start, self.token_bytes, choice.offset_decoder)
                if echo_lps is not None:
                    logprobs = join_logprobs(echo_lps, logprobs)
        finish = event.finish_reason if event.finished else None
        if event.error is not None:
            finish = "abort"
        body: dict[str, Any]
        if self.kind == "chat":
            body = {"index": choice_index, "delta": {"content": event.text} if event.text or not finish else {},
                    "logprobs": logprobs, "finish_reason": finish}
        else:
            body = {"index": choice_index, "text": event.text, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            body["stop_reason"] = choice.stop_reason
        return self._chunk([body])

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk when ``include_usage``: no choices, the final usage."""
        return {"id": self.id, "object": self.object_chunk, "created": self.created, "model": self.model,
                "choices": [], "usage": self.usage()}

    # ---- whole response ----------------------------------------------------------------------

    def response(self) -> dict[str, Any]:
        choices = []
        for c in self.choices:
            text = "".join(c.text)
            logprobs = None
            if self.want_logprobs:
                if self.kind == "chat":
                    logprobs = chat_logprobs(self.token_str, c.logprobs, self.token_bytes)
                elif self.echo is not None:
                    echoed = echo_logprobs(self.token_str, self.echo[c.index // self.n][1], c.prompt_logprobs,
                                           self.num_logprobs)
                    last = echoed["text_offset"][-1] + len(echoed["tokens"][-1]) if echoed["tokens"] else 0
                    logprobs = join_logprobs(echoed, completion_logprobs(self.token_str, c.logprobs, last,
                                                                         self.token_bytes))
                else:
                    logprobs = completion_logprobs(self.token_str, c.logprobs, 0, self.token_bytes)
            if self.kind == "chat":
                message: dict[str, Any] = {"role": "assistant", "content": text}
                finish = c.finish_reason
                if self.tools is not None:
                    extracted, finish = extract_output(self.tools, text, finish)
                    message = {"role": "assistant", "content": extracted.content, "tool_calls": extracted.calls}
                choices.append({"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": finish,
                                "stop_reason": c.stop_reason})
            else:
                choices.append({"index": c.index, "text": text, "logprobs": logprobs,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
                if self.prompt_logprobs is not None:
                    choices[-1]["prompt_logprobs"] = prompt_logprobs_body(self.token_str, c.prompt_logprobs,
                                                                          self.prompt_logprobs)
        body = {"id": self.id, "object": "chat.completion" if self.kind == "chat" else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage()}
        if self.kind == "chat" and self.prompt_logprobs is not None:  # vLLM puts chat's at the response level
            body["prompt_logprobs"] = prompt_logprobs_body(self.token_str, self.choices[0].prompt_logprobs,
                                                           self.prompt_logprobs)
        return body
