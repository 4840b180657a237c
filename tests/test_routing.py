"""KV-aware routing: the index built from KV events, the cost function, pinned tasks that never strand."""

from __future__ import annotations

import asyncio
import random
import signal

import pytest

from bus.kv_events import KvEventPublisher
from bus.pools import PoolsConfig
from bus.kv_index import Candidate, KvIndex, choose
from bus.router import KvEventFeed, Router, RouterMode, RouterOptions
from schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch
from schemas.kv_hashing import chain_hashes
from schemas.registry import Stage
from schemas.replies import FinalFrame, FinishReason
from tests.conftest import Bus
from tests.helpers import metric, wait_until
from tests.pipeline_helpers import (
    MOCK,
    client_of,
    completion,
    mock_decode,
    running_workers,
    wait_for_workers,
    worker_processes,
)
from workers.engines.factory import EngineKind
from workers.processor import ProcessorStage
from workers.stages import served_model

BLOCK = 16


def stored(tokens: list[int], parent_blocks: int = 0) -> BlockStored:
    keys = chain_hashes(tokens, BLOCK)
    return BlockStored(block_hashes=keys[parent_blocks:], parent_block_hash=keys[parent_blocks - 1] if parent_blocks else None,
                       token_ids=tokens[parent_blocks * BLOCK: len(keys) * BLOCK], block_size=BLOCK)


def batch(worker_id: str, seq: int, *events: object) -> KvEventBatch:
    return KvEventBatch(worker_id=worker_id, seq=seq, ts=0.0, events=list(events))  # type: ignore[arg-type]


def test_the_index_counts_the_cached_prefix_per_worker_and_stops_at_the_first_miss() -> None:
    shared, other = list(range(100, 164)), list(range(500, 564))  # 4 blocks each
    index = KvIndex()
    index.apply(batch("a", 0, stored(shared)))
    index.apply(batch("b", 0, stored(shared[:32])))
    index.apply(batch("c", 0, stored(other)))
    prompt = shared + [7] * 20
    assert index.cached_blocks(prompt, ["a", "b", "c", "unknown"]) == {"a": 4, "b": 2, "c": 0, "unknown": 0}
    # A removed middle block ends the prefix there, even though later blocks are still held.
    index.apply(batch("a", 1, BlockRemoved(block_hashes=[chain_hashes(shared, BLOCK)[1]])))
    assert index.cached_blocks(prompt, ["a"]) == {"a": 1}
    index.apply(batch("b", 1, AllBlocksCleared()))
    index.forget_worker("c")
    assert index.cached_blocks(prompt, ["a", "b"]) == {"a": 1, "b": 0} and index.workers == ["a", "b"]


def test_a_new_worker_in_a_gone_workers_slot_inherits_none_of_its_blocks_and_snapshots_round_trip() -> None:
    shared = list(range(100, 164))
    index = KvIndex()
    index.apply(batch("a", 0, stored(shared)))
    index.apply(batch("b", 0, stored(shared[:32])))
    index.forget_worker("a")
    index.apply(batch("c", 0, stored(list(range(900, 916)))))  # takes a's slot
    assert index.cached_blocks(shared, ["b", "c"]) == {"b": 2, "c": 0} and index.num_blocks == 3
    copy = KvIndex.restored(index.snapshot())
    assert copy.cached_blocks(shared, ["b", "c"]) == {"b": 2, "c": 0} and copy.last_seq("c") == 0
    copy.apply(batch("d", 0, stored(shared)))  # a slot neither b nor c holds
    copy.apply(batch("b", 1, BlockRemoved(block_hashes=chain_hashes(shared, BLOCK)[:1])))
    assert copy.cached_blocks(shared, ["b", "c", "d"]) == {"b": 0, "c": 0, "d": 4}


def test_a_workers_churn_does_not_grow_the_index() -> None:
    index = KvIndex()
    for seq in range(0, 800, 2):  # store 400 prompts of 4 blocks and evict each again
        tokens = list(range(seq * 1000, seq * 1000 + 64))
        index.apply(batch("a", seq, stored(tokens)))
        index.apply(batch("a", seq + 1, BlockRemoved(block_hashes=chain_hashes(tokens, BLOCK))))
    kept = list(range(7, 71))
    index.apply(batch("a", 800, stored(kept)))
    assert index.num_blocks == 4 and len(index._workers["a"].stored) <= 2 * 4 + 1024
    index.forget_worker("a")
    assert index.num_blocks == 0 and index.cached_blocks(kept, ["a"]) == {"a": 0}


def test_the_index_reports_missed_batches_and_skips_ones_it_has() -> None:
    index = KvIndex()
    assert not index.apply(batch("a", 0, stored(list(range(16)))))
    assert index.apply(batch("a", 3, AllBlocksCleared())) == range(1, 3)
    assert not index.apply(batch("a", 2, stored(list(range(16)))))  # older than the last one: skipped
    assert index.num_blocks == 0


def test_the_cost_weighs_blocks_to_compute_against_load() -> None:
    warm_busy, cold_idle = Candidate("warm", cached_blocks=8, load_blocks=50), Candidate("cold", 0, load_blocks=0)
    assert choose([warm_busy, cold_idle], prompt_blocks=10).worker_id == "cold"  # 2 + 50 > 10
    warm = Candidate("warm", cached_blocks=8, load_blocks=5)
    assert choose([warm, cold_idle], prompt_blocks=10).worker_id == "warm"  # 2 + 5 < 10
    assert choose([warm, cold_idle], prompt_blocks=10, overlap_weight=0.1).worker_id == "cold"  # 0.2 + 5 > 1
    # A temperature samples: the cheaper worker most often, the other sometimes.
    rng = random.Random(0)
    picks = [choose([warm, cold_idle], 10, temperature=0.5, rng=rng).worker_id for _ in range(400)]
    assert 200 < picks.count("warm") < 400


async def test_a_gap_in_a_workers_events_is_repaired_from_the_stream(bus: Bus) -> None:
    publisher = KvEventPublisher(bus.js, bus.names, "w1")
    first, second, third = list(range(16)), list(range(16, 32)), list(range(32, 48))
    for tokens in (first, second, third):
        await publisher.publish([stored(tokens)])
    index = KvIndex()
    feed = KvEventFeed(bus.js, bus.names, index)
    feed.apply(batch("w1", 0, stored(first)))
    feed.apply(batch("w1", 2, stored(third)))  # batch 1 never reached this reader
    await wait_until(lambda: feed.replays_done == 1, timeout_s=10)
    assert {tuple(tokens): index.cached_blocks(tokens, ["w1"])["w1"] for tokens in (first, second, third)} == {
        tuple(first): 1, tuple(second): 1, tuple(third): 1}
    await feed.stop()


async def test_a_repeated_prefix_goes_to_the_replica_that_holds_it(bus: Bus) -> None:
    processor = ProcessorStage({MOCK: served_model(EngineKind.MOCK, MOCK)}, RouterOptions(RouterMode.KV))
    decoders = [mock_decode() for _ in range(3)]
    system = [(i * 7919) % 30000 + 3 for i in range(256)]  # 16 blocks
    async with running_workers(bus, [(Stage.PROCESSOR, processor)] + [(Stage.DECODE, d) for d in decoders]):
        client = client_of(bus)
        first = await finish(client, system + [11, 12, 13])
        holder = next(d for d in decoders if d.engine.seen)  # type: ignore[attr-defined]
        router = processor._router
        assert router is not None
        await wait_until(lambda: router.index.num_blocks >= 16, timeout_s=10)
        repeats = []
        for turn in range(6):
            # The holder reports itself idle again within 50 ms; busy, it could rightly be passed over.
            await asyncio.sleep(0.15)
            repeats.append(await finish(client, system + [20 + turn, 30 + turn]))
    assert first.usage.cached_tokens == 0
    assert [r.usage.cached_tokens for r in repeats] == [256] * 6  # every turn found the system prompt cached
    assert len(holder.engine.seen) == 7  # type: ignore[attr-defined]
    assert metric("conveyor_router_decisions_total", mode="kv", outcome="hit") >= 6


@pytest.mark.parametrize("pool", [None, "cheap"])
async def test_pinned_tasks_of_a_killed_worker_go_back_to_the_shared_queue(bus: Bus, pool: str | None) -> None:
    """In a pool, back to the pool's queue (the model's is pulled by nobody there)."""
    env = {"CONVEYOR_POOL": pool} if pool else {}
    pools = PoolsConfig(models=[{"model": MOCK, "aggregated": {  # type: ignore[list-item]
        "pools": [pool], "ttft_ms": {"min": 0, "max": 1, "resolution": 1}, "itl_ms": {"min": 0, "max": 1, "resolution": 1},
        "mapping": [[0]]}}]) if pool else None
    async with worker_processes(bus.nats_settings.urls, bus.names.namespace, ["decode", "decode"], **env) as decoders:
        processor = ProcessorStage({MOCK: served_model(EngineKind.MOCK, MOCK)}, RouterOptions(RouterMode.ROUND_ROBIN),
                                   pools)
        async with running_workers(bus, [(Stage.PROCESSOR, processor)]):
            client = client_of(bus)
            await wait_for_workers(client, num_workers=3, timeout_s=60)
            # The processor's own view must hold both decode cards, so the router pins to both.
            cards = await processor._live_cards(max_age_s=0.0)
            assert sum(card.stage == Stage.DECODE and card.ready for card in cards) == 2
            before = metric("conveyor_unpinned_tasks_total", stage="decode")
            # SIGKILL: its card lives on until the registry TTL, so the router still pins half the requests to it.
            decoders[0].send_signal(signal.SIGKILL)
            decoders[0].wait()
            finals = await asyncio.gather(*(finish(client, [5, 6, 7, n], max_tokens=8, timeout_s=60) for n in range(8)))
    assert [f.finish_reason for f in finals] == [FinishReason.LENGTH] * 8
    assert metric("conveyor_unpinned_tasks_total", stage="decode") - before >= 1


async def finish(client, prompt: list[int], max_tokens: int = 4, timeout_s: float = 20.0) -> FinalFrame:  # type: ignore[no-untyped-def]
    request = completion(client, prompt, max_tokens=max_tokens)
    async with await client.submit(request, first_frame_timeout_s=timeout_s) as stream:
        await stream.collect()
    assert isinstance(stream.terminal, FinalFrame)
    return stream.terminal


async def test_a_restarted_router_resumes_from_the_snapshot_not_the_whole_stream(bus: Bus) -> None:
    publisher = KvEventPublisher(bus.js, bus.names, "w1")
    early, late = list(range(16)), list(range(16, 32))
    await publisher.publish([stored(early)])
    options = RouterOptions(RouterMode.KV, snapshot_interval_s=0)
    first = Router(bus.nc, bus.js, bus.names, bus.settings, options)
    await first.start()
    await wait_until(lambda: first.index.num_blocks == 1, timeout_s=10)
    saved_seq = await first.save_snapshot()
    await first.stop()
    # The early batch leaves the stream (its max age, in real life): only the snapshot still knows it.
    await bus.js.delete_msg(bus.names.kv_events_stream, saved_seq)
    await publisher.publish([stored(late)])
    second = Router(bus.nc, bus.js, bus.names, bus.settings, options)
    await second.start()
    await wait_until(lambda: second.index.num_blocks == 2, timeout_s=10)
    assert second.index.cached_blocks(early, ["w1"]) == second.index.cached_blocks(late, ["w1"]) == {"w1": 1}
    assert second.index.last_seq("w1") == 1
    await second.stop()
