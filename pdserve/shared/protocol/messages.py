"""Redis stream entries of the ensemble: the prefill queue entry and the per-request output event.

Each message is a dataclass with ``encode() -> dict[str, bytes]`` (the fields for ``XADD``) and
``decode(fields) -> cls`` (the field map ``XREAD``/``XREADGROUP`` returns, keys and values as ``bytes`` or
``str``). The payload travels as one msgpack field ``data`` (no pickle); a few fields are duplicated as plain
stream fields for readers that must not unpack it (the planner sums ``prompt_tokens`` over the queue) and for
``redis-cli`` debugging. Unknown msgpack keys are ignored on decode, so a newer writer can add optional fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

import msgpack

from pdserve.shared.protocol.sampling_params import SamplingParams, SamplingParamsError

DATA_FIELD = "data"


class MessageError(ValueError):
    """A stream entry that is not a valid message of the expected type."""


class BadSamplingParams(MessageError):
    """A ``PrefillRequest`` whose ``sampling_params`` do not validate: the request (``request_id``) fails with a
    400 rather than being dropped like an unreadable entry."""

    def __init__(self, request_id: str, error: SamplingParamsError | TypeError, router_id: str | None = None) -> None:
        super().__init__(f"bad sampling_params: {error}")
        self.request_id = request_id
        self.router_id = router_id  # where its error goes (PrefillRequest.router_id)


def _get(fields: Mapping[Any, Any], name: str) -> bytes | None:
    value = fields.get(name)
    if value is None:
        value = fields.get(name.encode())
    if isinstance(value, str):
        value = value.encode()
    return value


def _unpack(cls: type, fields: Mapping[Any, Any]) -> dict[str, Any]:
    raw = _get(fields, DATA_FIELD)
    if raw is None:
        raise MessageError(f"{cls.__name__}: stream entry has no {DATA_FIELD!r} field")
    try:
        payload = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise MessageError(f"{cls.__name__}: undecodable payload: {exc}") from exc
    if not isinstance(payload, dict):
        raise MessageError(f"{cls.__name__}: payload is {type(payload).__name__}, expected a map")
    known = {f.name for f in dataclasses.fields(cls)}
    missing = [f.name for f in dataclasses.fields(cls)
               if f.name not in payload and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise MessageError(f"{cls.__name__}: missing fields {missing}")
    return {k: v for k, v in payload.items() if k in known}


@dataclass(slots=True)
class PrefillRequest:
    """One request (one choice of an OpenAI request) waiting for prefill.

    XADDed by the router to ``keys.PREFILL_STREAM`` (remote prefill) or to ``keys.decode_stream(decode_pod_id)``
    (the decode pod prefills it itself). ``sampling_params`` are this one choice's (``n`` = 1; a seeded request
    with n > 1 gets ``seed + choice_index``), ``SamplingParams.to_dict()`` on the wire. ``arrival_time`` and
    ``deadline`` are unix seconds (``time.time()``). The decode pod named here is where the KV blocks go and
    where the request is decoded; its output goes to ``keys.output_stream(request_id)``.
    """

    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    decode_pod_id: str
    decode_host: str
    decode_kv_port: int
    arrival_time: float
    deadline: float | None = None
    cache_salt: str | None = None
    priority: int = 0
    choice_index: int = 0
    # A migrated request resumes: the output its client already has (``LLMEngine.add_request``)
    output_token_ids: list[int] = field(default_factory=list)
    output_text_len: int = 0
    # The router incarnation relaying the output (``keys.router_key``): once it is gone, the decode pod drops
    # the request as an orphan. None: never dropped so.
    router_id: str | None = None
    # W3C trace context of the router's request span (pdserve/shared/tracing.py); None: not traced
    traceparent: str | None = None
    # The decode pod's KV-connector endpoint fields (``PodInfo.kv_endpoint``); empty: a router that predates them,
    # and ``decode_kv_port`` is the endpoint
    decode_kv_endpoint: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def encode(self) -> dict[str, bytes]:
        payload = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        payload["sampling_params"] = self.sampling_params.to_dict()
        return {
            "request_id": self.request_id.encode(),
            "prompt_tokens": str(self.prompt_tokens).encode(),
            DATA_FIELD: msgpack.packb(payload, use_bin_type=True),
        }

    @classmethod
    def decode(cls, fields: Mapping[Any, Any]) -> PrefillRequest:
        """Raises ``BadSamplingParams`` (a ``MessageError``) when only the sampling parameters are invalid,
        ``MessageError`` when the entry is unreadable."""
        kwargs = _unpack(cls, fields)
        params = kwargs["sampling_params"]
        if not isinstance(params, dict):
            raise MessageError(f"PrefillRequest: sampling_params is {type(params).__name__}, expected a map")
        try:
            kwargs["sampling_params"] = SamplingParams.from_dict(params)
        except (SamplingParamsError, TypeError) as exc:
            router_id = kwargs.get("router_id")
            raise BadSamplingParams(str(kwargs["request_id"]), exc,
                                    router_id if isinstance(router_id, str) else None) from exc
        return cls(**kwargs)


@dataclass(slots=True)
class TokenLogprob:
    """Log-probability of one sampled token and the ``top`` most likely alternatives at its position.

    ``top`` is a list of ``(token_id, logprob)`` pairs, most likely first (length = the request's
    ``logprobs`` / ``top_logprobs``, plus the sampled token last when it is not among them; may be empty).
    Natural log, as OpenAI and vLLM report it.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)

    def to_wire(self) -> list[Any]:
        return [self.token_id, self.logprob, [[t, lp] for t, lp in self.top]]

    @classmethod
    def from_wire(cls, item: list[Any]) -> TokenLogprob:
        token_id, logprob, top = item
        return cls(int(token_id), float(logprob), [(int(t), float(lp)) for t, lp in top])


@dataclass(slots=True)
class OutputEvent:
    """One step of a request's output, XADDed by a worker to ``keys.output_stream(request_id)``.

    ``token_ids`` are the new tokens of this event and ``text`` their detokenized delta (text never retracted:
    the worker holds back what a stop string might still cut). ``logprobs`` (when the request asked for them)
    has one ``TokenLogprob`` per token in ``token_ids``. ``completion_tokens`` counts all tokens generated so far
    (cumulative), ``prompt_tokens`` the prompt length. The final event has ``finish_reason`` ("stop" | "length"
    | "abort") or ``error`` ({"message", "type", "code": HTTP status int, and "param" when a 400 names a request
    field}); nothing follows it.
    ``stop_reason`` is the stop string or stop token id that ended the request (vLLM's field), ``None`` for EOS
    or length. ``first_token_time`` (unix s, when the first token was sampled) rides on the first event;
    ``num_cached_tokens`` is the prompt's prefix-cache hit on the prefill side. ``prompt_logprobs`` (requests
    whose sampling params ask for them; on the event of the pod that computed the prompt, with its first token):
    per prompt token ``None`` for the first, then ``[[token_id, logprob, rank], ...]``, the prompt token first,
    then the most likely tokens at that position. ``keepalive``: an event that carries nothing but "still alive,
    waiting" (a prefill pod writes one every few seconds while the request waits for its hand-over to a decode
    pod); it resets the router's silence bound and nothing else.
    """

    request_id: str
    index: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: dict[str, Any] | None = None
    stop_reason: str | int | None = None
    first_token_time: float | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[list[list] | None] | None = None
    keepalive: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def encode(self) -> dict[str, bytes]:
        payload = dataclasses.asdict(self)
        payload["logprobs"] = None if self.logprobs is None else [lp.to_wire() for lp in self.logprobs]
        out = {DATA_FIELD: msgpack.packb(payload, use_bin_type=True)}
        if self.finished:
            out["final"] = b"1"
        return out

    def to_payload(self) -> dict[str, Any]:
        """The event as an ``OutputBatch`` item: a msgpack-ready map without the fields at their defaults (a token
        delta is a few bytes, not fourteen keys)."""
        payload: dict[str, Any] = {"request_id": self.request_id}
        for name, default in _EVENT_DEFAULTS.items():
            value = getattr(self, name)
            if value != default:
                payload[name] = [lp.to_wire() for lp in value] if name == "logprobs" else value
        return payload

    @classmethod
    def from_payload(cls, payload: Any) -> OutputEvent:
        """The inverse of ``to_payload``; unknown keys are ignored. Raises ``MessageError``."""
        if not isinstance(payload, dict) or not isinstance(payload.get("request_id"), str):
            raise MessageError("OutputBatch: an event is not a map with a request_id")
        kwargs = {k: v for k, v in payload.items() if k in _EVENT_DEFAULTS or k == "request_id"}
        try:
            if kwargs.get("logprobs") is not None:
                kwargs["logprobs"] = [TokenLogprob.from_wire(item) for item in kwargs["logprobs"]]
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise MessageError(f"OutputBatch: bad event: {exc}") from exc

    @classmethod
    def decode(cls, fields: Mapping[Any, Any]) -> OutputEvent:
        kwargs = _unpack(cls, fields)
        if kwargs.get("logprobs") is not None:
            kwargs["logprobs"] = [TokenLogprob.from_wire(item) for item in kwargs["logprobs"]]
        return cls(**kwargs)


@dataclass(slots=True)
class OutputBatch:
    """One step's ``OutputEvent``s for the requests of one router, XADDed by a worker to
    ``keys.relay_stream(router_id)`` as ONE stream entry (instead of one entry per request per step).

    ``events`` are the per-request deltas of that step, each the ``OutputEvent`` a per-request stream would carry:
    request id, new tokens and text, logprobs, finish reason or error. ``completion_tokens`` (cumulative) is each
    request's sequence number: the router drops a delta it already relayed and fails a request whose next delta
    skips tokens, so a batch written twice (a retried pipeline) or a request replayed after a migration is relayed
    exactly once. ``pod_id`` names the writer (logs). Wire: one msgpack field ``data`` holding
    ``{"pod_id": str, "events": [OutputEvent payload map, ...]}``.
    """

    events: list[OutputEvent] = field(default_factory=list)
    pod_id: str = ""

    def encode(self) -> dict[str, bytes]:
        return {DATA_FIELD: self.pack()}

    def pack(self) -> bytes:
        return msgpack.packb({"pod_id": self.pod_id, "events": [e.to_payload() for e in self.events]},
                             use_bin_type=True)

    @classmethod
    def decode(cls, fields: Mapping[Any, Any]) -> OutputBatch:
        raw = _get(fields, DATA_FIELD)
        if raw is None:
            raise MessageError(f"OutputBatch: stream entry has no {DATA_FIELD!r} field")
        return cls.unpack(raw)

    @classmethod
    def unpack(cls, raw: bytes) -> OutputBatch:
        try:
            payload = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises several unrelated types
            raise MessageError(f"OutputBatch: undecodable payload: {exc}") from exc
        if not isinstance(payload, dict) or not isinstance(payload.get("events"), list):
            raise MessageError("OutputBatch: payload is not a map with an 'events' list")
        return cls([OutputEvent.from_payload(p) for p in payload["events"]], str(payload.get("pod_id", "")))



def _defaults(cls: type) -> dict[str, Any]:
    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}


_EVENT_DEFAULTS = _defaults(OutputEvent)
