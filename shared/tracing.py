"""OpenTelemetry tracing across the gateway-to-worker hop: off unless ``traces_exporter`` names an exporter.

The gateway traces each API request (authentication, limits, the publish) and puts the trace context in the NATS
message's headers (W3C ``traceparent``); the worker continues that trace with the request's time in the queue,
its prefill and its decode, so one request's time reads end to end in one trace. With no exporter configured
the OpenTelemetry API hands out non-recording spans, which cost next to nothing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace import Span
from opentelemetry.util.types import AttributeValue

tracer = trace.get_tracer("switchyard")


class JsonLinesExporter(SpanExporter):
    """Appends each span as one JSON line to a file (several processes may share it: one write per span, with
    O_APPEND, lands whole)."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        for span in spans:
            os.write(self._fd, (span.to_json(indent=None) + "\n").encode())
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        os.close(self._fd)


def setup_tracing(service: str, exporter: str, traces_file: Path | None = None) -> None:
    """Install the process's tracer provider for ``service`` ("switchyard-gateway", "switchyard-worker")."""
    if exporter == "none":
        return
    if exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise SystemExit("traces_exporter=otlp needs the tracing extra: pip install 'switchyard[tracing]'") \
                from exc
        processor: SpanProcessor = BatchSpanProcessor(OTLPSpanExporter())  # endpoint etc. from OTEL_EXPORTER_OTLP_*
    elif exporter == "file":
        if traces_file is None:
            raise SystemExit("traces_exporter=file needs traces_file")
        processor = SimpleSpanProcessor(JsonLinesExporter(traces_file))
    else:
        processor = SimpleSpanProcessor(ConsoleSpanExporter())
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str]:
    """``headers`` plus the current trace context (none when nothing is traced)."""
    headers = dict(headers or {})
    propagate.inject(headers)
    return headers


def extract_context(headers: dict[str, str] | None) -> otel_context.Context | None:
    """The trace context a message's headers carry, or None."""
    if not headers or "traceparent" not in headers:
        return None
    return propagate.extract(headers)


def record_span(name: str, parent: otel_context.Context | None, start_s: float, end_s: float,
                **attributes: AttributeValue) -> Span | None:
    """A finished span of ``parent``'s trace from unix time ``start_s`` to ``end_s`` (for work timed while it
    ran and reported when it ended, as the worker does for a request's queue, prefill and decode)."""
    if parent is None:
        return None
    span = tracer.start_span(name, context=parent, start_time=int(start_s * 1e9), attributes=attributes)
    span.end(end_time=int(max(end_s, start_s) * 1e9))
    return span


def child_context(span: Span | None) -> otel_context.Context:
    """A context whose current span is ``span``, to start its children in (None: a context with no span, whose
    children are not recorded)."""
    return trace.set_span_in_context(span if span is not None else trace.INVALID_SPAN)
