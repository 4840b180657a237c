"""Images through processor → image worker (a diffusers pipeline built from a config with a fixed seed):
PNGs that open, progress frames, reproducible seeds, URLs through fsspec storage, a PNG larger than a
NATS message split over frames, cancel between steps, the gateway with the openai SDK, the CLI against
worker processes, and bad inputs answered by typed errors from a worker that keeps serving."""

from __future__ import annotations

import asyncio
import base64
import io
import uuid
from pathlib import Path

import msgpack
import openai
import pytest
from PIL import Image

from bus.errors import RemoteError
from schemas.client import ImageRequest
from schemas.registry import ServingMode, Stage
from schemas.replies import ErrorCode, FinalFrame, FinishReason, ImageData, ImageProgress, ImageResult
from tests.conftest import Bus
from tests.helpers import open_stream
from tests.pipeline_helpers import client_of, run_cli_when_served, running_workers, worker_processes
from workers.engines.factory import EngineKind
from workers.engines.torch_engine.image_diffusion import SEEDED_IMAGE_MODEL
from workers.gateway import GatewayOptions, serving
from workers.image import ImageStorage
from workers.processor import ProcessorStage
from workers.stages import image_stage

MODEL = SEEDED_IMAGE_MODEL


def specs(storage: ImageStorage) -> list:  # type: ignore[type-arg]
    return [(Stage.PROCESSOR, ProcessorStage({})), (Stage.IMAGE, image_stage(EngineKind.TORCH, MODEL, storage))]


def image_request(bus: Bus, **fields: object) -> ImageRequest:
    defaults: dict[str, object] = {"model": MODEL, "prompt": "a red fox in the snow", "size": "64x64",
                                   "num_inference_steps": 3}
    return ImageRequest(request_id=f"i-{uuid.uuid4().hex[:12]}", reply_to=client_of(bus).new_inbox(),
                        **(defaults | fields))  # type: ignore[arg-type]


async def generate(bus: Bus, **fields: object) -> tuple[list[bytes | str], ImageResult, list[int]]:
    steps: list[int] = []
    async with await client_of(bus).submit(image_request(bus, **fields), first_frame_timeout_s=60) as stream:
        images, result = await stream.collect_images(lambda step, num_steps: steps.append(step))
    assert isinstance(result, ImageResult)
    return images, result, steps


def opened(png: bytes | str) -> Image.Image:
    assert isinstance(png, bytes) and png.startswith(b"\x89PNG")
    image = Image.open(io.BytesIO(png))
    image.load()
    return image


def pixel_difference(first: bytes | str, second: bytes | str) -> float:
    """Mean absolute difference of two images' RGB values (0-255)."""
    a, b = opened(first).convert("RGB").tobytes(), opened(second).convert("RGB").tobytes()
    assert len(a) == len(b)
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


async def test_images_come_back_as_pngs_with_progress_and_reproduce_from_their_seed(bus: Bus, tmp_path: Path) -> None:
    async with running_workers(bus, specs(ImageStorage(tmp_path.as_uri())), model=MODEL, mode=ServingMode.IMAGE):
        pair, result, steps = await generate(bus, n=2, seed=11)
        again, _, _ = await generate(bus, n=1, seed=11)
        other, _, _ = await generate(bus, n=1, seed=12)
        drawn, drawn_result, _ = await generate(bus, size="auto", num_inference_steps=1)
        stored, stored_result, _ = await generate(bus, n=2, response_format="url", seed=5)
    assert [opened(png).size for png in pair] == [(64, 64), (64, 64)]
    assert opened(pair[0]).mode == "RGB"
    assert steps == [1, 2, 3]
    assert (result.num_images, result.width, result.height, result.seed) == (2, 64, 64, 11)
    # Image i is drawn with seed + i: the same seed gives the same picture whether it came alone or in a pair (a batch
    # of two can round a few pixels apart, as torch's kernels differ by batch size), another seed another picture.
    assert pixel_difference(again[0], pair[0]) < 0.05
    assert pixel_difference(other[0], pair[0]) > 10.0 and pixel_difference(pair[1], pair[0]) > 10.0
    assert opened(drawn[0]).size == (256, 256) == (drawn_result.width, drawn_result.height)
    assert drawn_result.seed >= 0  # drawn by the processor, reported so the image can be made again
    for url in stored:
        assert isinstance(url, str) and url.startswith(tmp_path.as_uri())
        opened(Path(url.removeprefix("file://")).read_bytes())
    assert stored_result.num_images == 2


async def test_a_png_larger_than_a_nats_message_arrives_whole_over_several_frames(bus: Bus, tmp_path: Path) -> None:
    async with running_workers(bus, specs(ImageStorage(tmp_path.as_uri())), model=MODEL, mode=ServingMode.IMAGE):
        stream = await open_stream(bus, "big-image", first_frame_timeout_s=120)
        request = image_request(bus, size="1024x1024", num_inference_steps=1).model_copy(
            update={"request_id": "big-image", "reply_to": stream.inbox})
        await client_of(bus).submit(request)
        frames = []
        async for frame in stream.frames():
            frames.append(frame)
        await stream.close()
    pieces = [frame for frame in frames if isinstance(frame, ImageData)]
    png = b"".join(piece.png or b"" for piece in pieces)
    assert len(pieces) >= 2 and all(len(piece.png or b"") < bus.nc.max_payload for piece in pieces)
    assert [piece.last for piece in pieces] == [False] * (len(pieces) - 1) + [True]
    assert opened(png).size == (1024, 1024)
    assert isinstance(frames[0], ImageProgress) and isinstance(stream.terminal, ImageResult)


async def test_cancel_stops_denoising_between_steps_and_the_worker_serves_on(bus: Bus, tmp_path: Path) -> None:
    async with running_workers(bus, specs(ImageStorage(tmp_path.as_uri())), model=MODEL, mode=ServingMode.IMAGE):
        client = client_of(bus)
        request = image_request(bus, num_inference_steps=400)
        steps: list[int] = []
        async with await client.submit(request, first_frame_timeout_s=60) as stream:
            reading = asyncio.create_task(stream.collect_images(lambda step, num_steps: steps.append(step)))
            while not steps:
                await asyncio.sleep(0.01)
            await client.cancel(request.request_id)
            images, terminal = await asyncio.wait_for(reading, timeout=10)
        after, _, _ = await generate(bus)
    assert images == [] and isinstance(terminal, FinalFrame) and terminal.finish_reason == FinishReason.CANCELLED
    assert len(steps) < 400
    assert len(after) == 1


async def test_bad_image_requests_get_typed_errors_and_the_worker_keeps_serving(bus: Bus, tmp_path: Path) -> None:
    unwritable = ImageStorage((tmp_path / "a-file").as_uri() + "/images")  # a path under a regular file
    (tmp_path / "a-file").write_text("not a directory")
    cases = [
        ({"size": "100x100"}, ErrorCode.INVALID_REQUEST, "multiples of 8"),
        ({"size": "16x16"}, ErrorCode.INVALID_REQUEST, "at least"),
        ({"size": "4096x4096"}, ErrorCode.INVALID_REQUEST, "pixels"),
        ({"response_format": "url"}, ErrorCode.INTERNAL, "could not store"),
        ({"model": "no-such-image-model"}, ErrorCode.UNKNOWN_MODEL, "no ready image worker"),
    ]
    async with running_workers(bus, specs(unwritable), model=MODEL, mode=ServingMode.IMAGE):
        client = client_of(bus)
        for fields, code, words in cases:
            async with await client.submit(image_request(bus, **fields), first_frame_timeout_s=30) as stream:
                with pytest.raises(RemoteError) as raised:
                    await stream.collect_images()
            assert raised.value.code == code and words in raised.value.frame.message, (fields, raised.value.frame)
        # Fields a client in another language may get wrong: answered by the schema, as invalid_request.
        for bad in ({"n": 11}, {"prompt": 123}, {"prompt": ""}, {"size": "big"}, {"guidance_scale": "high"}):
            raw = image_request(bus).model_dump(mode="python") | bad
            stream = await open_stream(bus, raw["request_id"])
            raw["reply_to"] = stream.inbox
            await bus.js.publish(bus.names.work_subject(Stage.PROCESSOR), msgpack.packb(raw))
            with pytest.raises(RemoteError) as raised:
                await stream.collect_images()
            await stream.close()
            assert raised.value.code == ErrorCode.INVALID_REQUEST, bad
        images, _, _ = await generate(bus)
    assert opened(images[0]).size == (64, 64)


async def test_images_through_the_gateway_with_the_openai_sdk(bus: Bus, tmp_path: Path) -> None:
    async with running_workers(bus, specs(ImageStorage(tmp_path.as_uri())), model=MODEL, mode=ServingMode.IMAGE):
        async with serving(client_of(bus), GatewayOptions(host="127.0.0.1", port=0)) as port:
            sdk = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
            knobs = {"num_inference_steps": 2, "seed": 3}
            inline = await sdk.images.generate(model=MODEL, prompt="a lighthouse", n=2, size="64x64",
                                               response_format="b64_json", extra_body=knobs)
            linked = await sdk.images.generate(model=MODEL, prompt="a lighthouse", size="64x64",
                                               response_format="url", extra_body=knobs)
            with pytest.raises(openai.BadRequestError, match="multiples"):
                await sdk.images.generate(model=MODEL, prompt="x", size="100x100", extra_body=knobs)  # type: ignore[arg-type]
            with pytest.raises(openai.NotFoundError):
                await sdk.images.generate(model="no-such-model", prompt="x", extra_body=knobs)
            await sdk.close()
    assert inline.data is not None and len(inline.data) == 2
    assert [opened(base64.b64decode(item.b64_json or "")).size for item in inline.data] == [(64, 64)] * 2
    assert linked.data is not None and (linked.data[0].url or "").startswith("file://")
    opened(Path((linked.data[0].url or "").removeprefix("file://")).read_bytes())


async def test_conveyor_image_writes_a_png_through_worker_processes(bus: Bus, tmp_path: Path) -> None:
    url = bus.nats_settings.urls[0]
    out = tmp_path / "fox.png"
    async with worker_processes([url], bus.settings.namespace, ["processor", "image"], engine="torch"):
        done = await run_cli_when_served(url, bus.settings.namespace, "image", "a fox", "--out", str(out), "-n", "2",
                                         "--size", "64x64", "--steps", "3", "--seed", "9")
    assert done.returncode == 0, done.stderr.decode()
    written = [tmp_path / "fox-0.png", tmp_path / "fox-1.png"]
    assert done.stdout.decode().split() == [str(path) for path in written]
    assert [opened(path.read_bytes()).size for path in written] == [(64, 64)] * 2
    assert "step 3/3" in done.stderr.decode() and "seed 9" in done.stderr.decode()
