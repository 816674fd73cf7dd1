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


def _step(sched, log) -> None:
    """One engine step as ``LLMEngine.step`` logs it: schedule, ``begin``, compute, ``end``."""
    out = sched.schedule()
    log.begin(out)
    for request in sched.update_after_step(out):
        request.append_output_token(1)
    log.end()


def test_each_prefill_chunk_is_a_span_and_a_preemption_an_event_on_the_requests_span(exported):
    """The real scheduler (budget 16 tokens, 5 blocks of 4): a 40-token prompt runs as chunks of 16, 16 and 8;
    then three one-block requests fill the pool and the latest one is preempted by recompute. Oracle: the chunks
    the scheduler's own rule gives (test_scheduler.py), one span each under the request's span, and one event."""
    from pdserve.shared.engine.kv_cache_manager import KVCacheManager
    from pdserve.shared.engine.request import Request
    from pdserve.shared.engine.scheduler import Scheduler
    from pdserve.shared.engine.step_log import StepLog
    from pdserve.shared.worker.step_spans import trace_steps
    from pdserve.shared.worker.tracked import Tracked

    def req(rid, tokens):
        return Request(rid, tokens, SamplingParams(max_tokens=8), 8, frozenset())

    log = StepLog()
    sched = Scheduler(KVCacheManager(64, 4, False), 8, 16, 1024, "fcfs")
    sched.add_request(req("long", list(range(40))))
    for _ in range(4):  # three chunks, then a decode step (not logged)
        _step(sched, log)
    spans = {"long": Tracked(0.0, span=tracing.start("prefill", VALID))}
    trace_steps(spans, log.take())
    assert log.take() == []

    sched = Scheduler(KVCacheManager(5, 4, False), 8, 64, 1024, "fcfs")
    for i in range(3):
        sched.add_request(req(f"r{i}", [10 * i + j for j in range(4)]))
    _step(sched, log)
    sched.add_request(req("late", [7] * 4))
    _step(sched, log)  # r2 is preempted: its next token needs a block
    spans.update({f"r{i}": Tracked(0.0, span=tracing.start("decode", VALID)) for i in range(3)})
    trace_steps(spans, log.take())
    for info in spans.values():
        tracing.end(info.span)

    finished = exported.get_finished_spans()
    by_id = {s.context.span_id: s for s in finished}
    chunks = [s for s in finished if s.name == "prefill_chunk" and by_id[s.parent.span_id].name == "prefill"]
    assert [(s.attributes["pdserve.chunk.first_token"], s.attributes["pdserve.chunk.tokens"]) for s in chunks] == \
        [(0, 16), (16, 16), (32, 8)]
    assert all(s.start_time <= s.end_time for s in chunks)
    decode_chunks = sorted((by_id[s.parent.span_id].name, s.attributes["pdserve.chunk.tokens"])
                           for s in finished if s.name == "prefill_chunk" and s not in chunks)
    assert decode_chunks == [("decode", 4)] * 3  # the three prompts' one chunk each
    events = {s.context.span_id: [(e.name, dict(e.attributes)) for e in s.events] for s in finished}
    assert events[spans["r2"].span.context.span_id] == [
        ("preemption", {"pdserve.preemption.mode": "recompute", "pdserve.preemption.num_tokens": 5})]
    assert events[spans["r0"].span.context.span_id] == []


def test_every_gen_ai_attribute_name_is_one_of_the_semantic_conventions():
    """Oracle: the names OpenTelemetry's GenAI semantic conventions define (opentelemetry-semantic-conventions),
    less the deprecated ones. Every ``gen_ai.*`` string in pdserve's code must be one of them."""
    import pathlib
    import re

    from opentelemetry.semconv._incubating.attributes import gen_ai_attributes

    defined = {v for k, v in vars(gen_ai_attributes).items() if k.startswith("GEN_AI_") and isinstance(v, str)}
    deprecated = {"gen_ai.system", "gen_ai.prompt", "gen_ai.completion", "gen_ai.usage.prompt_tokens",
                  "gen_ai.usage.completion_tokens"}
    root = pathlib.Path(tracing.__file__).parents[1]
    used = {m for path in root.rglob("*.py") for m in re.findall(r'"(gen_ai\.[a-z_.]+)"', path.read_text())}
    assert used, "no GenAI attribute found: the scan is broken"
    assert used <= defined - deprecated, used - (defined - deprecated)
