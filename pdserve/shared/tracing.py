"""OpenTelemetry tracing: one trace per request across the router, the queue, the prefill pod, the KV transfer and
the decode pod (docs/observability.md "Tracing").

Configured only by OpenTelemetry's standard variables (``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, ``OTEL_TRACES_EXPORTER``, ``OTEL_SERVICE_NAME``, ``OTEL_TRACES_SAMPLER``
and ``_ARG``, ``OTEL_BSP_*``), read by the SDK itself. Tracing is on only when an endpoint is set and the exporter
is not ``none``; off, ``setup`` imports nothing and every helper returns at its first line, so a service pays one
global read per call. The SDK and the OTLP/HTTP exporter are the ``tracing`` extra.

Context crosses processes as a W3C ``traceparent`` string (https://www.w3.org/TR/trace-context/): in the
``PrefillRequest`` queue entry and the ``Commit`` hand-over frame. Span and attribute names follow the
OpenTelemetry GenAI semantic conventions (``gen_ai.*``) where one exists, else ``pdserve.*``.

Helpers take and return ``Span | None`` (None: tracing off, or no span), so callers never branch on tracing.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
from typing import Any, Iterator, Mapping

logger = logging.getLogger("pdserve.tracing")

_tracer: Any = None  # an SDK Tracer once ``setup`` turned tracing on; None: off (every helper is a no-op)

# version 00: exactly four parts; a later version may append fields after the flags (W3C "Versioning")
_TRACEPARENT_RE = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")


# ---- traceparent (pure functions: no OpenTelemetry import) -------------------------------------------------


def parse_traceparent(value: str | None) -> tuple[int, int, int] | None:
    """``(trace_id, span_id, trace_flags)`` of a W3C ``traceparent`` header value, or None when it is absent or
    invalid (the spec's rule: an invalid header is ignored and a new trace starts). Invalid: not lowercase hex
    of the right lengths, version ``ff``, extra fields on version 00, an all-zero trace or span id."""
    if not value:
        return None
    m = _TRACEPARENT_RE.match(value.strip())
    if m is None:
        return None
    version, trace_hex, span_hex, flags_hex, rest = m.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if trace_id == 0 or span_id == 0:
        return None
    return trace_id, span_id, int(flags_hex, 16)


def format_traceparent(trace_id: int, span_id: int, trace_flags: int) -> str:
    """The version-00 ``traceparent`` value of a span context (ids as ints, ``trace_flags`` 1: sampled)."""
    return f"00-{trace_id:032x}-{span_id:016x}-{trace_flags:02x}"


# ---- setup ---------------------------------------------------------------------------------------------------


def configured(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment turns tracing on: an OTLP endpoint is set, ``OTEL_TRACES_EXPORTER`` is not
    ``none`` and ``OTEL_SDK_DISABLED`` is not ``true``."""
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    exporter = environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower()
    disabled = environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
    return bool(endpoint) and exporter != "none" and not disabled


def setup(service_name: str, **resource: str) -> bool:
    """Turn tracing on for this process when ``configured()``: a tracer provider with the SDK's sampler from
    ``OTEL_TRACES_SAMPLER`` (default: parent-based always-on), a batch span processor (``OTEL_BSP_*``) and the
    OTLP/HTTP exporter (``OTEL_EXPORTER_OTLP_*``), flushed at exit. ``service_name``: ``service.name`` unless
    ``OTEL_SERVICE_NAME`` sets it; ``resource``: more resource attributes. Returns whether tracing is on. Raises
    ``ImportError`` with the fix when an endpoint is set but the ``tracing`` extra is not installed."""
    global _tracer
    if not configured():
        return False
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise ImportError(f"an OTLP endpoint is set but OpenTelemetry's SDK is missing ({exc}): "
                          "pip install 'pdserve[tracing]', or unset OTEL_EXPORTER_OTLP_ENDPOINT") from exc
    attributes = {"service.name": os.environ.get("OTEL_SERVICE_NAME") or service_name, **resource}
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    atexit.register(provider.shutdown)  # the last batch is exported before the process ends
    _tracer = trace.get_tracer("pdserve", tracer_provider=provider)
    logger.info("tracing on: OTLP/HTTP to %s as %s", os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or
                os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"), attributes["service.name"])
    return True


def enabled() -> bool:
    """Whether this process records spans (``setup`` turned tracing on)."""
    return _tracer is not None


# ---- spans ---------------------------------------------------------------------------------------------------


def _context(parent: Any) -> Any:
    """An OpenTelemetry context whose current span is ``parent``: a span, a ``traceparent`` string (a remote
    parent), or None (a new trace)."""
    from opentelemetry import trace

    if parent is None:
        return trace.set_span_in_context(trace.INVALID_SPAN)
    if isinstance(parent, str):
        ids = parse_traceparent(parent)
        if ids is None:
            return trace.set_span_in_context(trace.INVALID_SPAN)
        ctx = trace.SpanContext(ids[0], ids[1], is_remote=True, trace_flags=trace.TraceFlags(ids[2]))
        return trace.set_span_in_context(trace.NonRecordingSpan(ctx))
    return trace.set_span_in_context(parent)


def start(name: str, parent: Any = None, attributes: Mapping[str, Any] | None = None, start_s: float | None = None,
          kind: str = "internal") -> Any:
    """A started span (end it with ``end``), or None when tracing is off. ``parent``: see ``_context``;
    ``start_s``: its start in unix seconds (default now); ``kind``: ``server``, ``client``, ``consumer``, ... """
    if _tracer is None:
        return None
    from opentelemetry.trace import SpanKind

    return _tracer.start_span(name, context=_context(parent), kind=SpanKind[kind.upper()],
                              attributes=_clean(attributes),
                              start_time=None if start_s is None else int(start_s * 1e9))


def end(span: Any, attributes: Mapping[str, Any] | None = None, end_s: float | None = None,
        error: str | None = None) -> None:
    """Set ``attributes`` on ``span`` and end it (``end_s``: unix seconds, default now; ``error``: mark it failed
    with this description). No-op for None or a span already ended."""
    if span is None or not span.is_recording():
        return
    if attributes:
        span.set_attributes(_clean(attributes))
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=None if end_s is None else int(end_s * 1e9))


def record(name: str, parent: Any, start_s: float, end_s: float, attributes: Mapping[str, Any] | None = None,
           kind: str = "internal") -> None:
    """A span whose interval was measured elsewhere (a queue wait: from the entry's enqueue time to now)."""
    if _tracer is None:
        return
    end(start(name, parent, attributes, start_s, kind), end_s=end_s)


@contextlib.contextmanager
def _span(name: str, parent: Any, attributes: Mapping[str, Any] | None, kind: str) -> Iterator[Any]:
    s = start(name, parent, attributes, kind=kind)
    try:
        yield s
    except BaseException as exc:
        end(s, error=f"{type(exc).__name__}: {exc}")
        raise
    end(s)


_NULL = contextlib.nullcontext()


def span(name: str, parent: Any = None, attributes: Mapping[str, Any] | None = None,
         kind: str = "internal") -> contextlib.AbstractContextManager:
    """``with span(...) as s``: a span around a block (``s`` None when off); an exception ends it as an error."""
    if _tracer is None:
        return _NULL
    return _span(name, parent, attributes, kind)


def event(span: Any, name: str, attributes: Mapping[str, Any] | None = None, at_s: float | None = None) -> None:
    """A timestamped event on ``span`` (a preemption, the first token; ``at_s``: unix seconds, default now); no-op
    for None."""
    if span is not None and span.is_recording():
        span.add_event(name, _clean(attributes), timestamp=None if at_s is None else int(at_s * 1e9))


def set_attributes(span: Any, attributes: Mapping[str, Any]) -> None:
    if span is not None and span.is_recording():
        span.set_attributes(_clean(attributes))


def traceparent(span: Any) -> str | None:
    """The ``traceparent`` that makes a span in another process a child of ``span``; None for None."""
    if span is None:
        return None
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None
    return format_traceparent(ctx.trace_id, ctx.span_id, int(ctx.trace_flags))


def _clean(attributes: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """OpenTelemetry refuses None values (with a warning per attribute): they are left out."""
    if not attributes:
        return None
    return {k: v for k, v in attributes.items() if v is not None}
