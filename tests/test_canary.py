"""The worker's canary (the health check behind /ready) on real workers and a real nats-server: it checks the engine
only when live traffic has not, as Dynamo's canary waits for a quiet spell, and it samples as the engine does by
default (a greedy request in SGLang's running batch keeps the whole batch on a slower sampling path)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from bus.client import PipelineClient
from bus.errors import RemoteError
from schemas.registry import Stage
from schemas.replies import FinishReason
from tests.conftest import Bus
from tests.helpers import metric
from tests.pipeline_helpers import ask_to_the_end, client_of, mock_processor, running_workers
from workers.decode import DecodeStage
from workers.engines.mock import MockEngine, MockEngineConfig
from workers.engines.protocol import GenerateOutput, GenerateRequest

CANARY_WAIT_S = 0.5


class CanaryCountingEngine(MockEngine):
    """A mock engine that keeps every canary it ran and when, and fails live requests while `failing` is set."""

    def __init__(self) -> None:
        super().__init__(MockEngineConfig(inter_token_s=0.001))
        self.canaries: list[tuple[float, GenerateRequest]] = []  # (time.monotonic(), the request)
        self.failing = False

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:  # type: ignore[override]
        if request.health_check:
            self.canaries.append((time.monotonic(), request))
        elif self.failing:
            yield GenerateOutput([], finish_reason=FinishReason.ERROR, error="the engine is broken")
            return
        async for output in super().generate(request):
            yield output

    def canaries_between(self, start_s: float, end_s: float) -> int:
        return sum(start_s <= at_s <= end_s for at_s, _ in self.canaries)


@asynccontextmanager
async def serving(bus: Bus) -> AsyncIterator[tuple[CanaryCountingEngine, PipelineClient]]:
    """A processor and a decode worker whose canary waits CANARY_WAIT_S, once a first request went through."""
    engine = CanaryCountingEngine()
    specs = [(Stage.PROCESSOR, mock_processor()), (Stage.DECODE, DecodeStage(engine, "mock"))]
    async with running_workers(bus, specs, canary_wait_s=CANARY_WAIT_S):
        client = client_of(bus)
        await ask_to_the_end(client, max_tokens=2)
        yield engine, client


async def traffic_for(client: PipelineClient, duration_s: float) -> list[bool]:
    """Requests one after another for `duration_s`, each read to its end: whether each ended well."""
    outcomes: list[bool] = []
    deadline_s = time.monotonic() + duration_s
    while time.monotonic() < deadline_s:
        try:
            await ask_to_the_end(client, max_tokens=2)
            outcomes.append(True)
        except RemoteError:
            outcomes.append(False)
        await asyncio.sleep(0.05)
    return outcomes


def canary_count(outcome: str) -> float:
    return metric("conveyor_canaries_total", stage="decode", outcome=outcome)


async def test_the_canary_waits_while_live_requests_succeed_and_checks_once_traffic_stops(bus: Bus) -> None:
    async with serving(bus) as (engine, client):
        deferred, passed = canary_count("deferred"), canary_count("passed")
        started_s = time.monotonic()
        outcomes = await traffic_for(client, duration_s=8 * CANARY_WAIT_S)
        ended_s = time.monotonic()
        assert outcomes and all(outcomes)
        # Once requests had been ending well for a whole wait, they were the check.
        assert engine.canaries_between(started_s + CANARY_WAIT_S, ended_s) == 0
        assert canary_count("deferred") >= deferred + 4  # counted for the operator, every wait
        await asyncio.sleep(4 * CANARY_WAIT_S)  # quiet: the canary checks again
        assert engine.canaries_between(ended_s, time.monotonic()) >= 1
        assert canary_count("passed") > passed
    # Sampled as the engine samples by default: no temperature, top-k or top-p of its own.
    assert all(canary.sampling.temperature is None and canary.sampling.top_k is None and canary.sampling.top_p is None
               for _, canary in engine.canaries)


async def test_failing_live_requests_do_not_stand_in_for_the_canary(bus: Bus) -> None:
    async with serving(bus) as (engine, client):
        engine.failing = True
        failed = canary_count("failed")
        started_s = time.monotonic()
        outcomes = await traffic_for(client, duration_s=8 * CANARY_WAIT_S)
        assert outcomes and not any(outcomes)
        assert engine.canaries_between(started_s, time.monotonic()) >= 2  # every wait, traffic or not
        assert canary_count("failed") == failed  # the engine answers its canary: the live requests' failures are theirs
