"""One streamed request, as the client saw it: chunk arrival times turned into TTFT, ITL and E2EL.

Definitions follow vLLM ``bench serve`` (``vllm/benchmarks/lib/endpoint_request_func.py``) with one
deliberate tightening: TTFT is taken at the first chunk that *carries content* (non-empty text, or at
least one token by ``token_ids``/``logprobs``/continuous ``usage``), so a server that sends an empty
``{"role": "assistant"}`` chunk before prefill finishes is not credited with an early first token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestRecord:
    """What one request did. Times are seconds; ``*_send`` are relative to the benchmark start.

    ``itl`` holds one gap per content chunk after the first; ``chunk_tokens[i]`` is how many tokens
    content chunk ``i`` carried (``None`` where the server did not say), so ``len(chunk_tokens) ==
    len(itl) + 1`` for a successful request.
    """

    index: int
    label: str = ""
    prompt_len: int = 0
    expected_output_len: int = 0
    intended_send: float = 0.0
    dispatch: float = 0.0
    actual_send: float = 0.0
    success: bool = False
    status: str = ""
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunk_tokens: list[int | None] = field(default_factory=list)
    output_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    generated_text: str = ""
    session_id: int | None = None
    turn: int | None = None

    @property
    def send_lag(self) -> float:
        """Seconds the client dispatched the request after its intended time (its own lag)."""
        return self.dispatch - self.intended_send

    @property
    def queue_wait(self) -> float:
        """Seconds spent waiting for a ``--max-concurrency`` slot (by design, not client lag)."""
        return self.actual_send - self.dispatch


def _chunk_content(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or delta.get("reasoning") or "")


def _chunk_token_count(choice: dict[str, Any]) -> int | None:
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return len(ids)
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):
        if isinstance(logprobs.get("content"), list):
            return len(logprobs["content"])
        if isinstance(logprobs.get("tokens"), list):
            return len(logprobs["tokens"])
    return None


class StreamTimeline:
    """Folds the parsed SSE ``data:`` payloads of one response into a :class:`RequestRecord`.

    ``start`` is the ``time.perf_counter()`` value when the request was sent; each ``on_chunk`` call
    passes the arrival time of that chunk on the same clock.
    """

    def __init__(self, record: RequestRecord, start: float) -> None:
        self.record = record
        self.start = start
        self._last: float | None = None
        self._usage_cum = 0
        self._pending_tokens = 0
        self._usage_per_chunk = False
        self._text: list[str] = []

    def on_chunk(self, t: float, data: dict[str, Any]) -> None:
        rec = self.record
        if data.get("error") and not data.get("choices"):
            err = data["error"]
            rec.status = "stream_error"
            rec.error = str(err.get("message", err) if isinstance(err, dict) else err)
            return
        choices = data.get("choices") or []
        usage = data.get("usage")
        usage_delta = None
        if isinstance(usage, dict):
            if usage.get("completion_tokens") is not None:
                cum = int(usage["completion_tokens"])
                if choices:
                    # continuous usage stats: the cumulative count says how many tokens this chunk carried
                    self._usage_per_chunk = True
                    usage_delta = cum - self._usage_cum
                    self._usage_cum = cum
                rec.output_tokens = cum
            if usage.get("prompt_tokens") is not None:
                rec.usage_prompt_tokens = int(usage["prompt_tokens"])
        if not choices:
            return
        choice = choices[0]
        content = _chunk_content(choice)
        tokens = _chunk_token_count(choice)
        if tokens is None and usage_delta is not None:
            tokens = usage_delta
        if not content and not tokens:
            if tokens is not None:
                self._pending_tokens += tokens
            return
        if tokens is not None:
            tokens += self._pending_tokens
            self._pending_tokens = 0
        if self._last is None:
            rec.ttft = t - self.start
        else:
            rec.itl.append(t - self._last)
        self._last = t
        rec.chunk_tokens.append(tokens)
        self._text.append(content)

    def fail(self, status: str, error: str) -> RequestRecord:
        self.record.success = False
        self.record.status = status
        self.record.error = error
        return self.record

    def finish(self) -> RequestRecord:
        """Close the timeline after the stream ended (``[DONE]`` or connection close)."""
        rec = self.record
        rec.generated_text = "".join(self._text)
        if rec.status == "stream_error":
            rec.success = False
        elif self._last is None:
            rec.success = False
            rec.status = "no_content"
            rec.error = "the stream ended without a chunk that carries content"
        else:
            rec.success = True
            rec.status = "200"
            rec.latency = self._last - self.start
            if not self._usage_per_chunk and all(c is None for c in rec.chunk_tokens):
                # no per-chunk counts: one token per chunk is provable only when the totals agree
                if rec.output_tokens is not None and rec.output_tokens == len(rec.chunk_tokens):
                    rec.chunk_tokens = [1] * len(rec.chunk_tokens)
        return rec
