"""Encode stage: images → embedding rows, handed to the LLM worker over NIXL.

Consumes `EncodeTask` from `{ns}.work.encode.{model}`: a preprocessed prompt with one image
placeholder token per image and the images' URLs. For each it loads the media concurrently
(`data:`, `file://`, `http(s)://`, with size, pixel and time limits), runs the vision tower on the
images its LRU cache does not hold (keyed by content hash), expands each placeholder to the image's
pad ids, copies the rows into its NIXL export pool and publishes the next task — `DecodeTask` (E/PD)
or `PrefillTask` (E/P/D), as the processor chose — with the request as it came (images included) and
`EncodedImages`: the expanded prompt and a `NixlHandle` (descriptors, shape, dtype; never the rows). It
acks once the next task is published, so its slot takes the next image request at once; the exporter
keeps the rows until the LLM worker has read them (or the request is cancelled, or nobody came).

Emits to the client only errors (and `cancelled` when the cancel lands while encoding): the LLM
stage streams the answer.

Fails how: bad media — not an image, truncated, too large, too many images, a decompression bomb,
an unreachable URL, placeholders that do not match the images — → `invalid_request` (video →
`unsupported`); an expanded prompt that does not fit the context → `context_length_exceeded`. A
cancel frees the buffer at once; a reader that never comes frees it after `handoff_timeout_s`. If this
worker dies after its ack, the LLM worker cannot read the rows and encodes the images itself.
"""

from __future__ import annotations

import base64
import io
import time

import structlog

from bus.consumer import Delivery
from bus.errors import RejectRequest
from bus.metrics import QUEUE_SECONDS, REQUESTS
from schemas.client import MediaUrl
from schemas.registry import Stage
from schemas.replies import ErrorCode, FinishReason, Usage
from schemas.tasks import DecodeTask, EncodedImages, EncodeTask, MediaItem, PrefillTask
from workers.media import MediaEncoder, MediaError
from workers.media_transfer import EmbeddingExporter
from workers.runtime import StageContext

log = structlog.get_logger(__name__)


class EncodeStage:
    task_type = EncodeTask
    accepts_media = True
    journals_replies = False
    # The vision tower is not a generation engine: no KV events, load gauges or engine-control routes.
    engine = None

    def __init__(self, encoder: MediaEncoder, model: str, context_length: int,
                 export_pool_bytes: int = 64 << 20, handoff_timeout_s: float = 60.0) -> None:
        self._encoder = encoder
        self.model = self.consumes_model = model
        self._context_length = context_length
        self._export_pool_bytes = export_pool_bytes
        self._handoff_timeout_s = handoff_timeout_s
        self._context: StageContext | None = None
        self._exporter: EmbeddingExporter | None = None

    async def start(self, context: StageContext) -> None:
        self._context = context
        self._exporter = EmbeddingExporter(f"encode-{context.worker_id}", self._export_pool_bytes)

    async def stop(self) -> None:
        if self._exporter is not None:
            await self._exporter.close()

    async def canary(self) -> None:
        encoded = await self._encoder.encode([1, self._encoder.placeholder_id, 2], [canary_image()])
        num_rows = 0 if encoded.rows is None else int(encoded.rows.shape[0])
        if not num_rows or num_rows != len(encoded.token_ids) - 2:
            raise RuntimeError(f"vision tower gave {num_rows} rows for {len(encoded.token_ids) - 2} image tokens")

    async def handle(self, task: EncodeTask, delivery: Delivery) -> None:
        assert self._context is not None and self._exporter is not None
        QUEUE_SECONDS.labels(stage=Stage.ENCODE.value).observe(delivery.queued_s)
        started_s = time.perf_counter()
        try:
            encoded = await self._encoder.encode(task.request.token_ids, task.request.media)
        except MediaError as error:
            raise RejectRequest(error.code, str(error)) from error
        if len(encoded.token_ids) >= self._context_length:
            raise RejectRequest(ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                                f"prompt of {len(encoded.token_ids)} tokens with its images does not fit the context "
                                f"of {self._context_length} tokens")
        if delivery.cancelled.is_set():
            await delivery.reply.finish(FinishReason.CANCELLED, Usage.of(len(encoded.token_ids), 0))
            return
        assert encoded.rows is not None  # an encode task has at least one image
        is_cancelled = self._context.is_cancelled
        handle = await self._exporter.offer(task.request_id, encoded.rows, wait_for_space_s=self._handoff_timeout_s,
                                            cancelled=lambda: is_cancelled(task.request_id, task.reply_to),
                                            hold_s=self._handoff_timeout_s)
        # The request goes on with its images: a reader that finds this worker dead encodes them itself.
        images = EncodedImages(token_ids=encoded.token_ids, rows=handle, image_grids=encoded.grids)
        stage = Stage.PREFILL if task.next_stage == "prefill" else Stage.DECODE
        next_task = (PrefillTask(header=task.header, request=task.request, encoded_images=images)
                     if stage == Stage.PREFILL else DecodeTask(header=task.header, request=task.request, encoded_images=images))
        try:
            published = await self._context.publisher.publish(stage, next_task, task.request_id, delivery.trace,
                                                              model=self.model)
        except BaseException:
            self._exporter.release(task.request_id)
            raise
        if not published:
            # Redelivered after an encode worker died past its handoff: the LLM stage has the task already,
            # and encodes the images itself when the dead worker's rows cannot be read. Nobody reads these.
            self._exporter.release(task.request_id)
            REQUESTS.labels(stage=Stage.ENCODE.value, model=self.model, outcome="duplicate").inc()
            log.info("encode.duplicate")
            return
        log.info("encode.handed_off", images=len(task.request.media), rows=int(encoded.rows.shape[0]),
                 to=stage.value, encode_ms=round((time.perf_counter() - started_s) * 1000, 1))
        REQUESTS.labels(stage=Stage.ENCODE.value, model=self.model, outcome="handed_off").inc()


def canary_image() -> MediaItem:
    """A 2×2 PNG as a data URL: the health check runs the whole load → encode path."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (2, 2), (200, 30, 30)).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    return MediaItem(modality="image", source=MediaUrl(url=url))
