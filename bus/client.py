"""The client side of the pipeline: submit a request, read its reply stream, cancel it.

Used by `conveyor ask`, the gateway and the tests; any NATS client can do the same by following
docs/wire-protocol.md.
"""

from __future__ import annotations

from nats.aio.client import Client
from nats.js import JetStreamContext

from bus.cancel import send_cancel
from bus.publish import TaskPublisher
from bus.replies import ReplyStream
from bus.settings import BusSettings
from bus.subjects import Names
from bus.tracing import TraceContext
from schemas.client import ChatRequest, CompletionRequest, EmbeddingRequest
from schemas.registry import Stage

ClientRequestModel = ChatRequest | CompletionRequest | EmbeddingRequest


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
            await self._publisher.publish(Stage.PROCESSOR, request, request.request_id, TraceContext.new())
        except BaseException:
            await stream.close()
            raise
        return stream

    async def cancel(self, request_id: str, reason: str = "cancelled by client") -> None:
        await send_cancel(self._js, self._names, request_id, reason)
