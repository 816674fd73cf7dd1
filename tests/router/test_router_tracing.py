"""The router's root span joins the client's trace on every generation endpoint: the real router over HTTP (in
this process, so an in-memory exporter sees its spans), the stand-in worker answering. Oracle: the client's own
``traceparent`` (its trace id, and its span id as the root span's parent)."""

from __future__ import annotations

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.shared import tracing

MODEL = "smollm2-135m-instruct"
TRACE, SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


@pytest.fixture
def exported(monkeypatch):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    yield exporter
    provider.shutdown()


@pytest.mark.parametrize("path,body,root", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
     f"chat {MODEL}"),
    ("/v1/responses", {"input": "What is the capital of France?"}, f"chat {MODEL}"),
])
def test_the_root_span_is_a_child_of_the_clients_traceparent(router, worker, exported, path, body, root):
    resp = httpx.post(router.url + path, json={"model": MODEL, **body}, timeout=30,
                      headers={"traceparent": f"00-{TRACE}-{SPAN}-01"})
    assert resp.status_code == 200, resp.text
    spans = [s for s in exported.get_finished_spans() if s.name == root]
    assert len(spans) == 1, [s.name for s in exported.get_finished_spans()]
    assert f"{spans[0].context.trace_id:032x}" == TRACE
    assert f"{spans[0].parent.span_id:016x}" == SPAN
    assert spans[0].attributes["gen_ai.usage.output_tokens"] > 0
    children = {s.name for s in exported.get_finished_spans() if s.parent and s.parent.span_id ==
                spans[0].context.span_id}
    assert {"validate", "tokenize", "admission", "route"} <= children
