"""OpenAI response bodies and SSE chunks built from ``OutputEvent``s (no HTTP here).

Shapes are OpenAI's (and vLLM's): ``chat.completion`` / ``chat.completion.chunk`` and ``text_completion``;
streamed chat opens each choice with a ``{"role": "assistant", "content": ""}`` delta; with
``stream_options.include_usage`` every chunk carries ``"usage": null`` and a last chunk has empty ``choices``
and the usage. ``usage.prompt_tokens`` counts each prompt once (not once per choice); ``completion_tokens``
sums the choices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from pdserve.shared.protocol.messages import OutputEvent, TokenLogprob

TokenStr = Callable[[int], str]


def _logprob_entry(token_str: TokenStr, token_id: int, logprob: float) -> dict[str, Any]:
    text = token_str(token_id)
    return {"token": text, "logprob": max(logprob, -9999.0), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(token_str: TokenStr, lps: list[TokenLogprob]) -> dict[str, Any]:
    """OpenAI chat ``logprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``."""
    content = []
    for lp in lps:
        entry = _logprob_entry(token_str, lp.token_id, lp.logprob)
        entry["top_logprobs"] = [_logprob_entry(token_str, t, v) for t, v in lp.top]
        content.append(entry)
    return {"content": content}


def completion_logprobs(token_str: TokenStr, lps: list[TokenLogprob], text_offset: int) -> dict[str, Any]:
    """Legacy completions ``logprobs``: parallel lists ``tokens``, ``token_logprobs``, ``top_logprobs``
    (one ``{token: logprob}`` map per position) and ``text_offset`` (character offsets into the choice's text,
    starting at ``text_offset``)."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = text_offset
    for lp in lps:
        text = token_str(lp.token_id)
        tokens.append(text)
        token_logprobs.append(max(lp.logprob, -9999.0))
        tops.append({token_str(t): max(v, -9999.0) for t, v in lp.top} if lp.top else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


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
    finished: bool = False
    cached_tokens: int | None = None  # the prompt's prefix-cache hit where it was prefilled (first event)

    def add(self, event: OutputEvent) -> None:
        if self.cached_tokens is None:
            self.cached_tokens = event.num_cached_tokens
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
                 prompt_tokens_details: bool = False) -> None:
        self.kind = kind
        self.id = response_id
        self.model = model
        self.created = created
        self.token_str = token_str
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage and include_usage
        self.prompt_tokens_details = prompt_tokens_details
        self.n = n
        self.prompt_lens = prompt_lens
        self.choices = [ChoiceState(index=i, prompt_tokens=prompt_lens[i // n])
                        for i in range(len(prompt_lens) * n)]

    @property
    def object_chunk(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def usage(self) -> dict[str, Any]:
        cached = None
        if self.prompt_tokens_details:  # each prompt once, as prompt_tokens: its first choice's hit
            cached = sum(self.choices[p * self.n].cached_tokens or 0 for p in range(len(self.prompt_lens)))
        return usage(sum(self.prompt_lens), sum(c.completion_tokens for c in self.choices), cached)

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {"id": self.id, "object": self.object_chunk, "created": self.created,
                                 "model": self.model, "choices": choices}
        if self.include_usage:
            chunk["usage"] = self.usage() if self.continuous_usage else None
        return chunk

    # ---- streaming ---------------------------------------------------------------------------

    def role_chunks(self) -> list[dict[str, Any]]:
        """Chat only: the opening chunk of every choice."""
        if self.kind != "chat":
            return []
        return [self._chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}]) for c in self.choices]

    def on_event(self, choice_index: int, event: OutputEvent) -> dict[str, Any] | None:
        """Record ``event`` for the choice and return its chunk (None when there is nothing to send)."""
        choice = self.choices[choice_index]
        offset = choice.text_len
        choice.add(event)
        if not event.text and not event.finished and not event.logprobs:
            return None
        logprobs = None
        if self.want_logprobs and event.logprobs:
            logprobs = (chat_logprobs(self.token_str, event.logprobs) if self.kind == "chat"
                        else completion_logprobs(self.token_str, event.logprobs, offset))
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
                logprobs = (chat_logprobs(self.token_str, c.logprobs) if self.kind == "chat"
                            else completion_logprobs(self.token_str, c.logprobs, 0))
            if self.kind == "chat":
                choices.append({"index": c.index, "message": {"role": "assistant", "content": text},
                                "logprobs": logprobs, "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason})
            else:
                choices.append({"index": c.index, "text": text, "logprobs": logprobs,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return {"id": self.id, "object": "chat.completion" if self.kind == "chat" else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage()}
