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


async def test_every_log_line_of_a_request_carries_its_request_and_trace_ids(bus: Bus) -> None:
    """Read from a worker process's own stderr (JSON lines when it is not a terminal), so no logger cached in this
    process can hide a line."""
    import asyncio
    import json
    import os
    import subprocess
    import sys
    import time

    from tests.pipeline_helpers import MOCK, REPO_ROOT

    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "CONVEYOR_NAMESPACE": bus.names.namespace,
           "CONVEYOR_NATS_URLS": ",".join(bus.nats_settings.urls)}
    processor = subprocess.Popen([sys.executable, "-m", "workers.cli", "worker", "processor", "--engine", "mock",
                                  "--model", MOCK, "--log-level", "INFO", "--shutdown-grace-s", "1"],
                                 cwd=REPO_ROOT, env=env, stderr=subprocess.PIPE, text=True)
    caller = TraceContext.new()
    try:
        async with running_workers(bus, [(Stage.DECODE, mock_decode(inter_token_s=0.001))]):
            client = client_of(bus)
            deadline = time.monotonic() + 60
            while not any(c.stage == Stage.PROCESSOR and c.ready for c in await client.live_workers()):
                assert time.monotonic() < deadline and processor.poll() is None, "the processor did not start"
                await asyncio.sleep(0.2)
            request = chat(client, "hello", max_tokens=3)
            async with await client.submit(request, trace=caller) as stream:
                _, final = await stream.collect()
            assert isinstance(final, FinalFrame)
    finally:
        processor.terminate()
        _, stderr = processor.communicate(timeout=30)
    lines = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    mine = [line for line in lines if line.get("request_id") == request.request_id]
    assert mine, "the processor logged nothing for the request"
    assert all(line.get("trace_id") == caller.trace_id for line in mine), mine
