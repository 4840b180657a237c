"""What every stage process shares: connect, declare, load, warm up, serve, register, shut down.

A stage (processor, prefill, decode) supplies a `PipelineStage`: the task type it consumes, a typed handler,
and how to start, check (canary) and stop its engine. `WorkerRuntime` does the rest, in this order:

1. connect to NATS and declare the streams and bucket (idempotent; any worker may be first);
2. start the stage (load the engine or tokenizer), run its canary, bind the shared consumer;
3. serve `/metrics`, `/live`, `/ready` (and engine control) on the HTTP port, register the worker
   card with a heartbeat, relay the engine's KV events, refresh load gauges;
4. on SIGTERM / SIGINT: mark the card not ready, stop pulling, give in-flight work `shutdown_grace_s`
   to finish and hand the rest back (nak), remove the card, drain the connection, return.

Engine control (Dynamo's `/engine/*` routes) keeps Dynamo's order: releasing memory first takes the
worker out of the registry and pauses pulling; resuming reverses it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import structlog
from aiohttp import web
from pydantic import BaseModel, TypeAdapter, ValidationError
from tenacity import AsyncRetrying, wait_exponential

from bus.adapters import AdapterBucket, ensure_lora_bucket
from bus.cancel import CancelRegistry
from bus.connection import close_connection, connect
from bus.consumer import ConsumerOptions, Delivery, WorkConsumer
from bus.kv_events import KvEventPublisher
from bus.lifecycle import event_loop_lag_observed, freeze_startup_objects, observe_gc_pauses, sleep_unless, stop_tasks
from bus.metrics import (CACHE_HIT_RATE, CANARIES, ENGINE_RUNNING, ENGINE_WAITING, KV_EVENT_BATCHES, KV_USAGE,
                         QUEUE_TASKS, WORKER_READY)
from bus.publish import TaskPublisher
from bus.registry import Registration, RegistryChange, live_workers, registry_changes
from bus.sessions import SessionPlaces, ensure_session_bucket
from bus.router import Router, RouterOptions
from bus.settings import BusSettings, NatsSettings
from bus.streams import declare_all, declare_all_when_ready, ensure_registry_bucket
from bus.subjects import Names
from bus.tracing import configure_tracing
from schemas.codec import WIRE_VERSION, encode
from schemas.registry import BootstrapEndpoint, KvCapacity, ServingMode, Stage, WorkerCard, WorkerLoad
from schemas.control import LoraAdapter, LoraName
from workers.adapters import AdapterSync
from workers.engines.events import relay_in_windows
from workers.engines.protocol import Engine, ExpertRecording, KvEventBatchOut, MemoryTag
from workers.http import HealthServer

log = structlog.get_logger(__name__)

# Tasks a worker holds when neither it is told nor its engine states how many it runs at once.
DEFAULT_MAX_CONCURRENCY = 32
# By default a worker holds this fraction (1/N) of its engine's running limit beyond it (WorkerOptions.queue_ahead).
QUEUE_AHEAD_SHARE = 8


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    stage: Stage
    model: str
    mode: ServingMode
    engine_name: str
    http_host: str = "0.0.0.0"
    # 0 picks a free port (printed at start and written in the worker card).
    http_port: int = 0
    # At most this many tasks at once; None: as many as the engine runs at once and queue_ahead beyond
    # (DEFAULT_MAX_CONCURRENCY for a stage whose engine states no limit).
    max_concurrency: int | None = None
    # Tasks held beyond what the engine runs at once, waiting in the engine's own queue, so that a finished request's
    # place is taken at once rather than after the next pull from the stage's queue; taken only from a backlog, after
    # every replica with a free place (bus/consumer.py). None: an eighth of the engine's running limit (16 for
    # SGLang's 128; none for an engine running fewer than 8).
    queue_ahead: int | None = None
    # Tasks one JetStream pull takes when a backlog is queued (bus/consumer.py).
    fetch_batch: int = 8
    shutdown_grace_s: float = 30.0
    # The canary re-checks the engine after this long without a task ending well (Dynamo's DYN_CANARY_WAIT_TIME): live
    # traffic is the check while it flows.
    canary_wait_s: float = 30.0
    coalesce_window_s: float = 0.0
    # Publish the engine's KV events to the KV-events stream (what a `--router kv` processor indexes).
    kv_events: bool = True
    # KV-event batches arriving within this long of each other are published as one message.
    kv_events_interval_s: float = 0.005
    # A processor's other models (written in its card, so each counts as served).
    also_serves: tuple[str, ...] = ()
    # The pool this prefill or decode worker serves in (bus/pools.py): it pulls that pool's queue, not the model's.
    pool: str | None = None
    # Stop on SIGTERM / SIGINT (off when workers run inside another program, e.g. tests).
    handle_signals: bool = True
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()[:24]}-{os.getpid()}-{uuid.uuid4().hex[:6]}")

    def __post_init__(self) -> None:
        # Worker ids become subject tokens and KV keys.
        object.__setattr__(self, "worker_id", "".join(c if c.isalnum() or c in "-_" else "-" for c in self.worker_id))


@dataclass(frozen=True, slots=True)
class StageContext:
    """What a stage may use of the bus: publishing the next stage's task, and the registry."""

    names: Names
    settings: BusSettings
    publisher: TaskPublisher
    list_workers: Callable[[], Awaitable[list[WorkerCard]]]
    worker_id: str
    # A KV-aware router over this bus (the processor's), not started.
    make_router: Callable[[RouterOptions], Router]
    # Whether a request (by id and reply inbox) was cancelled: for work that outlives its task's handler.
    is_cancelled: Callable[[str, str], bool]
    # The LoRA adapters of this worker's engine (prefill and decode workers; None elsewhere).
    adapters: AdapterSync | None = None
    # Where each open session is (the processor's; None elsewhere).
    sessions: SessionPlaces | None = None
    # The registry's cards now and then each change, from a watch (bus/registry.py: registry_changes); None: none.
    registry_changes: Callable[[], AsyncIterator[RegistryChange]] | None = None


class PipelineStage(Protocol):
    """A stage of the pipeline, as the runtime drives it."""

    @property
    def task_type(self) -> TypeAdapter[Any] | type[Any]: ...

    @property
    def engine(self) -> Engine | None:
        """The engine whose KV events, load and control routes the runtime exposes (None: none)."""

    @property
    def accepts_media(self) -> bool:
        """Whether the processor may send this worker requests with images (written in its card)."""

    @property
    def consumes_model(self) -> str | None:
        """The model whose work subject this stage pulls from (None: the shared processor subject)."""

    @property
    def journals_replies(self) -> bool:
        """Whether its reply streams are journaled, so another replica can take a request over."""

    async def start(self, context: StageContext) -> None: ...

    async def handle(self, task: Any, delivery: Delivery) -> None: ...

    async def canary(self) -> None:
        """A minimal request through the stage's own engine; raises when it fails."""

    async def stop(self) -> None: ...


class ReleaseMemoryBody(BaseModel):
    tags: list[MemoryTag] = [MemoryTag.KV_CACHE, MemoryTag.WEIGHTS]


class ProfileBody(BaseModel):
    output_dir: Path = Path("profiles")


class UpdateWeightsBody(BaseModel):
    model_path: Path


class LoadLoraBody(BaseModel):
    lora_name: LoraName
    lora_path: str


class UnloadLoraBody(BaseModel):
    lora_name: LoraName


class WorkerRuntime:
    def __init__(self, stage: PipelineStage, options: WorkerOptions, nats: NatsSettings, bus: BusSettings) -> None:
        self._stage = stage
        self.options = options
        self._nats = nats
        self._bus = bus
        self._names = Names(bus.namespace)
        self._stopping = asyncio.Event()
        self._not_ready_reason: str | None = "starting"
        self._consumer: WorkConsumer[Any] | None = None
        self._adapters: AdapterSync | None = None
        self._registration: Registration | None = None
        self._health: HealthServer | None = None
        self._background: list[asyncio.Task[None]] = []
        self._recovery: asyncio.Task[None] | None = None
        self._js: Any = None
        self._max_payload = 0
        self.started = asyncio.Event()

    @property
    def ready(self) -> bool:
        return self._not_ready_reason is None

    @property
    def in_flight(self) -> int:
        """Tasks this worker is handling now."""
        return self._consumer.in_flight if self._consumer is not None else 0

    def request_stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        """Serve until `request_stop()` or a signal, then shut down cleanly."""
        stage_value = self.options.stage.value
        structlog.contextvars.bind_contextvars(stage=stage_value, worker_id=self.options.worker_id)
        if configure_tracing(f"conveyor-{stage_value}"):
            log.info("worker.tracing", exporter="otlp")
        nc = await connect(self._nats, name=f"conveyor-{stage_value}-{self.options.worker_id}",
                           on_reconnected=self._on_reconnected)
        js = nc.jetstream()
        self._js, self._max_payload = js, nc.max_payload
        bucket = await declare_all_when_ready(js, self._names, self._bus, nc.max_payload)
        cancels = CancelRegistry(nc, js, self._names, self._bus.cancel_ttl_s)
        await cancels.start()
        if self.options.handle_signals:
            self._install_signal_handlers()
        try:
            self._health = HealthServer(self.options.http_host, self.options.http_port, self._readiness,
                                        extra_routes=self._control_routes())
            await self._health.start()
            self._adapters = await self._adapter_sync(js)
            context = StageContext(
                names=self._names, settings=self._bus,
                publisher=TaskPublisher(js, self._names, min(self._bus.max_message_bytes, nc.max_payload)),
                list_workers=lambda: live_workers(bucket), worker_id=self.options.worker_id,
                registry_changes=lambda: registry_changes(bucket, quiet_limit_s=self._bus.registry_ttl_s / 2),
                make_router=lambda options: Router(nc, js, self._names, self._bus, options),
                is_cancelled=cancels.is_cancelled,
                adapters=self._adapters,
                sessions=SessionPlaces(await ensure_session_bucket(js, self._names, self._bus))
                if self.options.stage == Stage.PROCESSOR else None,
            )
            log.info("worker.starting", model=self.options.model, mode=self.options.mode.value)
            await self._stage.start(context)
            if self._adapters is not None:
                await self._adapters.start()
            max_concurrency, queued_ahead = self._holding()
            self._consumer = WorkConsumer(
                nc, js, self._names, self._bus, self.options.stage, self._stage.task_type, self._stage.handle,
                cancels, worker_id=self.options.worker_id, model=self._stage.consumes_model,
                options=ConsumerOptions(max_concurrency=max_concurrency, queued_ahead=queued_ahead,
                                        fetch_batch=self.options.fetch_batch,
                                        coalesce_window_s=self.options.coalesce_window_s,
                                        journal_replies=self._stage.journals_replies,
                                        # The stages that run prompts: a router may pin a task to one replica.
                                        pinned=self.options.stage in (Stage.DECODE, Stage.PREFILL),
                                        pool=self.options.pool),
            )
            await self._stage.canary()
            await self._consumer.bind()
            self._registration = Registration(
                bucket, self._card(ready=True), self._bus.registry_ttl_s,
                reopen=lambda: ensure_registry_bucket(js, self._names, self._bus),
            )
            await self._registration.open()
            self._set_ready(None)
            self._start_background(nc, js)
            consumer_loop = asyncio.create_task(self._consumer.run(), name="consumer")
            log.info("worker.ready", http=self._health.url, consumer=self._names.work_consumer(
                self.options.stage, self._stage.consumes_model, self.options.pool))
            self.started.set()
            stop_requested = asyncio.create_task(self._stopping.wait())
            await asyncio.wait([stop_requested, consumer_loop], return_when=asyncio.FIRST_COMPLETED)
            stop_requested.cancel()
            await self._shutdown(nc, consumer_loop)
        finally:
            self._stopping.set()
            if self._adapters is not None:
                await self._adapters.stop()
            await stop_tasks([*self._background, *([self._recovery] if self._recovery else [])])
            await self._stage.stop()
            await _unless_nats_is_away(nc, "cancels.stop", cancels.stop)
            if self._health is not None:
                await self._health.stop()
            await close_connection(nc, drain_timeout_s=10.0)
            log.info("worker.stopped")

    async def _adapter_sync(self, js: Any) -> AdapterSync | None:
        engine = self._stage.engine
        if engine is None or self.options.stage not in (Stage.DECODE, Stage.PREFILL):
            return None
        bucket = AdapterBucket(await ensure_lora_bucket(js, self._names, self._bus))
        return AdapterSync(engine, self.options.model, bucket, self._publish_card)

    async def _publish_card(self) -> None:
        """Write the card now (a LoRA adapter came or went); before registering there is nothing to write."""
        if self._registration is not None:
            await self._registration.update(self._card(ready=self.ready))

    def _holding(self) -> tuple[int, int]:
        """Tasks this worker holds at once, and how many of those wait ahead of its engine: what the engine runs at
        once and a few ahead, or fewer where configured (DEFAULT_MAX_CONCURRENCY, none ahead, where neither says).
        Replicas pull from one queue; a replica holding many more than its engine runs keeps tasks waiting while
        others have room (p99 time to first token 1.35 s instead of 170 ms at 8 mock replicas: docs/performance.md),
        so the queue ahead is pulled for behind every replica with a free place (bus/consumer.py). Holding none ahead,
        SGLang ran 115 of its 128 requests on average at 256 streams on the H200 against the server's 125: each
        finished request's place stayed empty until the worker's next pull brought another."""
        asked = self.options.max_concurrency
        engine = self._stage.engine
        capacity = engine.info.max_running_requests if engine is not None else None
        if capacity is None:
            return asked or DEFAULT_MAX_CONCURRENCY, 0
        ahead = capacity // QUEUE_AHEAD_SHARE if self.options.queue_ahead is None else self.options.queue_ahead
        if asked is not None and asked <= capacity + ahead:
            return asked, max(0, asked - capacity)
        log.info("worker.concurrency_from_engine", asked=asked, engine_runs=capacity, queued_ahead=ahead)
        return capacity + ahead, ahead

    async def _shutdown(self, nc: Any, consumer_loop: asyncio.Task[None]) -> None:
        """Deregister and drain; with NATS away (a server stopped with its workers) every step that needs it is
        skipped, or gives up after its timeout, so SIGTERM always ends the process, and soon."""
        assert self._consumer is not None and self._registration is not None
        registration = self._registration
        log.info("worker.draining", in_flight=self._consumer.in_flight, grace_s=self.options.shutdown_grace_s)
        self._set_ready("shutting down")
        await _unless_nats_is_away(nc, "registry.update", lambda: registration.update(self._card(ready=False)))
        await self._consumer.stop(grace_s=self.options.shutdown_grace_s)
        await consumer_loop
        await _unless_nats_is_away(nc, "registry.close", registration.close)

    async def _on_reconnected(self) -> None:
        # Called inside nats-py's reconnect path: recover in a task of our own, one at a time.
        if self._stopping.is_set() or self._js is None:
            return
        if self._consumer is not None:
            self._consumer.resync_replies()
        if self._recovery is not None and not self._recovery.done():
            self._recovery.cancel()
        self._recovery = asyncio.create_task(self._recover(), name="recover")

    async def _recover(self) -> None:
        """Put back what a restarted server lost: streams and bucket (a fresh store has none), this
        stage's consumer, and the card, written now rather than at the next heartbeat. JetStream
        answers a moment after the server accepts clients, so this retries with backoff."""
        retrying = AsyncRetrying(wait=wait_exponential(multiplier=0.1, max=2.0),
                                 stop=lambda _: self._stopping.is_set(), reraise=True)
        try:
            async for attempt in retrying:
                with attempt:
                    await declare_all(self._js, self._names, self._bus, self._max_payload)
                    if self._consumer is not None:
                        await self._consumer.declare()
                    if self._registration is not None:
                        await self._registration.write_now()
        except Exception as error:
            # Retries end only when the worker stops: a shutdown during an outage, not a failure of its own.
            log.info("worker.recovery_stopped", error=repr(error))
            return
        log.info("worker.recovered_after_reconnect")

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(signum, self.request_stop)
            except (NotImplementedError, RuntimeError):
                pass  # not the main thread (tests run workers as tasks)

    def _set_ready(self, reason: str | None) -> None:
        self._not_ready_reason = reason
        WORKER_READY.labels(stage=self.options.stage.value).set(1 if reason is None else 0)

    def _readiness(self) -> str | None:
        if self._consumer is not None and not self._consumer.bound:
            return "consumer not bound"
        return self._not_ready_reason

    def _card(self, ready: bool) -> WorkerCard:
        engine = self._stage.engine
        bootstrap: BootstrapEndpoint | None = engine.bootstrap_endpoint if engine is not None else None
        kv: KvCapacity | None = None
        context_length: int | None = None
        if engine is not None:
            load = engine.load()
            kv = KvCapacity(block_size=load.kv_block_size, total_blocks=load.kv_total_blocks, used_blocks=load.kv_used_blocks)
            context_length = engine.info.context_length or None
        metrics_url = f"http://{_advertised_host(self.options.http_host)}:{self._health.port}/metrics" if self._health else None
        return WorkerCard(
            worker_id=self.options.worker_id, stage=self.options.stage, model=self.options.model,
            mode=self.options.mode, engine=self.options.engine_name, host=socket.gethostname(), pid=os.getpid(),
            started_at_s=time.time(), metrics_url=metrics_url, bootstrap=bootstrap, kv=kv,
            context_length=context_length, ready=ready, wire_version=WIRE_VERSION,
            accepts_media=self._stage.accepts_media,
            prefills_locally=self._runs_prompts_itself(),
            lora_adapters=sorted(engine.loras()) if engine is not None else [],
            also_serves=list(self.options.also_serves), pool=self.options.pool,
            lora_failures=dict(self._adapters.failures) if self._adapters is not None else {},
        )

    def _runs_prompts_itself(self) -> bool:
        """A decode worker that can run a disaggregated model's prompt without a prefill worker: one started
        aggregated (any engine), or whose engine prefills in the decode role too (torch, mock)."""
        engine = self._stage.engine
        if engine is None or self.options.stage != Stage.DECODE:
            return False
        aggregated = self.options.mode not in (ServingMode.DISAGGREGATED, ServingMode.ENCODE_DISAGGREGATED)
        return aggregated or engine.info.prefills_in_decode_role

    def _start_background(self, nc: Any, js: Any) -> None:
        engine = self._stage.engine
        self._background.append(asyncio.create_task(self._refresh_loop(), name="refresh"))
        if engine is not None:
            if self.options.kv_events:
                publisher = KvEventPublisher(js, self._names, self.options.worker_id)
                self._background.append(asyncio.create_task(self._relay_kv_events(engine, publisher), name="kv-events"))
            self._background.append(asyncio.create_task(self._canary_loop(), name="canary"))
            self._background.append(asyncio.create_task(self._report_load(engine, nc), name="load"))

    async def _relay_kv_events(self, engine: Engine, publisher: KvEventPublisher) -> None:
        """The engine's KV-event batches to the KV-events stream; those that arrive within `kv_events_interval_s` of
        the first go as one message. The torch engine emits a batch at every step that fills a page (about 500 a
        second at 16 streams of 2 ms steps; SGLang, after each prefill and every 40th decode step), and each
        acknowledged publish costs this event loop, which every token frame shares, 0.1–0.2 ms
        (scripts/bench_kv_relay.py)."""
        await relay_in_windows(engine.kv_events(), lambda batch: self._publish_kv_batch(publisher, batch),
                               self.options.kv_events_interval_s)

    async def _publish_kv_batch(self, publisher: KvEventPublisher, batch: KvEventBatchOut) -> None:
        try:
            await publisher.publish(batch.events, ts=batch.ts, data_parallel_rank=batch.data_parallel_rank)
            KV_EVENT_BATCHES.labels(stage=self.options.stage.value).inc()
        except Exception as error:  # NATS away: the batch number is kept, readers see no gap
            log.warning("kv_events.publish_failed", error=repr(error))

    async def _report_load(self, engine: Engine, nc: Any, interval_s: float = 0.05) -> None:
        """The engine's load on `{ns}.load.{worker_id}` whenever it changed: routers weigh it per request."""
        subject, last = self._names.load_subject(self.options.worker_id), None
        while not await sleep_unless(self._stopping, interval_s):
            load = engine.load()
            report = WorkerLoad(worker_id=self.options.worker_id, kv_used_blocks=load.kv_used_blocks,
                                running_requests=load.running_requests, waiting_requests=load.waiting_requests,
                                waiting_prompt_tokens=load.waiting_prompt_tokens)
            if report == last:
                continue
            try:
                await nc.publish(subject, encode(report))
                last = report
            except Exception as error:  # NATS away: the next change is reported
                log.debug("load.publish_failed", error=repr(error))

    async def _refresh_loop(self) -> None:
        """Load gauges and the card's KV usage, a few times per registry TTL."""
        labels = {"stage": self.options.stage.value, "model": self.options.model}
        while not await sleep_unless(self._stopping, self._bus.registry_ttl_s / 3):
            engine = self._stage.engine
            if engine is not None:
                load = engine.load()
                ENGINE_RUNNING.labels(**labels).set(load.running_requests)
                ENGINE_WAITING.labels(**labels).set(load.waiting_requests)
                KV_USAGE.labels(**labels).set(load.kv_usage)
                CACHE_HIT_RATE.labels(**labels).set(load.cache_hit_rate)
            if self._registration is not None and self._not_ready_reason in (None, "canary failed"):
                self._registration.refresh(self._card(ready=self.ready))
            await self._report_queue()

    async def _report_queue(self) -> None:
        if self._consumer is None:
            return
        labels = {"stage": self.options.stage.value, "model": self._stage.consumes_model or ""}
        try:
            waiting, delivered = await self._consumer.queue_depth()
        except Exception as error:  # NATS away: the gauges keep their last values
            log.debug("worker.queue_depth_failed", error=repr(error))
            return
        QUEUE_TASKS.labels(**labels, state="waiting").set(waiting)
        QUEUE_TASKS.labels(**labels, state="delivered").set(delivered)

    async def _canary_loop(self) -> None:
        outcomes = {outcome: CANARIES.labels(stage=self.options.stage.value, outcome=outcome)
                    for outcome in ("passed", "failed", "deferred")}
        while not await sleep_unless(self._stopping, self.options.canary_wait_s):
            if self._not_ready_reason not in (None, "canary failed"):
                continue  # paused or stopping: not the canary's business
            if self._not_ready_reason is None and self._served_within(self.options.canary_wait_s):
                # A synthetic request in a busy engine costs real work: SGLang keeps a greedy request's slower sampling
                # path for its whole running batch (docs/performance.md, twenty-ninth stop).
                outcomes["deferred"].inc()
                continue
            try:
                await asyncio.wait_for(self._stage.canary(), timeout=60)
                outcomes["passed"].inc()
                self._set_ready(None)
            except Exception as error:
                outcomes["failed"].inc()
                log.error("worker.canary_failed", error=repr(error))
                self._set_ready("canary failed")

    def _served_within(self, seconds: float) -> bool:
        last_success_s = self._consumer.last_success_s if self._consumer is not None else None
        return last_success_s is not None and time.monotonic() - last_success_s < seconds

    # ----- engine control ----------------------------------------------------------------------

    def _control_routes(self) -> list[web.RouteDef]:
        if self._stage.engine is None:
            return []
        return [
            web.post("/engine/release_memory_occupation", self._release_memory),
            web.post("/engine/resume_memory_occupation", self._resume_memory),
            web.post("/engine/start_profile", self._start_profile),
            web.post("/engine/stop_profile", self._stop_profile),
            web.post("/engine/update_weights_from_disk", self._update_weights),
            web.post("/engine/flush_cache", self._flush_cache),
            web.post("/engine/load_lora", self._load_lora),
            web.post("/engine/unload_lora", self._unload_lora),
            web.get("/engine/list_loras", self._list_loras),
            *[web.post(f"/engine/{action.value}_expert_distribution_record", self._expert_route(action))
              for action in ExpertRecording],
        ]

    async def _release_memory(self, request: web.Request) -> web.Response:
        body = await _body(request, ReleaseMemoryBody)
        assert self._consumer is not None and self._registration is not None
        # Dynamo's order: leave the registry, stop taking work, then free the memory.
        self._set_ready("memory released")
        await self._registration.update(self._card(ready=False))
        self._consumer.pause()
        return await _control(lambda: self._stage.engine.release_memory(body.tags))  # type: ignore[union-attr]

    async def _resume_memory(self, request: web.Request) -> web.Response:
        body = await _body(request, ReleaseMemoryBody)
        assert self._consumer is not None and self._registration is not None

        async def resume() -> None:
            await self._stage.engine.resume_memory(body.tags)  # type: ignore[union-attr]
            self._consumer.resume()  # type: ignore[union-attr]
            self._set_ready(None)
            await self._registration.update(self._card(ready=True))  # type: ignore[union-attr]

        return await _control(resume)

    async def _start_profile(self, request: web.Request) -> web.Response:
        body = await _body(request, ProfileBody)
        return await _control(lambda: self._stage.engine.start_profile(body.output_dir))  # type: ignore[union-attr]

    async def _stop_profile(self, request: web.Request) -> web.Response:
        return await _control(lambda: self._stage.engine.stop_profile())  # type: ignore[union-attr]

    async def _update_weights(self, request: web.Request) -> web.Response:
        body = await _body(request, UpdateWeightsBody)
        return await _control(lambda: self._stage.engine.update_weights_from_disk(body.model_path))  # type: ignore[union-attr]

    async def _flush_cache(self, request: web.Request) -> web.Response:
        return await _control(lambda: self._stage.engine.flush_cache())  # type: ignore[union-attr]

    async def _load_lora(self, request: web.Request) -> web.Response:
        """This worker only; `conveyor lora load` serves an adapter on every replica, later ones included."""
        body = await _body(request, LoadLoraBody)
        if self._adapters is None:
            raise web.HTTPNotFound(text=f"a {self.options.stage.value} worker has no LoRA adapters")
        adapter = LoraAdapter(name=body.lora_name, base_model=self.options.model, path=body.lora_path)
        return await _control(lambda: self._adapters.load(adapter))  # type: ignore[union-attr]

    async def _unload_lora(self, request: web.Request) -> web.Response:
        body = await _body(request, UnloadLoraBody)
        if self._adapters is None:
            raise web.HTTPNotFound(text=f"a {self.options.stage.value} worker has no LoRA adapters")
        return await _control(lambda: self._adapters.unload(body.lora_name))  # type: ignore[union-attr]

    def _expert_route(self, action: ExpertRecording) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def route(request: web.Request) -> web.Response:
            return await _control(lambda: self._stage.engine.record_experts(action))  # type: ignore[union-attr]

        return route

    async def _list_loras(self, request: web.Request) -> web.Response:
        loras = self._stage.engine.loras()  # type: ignore[union-attr]
        return web.json_response({"status": "success", "loras": loras, "count": len(loras)})


async def _unless_nats_is_away(nc: Any, step: str, action: Callable[[], Awaitable[None]],
                               timeout_s: float = 5.0) -> None:
    """Run a shutdown step that needs NATS, skipped at once while the connection is away: a server stopped before
    its workers (the server's host going down, a script stopping everything at once) made each step wait its whole
    timeout: 15 s a worker before it exited."""
    if not nc.is_connected:
        log.warning("worker.shutdown_step_skipped", step=step, error="not connected to NATS")
        return
    try:
        await asyncio.wait_for(action(), timeout=timeout_s)
    except Exception as error:  # the bus is gone: the TTL removes the card, JetStream redelivers the work
        log.warning("worker.shutdown_step_skipped", step=step, error=repr(error))


async def _body(request: web.Request, model: type[BaseModel]) -> Any:
    try:
        raw = await request.json() if request.can_read_body else {}
        return model.model_validate(raw)
    except (ValueError, ValidationError) as error:
        raise web.HTTPBadRequest(text=str(error)) from error


async def _control(action: Callable[[], Awaitable[None]]) -> web.Response:
    try:
        await action()
    except Exception as error:
        return web.json_response({"success": False, "message": str(error)}, status=409)
    return web.json_response({"success": True})


def _advertised_host(bind_host: str) -> str:
    return socket.gethostname() if bind_host in ("0.0.0.0", "::") else bind_host


async def run_in_own_process(runtime: WorkerRuntime, freeze_gc: bool = True) -> None:
    """Run a worker that has its process to itself (`conveyor worker`). Once it is ready, with `freeze_gc`, what
    startup created leaves the garbage collector's view (`freeze_startup_objects`): full collections stay short.
    Every collection's pause is timed either way (`conveyor_gc_pause_seconds`), and so is the event loop's lag
    (`conveyor_event_loop_lag_seconds`)."""
    observe_gc_pauses()
    async with event_loop_lag_observed():
        running = asyncio.create_task(runtime.run(), name="worker")
        started = asyncio.create_task(runtime.started.wait())
        await asyncio.wait([running, started], return_when=asyncio.FIRST_COMPLETED)
        started.cancel()
        if runtime.started.is_set() and freeze_gc:
            log.info("worker.startup_objects_frozen", objects=freeze_startup_objects())
        await running
