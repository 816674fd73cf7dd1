"""Trace-context propagation (pdserve/shared/tracing.py): the W3C ``traceparent`` parser against OpenTelemetry's
own propagator, the field through the prefill queue entry and the Commit hand-over frame (and its absence, for
peers from before tracing), and parent links of spans made from a propagated context (in-memory exporter)."""

from __future__ import annotations

import msgpack
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pdserve.shared import tracing
from pdserve.shared.protocol.messages import PrefillRequest
from pdserve.shared.protocol.sampling_params import SamplingParams
from pdserve.shared.transport.frames import Commit, encode_frame, frame_from_fields

VALID = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
HEADERS = [
    VALID, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",  # not sampled
    "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-future",  # a later version may add fields
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",  # version 00 may not
    "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # forbidden version
    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # zero trace id
    "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # zero span id
    "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",  # uppercase
    "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",  # short trace id
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7", "", "garbage",
]


@pytest.mark.parametrize("value", HEADERS)
def test_traceparent_parsing_agrees_with_opentelemetrys_propagator(value):
    ctx = get_current_span(TraceContextTextMapPropagator().extract({"traceparent": value})).get_span_context()
    expected = (ctx.trace_id, ctx.span_id, int(ctx.trace_flags)) if ctx.is_valid else None
    assert tracing.parse_traceparent(value) == expected


def test_traceparent_formats_what_it_parses():
    assert tracing.format_traceparent(*tracing.parse_traceparent(VALID)) == VALID


def test_tracing_is_on_only_with_an_endpoint_and_an_exporter():
    assert not tracing.configured({})
    assert not tracing.configured({"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"})
    assert tracing.configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert tracing.configured({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"})
    assert not tracing.configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"})
    assert not tracing.configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"})


def test_helpers_are_no_ops_when_tracing_is_off():
    assert not tracing.enabled()
    assert tracing.start("x", VALID) is None and tracing.traceparent(None) is None
    with tracing.span("x", VALID) as s:
        assert s is None
    tracing.end(None, {"a": 1})
    tracing.record("queue", VALID, 1.0, 2.0)


def request(**kw) -> PrefillRequest:
    return PrefillRequest("r-1", "m", [1, 2, 3], SamplingParams(max_tokens=4), "d-1", "127.0.0.1", 7000, 1.5, **kw)


def test_traceparent_travels_in_the_queue_entry():
    assert PrefillRequest.decode(request(traceparent=VALID).encode()).traceparent == VALID
    old = request().encode()  # an entry from a router before tracing has no such key
    payload = msgpack.unpackb(old["data"], raw=False)
    del payload["traceparent"]
    assert PrefillRequest.decode({**old, "data": msgpack.packb(payload)}).traceparent is None


def commit_fields(frame: Commit) -> dict:
    (head,) = encode_frame(frame)
    return msgpack.unpackb(bytes(head)[4:], raw=False)["fields"]


def test_traceparent_travels_in_the_commit_frame_and_is_left_off_when_none():
    commit = Commit("r-1", 7, SamplingParams(), [1, 2, 3], 1.5, traceparent=VALID)
    assert frame_from_fields("commit", commit_fields(commit)) == commit
    # a receiver from before tracing refuses unknown fields: an untraced commit sends what it always sent
    assert "traceparent" not in commit_fields(Commit("r-1", 7, SamplingParams(), [1, 2, 3], 1.5))


@pytest.fixture
def exported(monkeypatch):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    yield exporter
    provider.shutdown()


def test_a_span_started_from_a_propagated_traceparent_is_its_child(exported):
    root = tracing.start("chat m", VALID, kind="server")
    sent = tracing.traceparent(root)  # what the router writes into the queue entry
    tracing.record("queue", sent, 10.0, 10.5)
    with tracing.span("blocks", tracing.start("kv_transfer", sent), {"pdserve.kv.bytes": 4096, "none": None}):
        pass
    tracing.end(root)
    spans = {s.name: s for s in exported.get_finished_spans()}
    trace_id, client_span, _ = tracing.parse_traceparent(VALID)
    assert {s.context.trace_id for s in spans.values()} == {trace_id}
    assert spans["chat m"].parent.span_id == client_span
    assert spans["queue"].parent.span_id == spans["chat m"].context.span_id
    assert (spans["queue"].start_time, spans["queue"].end_time) == (10_000_000_000, 10_500_000_000)
    assert spans["blocks"].attributes == {"pdserve.kv.bytes": 4096}
    assert "kv_transfer" not in spans  # never ended: never exported
