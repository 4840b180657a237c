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
from array import array
from dataclasses import dataclass, field
from typing import Any

from schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch
from schemas.kv_hashing import iter_chain_hashes


@dataclass(slots=True)
class _Worker:
    # Its bit in the holder masks.
    slot: int
    block_size: int | None = None
    # The last batch number applied; -1 before the first.
    last_seq: int = -1
    num_blocks: int = 0
    # Every block it stored, 8 bytes each, so that removing the worker touches only its own; removals leave their
    # entries behind until the list is twice what the worker holds, then it is compacted.
    stored: array[int] = field(default_factory=lambda: array("Q"))


class KvIndex:
    """Block hash → a bit mask of the workers holding it, one bit per worker slot, and per worker a flat array of the
    blocks it stored. 64 workers × 100k blocks took 2.2 GB as Python sets per worker and per block, about a quarter
    of it so (scripts/bench_routing.py --router-cost)."""

    def __init__(self) -> None:
        self._workers: dict[str, _Worker] = {}
        self._holders: dict[int, int] = {}
        self._free_slots: list[int] = []
        # The one-bit masks, made once: most blocks have a single holder, and they share these objects.
        self._bits: list[int] = []

    def apply(self, batch: KvEventBatch) -> range:
        """Apply one batch; returns the batch numbers missed before it (empty when none). A batch already
        applied (a replay overlapping the live feed) is skipped."""
        worker = self._worker(batch.worker_id)
        if batch.seq <= worker.last_seq:
            return range(0)
        missed = range(worker.last_seq + 1, batch.seq)
        worker.last_seq = batch.seq
        for event in batch.events:
            if isinstance(event, BlockStored):
                worker.block_size = event.block_size
                self._store(worker, event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self._remove(worker, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self._clear(worker)
        return missed

    def forget_worker(self, worker_id: str) -> None:
        """A worker gone (its card expired), or one whose events must be replayed from scratch."""
        worker = self._workers.pop(worker_id, None)
        if worker is None:
            return
        self._clear(worker)
        self._free_slots.append(worker.slot)

    def cached_blocks(self, token_ids: list[int], worker_ids: list[str],
                      lora_name: str | None = None) -> dict[str, int]:
        """For each worker, how many of the prompt's leading blocks it holds (a prefix: the first miss ends it),
        as run with the adapter `lora_name` (None: the base model)."""
        overlaps = dict.fromkeys(worker_ids, 0)
        by_block_size: dict[int, list[_Worker]] = {}
        names: dict[int, str] = {}
        for worker_id in worker_ids:
            worker = self._workers.get(worker_id)
            if worker is not None and worker.block_size is not None:
                by_block_size.setdefault(worker.block_size, []).append(worker)
                names[worker.slot] = worker_id
        for block_size, candidates in by_block_size.items():
            active = 0
            for worker in candidates:
                active |= self._bit(worker.slot)
            depth = 0
            for block in iter_chain_hashes(token_ids, block_size, lora_name):
                held = active & self._holders.get(block, 0)
                self._record(active & ~held, depth, names, overlaps)
                active = held
                if not active:
                    break
                depth += 1
            self._record(active, depth, names, overlaps)
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
        """The index as plain data (msgpack-able), built at C speed: the workers (slot, block size, last batch
        number, stored blocks as bytes), and the block hashes with their holder masks as two parallel lists."""
        return {"format": 2,
                "workers": {worker_id: {"slot": w.slot, "block_size": w.block_size, "last_seq": w.last_seq,
                                        "num_blocks": w.num_blocks, "stored": w.stored.tobytes()}
                            for worker_id, w in self._workers.items()},
                "blocks": list(self._holders), "masks": list(self._holders.values())}

    @classmethod
    def restored(cls, snapshot: dict[str, Any]) -> KvIndex:
        if snapshot.get("format") != 2:
            raise ValueError("a snapshot of an older index format")
        index = cls()
        for worker_id, data in snapshot["workers"].items():
            stored: array[int] = array("Q")
            stored.frombytes(data["stored"])
            index._workers[worker_id] = _Worker(slot=data["slot"], block_size=data["block_size"],
                                                last_seq=data["last_seq"], num_blocks=data["num_blocks"], stored=stored)
        used = {w.slot for w in index._workers.values()}
        index._free_slots = [slot for slot in range(max(used, default=-1) + 1) if slot not in used]
        index._holders = dict(zip(snapshot["blocks"], snapshot["masks"], strict=True))
        return index

    def _worker(self, worker_id: str) -> _Worker:
        worker = self._workers.get(worker_id)
        if worker is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._workers)
            worker = self._workers[worker_id] = _Worker(slot)
        return worker

    def _bit(self, slot: int) -> int:
        while len(self._bits) <= slot:
            self._bits.append(1 << len(self._bits))
        return self._bits[slot]

    def _store(self, worker: _Worker, blocks: list[int]) -> None:
        bit, holders = self._bit(worker.slot), self._holders
        for block in blocks:
            mask = holders.get(block, 0)
            if not mask & bit:
                holders[block] = bit if not mask else mask | bit
                worker.num_blocks += 1
                worker.stored.append(block)

    def _remove(self, worker: _Worker, blocks: list[int]) -> None:
        bit = self._bit(worker.slot)
        for block in blocks:
            self._drop(block, bit, worker)
        if len(worker.stored) > 2 * worker.num_blocks + 1024:
            # Mostly removed blocks by now: keep those still held, once each.
            holders = self._holders
            worker.stored = array("Q", dict.fromkeys(b for b in worker.stored if holders.get(b, 0) & bit))

    def _clear(self, worker: _Worker) -> None:
        """Drop every block of one worker (it left, or its engine cleared its cache)."""
        bit = self._bit(worker.slot)
        for block in worker.stored:
            self._drop(block, bit, worker)
        worker.stored = array("Q")
        worker.num_blocks = 0

    def _drop(self, block: int, bit: int, worker: _Worker) -> None:
        mask = self._holders.get(block, 0)
        if mask & bit:
            worker.num_blocks -= 1
            if mask == bit:
                del self._holders[block]
            else:
                self._holders[block] = self._single_or(mask & ~bit)

    def _single_or(self, mask: int) -> int:
        """A one-bit mask as the shared object (no new int per block), any other as it is."""
        if mask & (mask - 1) == 0:
            return self._bit(mask.bit_length() - 1)
        return mask

    @staticmethod
    def _record(gone: int, depth: int, names: dict[int, str], overlaps: dict[str, int]) -> None:
        while gone:
            low = gone & -gone
            overlaps[names[low.bit_length() - 1]] = depth
            gone ^= low


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
