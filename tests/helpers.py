"""Small helpers shared by the bus tests: publish raw bytes, run a consumer in the background."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from prometheus_client import REGISTRY

from bus.consumer import ConsumerOptions, Delivery, WorkConsumer
from bus.replies import ReplyStream
from schemas.registry import Stage
from schemas.tasks import DecodeTask, PreprocessedRequest, TaskHeader
from tests.conftest import Bus


def decode_task(request_id: str | None = None, reply_to: str = "_INBOX.unused") -> DecodeTask:
    return DecodeTask(
        header=TaskHeader(request_id=request_id or uuid.uuid4().hex, reply_to=reply_to, created_at_s=time.time()),
        request=PreprocessedRequest(model="m", token_ids=[1, 2, 3]),
    )


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def stream_len(bus: Bus, stage: Stage) -> int:
    info = await bus.js.stream_info(bus.names.work_stream(stage))
    return info.state.messages


@asynccontextmanager
async def running_consumer(
    bus: Bus,
    handler: Callable[[DecodeTask, Delivery], Awaitable[None]],
    options: ConsumerOptions = ConsumerOptions(fetch_timeout_s=0.2),
    worker_id: str = "w1",
    settings: Any = None,
) -> AsyncIterator[WorkConsumer[DecodeTask]]:
    cancels = await bus.cancel_registry()
    consumer = WorkConsumer(
        bus.nc, bus.js, bus.names, settings or bus.settings, Stage.DECODE, DecodeTask, handler, cancels,
        worker_id=worker_id, options=options,
    )
    await consumer.bind()
    loop_task = asyncio.create_task(consumer.run())
    try:
        yield consumer
    finally:
        await consumer.stop(grace_s=1.0)
        await loop_task
        await cancels.stop()


async def open_stream(bus: Bus, request_id: str, first_frame_timeout_s: float = 10.0) -> ReplyStream:
    stream = ReplyStream(
        bus.nc, bus.nc.new_inbox(), request_id,
        heartbeat_timeout_s=bus.settings.heartbeat_timeout_s, first_frame_timeout_s=first_frame_timeout_s,
    )
    await stream.__aenter__()
    return stream


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


async def wait_until_async(predicate: Callable[[], Awaitable[bool]], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)
