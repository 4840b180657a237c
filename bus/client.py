"""The client side of the pipeline: submit a request, read its reply stream, cancel it; serve LoRA adapters.

Used by `conveyor ask`, the gateway and the tests; any NATS client can do the same by following
docs/wire-protocol.md.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from nats.aio.client import Client
from nats.js import JetStreamContext

from bus.adapters import AdapterBucket, ensure_lora_bucket
from bus.cancel import scope_of, send_cancel
from bus.connection import close_connection, connect
from bus.errors import RequestIdInUse
from bus.publish import TaskPublisher
from bus.registry import live_workers
from bus.replies import ReplyInboxes, ReplyStream
from bus.settings import BusSettings, NatsSettings
from bus.streams import ensure_registry_bucket
from bus.subjects import Names
from bus.tracing import TraceContext, stage_span
from schemas.client import ChatRequest, CompletionRequest, EmbeddingRequest, ImageRequest
from schemas.control import LoraAdapter
from schemas.registry import Stage, WorkerCard

ClientRequestModel = ChatRequest | CompletionRequest | EmbeddingRequest | ImageRequest


class PipelineClient:
    def __init__(self, nc: Client, js: JetStreamContext, names: Names, settings: BusSettings) -> None:
        self._nc = nc
        self._js = js
        self._names = names
        self._settings = settings
        self._publisher = TaskPublisher(js, names, min(settings.max_message_bytes, nc.max_payload))
        self._inboxes = ReplyInboxes(nc)

    def new_inbox(self) -> str:
        """A reply inbox that `submit` reads through this client's one shared subscription."""
        return self._inboxes.new_inbox()

    async def submit(self, request: ClientRequestModel, first_frame_timeout_s: float = 60.0,
                     trace: TraceContext | None = None) -> ReplyStream:
        """Subscribe to the request's inbox, then publish it; read the returned stream with
        `async with stream:` ... `async for chunk in stream`. `trace`: the caller's trace (an HTTP request's
        `traceparent`) that the request's spans join; a new trace otherwise."""
        stream = ReplyStream(
            self._nc,
            request.reply_to,
            request.request_id,
            heartbeat_timeout_s=self._settings.heartbeat_timeout_s,
            first_frame_timeout_s=first_frame_timeout_s,
            inboxes=self._inboxes,
        )
        await stream.__aenter__()
        try:
            with stage_span("submit", trace or TraceContext.new(), request_id=request.request_id) as hop:
                published = await self._publisher.publish(Stage.PROCESSOR, request, request.request_id, hop)
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

    @property
    def registry_ttl_s(self) -> float:
        """How long a worker's card outlives its last heartbeat (the registry bucket's TTL)."""
        return self._settings.registry_ttl_s

    async def live_workers(self) -> list[WorkerCard]:
        bucket = await ensure_registry_bucket(self._js, self._names, self._settings)
        return await live_workers(bucket)

    async def adapters(self) -> AdapterBucket:
        """The LoRA adapters the deployment serves (wanted state; the cards say what each worker loaded)."""
        return AdapterBucket(await ensure_lora_bucket(self._js, self._names, self._settings))

    async def load_lora(self, adapter: LoraAdapter, timeout_s: float = 60.0) -> AdapterRollout:
        """Serve `adapter` on every LLM worker of its base model (and on those that start later); returns once
        each ready one has loaded it or failed to, or at the timeout with the rest pending. An adapter every worker
        refused is taken out of the bucket again, so nothing is left half-served."""
        bucket = await self.adapters()
        await bucket.put(adapter)
        rollout = await self._rollout(adapter.name, adapter.base_model, timeout_s, loading=True)
        if rollout.refused:
            await bucket.delete(adapter.name)
        return rollout

    async def unload_lora(self, name: str, timeout_s: float = 60.0) -> AdapterRollout | None:
        """Stop serving `name` everywhere; None when the deployment did not serve it."""
        bucket = await self.adapters()
        adapter = await bucket.get(name)
        if adapter is None or not await bucket.delete(name):
            return None
        return await self._rollout(name, adapter.base_model, timeout_s, loading=False)

    async def _rollout(self, name: str, base_model: str, timeout_s: float, loading: bool) -> AdapterRollout:
        deadline_s = time.monotonic() + timeout_s
        while True:
            workers = [card for card in await self.live_workers() if card.ready and card.model == base_model
                       and card.stage in (Stage.DECODE, Stage.PREFILL)]
            done = [c.worker_id for c in workers if (name in c.lora_adapters) == loading and name not in c.lora_failures]
            failed = {c.worker_id: c.lora_failures[name] for c in workers if loading and name in c.lora_failures}
            pending = [c.worker_id for c in workers if c.worker_id not in done and c.worker_id not in failed]
            if not pending or time.monotonic() > deadline_s:
                return AdapterRollout(done=done, failed=failed, pending=pending)
            await asyncio.sleep(0.2)


@dataclass(frozen=True, slots=True)
class AdapterRollout:
    """Where a LoRA load or unload stands, by worker id."""

    done: list[str]
    failed: dict[str, str]
    pending: list[str]

    @property
    def refused(self) -> bool:
        """Every worker that answered failed (a bad path, an adapter that does not fit the model)."""
        return bool(self.failed) and not self.done and not self.pending

    def failures(self) -> str:
        return "; ".join(f"{worker}: {reason}" for worker, reason in self.failed.items())


@asynccontextmanager
async def open_client(nats: NatsSettings, bus: BusSettings, name: str) -> AsyncIterator[PipelineClient]:
    """A connected client of the namespace's pipeline, closed on exit."""
    nc = await connect(nats, name=name)
    try:
        yield PipelineClient(nc, nc.jetstream(), Names(bus.namespace), bus)
    finally:
        await close_connection(nc)
