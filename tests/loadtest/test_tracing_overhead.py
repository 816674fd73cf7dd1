"""``pdserve bench tracing-overhead``: the turn order, the ensemble's OpenTelemetry variables, the summary's
arithmetic, and the OTLP sink counting real exported spans (the full command needs `pdserve up`: its figures are
in pdserve/loadtest/README.md "Tracing overhead")."""

from __future__ import annotations

import pytest

from pdserve.loadtest.errors import LoadTestError
from pdserve.loadtest.tracing_overhead import parse_turns, summary, tracing_env
from pdserve.shared import tracing


def test_turns_parse_and_refuse_other_words():
    assert parse_turns("off, on,OFF,on") == [False, True, False, True]
    with pytest.raises(LoadTestError):
        parse_turns("off,maybe")
    with pytest.raises(LoadTestError):
        parse_turns("")


def test_tracing_env_turns_tracing_on_and_off_whatever_the_shell_set():
    on = tracing_env(True, "http://127.0.0.1:1", "always_on")
    off = tracing_env(False, "http://127.0.0.1:1", "always_on")
    shell = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://elsewhere:4318", "OTEL_TRACES_EXPORTER": "none"}
    assert tracing.configured({**shell, **on})
    assert on["OTEL_TRACES_SAMPLER"] == "always_on"
    assert not tracing.configured({**shell, "OTEL_TRACES_EXPORTER": "otlp", **off})


def _turn(arm: str, tokens: int, duration: float, cpu: float, spans: int) -> dict:
    result = {"output_throughput": tokens / duration, "total_output_tokens": tokens, "duration": duration,
              "completed": 4, "failed": 0, "median_ttft_ms": 100.0, "median_tpot_ms": 20.0, "median_itl_ms": 19.0}
    return {"tracing": arm, "result": result, "cpu_s": cpu, "tok_per_cpu_s": tokens / cpu, "spans": spans,
            "loadavg": (1.0, 2.0)}


def test_summary_pools_each_arm_and_compares_on_with_off():
    text = summary([_turn("off", 100, 10, 5, 0), _turn("on", 96, 10, 5, 52), _turn("off", 100, 10, 5, 0),
                    _turn("on", 96, 10, 5, 52)])
    assert "| 2 | on | 9.6 | 19.20 | 5.0 | 100 | 20 | 19 | 13.0 | 0 | 1.0 → 2.0 |" in text
    assert "on vs off: throughput -4.0%, tokens per CPU-s -4.0%" in text


@pytest.mark.slow  # starts the sink process
def test_the_sink_counts_the_spans_an_otlp_exporter_sends():
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from pdserve.loadtest.tracing_overhead import sink_count, start_sink

    sink, url = start_sink()
    try:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=url + "/v1/traces")))
        tracer = provider.get_tracer("t")
        for name in ("a", "b", "a"):
            tracer.start_span(name).end()
        provider.shutdown()
        assert sink_count(url) == {"spans": 3, "exports": 3, "by_name": {"a": 2, "b": 1}}
    finally:
        sink.terminate()
        sink.wait(10)
