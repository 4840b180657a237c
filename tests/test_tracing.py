"""One request is one trace: with an exporter configured, the client's submit, the processor and the decode worker
each record a span, parented hop to hop through the `traceparent` header."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bus import tracing
from bus.tracing import TraceContext, configure_tracing
from schemas.registry import Stage
from schemas.replies import FinalFrame
from tests.conftest import Bus
from tests.pipeline_helpers import chat, client_of, mock_decode, mock_processor, running_workers


async def test_a_request_is_one_trace_across_the_stages(bus: Bus, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracing, "_tracer", None)  # restored after the test: no export elsewhere
    exporter = InMemorySpanExporter()
    assert configure_tracing("conveyor-test", exporter=exporter)
    caller = TraceContext.new()  # e.g. an HTTP client's traceparent, as the gateway passes it on
    async with running_workers(bus, [(Stage.PROCESSOR, mock_processor()), (Stage.DECODE, mock_decode(inter_token_s=0.001))]):
        client = client_of(bus)
        async with await client.submit(chat(client, "hello", max_tokens=3), trace=caller) as stream:
            _, final = await stream.collect()
    assert isinstance(final, FinalFrame)
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert {"submit", "processor", "decode"} <= spans.keys()
    assert {f"{span.context.trace_id:032x}" for span in spans.values()} == {caller.trace_id}
    assert f"{spans['submit'].parent.span_id:016x}" == caller.span_id
    assert spans["processor"].parent.span_id == spans["submit"].context.span_id
    assert spans["decode"].parent.span_id == spans["processor"].context.span_id
    assert spans["decode"].attributes["request_id"] == spans["processor"].attributes["request_id"]
