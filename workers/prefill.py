"""Prefill stage: compute a prompt's KV and hand it to a decode engine (disaggregated serving).

Consumes `PrefillTask` from `{ns}.work.prefill.{model}`. For each task it takes a bootstrap room
(the task's, when a router chose one, else a random 63-bit number), starts the prompt on its engine
with that room, publishes the `DecodeTask` carrying `{bootstrap_host, bootstrap_port,
bootstrap_room}` to `{ns}.work.decode.{model}` (or the decode pool the processor chose: bus/pools.py), and
acks only when the handoff is done (the decode engine has read the KV), so a worker that dies mid-prefill
leaves the task to be redelivered.

Emits nothing to the client: the decode stage streams. The prompt is registered with the engine
before the decode task is published; a decode engine that asks first simply waits for the room.

A prefill worker that dies: before publishing, its task is redelivered and run again; after, the
decode worker's KV read fails and it runs the prompt itself where its engine can (torch, mock), and the
redelivered prefill, whose decode task JetStream drops as a duplicate, aborts.

Fails how: an engine failure before the decode task is published → retried (nak with backoff);
after it, the decode side reports the failed handoff, so the prefill acks rather than run the
prompt twice. A task given faster pools to retry on goes to the next of them instead of failing, once its
retries here are spent (nothing was streamed yet). A `Cancel` aborts the prefill and frees its blocks; the
decode stage, which hears the same cancel, tells the client `cancelled`.
"""

from __future__ import annotations

import asyncio
import secrets

import structlog

from bus.consumer import Delivery
from bus.metrics import QUEUE_SECONDS, REQUESTS
from schemas.registry import Stage
from schemas.tasks import BootstrapInfo, DecodeTask, EncodedImages, PrefillTask
from workers.decode import offer_failures_to_faster_pools, resolve_images, run_canary
from workers.engines.protocol import Engine, GenerateOutput, GenerateRequest
from workers.media import ImageInputs
from workers.runtime import StageContext

log = structlog.get_logger(__name__)


class PrefillStage:
    task_type = PrefillTask
    # The decode stage streams (and journals); a prefill sends the client nothing.
    journals_replies = False

    def __init__(self, engine: Engine, model: str, images: ImageInputs | None = None) -> None:
        self._engine = engine
        self.model = model
        self._images = images
        self._context: StageContext | None = None

    @property
    def accepts_media(self) -> bool:
        return self._images is not None and self._images.encoder is not None

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def consumes_model(self) -> str:
        return self.model

    async def start(self, context: StageContext) -> None:
        self._context = context
        await self._engine.start()
        if self._engine.bootstrap_endpoint is None:
            raise RuntimeError(f"the {self._engine.info.name} engine was not started in the prefill role")

    async def stop(self) -> None:
        await self._engine.shutdown()

    async def canary(self) -> None:
        # No room: the engine runs the prompt as an ordinary request, which warms it up too.
        await run_canary(self._engine, f"canary-prefill-{secrets.token_hex(4)}")

    async def handle(self, task: PrefillTask, delivery: Delivery) -> None:
        assert self._context is not None
        QUEUE_SECONDS.labels(stage=Stage.PREFILL.value).observe(delivery.queued_s)
        offer_failures_to_faster_pools(task, Stage.PREFILL, self.model, delivery, self._context)
        endpoint = self._engine.bootstrap_endpoint
        assert endpoint is not None
        room = task.bootstrap_room if task.bootstrap_room is not None else secrets.randbits(63)
        bootstrap = BootstrapInfo(bootstrap_host=endpoint.host, bootstrap_port=endpoint.port, bootstrap_room=room)
        if task.request.lora_name is not None and self._context.adapters is not None:
            await self._context.adapters.ensure(task.request.lora_name)
        prompt = await resolve_images(self._images, task, delivery)
        if prompt is None:
            return
        request = GenerateRequest(
            request_id=task.request_id, token_ids=prompt.token_ids, image_rows=prompt.rows, image_grids=prompt.grids,
            sampling=task.request.sampling,
            stop=task.request.stop, output=task.request.output, guided=task.request.guided, bootstrap=bootstrap,
            priority=task.request.priority, lora_name=task.request.lora_name,
        )
        prefill = asyncio.create_task(_drain(self._engine.generate(request)))
        # Let the engine register the room before the decode side learns of it.
        await asyncio.sleep(0)
        # The decode engine receives the KV of the prompt as run here (images expanded); the images go along
        # so that it can run the prompt itself should this worker die before the handoff.
        encoded = EncodedImages(token_ids=prompt.token_ids, image_grids=prompt.grids) if task.request.media else None
        decode_task = DecodeTask(header=task.header, request=task.request, bootstrap=bootstrap, encoded_images=encoded,
                                 retry_pools=task.decode_pools[1:])
        try:
            published = await self._context.publisher.publish(
                Stage.DECODE, decode_task, task.request_id, delivery.trace, model=self.model,
                pool=task.decode_pools[0] if task.decode_pools else None)
        except BaseException:
            prefill.cancel()
            raise
        if not published:
            # Redelivered after a prefill worker died: its decode task went out already, and that decode worker
            # runs the prompt itself when the handoff fails. Nobody will read this room.
            await self._engine.abort(task.request_id)
            await asyncio.gather(prefill, return_exceptions=True)
            REQUESTS.labels(stage=Stage.PREFILL.value, model=self.model, outcome="duplicate").inc()
            log.info("prefill.duplicate", room=room)
            return
        final = await _until_done_or_cancelled(prefill, self._engine, task.request_id, delivery)
        outcome = final.finish_reason.value if final is not None and final.finish_reason else "cancelled"
        if final is not None and final.error:
            log.warning("prefill.handoff_failed", room=room, error=final.error)
        REQUESTS.labels(stage=Stage.PREFILL.value, model=self.model, outcome=outcome).inc()


async def _drain(outputs: object) -> GenerateOutput | None:
    """Read the prefill stream to its end (the handoff); its tokens go nowhere."""
    last: GenerateOutput | None = None
    async for output in outputs:  # type: ignore[attr-defined]
        last = output
    return last


async def _until_done_or_cancelled(prefill: asyncio.Task[GenerateOutput | None], engine: Engine, request_id: str,
                                   delivery: Delivery) -> GenerateOutput | None:
    cancelled = asyncio.ensure_future(delivery.cancelled.wait())
    try:
        await asyncio.wait([prefill, cancelled], return_when=asyncio.FIRST_COMPLETED)
        if not prefill.done():
            await engine.abort(request_id)
        return await prefill
    finally:
        cancelled.cancel()
