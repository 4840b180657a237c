"""Worker cards: listed while heartbeating, gone on close or when heartbeats stop."""

from __future__ import annotations

import asyncio
import os
import time

from bus.registry import Registration, live_workers, ready_models
from schemas.codec import WIRE_VERSION, encode
from schemas.registry import ServingMode, Stage, WorkerCard
from tests.conftest import Bus


def card(worker_id: str, stage: Stage, ready: bool = True, mode: ServingMode = ServingMode.AGGREGATED) -> WorkerCard:
    return WorkerCard(
        worker_id=worker_id, stage=stage, model="m", mode=mode, engine="mock", host="localhost", pid=os.getpid(),
        started_at_s=time.time(), ready=ready, wire_version=WIRE_VERSION,
    )


async def test_registered_worker_is_listed_and_removed_on_close(bus: Bus) -> None:
    registration = Registration(bus.registry, card("decode-1", Stage.DECODE), bus.settings.registry_ttl_s)
    await registration.open()
    assert [c.worker_id for c in await live_workers(bus.registry)] == ["decode-1"]
    await registration.close()
    assert await live_workers(bus.registry) == []


async def test_card_of_a_worker_that_stops_heartbeating_expires(bus: Bus) -> None:
    # registry_ttl_s is 3 s in the tests: write once, never refresh.
    await bus.registry.put("stale-1", encode(card("stale-1", Stage.DECODE)))
    assert len(await live_workers(bus.registry)) == 1
    await asyncio.sleep(bus.settings.registry_ttl_s + 0.5)
    assert await live_workers(bus.registry) == []


async def test_heartbeats_keep_a_card_alive_past_the_ttl(bus: Bus) -> None:
    registration = Registration(bus.registry, card("alive-1", Stage.PROCESSOR), bus.settings.registry_ttl_s)
    await registration.open()
    try:
        await asyncio.sleep(bus.settings.registry_ttl_s + 0.5)
        assert [c.worker_id for c in await live_workers(bus.registry)] == ["alive-1"]
    finally:
        await registration.close()


def test_model_is_ready_only_when_every_stage_of_its_mode_is_ready() -> None:
    processor, decode = card("p", Stage.PROCESSOR), card("d", Stage.DECODE)
    assert ready_models([processor, decode]) == {"m": ServingMode.AGGREGATED}
    assert ready_models([processor]) == {}
    assert ready_models([processor, card("d", Stage.DECODE, ready=False)]) == {}
    disagg = [card(w, s, mode=ServingMode.DISAGGREGATED) for w, s in [("p", Stage.PROCESSOR), ("d", Stage.DECODE)]]
    assert ready_models(disagg) == {}
    assert ready_models([*disagg, card("f", Stage.PREFILL, mode=ServingMode.DISAGGREGATED)]) == {
        "m": ServingMode.DISAGGREGATED
    }
    # A processor started without --mode still routes the disaggregated pipeline.
    assert ready_models([processor, card("f", Stage.PREFILL, mode=ServingMode.DISAGGREGATED),
                         card("d", Stage.DECODE, mode=ServingMode.DISAGGREGATED)]) == {"m": ServingMode.DISAGGREGATED}


def test_a_processor_serving_several_models_counts_for_each() -> None:
    # compose's embedding profile: one processor serves the LLM and the embedding model (processors share one queue).
    processor = card("p", Stage.PROCESSOR).model_copy(update={"also_serves": ["minilm"]})
    embed = card("e", Stage.EMBED, mode=ServingMode.EMBEDDING).model_copy(update={"model": "minilm"})
    assert ready_models([processor, card("d", Stage.DECODE), embed]) == {"m": ServingMode.AGGREGATED,
                                                                         "minilm": ServingMode.EMBEDDING}
    assert ready_models([card("p", Stage.PROCESSOR), embed]) == {}
