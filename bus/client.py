"""The client side of the pipeline: submit a request, read its reply stream, cancel it.

Used by `conveyor ask`, the gateway and the tests; any NATS client can do the same by following
docs/wire-protocol.md.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from nats.aio.client import Client
from nats.js import JetStreamContext

from bus.cancel import scope_of, send_cancel
from bus.connection import connect
from bus.errors import RequestIdInUse
from bus.publish import TaskPublisher
from bus.registry import live_workers
from bus.replies import ReplyStream
from bus.settings import BusSettings, NatsSettings
from bus.streams import ensure_registry_bucket
from bus.subjects import Names
from bus.tracing import TraceContext
from schemas.client import ChatRequest, CompletionRequest, EmbeddingRequest, ImageRequest
from schemas.registry import Stage, WorkerCard

ClientRequestModel = ChatRequest | CompletionRequest | EmbeddingRequest | ImageRequest


class PipelineClient:
    def __init__(self, nc: Client, js: JetStreamContext, names: Names, settings: BusSettings) -> None:
        self._nc = nc
        self._js = js
        self._names = names
        self._settings = settings
        self._publisher = TaskPublisher(js, names, min(settings.max_message_bytes, nc.max_payload))

    def new_inbox(self) -> str:
        return self._nc.new_inbox()

    async def submit(self, request: ClientRequestModel, first_frame_timeout_s: float = 60.0) -> ReplyStream:
        """Subscribe to the request's inbox, then publish it; read the returned stream with
        `async with stream:` ... `async for chunk in stream`."""
        stream = ReplyStream(
            self._nc,
            request.reply_to,
            request.request_id,
            heartbeat_timeout_s=self._settings.heartbeat_timeout_s,
            first_frame_timeout_s=first_frame_timeout_s,
        )
        await stream.__aenter__()
        try:
            published = await self._publisher.publish(Stage.PROCESSOR, request, request.request_id, TraceContext.new())
        except BaseException:
            await stream.close()
            raise
        if not published:
            await stream.close()
            raise RequestIdInUse(f"request id {request.request_id!r} was used within the dedupe window "
                                 f"({self._settings.dedupe_window_s:.0f} s); give each request a fresh id")
        return stream

    async def cancel(self, request_id: str, reason: str = "cancelled by client") -> None:
        # Scoped to this client's inboxes when they carry an owner token (`_INBOX.alice.…`): a secured
        # server lets a client cancel only there.
        await send_cancel(self._js, self._names, request_id, reason, scope_of(self._nc.new_inbox()))

    async def live_workers(self) -> list[WorkerCard]:
        bucket = await ensure_registry_bucket(self._js, self._names, self._settings)
        return await live_workers(bucket)


@asynccontextmanager
async def open_client(nats: NatsSettings, bus: BusSettings, name: str) -> AsyncIterator[PipelineClient]:
    """A connected client of the namespace's pipeline, closed on exit."""
    nc = await connect(nats, name=name)
    try:
        yield PipelineClient(nc, nc.jetstream(), Names(bus.namespace), bus)
    finally:
        await nc.close()
