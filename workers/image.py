"""Image stage: a prompt → PNG images from a diffusion pipeline, as OpenAI's /v1/images/generations returns them.

Consumes `ImageTask` from `{ns}.work.image.{model}` (the processor checked the request and drew a seed when
the client gave none). The worker denoises `n` images in one batch (`ImageGenerator`, one request at a time
per worker: scale by replicas), streams an `ImageProgress` frame after each step, then each image as
`ImageData` frames — the PNG's bytes (split over several frames when larger than a NATS message), or, with
`response_format: url`, the address where it stored the PNG (any fsspec URL; a local directory by default)
— and ends with `ImageResult` (size, seed). Image i is drawn with seed + i, so a redelivered task (its
worker died) makes the same images, and frames the client already has are dropped by their `seq`.

Fails how (error frame, ack; the worker keeps serving): a size the model cannot make (not a multiple of
its latent scale, too small, too many pixels) → `invalid_request`; storing a PNG fails (`url`) →
`internal`, naming the storage URL. A cancel, or a client that went away, stops denoising before the
next step and answers `cancelled`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import secrets
from dataclasses import dataclass

import fsspec
import structlog

from bus.consumer import Delivery
from bus.errors import RejectRequest
from bus.metrics import QUEUE_SECONDS, REQUESTS
from schemas.registry import Stage
from schemas.replies import ErrorCode, FinishReason, Usage
from schemas.tasks import ImageTask
from workers.engines.torch_engine.image_diffusion import ImageCancelled, ImageGenerator, ImageJob
from workers.runtime import StageContext

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class ImageStorage:
    """Where `response_format: url` images go, and the base of the URLs clients get for them."""

    # Any fsspec URL or local directory: file:///srv/images, s3://bucket/images (with s3fs installed), ...
    url: str
    # What clients are given in place of `url` (e.g. the https:// address a web server publishes it under).
    public_base_url: str | None = None

    def store(self, name: str, png: bytes) -> str:
        with fsspec.open(f"{self.url.rstrip('/')}/{name}", "wb", auto_mkdir=True) as file:
            file.write(png)
        return f"{(self.public_base_url or self.url).rstrip('/')}/{name}"


class ImageStage:
    task_type = ImageTask
    accepts_media = False
    journals_replies = False
    # No generation engine: no KV events, load gauges or engine-control routes.
    engine = None

    def __init__(self, generator: ImageGenerator, model: str, storage: ImageStorage) -> None:
        self._generator = generator
        self._storage = storage
        self.model = self.consumes_model = model
        # One pipeline run at a time: the pipeline keeps per-run state.
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffusion")

    async def start(self, context: StageContext) -> None:
        return None

    async def stop(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def canary(self) -> None:
        width, height = self._generator.smallest_size
        job = ImageJob("canary", None, width, height, num_inference_steps=1, guidance_scale=1.0, seed=0, num_images=1)
        pngs = await asyncio.get_running_loop().run_in_executor(self._executor, self._generator.generate, job,
                                                                lambda step, num_steps: False)
        if len(pngs) != 1 or not pngs[0].startswith(b"\x89PNG"):
            raise RuntimeError("image canary made no PNG")

    async def handle(self, task: ImageTask, delivery: Delivery) -> None:
        QUEUE_SECONDS.labels(stage=Stage.IMAGE.value).observe(delivery.queued_s)
        width, height = self._size(task.size)
        seed = task.seed if task.seed is not None else secrets.randbelow(2**31)
        job = ImageJob(task.prompt, task.negative_prompt, width, height, task.num_inference_steps,
                       task.guidance_scale, seed, task.n)
        async with delivery.reply:
            try:
                pngs = await self._generate(job, delivery)
            except ImageCancelled:
                await delivery.reply.finish(FinishReason.CANCELLED, Usage.of(0, 0))
                REQUESTS.labels(stage=Stage.IMAGE.value, model=self.model, outcome="cancelled").inc()
                return
            for index, png in enumerate(pngs):
                if task.response_format == "url":
                    await delivery.reply.send_image(index, url=await self._store(f"{task.request_id}-{index}.png", png))
                else:
                    await delivery.reply.send_image(index, png=png)
            await delivery.reply.send_images_done(self.model, len(pngs), width, height, seed)
        REQUESTS.labels(stage=Stage.IMAGE.value, model=self.model, outcome="generated").inc()
        log.info("image.generated", images=len(pngs), width=width, height=height, steps=job.num_inference_steps)

    async def _generate(self, job: ImageJob, delivery: Delivery) -> list[bytes]:
        """Run the pipeline in its thread; each step's progress frame is sent from this loop, in order,
        before the images."""
        loop = asyncio.get_running_loop()
        sends: list[concurrent.futures.Future[None]] = []

        def on_step(step: int, num_steps: int) -> bool:
            sends.append(asyncio.run_coroutine_threadsafe(delivery.reply.send_image_progress(step, num_steps), loop))
            return delivery.cancelled.is_set() or delivery.reply.client_gone.is_set()

        try:
            return await loop.run_in_executor(self._executor, self._generator.generate, job, on_step)
        finally:
            await asyncio.gather(*(asyncio.wrap_future(send) for send in sends), return_exceptions=True)

    async def _store(self, name: str, png: bytes) -> str:
        try:
            return await asyncio.to_thread(self._storage.store, name, png)
        except Exception as error:  # any fsspec backend's failure: missing, read-only, unreachable, no driver
            raise RejectRequest(ErrorCode.INTERNAL, f"could not store the image at {self._storage.url}: "
                                f"{type(error).__name__}: {error}") from error

    def _size(self, size: str) -> tuple[int, int]:
        if size == "auto":
            return self._generator.default_size
        width, height = (int(side) for side in size.split("x"))
        problem = self._generator.check_size(width, height)
        if problem is not None:
            raise RejectRequest(ErrorCode.INVALID_REQUEST, f"size {size} is not supported by {self.model}: {problem}")
        return width, height
