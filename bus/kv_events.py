"""Relaying an engine's KV-cache events to the `{NS}_KV_EVENTS` stream, and reading them back.

Each worker numbers its batches 0, 1, 2, ... and publishes them to `{ns}.kv.{worker_id}` with
`Nats-Msg-Id = {worker_id}:{seq}`, so a re-sent batch is deduplicated and a reader that sees a
number skipped knows it lost events and must resynchronise (drop that worker's blocks).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from nats.js import JetStreamContext

from bus.publish import MSG_ID_HEADER
from bus.subjects import Names
from schemas.codec import WIRE_VERSION, WIRE_VERSION_HEADER, encode
from schemas.kv_events import KvEvent, KvEventBatch


class KvEventPublisher:
    def __init__(self, js: JetStreamContext, names: Names, worker_id: str) -> None:
        self._js = js
        self._subject = names.kv_events_subject(worker_id)
        self.worker_id = worker_id
        self._next_seq = 0

    async def publish(self, events: list[KvEvent], ts: float | None = None, data_parallel_rank: int = 0) -> int:
        """Publish one batch; returns its sequence number."""
        batch = KvEventBatch(
            worker_id=self.worker_id,
            seq=self._next_seq,
            ts=time.time() if ts is None else ts,
            data_parallel_rank=data_parallel_rank,
            events=events,
        )
        headers = {MSG_ID_HEADER: f"{self.worker_id}:{batch.seq}", WIRE_VERSION_HEADER: str(WIRE_VERSION)}
        await self._js.publish(self._subject, encode(batch), headers=headers)
        # Only a stored batch advances the number: a failed publish is retried under the same one.
        self._next_seq += 1
        return batch.seq


@dataclass
class GapTracker:
    """Follows each worker's batch numbers; reports the batches a reader missed."""

    last_seq: dict[str, int] = field(default_factory=dict)

    def observe(self, batch: KvEventBatch) -> range:
        """The sequence numbers missing before this batch (empty when none)."""
        previous = self.last_seq.get(batch.worker_id, -1)
        self.last_seq[batch.worker_id] = max(previous, batch.seq)
        return range(previous + 1, batch.seq)
