"""Declare the streams, consumers and bucket the pipeline needs; safe to run any number of times.

- one work-queue stream per stage: a task is deleted once acked, and replicas of a stage share one
  durable pull consumer, so each task goes to exactly one of them; its pulls carry a priority (JetStream's
  `prioritized` policy, nats-server 2.12+), so a task goes to a replica with a free engine place before it waits
  in another replica's engine queue (bus/consumer.py);
- `{NS}_CONTROL`: cancels, kept for the cancel TTL so a worker that starts late still learns them;
- `{NS}_KV_EVENTS`: KV-cache events, limits retention with a max age (a router replays from it);
- `{NS}_PROGRESS`: reply journals (bus/journal.py), in memory, so a replica can take a request over;
- `{ns}_workers`: the registry bucket, whose TTL expires the cards of workers that stopped;
- `{ns}_loras`: the LoRA adapters served (bus/adapters.py); `{ns}_sessions`: where sessions are (bus/sessions.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import APIError, BadRequestError, NotFoundError
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential
from nats.js.kv import KeyValue

from bus.adapters import ensure_lora_bucket
from bus.sessions import ensure_session_bucket
from bus.settings import BusSettings
from bus.subjects import Names
from schemas.registry import Stage

log = structlog.get_logger(__name__)

# The shared work consumer's one priority group: every pull from it names the group and a priority (0 first).
WORK_PRIORITY_GROUP = "work"

# JetStream's error code when a stream's max_bytes would take the server past its store limit.
_STORE_EXHAUSTED = 10047


class StoreTooSmall(RuntimeError):
    """JetStream will not reserve the bytes a stream is capped at. Waiting makes no room, so nothing retries it:
    the message says what to change."""


@dataclass(frozen=True, slots=True)
class StreamReport:
    name: str
    subjects: list[str]
    messages: int
    bytes: int
    consumers: int


def work_stream_config(names: Names, stage: Stage, settings: BusSettings, max_payload: int) -> StreamConfig:
    return StreamConfig(
        num_replicas=settings.stream_replicas,
        name=names.work_stream(stage),
        description=f"Conveyor {stage.value} work queue",
        subjects=names.work_stream_subjects(stage),
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        # Refuse new work when full rather than silently dropping queued requests.
        discard=DiscardPolicy.NEW,
        max_age=settings.work_max_age_s,
        max_msgs=settings.work_max_msgs,
        max_bytes=settings.work_max_bytes,
        max_msg_size=min(settings.max_message_bytes, max_payload),
        duplicate_window=settings.dedupe_window_s,
    )


def control_stream_config(names: Names, settings: BusSettings) -> StreamConfig:
    return StreamConfig(
        num_replicas=settings.stream_replicas,
        name=names.control_stream,
        description="Conveyor cancels, replayed by workers that start late",
        subjects=names.cancel_subjects,
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=settings.cancel_ttl_s,
        max_msgs=1_000_000,
        max_msg_size=4096,
    )


def kv_events_stream_config(names: Names, settings: BusSettings, max_payload: int) -> StreamConfig:
    return StreamConfig(
        num_replicas=settings.stream_replicas,
        name=names.kv_events_stream,
        description="Conveyor KV-cache events per worker",
        subjects=[names.kv_events_subjects],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=settings.kv_events_max_age_s,
        max_msg_size=max_payload,
        duplicate_window=min(settings.dedupe_window_s, settings.kv_events_max_age_s),
    )


def dead_letter_stream_config(names: Names, settings: BusSettings, max_payload: int) -> StreamConfig:
    return StreamConfig(
        num_replicas=settings.stream_replicas,
        name=names.dead_letter_stream,
        description="Conveyor tasks a stage gave up on, with the reason (conveyor dlq)",
        subjects=[names.dead_letter_subject("*")],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=settings.dead_letter_max_age_s,
        max_bytes=settings.work_max_bytes,
        # Oldest go first when full: a flood of poison must not stop new dead letters being kept.
        discard=DiscardPolicy.OLD,
        max_msg_size=max_payload,
    )


def progress_stream_config(names: Names, settings: BusSettings, max_payload: int) -> StreamConfig:
    return StreamConfig(
        num_replicas=settings.stream_replicas,
        name=names.progress_stream,
        description="Conveyor reply journals: what each streaming request has sent, for migration",
        subjects=[f"{names.namespace}.progress.>"],
        retention=RetentionPolicy.LIMITS,
        # A journal must outlive a worker, not the server; memory keeps a record per frame cheap.
        storage=StorageType.MEMORY,
        # Snapshots roll a request's records up; the terminal frame rolls them up to one record.
        allow_rollup_hdrs=True,
        max_age=settings.journal_max_age_s,
        max_bytes=settings.journal_max_bytes,
        # Oldest go first when full (ended requests' terminal records, in practice).
        discard=DiscardPolicy.OLD,
        max_msg_size=max_payload,
    )


async def ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    """Create the stream, or bring an existing one to this config."""
    try:
        try:
            await js.add_stream(config)
        except BadRequestError:
            # Exists with another config (limits changed between releases): update what may change.
            await js.update_stream(config)
            log.info("stream.updated", stream=config.name)
    except APIError as error:
        if error.err_code == _STORE_EXHAUSTED:
            raise StoreTooSmall(_store_too_small_message(config)) from error
        raise


def _store_too_small_message(config: StreamConfig) -> str:
    # A server reserves each stream's max_bytes up front, against a limit that defaults to 75% of the disk's
    # free space when it started: a nearly full disk refuses streams that would hold almost nothing.
    cap_mib = (config.max_bytes or 0) / (1 << 20)
    kind = "memory" if config.storage == StorageType.MEMORY else "file"
    return (f"JetStream has no room to reserve stream {config.name} ({cap_mib:.0f} MiB, {kind} storage): the "
            f"server's {kind} store limit is taken (by default 75% of the free disk, or memory, when it started). "
            f"Free space where it keeps its store and restart it, raise its jetstream max_{kind}_store, or lower "
            f"the caps: CONVEYOR_WORK_MAX_BYTES caps each work and dead-letter stream, "
            f"CONVEYOR_JOURNAL_MAX_BYTES the reply journals.")


async def declare_all(js: JetStreamContext, names: Names, settings: BusSettings, max_payload: int) -> KeyValue:
    """Declare every stream and the buckets (registry, LoRA adapters, sessions); returns the registry bucket."""
    for stage in Stage:
        await ensure_stream(js, work_stream_config(names, stage, settings, max_payload))
    await ensure_stream(js, control_stream_config(names, settings))
    await ensure_stream(js, kv_events_stream_config(names, settings, max_payload))
    await ensure_stream(js, dead_letter_stream_config(names, settings, max_payload))
    await ensure_stream(js, progress_stream_config(names, settings, max_payload))
    await ensure_lora_bucket(js, names, settings)
    await ensure_session_bucket(js, names, settings)
    return await ensure_registry_bucket(js, names, settings)


async def declare_all_when_ready(js: JetStreamContext, names: Names, settings: BusSettings, max_payload: int,
                                 timeout_s: float = 60.0) -> KeyValue:
    """`declare_all`, retried while JetStream cannot answer yet: a server still starting, or a cluster
    electing its leaders after a node died (a worker started then would otherwise exit). A store too small
    for the streams (`StoreTooSmall`) is raised at once."""
    retrying = AsyncRetrying(wait=wait_exponential(multiplier=0.1, max=2.0), stop=stop_after_delay(timeout_s),
                             retry=retry_if_exception_type((TimeoutError, APIError)),
                             before_sleep=lambda state: log.warning("streams.jetstream_not_ready",
                                                                    error=repr(state.outcome.exception())),
                             reraise=True)
    async for attempt in retrying:
        with attempt:
            return await declare_all(js, names, settings, max_payload)
    raise AssertionError("unreachable: tenacity re-raises the last error")


async def ensure_registry_bucket(js: JetStreamContext, names: Names, settings: BusSettings) -> KeyValue:
    try:
        return await js.key_value(names.registry_bucket)
    except (NotFoundError, BadRequestError):
        config = KeyValueConfig(
            bucket=names.registry_bucket,
            description="Conveyor worker cards",
            ttl=settings.registry_ttl_s,
            history=1,
            replicas=settings.stream_replicas,
            # On disk, so the cards outlive a server restart: the pipeline is ready the moment it is back.
            storage=StorageType.FILE,
        )
        return await js.create_key_value(config)


@dataclass
class PrioritizedConsumerConfig(ConsumerConfig):
    """nats-py's ConsumerConfig with JetStream's priority groups, which nats-py does not model yet (as_dict sends
    them as they are). Declaring the consumer without them turns the policy off again, so every declaration of a
    work consumer goes through work_consumer_config."""

    priority_groups: list[str] | None = None
    priority_policy: str | None = None


def work_consumer_config(
    names: Names, stage: Stage, model: str | None, settings: BusSettings, max_ack_pending: int,
    pool: str | None = None,
) -> ConsumerConfig:
    durable = names.work_consumer(stage, model, pool)
    return PrioritizedConsumerConfig(
        name=durable,
        durable_name=durable,
        description=f"Conveyor {stage.value} workers" + (f" for {model}" if model else "")
        + (f" in pool {pool}" if pool else ""),
        filter_subject=names.work_subject(stage, model, pool),
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=settings.ack_wait_s,
        max_deliver=settings.max_deliver,
        # Bounds the tasks all replicas hold un-acked at once; past it the rest stay queued.
        max_ack_pending=max_ack_pending,
        max_waiting=512,
        # Pending pulls are served lowest priority first: a replica asks at 0 for its engine's free places and at 1
        # for its queue ahead (bus/consumer.py).
        priority_groups=[WORK_PRIORITY_GROUP],
        priority_policy="prioritized",
    )


def pinned_consumer_config(names: Names, stage: Stage, model: str | None, worker_id: str,
                           settings: BusSettings) -> ConsumerConfig:
    """One worker's own consumer of the tasks a router pinned to it. Left behind by a worker that died, it is
    removed by the router that moves its tasks back to the shared queue, or by the server once idle."""
    durable = names.pinned_consumer(stage, model, worker_id)
    return ConsumerConfig(
        name=durable,
        durable_name=durable,
        description=f"Conveyor {stage.value} worker {worker_id}: pinned tasks",
        filter_subject=names.pinned_subject(stage, model, worker_id),
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=settings.ack_wait_s,
        max_deliver=settings.max_deliver,
        max_waiting=512,
        inactive_threshold=settings.pinned_consumer_idle_s,
    )


async def ensure_work_consumer(js: JetStreamContext, config: ConsumerConfig, stream: str) -> None:
    await js.add_consumer(stream, config)


async def delete_all(js: JetStreamContext, names: Names) -> None:
    """Remove every stream of the namespace, with what it holds (tests, `conveyor streams --delete`)."""
    for name in [*names.all_streams, names.router_snapshot_stream]:
        try:
            await js.delete_stream(name)
        except NotFoundError:
            continue


async def report(js: JetStreamContext, names: Names) -> list[StreamReport]:
    """What `conveyor streams` prints: each of our streams and what it holds."""
    reports = []
    for name in names.all_streams:
        try:
            info = await js.stream_info(name)
        except NotFoundError:
            continue
        reports.append(
            StreamReport(
                name=name,
                subjects=list(info.config.subjects or []),
                messages=info.state.messages,
                bytes=info.state.bytes,
                consumers=info.state.consumer_count,
            )
        )
    return reports
