"""W3C trace context (`traceparent`) carried from hop to hop in message headers.

Each hop keeps the trace id and mints its own span id, so a trace collector can stitch one
request's path through processor, prefill and decode back together.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

TRACEPARENT_HEADER = "traceparent"
_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


@dataclass(frozen=True, slots=True)
class TraceContext:
    trace_id: str
    span_id: str
    sampled: bool = True

    @classmethod
    def new(cls) -> TraceContext:
        return cls(trace_id=secrets.token_hex(16), span_id=secrets.token_hex(8))

    @classmethod
    def from_headers(cls, headers: dict[str, str] | None) -> TraceContext:
        """The incoming context, or a fresh trace when the header is missing or malformed."""
        match = _TRACEPARENT.match((headers or {}).get(TRACEPARENT_HEADER, ""))
        if match is None:
            return cls.new()
        trace_id, span_id, flags = match.groups()
        return cls(trace_id=trace_id, span_id=span_id, sampled=bool(int(flags, 16) & 1))

    def child(self) -> TraceContext:
        return TraceContext(trace_id=self.trace_id, span_id=secrets.token_hex(8), sampled=self.sampled)

    @property
    def traceparent(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-{'01' if self.sampled else '00'}"


# ----- OpenTelemetry export (the `otel` extra) -----------------------------------------------------------------------
#
# With an exporter configured, each stage's handling of a task is one span: its parent is the span id of the
# incoming `traceparent`, and the span's own id is what the next hop's `traceparent` carries, so one request is one
# trace across gateway → processor → encode → prefill → decode. Without one, nothing is imported or recorded.

_tracer: Any = None


def configure_tracing(service_name: str, endpoint: str | None = None, exporter: Any = None) -> bool:
    """Export spans over OTLP/HTTP to `endpoint` (default: CONVEYOR_OTLP_ENDPOINT, then OTel's own
    OTEL_EXPORTER_OTLP_ENDPOINT), or to `exporter` (tests); False when neither is set. Raises ImportError naming the
    extra when the packages are missing."""
    global _tracer
    endpoint = endpoint or os.environ.get("CONVEYOR_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if exporter is None and not endpoint:
        return False
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError as error:
        raise ImportError("OTLP export needs the otel extra: pip install 'conveyor[otel]'") from error
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        url = endpoint if endpoint.rstrip("/").endswith("/v1/traces") else endpoint.rstrip("/") + "/v1/traces"
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
    else:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    _tracer = provider.get_tracer("conveyor")
    return True


@contextmanager
def stage_span(name: str, incoming: TraceContext, **attributes: str | int) -> Iterator[TraceContext]:
    """This hop's context for the next: a span of its own when exporting, else a fresh span id."""
    if _tracer is None:
        yield incoming.child()
        return
    from opentelemetry import trace

    parent = trace.set_span_in_context(trace.NonRecordingSpan(trace.SpanContext(
        trace_id=int(incoming.trace_id, 16), span_id=int(incoming.span_id, 16), is_remote=True,
        trace_flags=trace.TraceFlags(1 if incoming.sampled else 0))))
    with _tracer.start_as_current_span(name, context=parent, kind=trace.SpanKind.CONSUMER,
                                       attributes=attributes) as span:
        context = span.get_span_context()
        yield TraceContext(trace_id=incoming.trace_id, span_id=f"{context.span_id:016x}", sampled=incoming.sampled)
