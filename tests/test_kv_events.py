"""KV events land on their stream numbered per worker; a reader can tell when it missed some."""

from __future__ import annotations

from nats.js.api import AckPolicy, ConsumerConfig

from bus.kv_events import GapTracker, KvEventPublisher
from schemas.codec import decode
from schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch
from tests.conftest import Bus
from workers.engines.events import merged_batches
from workers.engines.protocol import KvEventBatchOut


async def read_batches(bus: Bus) -> list[KvEventBatch]:
    subscription = await bus.js.pull_subscribe(
        bus.names.kv_events_subjects, stream=bus.names.kv_events_stream, config=ConsumerConfig(ack_policy=AckPolicy.NONE)
    )
    try:
        messages = await subscription.fetch(batch=100, timeout=1.0)
    finally:
        await subscription.unsubscribe()
    return [decode(msg.data, KvEventBatch) for msg in messages]


async def test_batches_are_stored_numbered_per_worker(bus: Bus) -> None:
    stored = BlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=list(range(8)), block_size=4)
    first, second = KvEventPublisher(bus.js, bus.names, "w-a"), KvEventPublisher(bus.js, bus.names, "w-b")
    assert await first.publish([stored]) == 0
    assert await first.publish([BlockRemoved(block_hashes=[12])]) == 1
    assert await second.publish([AllBlocksCleared()]) == 0
    batches = await read_batches(bus)
    assert [(b.worker_id, b.seq) for b in batches] == [("w-a", 0), ("w-a", 1), ("w-b", 0)]
    assert batches[0].events == [stored]


def test_gap_tracker_reports_missed_batches() -> None:
    tracker = GapTracker()
    batch = lambda seq: KvEventBatch(worker_id="w", seq=seq, ts=0.0, events=[AllBlocksCleared()])  # noqa: E731
    assert list(tracker.observe(batch(0))) == []
    assert list(tracker.observe(batch(1))) == []
    assert list(tracker.observe(batch(4))) == [2, 3]


def test_batches_of_one_rank_merge_in_order_and_ranks_stay_apart() -> None:
    stored = [BlockStored(block_hashes=[k], token_ids=list(range(4)), block_size=4) for k in range(4)]
    removed = BlockRemoved(block_hashes=[0])
    batches = [KvEventBatchOut([stored[0]], ts=1.0), KvEventBatchOut([stored[1], removed], ts=2.0),
               KvEventBatchOut([stored[2]], ts=3.0, data_parallel_rank=1), KvEventBatchOut([stored[3]], ts=4.0)]
    merged = merged_batches(batches)
    assert [(b.events, b.ts, b.data_parallel_rank) for b in merged] == [
        ([stored[0], stored[1], removed], 2.0, 0), ([stored[2]], 3.0, 1), ([stored[3]], 4.0, 0)]
    assert merged_batches([]) == []
