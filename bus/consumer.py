"""The pull-consumer loop every stage runs: fetch, decode once, handle, then ack / nak / term.

A stage gives a typed handler `async def handle(task, delivery)`; this loop owns what happens to
the message around it:

| what happened                                  | what the loop does                                     |
|------------------------------------------------|--------------------------------------------------------|
| handler returned                               | ack                                                    |
| payload not msgpack, or another wire version   | term, log the reason, count it                         |
| payload fails validation, inbox readable       | `invalid_request` error frame to the inbox, ack        |
| payload fails validation, no inbox             | term, log, count                                       |
| request cancelled before it was pulled         | `cancelled` final frame, ack                           |
| handler raised `RejectRequest`                 | error frame with its code, ack                         |
| handler raised anything else, nothing streamed | nak with exponential backoff; at max_deliver: term and |
|                                                | a retryable `internal` error frame                     |
| handler raised after streaming some frames     | retryable error frame, term (a retry would repeat      |
|                                                | output the client already has)                         |
| worker stopping with the handler unfinished    | nak without delay, so another replica takes it         |
| journaled stage, redelivered, journal ended    | ack (the request ended; only the ack was lost)         |
| journaled stage, redelivered, journal fresh    | hold it, watch the journal until its holder (alive but |
|                                                | slow) ends it or goes quiet                            |

A stage that streams (decode) journals its reply streams (bus/journal.py): on redelivery the handler
gets the journal's `Progress` and decides whether to take the request over where it stopped.

While a handler runs, `in_progress` is sent every third of the ack wait so JetStream does not
redeliver long work. At most `max_concurrency` handlers run at once per worker; fetches ask only
for as many messages as there are free slots, so one replica never hoards work others could do. Slots beyond what
the engine runs at once (`queued_ahead`) are filled only from a backlog, by pulls that do not wait and come after
every replica's waiting pull: a task goes to a replica whose engine has a free place before it waits in another's
engine queue.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from pydantic import TypeAdapter, ValidationError

from bus.cancel import CancelRegistry
from bus.dead_letters import dead_letter
from bus.errors import RejectRequest
from bus.journal import Progress, ReplyJournal, read_progress
from bus.lifecycle import note_work
from bus.metrics import (
    CANCELS,
    DEAD_LETTERS,
    HANDLER_SECONDS,
    IN_FLIGHT,
    MESSAGES_HANDLED,
    MESSAGES_IN,
    MIGRATIONS,
    REDELIVERIES,
    TERMINATIONS,
)
from bus.publish import PRIOR_DELIVERIES_HEADER
from bus.pull import Puller
from bus.replies import ReplySender
from bus.router import unpin
from bus.settings import BusSettings
from bus.streams import WORK_PRIORITY_GROUP, ensure_work_consumer, pinned_consumer_config, work_consumer_config
from bus.subjects import Names
from bus.tracing import TraceContext, stage_span
from schemas.client import Inbox, RequestId
from schemas.codec import WireVersionMismatch, check_wire_version, unpack
from schemas.registry import Stage
from schemas.replies import ErrorCode, FinishReason, Usage
from schemas.tasks import Task

log = structlog.get_logger(__name__)

_REQUEST_ID: TypeAdapter[str] = TypeAdapter(RequestId)
_INBOX: TypeAdapter[str] = TypeAdapter(Inbox)


class Addressed(Protocol):
    """Anything a stage consumes: it names its request and the inbox replies go to."""

    @property
    def request_id(self) -> str: ...

    @property
    def reply_to(self) -> str: ...


TaskT = TypeVar("TaskT", bound=Addressed)


@dataclass(frozen=True, slots=True)
class Delivery:
    """What a handler gets besides its task."""

    request_id: str
    # 1 on first delivery; higher after a nak or a lost worker.
    num_delivered: int
    # Seconds the task waited in the stream before this delivery.
    queued_s: float
    # This hop's trace context: pass it on when publishing the next stage's task.
    trace: TraceContext
    # Set when a Cancel for this request arrives (or had arrived before the handler started).
    cancelled: asyncio.Event
    # The request's reply stream; enter it (`async with`) to start heartbeats while streaming.
    reply: ReplySender
    # Journaled stages, on redelivery: what the client was sent before (`reply.resume` takes it over).
    progress: Progress | None = None


Handler = Callable[[TaskT, Delivery], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class ConsumerOptions:
    max_concurrency: int = 8
    # Tasks one pull asks for while a backlog is queued. A larger batch drains a burst in fewer round trips; 1 hands
    # a burst to the handler one task per pull (docs/performance.md, tenth stop: what that did to SGLang's batches).
    fetch_batch: int = 8
    # How long one fetch waits for work; also the longest a stop waits for the fetch to return.
    fetch_timeout_s: float = 1.0
    # Defaults to a third of the consumer's ack wait.
    in_progress_interval_s: float | None = None
    # Coalescing window of reply streams this worker sends (0: every chunk goes out at once).
    coalesce_window_s: float = 0.0
    # Journal reply streams so another replica can take a request over (the decode stage).
    journal_replies: bool = False
    # Also pull this worker's own pinned subject (a routed stage: a router may address it alone).
    pinned: bool = False
    # The pool whose queue this worker pulls instead of the model's (bus/pools.py); None: the model's.
    pool: str | None = None
    # Of max_concurrency, the tasks held beyond what the engine runs at once (they wait in its own queue). They are
    # taken only from a backlog: a task published while another replica with a free engine place was between two
    # pulls would otherwise wait here for a place (at 2 mock replicas of 64 streams each, asked for like the rest
    # they made p99 first tokens 1.5 s instead of 0.1 s). So a worker whose engine is full looks for queued tasks
    # every `ahead_poll_s`, behind any replica's waiting pull (priority 1), and does not wait for new ones.
    queued_ahead: int = 0
    ahead_poll_s: float = 0.02


class WorkConsumer(Generic[TaskT]):
    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        names: Names,
        settings: BusSettings,
        stage: Stage,
        task_type: TypeAdapter[TaskT] | type[TaskT],
        handler: Handler[TaskT],
        cancels: CancelRegistry,
        worker_id: str,
        model: str | None = None,
        options: ConsumerOptions = ConsumerOptions(),
    ) -> None:
        self._nc = nc
        self._js = js
        self._names = names
        self._settings = settings
        self.stage = stage
        self.model = model
        self._adapter: TypeAdapter[TaskT] = (
            task_type if isinstance(task_type, TypeAdapter) else TypeAdapter(task_type)
        )
        self._handler = handler
        self._cancels = cancels
        self._worker_id = worker_id
        self._options = options
        self._in_progress_interval_s = options.in_progress_interval_s or settings.ack_wait_s / 3
        # Pulls from the stage's shared queue, and (a routed stage) from this worker's pinned tasks.
        self._shared: Puller | None = None
        self._pinned: Puller | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # Reply streams of the handlers running now, to resync after a NATS reconnect.
        self._replies: set[ReplySender] = set()
        self._resyncs: set[asyncio.Task[None]] = set()
        self._slot_freed = asyncio.Event()
        self._stopping = asyncio.Event()
        self._loop_done = asyncio.Event()
        # Cleared while paused (engine memory released): nothing is fetched, nothing is lost.
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        # This stage's series of the per-task metrics, bound once (a `labels()` lookup per task adds up).
        self._in_flight = IN_FLIGHT.labels(stage=stage.value)
        self._messages_in = MESSAGES_IN.labels(stage=stage.value)
        self._handler_seconds = HANDLER_SECONDS.labels(stage=stage.value)
        self._acked = MESSAGES_HANDLED.labels(stage=stage.value, outcome="acked")
        # When a task last ended well here (time.monotonic(); None: none yet): live traffic that proves the engine,
        # so the worker's canary need not run meanwhile.
        self.last_success_s: float | None = None

    @property
    def bound(self) -> bool:
        return self._shared is not None and not self._stopping.is_set()

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    @property
    def paused(self) -> bool:
        return not self._unpaused.is_set()

    def pause(self) -> None:
        """Stop fetching new work (running handlers go on); the queue keeps it for other replicas."""
        self._unpaused.clear()

    def resume(self) -> None:
        self._unpaused.set()

    def resync_replies(self) -> None:
        """After a NATS reconnect: every running stream asks its client what it has and sends again
        what the outage lost (`ReplySender.resync`)."""
        for reply in list(self._replies):
            resync = asyncio.create_task(reply.resync(timeout_s=self._settings.heartbeat_timeout_s))
            self._resyncs.add(resync)
            resync.add_done_callback(self._resyncs.discard)

    def _forget_reply(self, reply: ReplySender) -> None:
        if not reply.sent_while_away:
            self._replies.discard(reply)
            return
        # It ended while NATS was away: its last frames may be lost, so keep it for the next resync.
        asyncio.get_running_loop().call_later(2 * self._settings.heartbeat_timeout_s, self._replies.discard, reply)

    async def bind(self) -> None:
        """Declare the shared durable consumer (idempotent) and start pulling from it."""
        durable = await self.declare()
        stream = self._names.work_stream(self.stage)
        self._shared = await self._start_puller(stream, durable, WORK_PRIORITY_GROUP)
        if self._options.pinned:
            config = pinned_consumer_config(self._names, self.stage, self.model, self._worker_id, self._settings)
            await ensure_work_consumer(self._js, config, stream)
            assert config.durable_name is not None
            self._pinned = await self._start_puller(stream, config.durable_name)

    async def _start_puller(self, stream: str, durable: str, group: str | None = None) -> Puller:
        # The JetStream context's API prefix ($JS.API, or a domain's): nats-py keeps it as `_prefix`.
        puller = Puller(self._nc, self._js._prefix, stream, durable, group)
        await puller.start()
        return puller

    async def queue_depth(self) -> tuple[int, int]:
        """The shared queue as JetStream counts it: tasks waiting for a worker, and tasks delivered but not yet acked
        (being worked on, by any replica)."""
        info = await self._js.consumer_info(self._names.work_stream(self.stage),
                                            self._names.work_consumer(self.stage, self.model, self._options.pool))
        return info.num_pending or 0, info.num_ack_pending or 0

    async def declare(self) -> str:
        """Declare the shared durable consumer (idempotent; again after a server lost it); its name."""
        max_ack_pending = max(1024, self._options.max_concurrency * 64)
        config = work_consumer_config(self._names, self.stage, self.model, self._settings, max_ack_pending,
                                      self._options.pool)
        await ensure_work_consumer(self._js, config, self._names.work_stream(self.stage))
        assert config.durable_name is not None
        return config.durable_name

    async def run(self) -> None:
        """Pull and handle work until `stop()`; returns once the loop has stopped fetching."""
        if self._shared is None:
            await self.bind()
        assert self._shared is not None
        try:
            # One loop per consumer pulled (the shared queue; this worker's pinned tasks), sharing the slots.
            pulls = [self._pull(self._shared, ahead_from_backlog=True)]
            if self._pinned is not None:
                # Tasks pinned here are for this worker alone: its queue ahead waits for them as for the rest.
                pulls.append(self._pull(self._pinned, ahead_from_backlog=False))
            await asyncio.gather(*pulls)
        finally:
            self._loop_done.set()

    async def _pull(self, puller: Puller, ahead_from_backlog: bool) -> None:
        # A waiting pull asks for one task, handed over alone the moment it comes (nats-py's fetch of several, which
        # this consumer used before bus/pull.py, could hold it 50–520 ms waiting for the rest). A full fetch means a
        # backlog: the next asks for a batch, which the queued tasks fill at once.
        batch = 1
        while not self._stopping.is_set():
            if not self._unpaused.is_set():
                await _first_of(self._unpaused.wait(), self._stopping.wait())
                continue
            free_slots = self._options.max_concurrency - len(self._tasks)
            if free_slots <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            free_places = self._free_places(ahead_from_backlog)
            if free_places > 0:
                asked = min(free_places, batch)
                msgs = await self._fetch(puller, asked, priority=0, wait=True)
            else:
                # The engine is full: the queue ahead takes what is queued now (ConsumerOptions.queued_ahead).
                if not await self._still_full_after(self._options.ahead_poll_s):
                    continue
                asked = min(self._options.max_concurrency - len(self._tasks), self._options.fetch_batch)
                msgs = await self._fetch(puller, asked, priority=1, wait=False)
            if self._stopping.is_set():
                # The pull outlived the stop's start (an idle worker's waits up to fetch_timeout_s): what it brought
                # goes back to the queue at once, for another replica, rather than starting here.
                await asyncio.gather(*(_quietly(msg.nak()) for msg in msgs))
                break
            for msg in msgs:
                self._spawn(msg)
            batch = self._options.fetch_batch if len(msgs) == asked else 1

    def _free_places(self, ahead_from_backlog: bool) -> int:
        """Free slots a waiting pull may fill: all of them, or those the queue ahead does not keep for a backlog."""
        free_slots = self._options.max_concurrency - len(self._tasks)
        return free_slots - self._options.queued_ahead if ahead_from_backlog else free_slots

    async def _still_full_after(self, delay_s: float) -> bool:
        """Wait `delay_s`; False as soon as a place in the engine frees (or the worker stops or pauses) meanwhile."""
        self._slot_freed.clear()
        await _first_of(self._slot_freed.wait(), self._stopping.wait(), asyncio.sleep(delay_s))
        return self._free_places(True) <= 0 and self._unpaused.is_set() and not self._stopping.is_set()

    async def stop(self, grace_s: float) -> None:
        """Stop fetching, give running handlers `grace_s` to finish, hand the rest back (nak)."""
        self._stopping.set()
        self._slot_freed.set()
        if self._shared is not None:
            await self._loop_done.wait()
        if self._tasks:
            _, unfinished = await asyncio.wait(set(self._tasks), timeout=grace_s)
            for task in unfinished:
                task.cancel()
            await asyncio.gather(*unfinished, return_exceptions=True)
        for puller in (self._shared, self._pinned):
            if puller is not None:
                await _quietly(puller.stop())
        if self._pinned is not None and not self._nc.is_connected:
            # With NATS away the move would only wait out the JetStream timeout (5 s more to a worker's stop): the
            # routers move what was pinned here once this worker's card expires.
            log.warning("task.step_failed", step="unpin", error="not connected to NATS")
        elif self._pinned is not None:
            # What routers pinned here and this worker will not run now goes to the other replicas.
            await _quietly(unpin(self._js, self._names, self._settings, self.stage, self.model, self._worker_id,
                                 self._options.pool))
        self._shared = self._pinned = None

    async def _fetch(self, puller: Puller, batch: int, priority: int, wait: bool) -> list[Msg]:
        try:
            return await puller.fetch(batch, self._options.fetch_timeout_s, priority, wait)
        except NatsError as error:
            # NATS is away or restarting (closed, reconnecting, no responders, a leader being elected): the client
            # reconnects; keep asking, but not in a hot loop. Any of these ending the loop would stop the worker.
            log.warning("consumer.fetch_failed", stage=self.stage.value, error=repr(error))
            await asyncio.sleep(self._settings.retry_base_s)
            return []

    def _spawn(self, msg: Msg) -> None:
        note_work()  # this process's loop stays warm for the next task (bus/lifecycle.py)
        task = asyncio.create_task(self._handle_guarded(msg))
        self._tasks.add(task)
        self._in_flight.inc()
        task.add_done_callback(self._on_task_done)

    def _on_task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._in_flight.dec()
        self._slot_freed.set()

    async def _handle_guarded(self, msg: Msg) -> None:
        try:
            await self._handle(msg)
        except asyncio.CancelledError:
            raise
        except Exception:
            # NATS failed under us while acking or replying: leave the message un-acked, so
            # JetStream redelivers it after the ack wait.
            log.exception("task.bus_error", stage=self.stage.value)

    async def _handle(self, msg: Msg) -> None:
        self._messages_in.inc()
        if _deliveries(msg) > 1:
            REDELIVERIES.labels(stage=self.stage.value).inc()
        try:
            check_wire_version(msg.headers)
        except WireVersionMismatch as error:
            await self._terminate(msg, "wire_version", str(error))
            return
        try:
            raw = unpack(msg.data)
        except Exception as error:  # msgpack raises several unrelated types for garbage
            await self._terminate(msg, "undecodable", f"not msgpack: {error!r}")
            return
        try:
            task = self._adapter.validate_python(raw)
        except ValidationError as error:
            await self._reject_invalid(msg, raw, error)
            return
        with structlog.contextvars.bound_contextvars(
            request_id=task.request_id, stage=self.stage.value, worker_id=self._worker_id
        ):
            await self._run_handler(msg, task)

    async def _run_handler(self, msg: Msg, task: TaskT) -> None:
        journal, progress = None, None
        if self._options.journal_replies:
            progress = await self._progress_of(msg, task.request_id)
            if progress is not None:
                progress = await self._may_take_over(msg, task.request_id, progress)
                if progress is None:
                    return
            journal = ReplyJournal(self._nc, self._names.progress_subject(task.request_id), task.request_id, progress)
        reply = ReplySender(
            self._nc,
            task.reply_to,
            task.request_id,
            coalesce_window_s=self._options.coalesce_window_s,
            heartbeat_interval_s=self._settings.heartbeat_interval_s,
            journal=journal,
        )
        if isinstance(task, Task) and task.header.first_reply_seq and progress is None:
            reply.continue_from(task.header.first_reply_seq)  # handed over from another pool (bus/pools.py)
        if self._cancels.is_cancelled(task.request_id, task.reply_to):
            CANCELS.labels(where="queued").inc()
            log.info("task.dropped_cancelled")
            await reply.finish(FinishReason.CANCELLED, Usage.of(0, 0))
            await self._ack(msg, "cancelled")
            return
        incoming = TraceContext.from_headers(msg.headers)
        with (self._cancels.watch(task.request_id, task.reply_to) as cancelled,
              stage_span(self.stage.value, incoming, request_id=task.request_id, worker_id=self._worker_id,
                         delivery=_deliveries(msg)) as trace,
              structlog.contextvars.bound_contextvars(trace_id=trace.trace_id)):
            delivery = Delivery(
                request_id=task.request_id,
                num_delivered=_deliveries(msg),
                queued_s=_queued_s(msg),
                trace=trace,
                cancelled=cancelled,
                reply=reply,
                progress=progress,
            )
            keep_alive = asyncio.create_task(self._keep_alive(msg))
            started_s = time.perf_counter()
            self._replies.add(reply)
            try:
                await self._handler(task, delivery)
            except RejectRequest as rejection:
                await self._send_error(reply, rejection.code, rejection.message, retryable=rejection.retryable)
                await self._ack(msg, "rejected")
            except asyncio.CancelledError:
                # The worker is stopping: hand the task back at once so another replica takes it.
                await _quietly(reply.release())
                await msg.nak()
                MESSAGES_HANDLED.labels(stage=self.stage.value, outcome="handed_back").inc()
                raise
            except Exception as error:
                await self._retry_or_give_up(msg, reply, error)
            else:
                await self._ack(msg, "acked")
                if not reply.failed:
                    self.last_success_s = time.monotonic()
            finally:
                self._forget_reply(reply)
                keep_alive.cancel()
                await reply.close_background()
                self._handler_seconds.observe(time.perf_counter() - started_s)

    async def _progress_of(self, msg: Msg, request_id: str) -> Progress | None:
        """A redelivered task's journal (None on first delivery: nothing can have been streamed)."""
        if _deliveries(msg) <= 1:
            return None
        return await read_progress(self._js, self._names, request_id)

    async def _may_take_over(self, msg: Msg, request_id: str, progress: Progress) -> Progress | None:
        """The journal once its holder is gone; None when the request must not run here (acked)."""
        progress = await self._wait_while_held(msg, request_id, progress)
        if progress.finished:
            # The terminal frame went out; the worker died before its ack.
            MIGRATIONS.labels(stage=self.stage.value, outcome="ended_already").inc()
            await self._ack(msg, "acked")
            return None
        return progress

    async def _wait_while_held(self, msg: Msg, request_id: str, progress: Progress) -> Progress:
        """Redelivered while its journal is still being written: the holder stalled past the ack wait
        but lives. Two writers would interleave two answers, so hold the task (in_progress) and watch
        the journal until it ends or goes quiet. Naking instead would spend deliveries (max_deliver)."""
        # A live holder journals at least one frame per heartbeat interval (heartbeats included).
        fresh_s = 2 * self._settings.heartbeat_interval_s + 0.5
        if progress.being_written(fresh_s):
            MIGRATIONS.labels(stage=self.stage.value, outcome="holder_alive").inc()
            log.warning("task.holder_alive", journal_age_s=round(progress.age_s, 3))
        while progress.being_written(fresh_s):
            await msg.in_progress()
            await asyncio.sleep(fresh_s - progress.age_s)
            progress = await read_progress(self._js, self._names, request_id)
        return progress

    async def _retry_or_give_up(self, msg: Msg, reply: ReplySender, error: Exception) -> None:
        delivery_count = _deliveries(msg)
        if reply.frames_sent > 0:
            log.exception("task.failed_mid_stream", error=repr(error))
            await self._send_error(reply, ErrorCode.INTERNAL, f"failed mid-stream: {error}", retryable=True)
            await self._dead_letter(msg, "failed_mid_stream", repr(error))
            await self._term(msg, "failed_mid_stream")
            return
        if delivery_count >= self._settings.max_deliver:
            log.exception("task.given_up", deliveries=delivery_count, error=repr(error))
            message = f"failed after {delivery_count} attempts: {error}"
            await self._send_error(reply, ErrorCode.INTERNAL, message, retryable=True)
            await self._dead_letter(msg, "max_deliver", repr(error))
            await self._term(msg, "max_deliver")
            return
        delay_s = min(self._settings.retry_base_s * 2 ** (delivery_count - 1), self._settings.retry_max_s)
        log.warning("task.retrying", deliveries=delivery_count, delay_s=delay_s, error=repr(error))
        await msg.nak(delay=delay_s)
        MESSAGES_HANDLED.labels(stage=self.stage.value, outcome="retried").inc()

    async def _reject_invalid(self, msg: Msg, raw: Any, error: ValidationError) -> None:
        request_id, reply_to = _address_of(raw)
        summary = _summarize(error)
        if request_id is None or reply_to is None:
            await self._terminate(msg, "undecodable", f"invalid and unaddressed: {summary}")
            return
        log.info("task.invalid", request_id=request_id, reason=summary)
        reply = ReplySender(self._nc, reply_to, request_id)
        await self._send_error(reply, ErrorCode.INVALID_REQUEST, summary, retryable=False)
        await self._ack(msg, "rejected")

    async def _send_error(self, reply: ReplySender, code: ErrorCode, message: str, retryable: bool) -> None:
        if reply.closed:
            return
        await reply.fail(code, message, retryable=retryable)

    async def _keep_alive(self, msg: Msg) -> None:
        while True:
            await asyncio.sleep(self._in_progress_interval_s)
            await msg.in_progress()

    async def _terminate(self, msg: Msg, reason: str, detail: str) -> None:
        log.warning("task.terminated", stage=self.stage.value, reason=reason, detail=detail)
        TERMINATIONS.labels(stage=self.stage.value, reason=reason).inc()
        await self._dead_letter(msg, reason, detail)
        await self._term(msg, "terminated")

    async def _dead_letter(self, msg: Msg, reason: str, detail: str) -> None:
        try:
            await dead_letter(self._js, self._names, self.stage.value, msg, reason, detail)
            DEAD_LETTERS.labels(stage=self.stage.value, reason=reason).inc()
        except Exception as error:  # never let keeping the evidence stop the loop
            log.warning("task.dead_letter_failed", reason=reason, error=repr(error))

    async def _term(self, msg: Msg, outcome: str) -> None:
        await msg.term()
        MESSAGES_HANDLED.labels(stage=self.stage.value, outcome=outcome).inc()

    async def _ack(self, msg: Msg, outcome: str) -> None:
        await msg.ack()
        (self._acked if outcome == "acked" else MESSAGES_HANDLED.labels(stage=self.stage.value, outcome=outcome)).inc()


async def _first_of(*waits: Awaitable[object]) -> None:
    tasks = [asyncio.ensure_future(wait) for wait in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


async def _quietly(step: Awaitable[None]) -> None:
    """A best-effort step on the way out (NATS may be away); its failure must not stop the rest."""
    try:
        await step
    except Exception as error:
        log.warning("task.step_failed", error=repr(error))


def _queued_s(msg: Msg) -> float:
    stored_at = msg.metadata.timestamp
    return max(0.0, time.time() - stored_at.timestamp()) if stored_at else 0.0


def _address_of(raw: Any) -> tuple[str | None, str | None]:
    """The request id and inbox of a payload that failed validation, where they can be read."""
    if not isinstance(raw, dict):
        return None, None
    source = raw.get("header") if isinstance(raw.get("header"), dict) else raw
    try:
        return _REQUEST_ID.validate_python(source.get("request_id")), _INBOX.validate_python(source.get("reply_to"))
    except ValidationError:
        return None, None


def _summarize(error: ValidationError, max_errors: int = 5) -> str:
    parts = []
    for detail in error.errors()[:max_errors]:
        location = ".".join(str(part) for part in detail["loc"]) or "request"
        parts.append(f"{location}: {detail['msg']}")
    more = error.error_count() - max_errors
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


def _deliveries(msg: Msg) -> int:
    """Times this task was delivered, counting deliveries to a gone worker before it was unpinned (bus/router.py)."""
    prior = (msg.headers or {}).get(PRIOR_DELIVERIES_HEADER, "0")
    return msg.metadata.num_delivered + (int(prior) if prior.isdigit() else 0)
