"""KV-aware routing on the bus: the processor's choice of replica, the index feed, pinned tasks.

Design. A routed stage (decode when aggregated, prefill when disaggregated) has, besides the shared
queue `{ns}.work.{stage}.{model}` that every replica pulls, one subject per replica,
`{ns}.work.{stage}.{model}.pinned.{worker_id}`, pulled only by that replica through a durable consumer
of its own (same work-queue stream; the filters do not overlap, as JetStream requires). The router
in each processor replica publishes a task to the pinned subject of the replica it chose, or to the
shared queue (`queue` mode, or when no replica can be chosen). Per-worker subjects rather than one
consumer per worker over a shared subject keep the shared queue exactly as it was: `queue` mode and
unrouted stages see no change, and a pinned task is visible as such in the stream.

A pinned task never strands: when a worker's card leaves the registry (SIGKILL, lost machine) the
router moves whatever its pinned consumer still holds — queued, or delivered and never acked — back
to the shared queue (`unpin`), and a worker that stops cleanly does the same for itself.

Every processor replica keeps its own `KvIndex`, fed from `{NS}_KV_EVENTS` by an ordered consumer
from the start of the stream (its max age bounds the replay). A worker whose batch numbers skip is
replayed from the stream alone (its live batches wait meanwhile); a worker whose card expired is
dropped from the index.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from collections import deque
from dataclasses import dataclass
from enum import StrEnum

import msgpack
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from nats.js.object_store import ObjectStore

from bus.kv_index import Candidate, KvIndex, choose
from bus.lifecycle import stop_tasks
from bus.metrics import (
    DISAGGREGATION_DECISIONS,
    KV_INDEX_BLOCKS,
    ROUTER_DECISIONS,
    ROUTER_PREDICTED_TOKENS,
    UNPINNED_TASKS,
)
from bus.publish import MSG_ID_HEADER, PRIOR_DELIVERIES_HEADER
from bus.settings import BusSettings
from bus.subjects import Names
from schemas.codec import decode
from schemas.kv_events import KvEventBatch
from schemas.registry import Stage, WorkerCard, WorkerLoad

log = structlog.get_logger(__name__)

_SNAPSHOT_OBJECT = "index"

# How fast the prompt blocks a router sent a worker stop counting as its load (they are being computed).
_RECENT_FADE_S = 0.5


class RouterMode(StrEnum):
    QUEUE = "queue"  # the shared queue: whichever replica pulls first (no router)
    KV = "kv"  # the replica holding the longest prefix, against its load
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"


@dataclass(frozen=True, slots=True)
class RouterOptions:
    mode: RouterMode = RouterMode.QUEUE
    # Weight of the blocks a replica would have to compute, against the blocks it holds for running requests.
    # Dynamo's default is 1; here 4 measured better on every engine (scripts/bench_routing.py, README): at 1 a
    # replica running two requests looked costlier than computing a whole 256-512-token prefix elsewhere, so hot
    # prefixes were computed again (torch engine: 47% of prompt tokens found cached at 1, 70% at 4).
    overlap_weight: float = 4.0
    # 0: always the cheapest replica; above 0: softmax sampling over the costs (spreads hot prefixes).
    temperature: float = 0.0
    # Conditional disaggregation: a disaggregated model's prompt with at most this many tokens to compute (beyond
    # what the best decode replica has cached) runs on a decode worker that can prefill itself. 0: never.
    # Dynamo's `isl_bounding`.
    local_prefill_max_tokens: int = 0
    # ... and so does any prompt while every prefill replica has more than this many prompt tokens waiting (reported,
    # plus those this router sent since). 0: never. Dynamo's `prefill_load`; both set: `isl_or_load`.
    prefill_busy_tokens: int = 0
    # How often a kv router stores its index (0: never); a router starting later resumes from the newest.
    snapshot_interval_s: float = 60.0


@dataclass(frozen=True, slots=True)
class LocalPrefill:
    """A disaggregated model's prompt that runs on a decode worker of this pool (None: the model's queue)."""

    pool: str | None


@dataclass(frozen=True, slots=True)
class Route:
    worker_id: str
    predicted_cached_tokens: int


class Router:
    """Chooses replicas for one processor; `start()` feeds its index, `stop()` ends that."""

    def __init__(self, nc: Client, js: JetStreamContext, names: Names, settings: BusSettings,
                 options: RouterOptions) -> None:
        self.options = options
        self._nc = nc
        self._js = js
        self._names = names
        self._settings = settings
        self._feed = KvEventFeed(js, names, KvIndex())
        self._turn = itertools.count()
        self._rng = random.Random()
        # (when, prompt blocks) sent to each worker lately: its card's KV use does not show them yet.
        self._recent: dict[str, deque[tuple[float, int]]] = {}
        # (stage, model, worker, its pool) this router pinned tasks to, to unpin when the worker is gone.
        self._pinned_to: set[tuple[Stage, str, str, str | None]] = set()
        self._unpinning: set[asyncio.Task[None]] = set()
        # Each worker's last load report (`{ns}.load.{worker_id}`), and when it came.
        self._loads: dict[str, tuple[float, WorkerLoad]] = {}
        self._load_subscription: Subscription | None = None
        self._snapshots: asyncio.Task[None] | None = None
        self._saved_seq = 0

    @property
    def index(self) -> KvIndex:
        return self._feed.index

    async def start(self) -> None:
        if self.options.mode != RouterMode.KV:
            return
        after_seq = await self._restore()
        await self._feed.start(after_seq)
        self._load_subscription = await self._nc.subscribe(self._names.load_subjects, cb=self._on_load)
        if self.options.snapshot_interval_s > 0:
            self._snapshots = asyncio.create_task(self._save_periodically(), name="router-snapshots")

    async def stop(self) -> None:
        await stop_tasks([*([self._snapshots] if self._snapshots else []), *self._unpinning])
        if self._load_subscription is not None:
            await self._load_subscription.unsubscribe()
        await self._feed.stop()

    async def save_snapshot(self) -> int:
        """Store the index and the stream position it reflects; a router starting later resumes from it instead
        of replaying the whole KV-event stream. Returns the stream sequence saved."""
        seq = self._feed.stream_seq
        data = msgpack.packb({"stream_seq": seq, "index": self.index.snapshot()})
        store = await self._snapshot_store()
        await store.put(_SNAPSHOT_OBJECT, data)
        self._saved_seq = seq
        return seq

    async def _restore(self) -> int:
        """Load the last snapshot, if any; the stream sequence to resume after (0: from the start)."""
        try:
            result = await (await self._js.object_store(self._names.router_snapshot_bucket)).get(_SNAPSHOT_OBJECT)
            snapshot = msgpack.unpackb(result.data, strict_map_key=False)
            self._feed.index = KvIndex.restored(snapshot["index"])
        except Exception as error:  # none yet, or unreadable: build the index from the stream
            log.info("router.no_snapshot", reason=repr(error))
            return 0
        log.info("router.snapshot_restored", stream_seq=snapshot["stream_seq"], blocks=self.index.num_blocks)
        return int(snapshot["stream_seq"])

    async def _snapshot_store(self) -> ObjectStore:
        try:
            return await self._js.object_store(self._names.router_snapshot_bucket)
        except NotFoundError:
            return await self._js.create_object_store(self._names.router_snapshot_bucket)

    async def _save_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.options.snapshot_interval_s)
            if self._feed.stream_seq == self._saved_seq:
                continue
            try:
                await self.save_snapshot()
            except Exception as error:  # NATS away: the next interval tries again
                log.warning("router.snapshot_failed", error=repr(error))

    def route(self, stage: Stage, model: str, token_ids: list[int], cards: list[WorkerCard],
              lora_name: str | None = None, pool: str | None = None) -> Route | None:
        """The replica of `pool` (None: the model's replicas outside pools) to pin this prompt (run with the adapter
        `lora_name`, if any) to; None: the shared queue (the pool's). A prompt naming an adapter that only some
        replicas have loaded is pinned to one of those in any mode."""
        workers = sorted(_ready(cards, stage, model, pool), key=lambda c: c.worker_id)
        holders = [c for c in workers if lora_name in c.lora_adapters]
        must_pin = lora_name is not None and 0 < len(holders) < len(workers)
        if must_pin:
            workers = holders
        if (self.options.mode == RouterMode.QUEUE and not must_pin) or not workers:
            ROUTER_DECISIONS.labels(mode=self.options.mode.value, outcome="shared").inc()
            return None
        if self.options.mode in (RouterMode.ROUND_ROBIN, RouterMode.QUEUE):
            chosen, cached_blocks, block_size = workers[next(self._turn) % len(workers)], 0, 1
        elif self.options.mode == RouterMode.RANDOM:
            chosen, cached_blocks, block_size = self._rng.choice(workers), 0, 1
        else:
            chosen, cached_blocks, block_size = self._by_kv(workers, token_ids, lora_name)
        self._pinned_to.add((stage, model, chosen.worker_id, pool))
        self._note_sent(chosen.worker_id, len(token_ids) // block_size - cached_blocks)
        predicted = cached_blocks * block_size
        ROUTER_DECISIONS.labels(mode=self.options.mode.value, outcome="hit" if predicted else "miss").inc()
        ROUTER_PREDICTED_TOKENS.inc(predicted)
        return Route(chosen.worker_id, predicted)

    def local_prefill(self, model: str, token_ids: list[int], cards: list[WorkerCard],
                      decode_pool: str | None = None, prefill_pool: str | None = None) -> LocalPrefill | None:
        """Where a disaggregated model's prompt runs on a decode worker rather than take a prefill worker (of
        `prefill_pool`) and a KV transfer — it is short once its cached prefix is discounted (Dynamo's
        `isl_bounding`), or every prefill replica is busy (`prefill_load`); either, when both are set — or None:
        remote. The decode workers that run prompts themselves are looked for in `decode_pool` first, then in any
        pool: torch and mock engines in the decode role do, and so does any engine started aggregated, which is how
        SGLang (whose decode role cannot) serves local prompts — aggregated workers in a pool of their own."""
        options = self.options
        if options.local_prefill_max_tokens <= 0 and options.prefill_busy_tokens <= 0:
            return None
        capable = [c for c in cards if c.stage == Stage.DECODE and c.model == model and c.ready and c.prefills_locally]
        decoders = [c for c in capable if c.pool == decode_pool] or capable
        if not decoders:
            return None
        pool = min((c.pool for c in decoders), key=lambda name: name or "")
        decoders = [c for c in decoders if c.pool == pool]
        short = False
        if options.local_prefill_max_tokens > 0:
            cached = (self.index.cached_blocks(token_ids, [c.worker_id for c in decoders])
                      if options.mode == RouterMode.KV else {})
            uncached = len(token_ids) - max(cached.values(), default=0) * self._block_size(decoders)
            short = uncached <= options.local_prefill_max_tokens
        busy = options.prefill_busy_tokens > 0 and self._prefill_busy(model, cards, prefill_pool)
        local = short or busy
        DISAGGREGATION_DECISIONS.labels(where="local" if local else "remote",
                                        why="short" if short else "prefill_busy" if busy else "long").inc()
        return LocalPrefill(pool) if local else None

    def _prefill_busy(self, model: str, cards: list[WorkerCard], pool: str | None) -> bool:
        """Every prefill replica has more prompt tokens waiting than the threshold (one without a report: not busy,
        as in Dynamo)."""
        prefills = _ready(cards, Stage.PREFILL, model, pool)
        return bool(prefills) and all(self._waiting_prompt_tokens(c) > self.options.prefill_busy_tokens
                                      for c in prefills)

    def _waiting_prompt_tokens(self, card: WorkerCard) -> float:
        """Prompt tokens a prefill worker has waiting: its last load report's, plus what this router sent it since."""
        reported = self._loads.get(card.worker_id)
        since_s, waiting = (reported[0], reported[1].waiting_prompt_tokens) if reported is not None else (0.0, 0)
        sent_blocks = sum(blocks for sent_s, blocks in self._recent.get(card.worker_id, ()) if sent_s > since_s)
        return waiting + sent_blocks * self._block_size([card])

    def forget_gone(self, live_cards: list[WorkerCard]) -> None:
        """Drop the index entries of workers whose cards expired and unpin their tasks (in the background)."""
        live = {card.worker_id for card in live_cards}
        for worker_id in set(self.index.workers) - live:
            self.index.forget_worker(worker_id)
        for worker_id in set(self._loads) - live:
            del self._loads[worker_id]
        for stage, model, worker_id, pool in [key for key in self._pinned_to if key[2] not in live]:
            self._pinned_to.discard((stage, model, worker_id, pool))
            task = asyncio.create_task(unpin(self._js, self._names, self._settings, stage, model, worker_id, pool))
            self._unpinning.add(task)
            task.add_done_callback(self._unpinning.discard)
        KV_INDEX_BLOCKS.set(self.index.num_blocks)

    def _by_kv(self, workers: list[WorkerCard], token_ids: list[int],
               lora_name: str | None) -> tuple[WorkerCard, int, int]:
        cached = self.index.cached_blocks(token_ids, [w.worker_id for w in workers], lora_name)
        block_size = self._block_size(workers)
        candidates = [Candidate(w.worker_id, cached[w.worker_id], self._load_blocks(w)) for w in workers]
        best = choose(candidates, len(token_ids) // block_size, self.options.overlap_weight, self.options.temperature,
                      self._rng)
        return next(w for w in workers if w.worker_id == best.worker_id), best.cached_blocks, block_size

    def _block_size(self, workers: list[WorkerCard]) -> int:
        """The KV block size of these workers: as their events say, else as their cards say."""
        from_events = next((size for w in workers if (size := self.index.block_size_of(w.worker_id))), None)
        return from_events or next((w.kv.block_size for w in workers if w.kv is not None), 16)

    async def _on_load(self, msg: Msg) -> None:
        try:
            report = decode(msg.data, WorkerLoad)
        except Exception as error:  # a stray publisher; its reports are ignored
            log.debug("router.bad_load_report", subject=msg.subject, error=repr(error))
            return
        self._loads[report.worker_id] = (time.monotonic(), report)

    def _load_blocks(self, card: WorkerCard) -> float:
        """Blocks the worker holds for running requests — from its last load report (≤ 50 ms old while it
        changes), else its card (seconds old) — plus the prompt blocks this router sent it since, fading as
        they are likely computed by now."""
        reported = self._loads.get(card.worker_id)
        if reported is not None:
            since_s, used = reported[0], reported[1].kv_used_blocks
        else:
            since_s, used = 0.0, card.kv.used_blocks if card.kv is not None else 0
        now = time.monotonic()
        return used + sum(blocks * math.exp(-(now - sent_s) / _RECENT_FADE_S)
                          for sent_s, blocks in self._recent.get(card.worker_id, ()) if sent_s > since_s)

    def _note_sent(self, worker_id: str, blocks: int) -> None:
        recent = self._recent.setdefault(worker_id, deque())
        now = time.monotonic()
        recent.append((now, max(0, blocks)))
        while recent and recent[0][0] < now - 5 * _RECENT_FADE_S:
            recent.popleft()


def _ready(cards: list[WorkerCard], stage: Stage, model: str, pool: str | None) -> list[WorkerCard]:
    """The ready replicas of a stage for a model, in one pool (None: those in no pool)."""
    return [c for c in cards if c.stage == stage and c.model == model and c.ready and c.pool == pool]


class KvEventFeed:
    """Keeps a `KvIndex` current from the KV-event stream; replays a worker whose batches skipped."""

    def __init__(self, js: JetStreamContext, names: Names, index: KvIndex) -> None:
        self._js = js
        self._names = names
        self.index = index
        # The stream sequence of the last message applied (a snapshot resumes after it).
        self.stream_seq = 0
        self._subscription: Subscription | None = None
        # Workers being replayed, with the live batches that arrived meanwhile.
        self._held: dict[str, list[KvEventBatch]] = {}
        self._replays: set[asyncio.Task[None]] = set()
        self.replays_done = 0

    async def start(self, after_seq: int = 0) -> None:
        """Follow the stream from its start, or from just after `after_seq` (a restored snapshot)."""
        self.stream_seq = after_seq
        config = (ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=after_seq + 1) if after_seq
                  else ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
        self._subscription = await self._js.subscribe(
            self._names.kv_events_subjects, stream=self._names.kv_events_stream, cb=self._on_message,
            ordered_consumer=True, config=config)

    async def stop(self) -> None:
        if self._subscription is not None:
            await self._subscription.unsubscribe()
            self._subscription = None
        await stop_tasks(self._replays)

    async def _on_message(self, msg: Msg) -> None:
        try:
            batch = decode(msg.data, KvEventBatch)
        except Exception as error:  # not ours to fix; the index simply does not learn from it
            log.warning("router.bad_kv_batch", subject=msg.subject, error=repr(error))
            return
        self.apply(batch)
        self.stream_seq = msg.metadata.sequence.stream

    def apply(self, batch: KvEventBatch) -> None:
        held = self._held.get(batch.worker_id)
        if held is not None:
            held.append(batch)
            return
        missed = self.index.apply(batch)
        if missed:
            log.warning("router.kv_gap", worker_id=batch.worker_id, missed=f"{missed.start}..{missed.stop - 1}")
            self._held[batch.worker_id] = []
            task = asyncio.create_task(self._replay(batch.worker_id))
            self._replays.add(task)
            task.add_done_callback(self._replays.discard)

    async def _replay(self, worker_id: str) -> None:
        """Rebuild one worker's blocks from every batch the stream still has of it."""
        self.index.forget_worker(worker_id)
        try:
            for batch in await read_worker_batches(self._js, self._names, worker_id):
                self.index.apply(batch)
        finally:
            for batch in self._held.pop(worker_id, []):
                self.index.apply(batch)
        self.replays_done += 1


async def read_worker_batches(js: JetStreamContext, names: Names, worker_id: str,
                              timeout_s: float = 2.0) -> list[KvEventBatch]:
    """Every batch of one worker the KV-event stream holds, in order."""
    config = ConsumerConfig(deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE, inactive_threshold=30.0)
    subscription = await js.pull_subscribe(names.kv_events_subject(worker_id), stream=names.kv_events_stream,
                                           config=config)
    batches: list[KvEventBatch] = []
    try:
        while True:
            try:
                messages = await subscription.fetch(batch=256, timeout=timeout_s)
            except TimeoutError:
                break
            batches += [decode(m.data, KvEventBatch) for m in messages]
            if messages[-1].metadata.num_pending == 0:
                break
    finally:
        await subscription.unsubscribe()
    return batches


async def unpin(js: JetStreamContext, names: Names, settings: BusSettings, stage: Stage, model: str | None,
                worker_id: str, pool: str | None = None) -> int:
    """Move one worker's pinned tasks back to its stage's shared queue (its pool's, when it is in one); how many
    moved.

    Binds the worker's own durable consumer, so a task it had pulled and never acked comes back after the
    ack wait too. A second copy of the same move (two processors both noticed) is harmless: each task is
    delivered to one of them, and the shared queue drops a re-published one as a duplicate."""
    durable = names.pinned_consumer(stage, model, worker_id)
    stream = names.work_stream(stage)
    try:
        subscription = await js.pull_subscribe_bind(durable=durable, stream=stream)
    except NotFoundError:
        return 0
    moved, deadline = 0, time.monotonic() + settings.ack_wait_s + 2.0
    try:
        while time.monotonic() < deadline:
            # Asked first, so a worker stopping with nothing pinned (the usual case) does not wait for a fetch.
            info = await js.consumer_info(stream, durable)
            if info.num_pending == 0 and info.num_ack_pending == 0:
                break
            try:
                messages = await subscription.fetch(batch=64, timeout=0.5)
            except TimeoutError:
                continue  # delivered to the gone worker: back after the ack wait
            for message in messages:
                headers = dict(message.headers or {})
                headers[MSG_ID_HEADER] = f"{headers.get(MSG_ID_HEADER, message.reply)}:unpinned"
                # Deliveries to the gone worker (not this one): the next replica reads the reply journal
                # when the task may have started streaming there.
                prior = int(headers.get(PRIOR_DELIVERIES_HEADER, 0)) + message.metadata.num_delivered - 1
                headers[PRIOR_DELIVERIES_HEADER] = str(prior)
                await js.publish(names.work_subject(stage, model, pool), message.data, headers=headers)
                await message.ack()
                moved += 1
                UNPINNED_TASKS.labels(stage=stage.value).inc()
        await js.delete_consumer(stream, durable)
    except NotFoundError:
        pass  # another router finished the move
    finally:
        await subscription.unsubscribe()
    if moved:
        log.info("router.unpinned", worker_id=worker_id, stage=stage.value, tasks=moved)
    return moved
