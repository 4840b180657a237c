"""Worker cards: listed while heartbeating, gone on close or when heartbeats stop."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from nats.js.api import KeyValueConfig

from bus.lifecycle import sleep_unless, stop_tasks
from bus.registry import Registration, RegistryView, live_workers, ready_models, registry_changes
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


async def test_a_card_comes_back_once_its_bucket_takes_puts_though_declaring_it_hangs(bus: Bus) -> None:
    # A cluster that lost the registry's leader node: the bucket's new leader takes puts again before the meta
    # leader answers declarations. The card must not wait for a declaration every beat (it lapsed in CI that way).
    config = KeyValueConfig(bucket=f"{bus.names.namespace}-cards", ttl=bus.settings.registry_ttl_s, history=1)
    bucket = await bus.js.create_key_value(config)
    declarations = 0

    async def declare_never_answers() -> object:
        nonlocal declarations
        declarations += 1
        await asyncio.sleep(3600)

    registration = Registration(bucket, card("decode-1", Stage.DECODE), bus.settings.registry_ttl_s,
                                reopen=declare_never_answers)
    await registration.open()
    try:
        await bus.js.delete_key_value(config.bucket)  # puts now fail, and the failed beat declares (in vain)
        deadline_s = time.monotonic() + 2 * bus.settings.registry_ttl_s
        while declarations == 0 and time.monotonic() < deadline_s:
            await asyncio.sleep(0.05)
        assert declarations >= 1
        await bus.js.create_key_value(config)  # the bucket takes puts again; nothing answers a declaration
        await asyncio.sleep(bus.settings.registry_ttl_s / 3 * 2 + 0.5)  # two beats
        assert [c.worker_id for c in await live_workers(bucket)] == ["decode-1"]
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


async def test_a_view_kept_fresh_serves_a_request_after_a_quiet_spell_without_waiting_for_a_read(bus: Bus) -> None:
    registration = Registration(bus.registry, card("decode-1", Stage.DECODE), bus.settings.registry_ttl_s)
    await registration.open()
    reads: list[float] = []
    slow_read_s = 0.5

    async def read() -> list[WorkerCard]:
        reads.append(time.monotonic())
        cards = await live_workers(bus.registry)
        await asyncio.sleep(slow_read_s)  # a registry slow to answer: a request that waits for it shows it
        return cards

    stale_limit_s = 1.0
    idle = RegistryView(read, refresh_after_s=0.1, stale_limit_s=stale_limit_s)
    kept = RegistryView(read, refresh_after_s=0.1, stale_limit_s=stale_limit_s)
    await idle.refresh()
    keeper = asyncio.create_task(kept.keep_fresh(stale_limit_s / 2))
    try:
        await asyncio.sleep(stale_limit_s + 0.7)  # quiet for longer than the stale limit
        started_s = time.monotonic()
        assert [c.worker_id for c in await kept.cards()] == ["decode-1"]
        kept_wait_s = time.monotonic() - started_s
        started_s = time.monotonic()
        assert [c.worker_id for c in await idle.cards()] == ["decode-1"]
        idle_wait_s = time.monotonic() - started_s
    finally:
        await stop_tasks([keeper])
        await registration.close()
    assert kept_wait_s < 0.05  # the kept view answered from its last timed read
    assert idle_wait_s >= slow_read_s * 0.9  # the view read only on demand waited for a read
    assert len(reads) >= 4  # one for the idle view, and the kept view's timed reads


def followed_view(bus: Bus, reads: list[float]) -> tuple[RegistryView, asyncio.Task[None]]:
    """A view of the test bucket following a watch on it, each of its registry reads noted in `reads`; and the task
    that follows."""
    ttl_s = bus.settings.registry_ttl_s

    async def read() -> list[WorkerCard]:
        reads.append(time.monotonic())
        return await live_workers(bus.registry)

    view = RegistryView(read, refresh_after_s=0.1, stale_limit_s=ttl_s)
    follower = asyncio.create_task(view.follow(lambda: registry_changes(bus.registry, quiet_limit_s=ttl_s / 2), ttl_s))
    return view, follower


async def test_a_followed_view_sees_a_new_worker_at_once_and_never_reads(bus: Bus) -> None:
    ttl_s = bus.settings.registry_ttl_s
    first = Registration(bus.registry, card("decode-1", Stage.DECODE), ttl_s)
    await first.open()
    reads: list[float] = []
    view, follower = followed_view(bus, reads)
    second = Registration(bus.registry, card("prefill-1", Stage.PREFILL), ttl_s)
    try:
        await asyncio.sleep(ttl_s / 2 + 0.3)  # the watch is trusted once every live worker has written since it began
        reads.clear()
        assert [c.worker_id for c in await view.cards()] == ["decode-1"]
        await second.open()
        await asyncio.sleep(0.2)
        assert [c.worker_id for c in await view.cards()] == ["decode-1", "prefill-1"]
        await first.close()
        await asyncio.sleep(0.2)
        assert [c.worker_id for c in await view.cards()] == ["prefill-1"]
    finally:
        await stop_tasks([follower])
        await second.close()
    assert reads == []  # every answer came from the watch


async def test_latest_reads_the_registry_until_the_watch_is_trusted_then_answers_from_it(bus: Bus) -> None:
    ttl_s = bus.settings.registry_ttl_s
    reads: list[float] = []
    view, follower = followed_view(bus, reads)
    first = Registration(bus.registry, card("decode-1", Stage.DECODE), ttl_s)
    second = Registration(bus.registry, card("prefill-1", Stage.PREFILL), ttl_s)
    try:
        await first.open()
        # The watch began a moment ago, so it is not trusted yet: each look reads, however fresh the last read.
        assert {c.worker_id for c in await view.latest()} == {"decode-1"}
        await second.open()
        assert {c.worker_id for c in await view.latest()} == {"decode-1", "prefill-1"}
        assert len(reads) == 2
        await asyncio.sleep(ttl_s / 2 + 0.3)
        reads.clear()
        await first.close()
        await asyncio.sleep(0.2)
        assert {c.worker_id for c in await view.latest()} == {"prefill-1"}
        assert reads == []  # trusted: the watch answers, the worker gone already gone from it
    finally:
        await stop_tasks([follower])
        await second.close()


async def test_a_followed_view_drops_a_card_not_written_for_a_ttl(bus: Bus) -> None:
    ttl_s = bus.settings.registry_ttl_s
    alive = Registration(bus.registry, card("alive-1", Stage.PROCESSOR), ttl_s)
    await alive.open()
    view, follower = followed_view(bus, [])
    try:
        await asyncio.sleep(0.2)
        await bus.registry.put("stale-1", encode(card("stale-1", Stage.DECODE)))  # written once, never again
        await asyncio.sleep(ttl_s / 2)
        assert [c.worker_id for c in await view.cards()] == ["stale-1", "alive-1"]  # sorted by stage
        await asyncio.sleep(ttl_s / 2 + 0.5)
        assert [c.worker_id for c in await view.cards()] == ["alive-1"]
    finally:
        await stop_tasks([follower])
        await alive.close()


async def test_a_followed_view_reads_the_registry_while_its_watch_is_quiet(bus: Bus) -> None:
    ttl_s = bus.settings.registry_ttl_s
    reads: list[float] = []
    view, follower = followed_view(bus, reads)
    registration = Registration(bus.registry, card("decode-1", Stage.DECODE), ttl_s)
    try:
        await asyncio.sleep(ttl_s / 2 + 0.3)
        # Nothing written since the watch began: it may have lost the server, so the view reads instead.
        assert await view.cards() == [] and len(reads) == 1
        await registration.open()
        # The quiet watch was begun again (after its quiet limit and a second's pause): trusted half a TTL later.
        await asyncio.sleep(1.0 + ttl_s / 2 + 0.5)
        reads.clear()
        assert [c.worker_id for c in await view.cards()] == ["decode-1"]
        assert reads == []  # heard from: the watch answers
        view.invalidate()
        assert [c.worker_id for c in await view.cards()] == ["decode-1"]
        assert len(reads) == 1  # invalidated: read first, whatever the watch says
    finally:
        await stop_tasks([follower])
        await registration.close()


async def test_a_followed_view_stops_at_once_when_cancelled_while_cards_keep_coming(bus: Bus) -> None:
    # A cancel that lands while a change is arriving must still stop the watch. nats-py's `updates(timeout=...)`
    # (asyncio.wait_for on Python 3.11) returned the change and dropped the cancel: the watch ran on, and a worker
    # stopping waited 5 s for it (stop_tasks' limit) before leaving it running.
    writing = True

    async def write_cards() -> None:
        index = 0
        while writing:
            index += 1
            await bus.registry.put(f"busy-{index % 4}", encode(card(f"busy-{index % 4}", Stage.DECODE)))

    writer = asyncio.create_task(write_cards())
    lingering = []
    try:
        for attempt in range(40):
            _, follower = followed_view(bus, [])
            await asyncio.sleep(0.02 + 0.001 * (attempt % 7))  # the watch is running, changes coming in
            follower.cancel()
            done, _ = await asyncio.wait([follower], timeout=1.0)
            if not done:
                lingering.append(attempt)
                await stop_tasks([follower], timeout_s=0.1)
    finally:
        writing = False
        await writer
    assert lingering == []


async def test_a_beat_sleep_cancelled_as_its_stop_is_set_is_cancelled() -> None:
    # The stop's wake-up runs first, then the cancel: asyncio.wait_for on Python 3.11 returned the stop's result there
    # and dropped the cancel, so a loop sleeping between beats (a registration's, a worker's) ran on after stop_tasks.
    stop = asyncio.Event()
    sleeper = asyncio.create_task(sleep_unless(stop, 10.0))
    await asyncio.sleep(0)  # the sleep is waiting
    stop.set()
    sleeper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sleeper


async def test_a_beat_sleep_says_whether_it_was_stopped() -> None:
    stop = asyncio.Event()
    assert await sleep_unless(stop, 0.01) is False
    asyncio.get_running_loop().call_later(0.01, stop.set)
    assert await sleep_unless(stop, 10.0) is True
