"""Images through processor → encode → prefill → decode on the torch engine: the three topologies agree
token for token, rows go over NIXL, the cache and the prefix cache key on image content, and every
class of bad media is a typed error frame from a worker that keeps serving."""

from __future__ import annotations

import asyncio
import base64
import io
from pathlib import Path

import openai
import pytest
import torch
from aiohttp import web
from PIL import Image

from bus.client import PipelineClient
from bus.errors import RemoteError
from schemas.client import ChatMessage, ImagePart, MediaUrl, TextPart, VideoPart
from schemas.codec import WIRE_VERSION
from schemas.codec import encode as encode_wire
from schemas.registry import ServingMode, Stage, WorkerCard
from schemas.replies import ErrorCode, FinalFrame, FinishReason
from schemas.tasks import MediaItem
from tests.conftest import Bus
from tests.helpers import metric, wait_until, wait_until_async
from tests.pipeline_helpers import client_of, running_workers, worker_processes
from workers.decode import DecodeStage
from workers.engines.factory import EngineKind
from schemas.sampling import SamplingOptions, StopConditions
from workers.engines.protocol import DisaggregationRole, GenerateRequest, UnsupportedOption
from workers.engines.torch_engine.engine import TorchEngine, TorchEngineConfig
from workers.engines.torch_engine.loader import DEFAULT_MODEL
from workers.gateway import GatewayOptions, serving
from workers.media import MediaError, MediaLimits
from workers.prefill import PrefillStage
from workers.processor import ProcessorStage
from workers.stages import _encode_stage, _image_inputs, _media_encoder, served_model


def png(color: tuple[int, int, int], size: tuple[int, int] = (64, 48)) -> bytes:
    buffer = io.BytesIO()
    image = Image.new("RGB", size, color)
    for x in range(0, size[0], 8):  # some structure, so the tower sees more than a flat colour
        image.putpixel((x, x % size[1]), (255 - color[0], 0, 255 - color[2]))
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(content: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64,{base64.b64encode(content).decode()}"


RED, BLUE = data_url(png((220, 20, 20))), data_url(png((20, 20, 220)))


def processor() -> ProcessorStage:
    return ProcessorStage({DEFAULT_MODEL: served_model(EngineKind.TORCH, DEFAULT_MODEL)})


def llm(role: DisaggregationRole = DisaggregationRole.NONE) -> TorchEngine:
    return TorchEngine(TorchEngineConfig(role=role, max_step_tokens=128))


def epd() -> list:  # type: ignore[type-arg]
    return [(Stage.PROCESSOR, processor()),
            (Stage.DECODE, DecodeStage(llm(), DEFAULT_MODEL, _image_inputs(EngineKind.TORCH, DEFAULT_MODEL, Stage.DECODE)))]


def e_pd() -> list:  # type: ignore[type-arg]
    return [(Stage.PROCESSOR, processor()), (Stage.ENCODE, _encode_stage(EngineKind.TORCH, DEFAULT_MODEL)),
            (Stage.DECODE, DecodeStage(llm(), DEFAULT_MODEL, _image_inputs(EngineKind.TORCH, DEFAULT_MODEL, Stage.DECODE)))]


def e_p_d() -> list:  # type: ignore[type-arg]
    return [(Stage.PROCESSOR, processor()), (Stage.ENCODE, _encode_stage(EngineKind.TORCH, DEFAULT_MODEL)),
            (Stage.PREFILL, PrefillStage(llm(DisaggregationRole.PREFILL), DEFAULT_MODEL,
                                         _image_inputs(EngineKind.TORCH, DEFAULT_MODEL, Stage.PREFILL))),
            (Stage.DECODE, DecodeStage(llm(DisaggregationRole.DECODE), DEFAULT_MODEL))]


def image_chat(client, images: list[str], text: str = "Describe the picture.", **fields: object):  # type: ignore[no-untyped-def]
    from tests.pipeline_helpers import chat

    request = chat(client, "x", model=DEFAULT_MODEL, temperature=0.0, max_tokens=12, **fields)
    parts: list = [TextPart(text=text)] + [ImagePart(image_url=MediaUrl(url=url)) for url in images]  # type: ignore[type-arg]
    return request.model_copy(update={"messages": [ChatMessage(role="user", content=parts)]})


async def ask(bus: Bus, images: list[str], text: str = "Describe the picture.") -> tuple[list[int], FinalFrame]:
    client = client_of(bus)
    async with await client.submit(image_chat(client, images, text), first_frame_timeout_s=60) as stream:
        chunks, final = await stream.collect()
    assert isinstance(final, FinalFrame), final
    return [t for c in chunks for t in c.token_ids], final


async def test_epd_e_pd_and_e_p_d_give_the_same_greedy_tokens(bus: Bus) -> None:
    answers = {}
    for name, specs, mode in [("EPD", epd(), ServingMode.AGGREGATED), ("E/PD", e_pd(), ServingMode.ENCODE_AGGREGATED),
                              ("E/P/D", e_p_d(), ServingMode.ENCODE_DISAGGREGATED)]:
        async with running_workers(bus, specs, model=DEFAULT_MODEL, mode=mode):
            answers[name] = [await ask(bus, [RED]), await ask(bus, [RED, BLUE], "Compare the two pictures.")]
    reference = answers["EPD"]
    for name, got in answers.items():
        for (tokens, final), (ref_tokens, ref_final) in zip(got, reference, strict=True):
            assert tokens == ref_tokens, name
            assert final.usage.prompt_tokens == ref_final.usage.prompt_tokens, name
    # 16 rows per image stand in for each image's one placeholder.
    assert reference[1][1].usage.prompt_tokens - reference[0][1].usage.prompt_tokens >= 16


async def test_the_same_image_hits_both_caches_and_a_different_image_shares_no_image_block(bus: Bus) -> None:
    specs = e_pd()
    encode = specs[1][1]
    async with running_workers(bus, specs, model=DEFAULT_MODEL, mode=ServingMode.ENCODE_AGGREGATED):
        hits_before = metric("conveyor_media_cache_total", result="hit")
        reads_before = metric("conveyor_embedding_handoffs_total", outcome="read")
        _, first = await ask(bus, [RED])
        _, blue = await ask(bus, [BLUE])
        _, again = await ask(bus, [RED])
        # The encode worker acked at each handoff; the LLM worker's reads are what free the rows.
        await wait_until(lambda: encode._exporter is not None and encode._exporter.pending == 0, timeout_s=5)
    assert metric("conveyor_embedding_handoffs_total", outcome="read") - reads_before == 3
    assert metric("conveyor_media_cache_total", result="hit") - hits_before == 1
    # The prompt is template + text, 16 image tokens, template: the repeated image's blocks are served
    # from the prefix cache; a different image's are not (its pad ids, hence its block keys, differ).
    image_end = first.usage.prompt_tokens - 5
    assert again.usage.cached_tokens >= (image_end // 16) * 16 > blue.usage.cached_tokens


async def test_image_rows_reach_the_model_and_change_its_answer() -> None:
    encoder = _media_encoder(EngineKind.TORCH, DEFAULT_MODEL)
    engine = llm()
    await engine.start()
    try:
        prompt = engine.tokenizer.encode("Describe the picture:")
        answers = []
        for index, url in enumerate([RED, BLUE, RED]):
            item = MediaItem(modality="image", source=MediaUrl(url=url))
            encoded = await encoder.encode(prompt + [encoder.placeholder_id] + prompt, [item])  # type: ignore[union-attr]
            request = GenerateRequest(f"r{index}", encoded.token_ids, SamplingOptions(temperature=0.0),
                                      StopConditions(max_tokens=8), image_rows=encoded.rows)
            answers.append([t async for output in engine.generate(request) for t in output.token_ids])
        with pytest.raises(UnsupportedOption, match="image embedding rows"):
            bad = GenerateRequest("bad", encoded.token_ids, SamplingOptions(temperature=0.0), StopConditions(max_tokens=2))
            [_ async for _ in engine.generate(bad)]
    finally:
        await engine.shutdown()
    assert answers[0] != answers[1] and answers[0] == answers[2]


async def test_image_requests_stream_through_the_gateway_with_the_openai_sdk(bus: Bus, tmp_path: Path) -> None:
    picture = tmp_path / "green.png"
    picture.write_bytes(png((20, 200, 20)))
    async with running_workers(bus, e_pd(), model=DEFAULT_MODEL, mode=ServingMode.ENCODE_AGGREGATED):
        async with serving(client_of(bus), GatewayOptions(host="127.0.0.1", port=0, first_token_timeout_s=60)) as port:
            sdk = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
            content = [{"type": "text", "text": "What is in these images?"},
                       {"type": "image_url", "image_url": {"url": RED}},
                       {"type": "image_url", "image_url": {"url": picture.as_uri()}}]
            stream = await sdk.chat.completions.create(model=DEFAULT_MODEL, max_tokens=8, temperature=0.0, stream=True,
                                                       messages=[{"role": "user", "content": content}])
            chunks = [chunk async for chunk in stream]
            with pytest.raises(openai.BadRequestError):
                await sdk.chat.completions.create(model=DEFAULT_MODEL, max_tokens=4, messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": data_url(b"not an image")}}]}])
            await sdk.close()
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


@pytest.fixture
async def image_server() -> str:  # type: ignore[misc]
    """A local HTTP server with a good image, a missing one and one that never answers."""

    async def red(_: web.Request) -> web.Response:
        return web.Response(body=png((220, 20, 20)), content_type="image/png")

    released = asyncio.Event()

    async def slow(_: web.Request) -> web.Response:
        # Answers only once the test is over: a fetch times out first, and the server's clean-up, which waits for
        # every handler in flight, does not wait out a sleep.
        await released.wait()
        return web.Response(body=b"")

    app = web.Application()
    app.add_routes([web.get("/red.png", red), web.get("/slow.png", slow)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}"
    released.set()
    await runner.cleanup()


def _bomb() -> bytes:
    """A PNG whose header claims 20000 × 20000 pixels but which compresses to a few hundred KB."""
    buffer = io.BytesIO()
    Image.new("1", (20000, 20000)).save(buffer, format="PNG")
    return buffer.getvalue()


async def test_every_class_of_bad_media_gets_a_typed_error_and_the_pipeline_keeps_serving(
    bus: Bus, image_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CONVEYOR_MEDIA_FETCH_TIMEOUT_S", "1")
    monkeypatch.setenv("CONVEYOR_MEDIA_MAX_IMAGE_BYTES", str(2 << 20))
    monkeypatch.setenv("CONVEYOR_MEDIA_MAX_IMAGES", "4")
    truncated = png((1, 2, 3))[:60]
    big = tmp_path / "big.bmp"
    Image.new("RGB", (1200, 1200)).save(big, format="BMP")  # 4.3 MB > the 2 MB limit set above
    cases = {
        "not an image": ([data_url(b"hello, world")], ErrorCode.INVALID_REQUEST, "not a decodable image"),
        "truncated": ([data_url(truncated)], ErrorCode.INVALID_REQUEST, "not a decodable image"),
        "too large": ([big.as_uri()], ErrorCode.INVALID_REQUEST, "at most"),
        "bomb": ([data_url(_bomb())], ErrorCode.INVALID_REQUEST, "pixels"),
        "unreachable": ([f"{image_server}/slow.png"], ErrorCode.INVALID_REQUEST, "timed out"),
        "missing file": ([(tmp_path / "nope.png").as_uri()], ErrorCode.INVALID_REQUEST, "cannot read"),
        "refused port": (["http://127.0.0.1:9/x.png"], ErrorCode.INVALID_REQUEST, "cannot fetch"),
        "too many": ([RED] * 5, ErrorCode.INVALID_REQUEST, "at most 4"),
        "bad scheme": (["ftp://example/x.png"], ErrorCode.INVALID_REQUEST, "scheme"),
    }
    async with running_workers(bus, e_pd(), model=DEFAULT_MODEL, mode=ServingMode.ENCODE_AGGREGATED):
        client = client_of(bus)
        for name, (urls, code, words) in cases.items():
            with pytest.raises(RemoteError) as raised:
                async with await client.submit(image_chat(client, urls), first_frame_timeout_s=30) as stream:
                    await stream.collect()
            assert raised.value.code == code and words in raised.value.frame.message, (name, raised.value.frame.message)
        video = image_chat(client, [])
        video = video.model_copy(update={"messages": [ChatMessage(role="user", content=[
            VideoPart(video_url=MediaUrl(url=(tmp_path / "clip.mp4").as_uri()))])]})
        with pytest.raises(RemoteError) as raised:
            async with await client.submit(video, first_frame_timeout_s=30) as stream:
                await stream.collect()
        assert raised.value.code == ErrorCode.UNSUPPORTED and "sampled frames as image parts" in raised.value.frame.message
        # Fetched over http, and the workers still serve.
        tokens, final = await ask(bus, [f"{image_server}/red.png"])
        assert tokens and final.finish_reason == FinishReason.LENGTH


async def test_text_only_pipeline_refuses_images_clearly(bus: Bus) -> None:
    from tests.pipeline_helpers import MOCK, mock_decode, mock_processor

    async with running_workers(bus, [(Stage.PROCESSOR, mock_processor()), (Stage.DECODE, mock_decode())]):
        client = client_of(bus)
        request = image_chat(client, [RED]).model_copy(update={"model": MOCK})
        with pytest.raises(RemoteError) as raised:
            async with await client.submit(request, first_frame_timeout_s=30) as stream:
                await stream.collect()
    assert raised.value.code == ErrorCode.UNSUPPORTED


async def test_encode_slot_takes_the_next_request_before_the_rows_are_read_and_cancel_frees_them(bus: Bus) -> None:
    encode = _encode_stage(EngineKind.TORCH, DEFAULT_MODEL)
    specs = [(Stage.PROCESSOR, processor()), (Stage.ENCODE, encode)]
    # One slot, and no LLM worker ever reads: the second request is encoded only if the first one's slot
    # was freed at its handoff.
    async with running_workers(bus, specs, model=DEFAULT_MODEL, mode=ServingMode.ENCODE_AGGREGATED, max_concurrency=1):
        await register_absent_decode(bus)
        await asyncio.sleep(1.1)  # the processor's view of the registry refreshes every second
        client = client_of(bus)
        first, second = image_chat(client, [BLUE]), image_chat(client, [RED])
        cancelled_before = metric("conveyor_embedding_handoffs_total", outcome="cancelled")
        async with await client.submit(first, first_frame_timeout_s=30), \
                await client.submit(second, first_frame_timeout_s=30):
            assert encode._exporter is not None
            exporter = encode._exporter
            await wait_until(lambda: exporter.pending == 2, timeout_s=20)
            await client.cancel(first.request_id)
            await wait_until(lambda: exporter.pending == 1, timeout_s=1)
            await client.cancel(second.request_id)
            await wait_until(lambda: exporter.pending == 0, timeout_s=1)
    assert metric("conveyor_embedding_handoffs_total", outcome="cancelled") == cancelled_before + 2


async def test_placeholders_must_match_the_images() -> None:
    encoder = _media_encoder(EngineKind.TORCH, DEFAULT_MODEL)
    assert encoder is not None
    item = MediaItem(modality="image", source=MediaUrl(url=RED))
    with pytest.raises(MediaError, match="1 image placeholders for 2 images"):
        await encoder.encode([1, encoder.placeholder_id, 2], [item, item])
    encoded = await encoder.encode([1, encoder.placeholder_id, 2, encoder.placeholder_id], [item, item])
    assert encoded.rows.shape == (32, 576) and len(encoded.token_ids) == 2 + 32
    assert torch.equal(encoded.rows[:16], encoded.rows[16:])  # the same image, from the cache
    assert MediaLimits().max_images == 16


async def test_images_survive_their_encode_worker_dying_after_the_handoff(bus: Bus) -> None:
    # The encode worker is a process of its own, so that it can die for real: SIGKILL once its rows are
    # offered and the decode task is queued, before any LLM worker read them.
    async with worker_processes(bus.nats_settings.urls, bus.names.namespace, ["encode"], engine="torch",
                                CONVEYOR_MODEL=DEFAULT_MODEL, CONVEYOR_MODE="encode-aggregated") as [encode_process]:
        async with running_workers(bus, [(Stage.PROCESSOR, processor())], model=DEFAULT_MODEL,
                                   mode=ServingMode.ENCODE_AGGREGATED):
            client = client_of(bus)
            await register_absent_decode(bus)
            await wait_until_async(lambda: stage_is_ready(client, Stage.ENCODE), timeout_s=90)
            before = metric("conveyor_migrations_total", stage="encode", outcome="encoded_by_llm_worker")
            async with await client.submit(image_chat(client, [BLUE]), first_frame_timeout_s=120) as stream:
                await wait_until_async(lambda: queued(bus, Stage.DECODE), timeout_s=60)
                encode_process.kill()
                encode_process.wait()
                decode = DecodeStage(llm(), DEFAULT_MODEL, _image_inputs(EngineKind.TORCH, DEFAULT_MODEL, Stage.DECODE))
                async with running_workers(bus, [(Stage.DECODE, decode)], model=DEFAULT_MODEL,
                                           mode=ServingMode.ENCODE_AGGREGATED):
                    chunks, final = await stream.collect()
    assert isinstance(final, FinalFrame) and final.finish_reason == FinishReason.LENGTH
    assert sum(len(chunk.token_ids) for chunk in chunks) == final.usage.completion_tokens == 12
    assert metric("conveyor_migrations_total", stage="encode", outcome="encoded_by_llm_worker") == before + 1


async def register_absent_decode(bus: Bus) -> None:
    """A decode card with no worker behind it: the processor routes, nobody pulls, the rows wait."""
    card = WorkerCard(worker_id="absent-decode", stage=Stage.DECODE, model=DEFAULT_MODEL,
                      mode=ServingMode.ENCODE_AGGREGATED, engine="torch", host="h", pid=1, started_at_s=0.0,
                      ready=True, wire_version=WIRE_VERSION)
    await bus.registry.put(card.worker_id, encode_wire(card))


async def stage_is_ready(client: PipelineClient, stage: Stage) -> bool:
    return any(card.stage == stage and card.ready for card in await client.live_workers())


async def queued(bus: Bus, stage: Stage) -> bool:
    return (await bus.js.stream_info(bus.names.work_stream(stage))).state.messages > 0

