"""Which worker holds which prefix block, and which worker a request should go to (KV-aware routing).

`KvIndex` is built from the engines' KV events (`schemas/kv_events.py`): block hashes per worker, the
same chained hashes every engine here computes (`schemas/kv_hashing.py`: part of the KV-event contract). It follows each
worker's batch numbers and reports the ones it missed, so its feed (bus/router.py) can replay that
worker's events from the stream. No NATS here: this is the routing arithmetic.

`choose()` is Dynamo's cost function: for each candidate worker, the prompt blocks it would have to
compute (those past its cached prefix) weighted by `overlap_weight`, plus the blocks it already holds
for running requests (its load); temperature 0 takes the cheapest (ties at random), above 0 samples a
softmax of the negated, normalised costs.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch
from schemas.kv_hashing import chain_hashes


@dataclass
class _Worker:
    blocks: set[int] = field(default_factory=set)
    block_size: int | None = None
    # The last batch number applied; -1 before the first.
    last_seq: int = -1


class KvIndex:
    def __init__(self) -> None:
        self._workers: dict[str, _Worker] = {}
        # block hash -> the workers holding it
        self._holders: dict[int, set[str]] = {}

    def apply(self, batch: KvEventBatch) -> range:
        """Apply one batch; returns the batch numbers missed before it (empty when none). A batch already
        applied (a replay overlapping the live feed) is skipped."""
        worker = self._workers.setdefault(batch.worker_id, _Worker())
        if batch.seq <= worker.last_seq:
            return range(0)
        missed = range(worker.last_seq + 1, batch.seq)
        worker.last_seq = batch.seq
        for event in batch.events:
            if isinstance(event, BlockStored):
                worker.block_size = event.block_size
                for block in event.block_hashes:
                    self._store(batch.worker_id, worker, block)
            elif isinstance(event, BlockRemoved):
                for block in event.block_hashes:
                    self._remove(batch.worker_id, worker, block)
            elif isinstance(event, AllBlocksCleared):
                for block in list(worker.blocks):
                    self._remove(batch.worker_id, worker, block)
        return missed

    def forget_worker(self, worker_id: str) -> None:
        """A worker gone (its card expired), or one whose events must be replayed from scratch."""
        worker = self._workers.pop(worker_id, None)
        if worker is None:
            return
        for block in worker.blocks:
            holders = self._holders.get(block)
            if holders is not None:
                holders.discard(worker_id)
                if not holders:
                    del self._holders[block]

    def cached_blocks(self, token_ids: list[int], worker_ids: list[str],
                      lora_name: str | None = None) -> dict[str, int]:
        """For each worker, how many of the prompt's leading blocks it holds (a prefix: the first miss ends it),
        as run with the adapter `lora_name` (None: the base model)."""
        overlaps = dict.fromkeys(worker_ids, 0)
        by_block_size: dict[int, list[str]] = {}
        for worker_id in worker_ids:
            worker = self._workers.get(worker_id)
            if worker is not None and worker.block_size is not None:
                by_block_size.setdefault(worker.block_size, []).append(worker_id)
        for block_size, candidates in by_block_size.items():
            active = set(candidates)
            for depth, block in enumerate(chain_hashes(token_ids, block_size, lora_name), start=1):
                active &= self._holders.get(block, set())
                if not active:
                    break
                for worker_id in active:
                    overlaps[worker_id] = depth
        return overlaps

    def block_size_of(self, worker_id: str) -> int | None:
        worker = self._workers.get(worker_id)
        return worker.block_size if worker is not None else None

    @property
    def workers(self) -> list[str]:
        return list(self._workers)

    @property
    def num_blocks(self) -> int:
        return len(self._holders)

    def last_seq(self, worker_id: str) -> int:
        worker = self._workers.get(worker_id)
        return worker.last_seq if worker is not None else -1

    def snapshot(self) -> dict[str, object]:
        """The index as plain data (msgpack-able): per worker its block size, last batch number and blocks."""
        return {worker_id: {"block_size": w.block_size, "last_seq": w.last_seq, "blocks": list(w.blocks)}
                for worker_id, w in self._workers.items()}

    @classmethod
    def restored(cls, snapshot: dict[str, dict[str, object]]) -> KvIndex:
        index = cls()
        for worker_id, data in snapshot.items():
            worker = _Worker(block_size=data["block_size"], last_seq=data["last_seq"])  # type: ignore[arg-type]
            index._workers[worker_id] = worker
            for block in data["blocks"]:  # type: ignore[attr-defined]
                index._store(worker_id, worker, block)
        return index

    def _store(self, worker_id: str, worker: _Worker, block: int) -> None:
        worker.blocks.add(block)
        self._holders.setdefault(block, set()).add(worker_id)

    def _remove(self, worker_id: str, worker: _Worker, block: int) -> None:
        worker.blocks.discard(block)
        holders = self._holders.get(block)
        if holders is not None:
            holders.discard(worker_id)
            if not holders:
                del self._holders[block]


@dataclass(frozen=True, slots=True)
class Candidate:
    worker_id: str
    # Prompt blocks it holds already (a prefix), and blocks it holds for running requests (its load).
    cached_blocks: int
    load_blocks: float


def choose(candidates: list[Candidate], prompt_blocks: int, overlap_weight: float = 1.0, temperature: float = 0.0,
           rng: random.Random | None = None) -> Candidate:
    """The worker to send a prompt of `prompt_blocks` blocks to."""
    rng = rng or random.Random()
    costs = [overlap_weight * max(0, prompt_blocks - c.cached_blocks) + c.load_blocks for c in candidates]
    if temperature <= 0:
        cheapest = min(costs)
        return rng.choice([c for c, cost in zip(candidates, costs, strict=True) if cost == cheapest])
    # Costs normalised to [0, 1] so the temperature means the same at any scale.
    spread = (max(costs) - min(costs)) or 1.0
    weights = [math.exp(-(cost - min(costs)) / spread / temperature) for cost in costs]
    return rng.choices(candidates, weights=weights)[0]
