"""`conveyor smoke`: prove the bus works end to end without any engine.

It starts (or joins) a NATS server, declares the streams, binds an echo consumer on the processor
subject, publishes a completion request through JetStream exactly as a client would, and prints
the reply stream: the prompt's words come back one chunk at a time, then a final frame. A failure
at any step names the step.
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from bus.cancel import CancelRegistry
from bus.client import PipelineClient
from bus.connection import close_connection, connect
from bus.consumer import ConsumerOptions, Delivery, WorkConsumer
from bus.server import STANDARD_PORT, EmbeddedNatsServer, port_is_free
from bus.settings import BusSettings, NatsSettings
from bus.streams import declare_all
from bus.subjects import Names
from schemas.client import CLIENT_REQUEST, ChatRequest, ClientRequest, CompletionRequest, StreamFormat
from schemas.registry import Stage
from schemas.replies import FinalFrame, FinishReason, Usage


def progress(message: str) -> None:
    print(f"[conveyor] {message}", file=sys.stderr, flush=True)


@asynccontextmanager
async def nats_url_or_embedded(nats: NatsSettings, embedded: bool) -> AsyncIterator[NatsSettings]:
    """The given settings, or settings pointing at a fresh embedded server for the block's life."""
    if not embedded:
        yield nats
        return
    # The standard port when it is free, so `conveyor ask` / `chat` / `status` in another terminal find it.
    standard = port_is_free("127.0.0.1", STANDARD_PORT)
    server = EmbeddedNatsServer(port=STANDARD_PORT if standard else None)
    progress("starting embedded nats-server with JetStream ...")
    url = server.start()  # in the main thread, so the server dies with this process (dies_with_parent)
    if (note := server.store_note()) is not None:
        progress(note)
    if standard:
        progress(f"nats-server ready at {url}; other terminals reach it with no flags")
    else:
        progress(f"port {STANDARD_PORT} is taken, so nats-server listens at {url}: "
                 f"other terminals need --nats {url}")
    try:
        yield nats.model_copy(update={"urls": [url]})
    finally:
        await asyncio.to_thread(server.stop)


async def echo(request: ClientRequest, delivery: Delivery) -> None:
    """Stream the prompt's words back; token ids are each word's UTF-8 bytes."""
    if isinstance(request, CompletionRequest) and isinstance(request.prompt, str):
        words = request.prompt.split()
    elif isinstance(request, ChatRequest):
        words = " ".join(m.content for m in request.messages if isinstance(m.content, str)).split()
    else:
        words = []
    async with delivery.reply:
        for word in words:
            await delivery.reply.send_tokens(list(word.encode()), text=word + " ")
            await asyncio.sleep(0.05)
        await delivery.reply.finish(FinishReason.STOP, Usage.of(len(words), len(words)))


async def run_smoke(nats: NatsSettings, bus: BusSettings, embedded: bool, prompt: str) -> None:
    async with nats_url_or_embedded(nats, embedded) as nats:
        nc = await connect(nats, name="conveyor-smoke")
        try:
            js = nc.jetstream()
            names = Names(f"{bus.namespace}-smoke")
            await declare_all(js, names, bus, nc.max_payload)
            progress(f"declared {len(names.all_streams)} streams in namespace {names.namespace}")
            cancels = CancelRegistry(nc, js, names, bus.cancel_ttl_s)
            await cancels.start()
            consumer = WorkConsumer(
                nc, js, names, bus, Stage.PROCESSOR, CLIENT_REQUEST, echo, cancels,
                worker_id="smoke-echo", options=ConsumerOptions(fetch_timeout_s=0.5),
            )
            await consumer.bind()
            loop = asyncio.create_task(consumer.run())
            progress("echo worker bound to the processor queue; sending the request")
            client = PipelineClient(nc, js, names, bus)
            request = CompletionRequest(
                request_id=f"smoke-{uuid.uuid4().hex[:12]}", reply_to=client.new_inbox(), model="echo",
                prompt=prompt, stream_format=StreamFormat.TEXT,
            )
            started_s = time.perf_counter()
            async with await client.submit(request, first_frame_timeout_s=10) as stream:
                async for chunk in stream:
                    print(chunk.text or "", end="", flush=True)
            print()
            assert isinstance(stream.terminal, FinalFrame)
            elapsed_ms = (time.perf_counter() - started_s) * 1000
            progress(f"round trip done in {elapsed_ms:.0f} ms: finish_reason={stream.terminal.finish_reason.value}")
            await consumer.stop(grace_s=1.0)
            await loop
            await cancels.stop()
        finally:
            await close_connection(nc)
