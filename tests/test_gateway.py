"""The OpenAI-compatible gateway, driven by the real `openai` SDK, over the real pipeline (mock engine)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import openai
import pytest

from bus.replies import _chunk_payload
from schemas.codec import unpack
from schemas.registry import Stage
from schemas.replies import REPLY_FRAME, ChatChunkDelta, Usage
from tests.conftest import Bus
from tests.helpers import wait_until
from tests.pipeline_helpers import MOCK, client_of, mock_decode, mock_processor, running_workers
from workers.gateway import GatewayOptions, _Shape, serving


@asynccontextmanager
async def gateway_over(bus: Bus, inter_token_s: float = 0.001) -> AsyncIterator[tuple[openai.AsyncOpenAI, str, object]]:
    decode = mock_decode(inter_token_s=inter_token_s)
    async with running_workers(bus, [(Stage.PROCESSOR, mock_processor()), (Stage.DECODE, decode)]):
        async with serving(client_of(bus), GatewayOptions(host="127.0.0.1", port=0, first_token_timeout_s=10)) as port:
            base = f"http://127.0.0.1:{port}"
            sdk = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
            yield sdk, base, decode
            await sdk.close()


async def test_streaming_chat_with_usage_through_the_openai_sdk(bus: Bus) -> None:
    async with gateway_over(bus) as (sdk, _, _):
        stream = await sdk.chat.completions.create(
            model=MOCK, messages=[{"role": "user", "content": "hello"}], max_tokens=6, stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content.strip() and chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert len({c.id for c in chunks}) == 1


async def test_whole_chat_and_completion_responses(bus: Bus) -> None:
    async with gateway_over(bus) as (sdk, _, _):
        chat = await sdk.chat.completions.create(model=MOCK, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        completion = await sdk.completions.create(model=MOCK, prompt="Once upon a time", max_tokens=5)
        streamed = [c async for c in await sdk.completions.create(model=MOCK, prompt=[5, 6, 7], max_tokens=3, stream=True)]
    assert chat.object == "chat.completion" and chat.choices[0].message.content
    assert chat.usage is not None and chat.usage.completion_tokens == 4
    assert completion.object == "text_completion" and completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 5
    assert "".join(c.choices[0].text for c in streamed).strip() and streamed[-1].choices[0].finish_reason == "length"


async def test_models_lists_only_ready_models(bus: Bus) -> None:
    async with gateway_over(bus) as (sdk, base, _):
        models = await sdk.models.list()
        async with aiohttp.ClientSession() as session, session.get(f"{base}/health") as health:
            assert health.status == 200 and (await health.json())["ready_models"] == [MOCK]
        async with aiohttp.ClientSession() as session, session.get(f"{base}/metrics") as metrics:
            assert metrics.status == 200 and "conveyor_event_loop_lag_seconds_bucket" in await metrics.text()
    assert [m.id for m in models.data] == [MOCK]


async def test_errors_come_back_with_the_status_codes_openai_clients_expect(bus: Bus) -> None:
    async with gateway_over(bus) as (sdk, _, _):
        with pytest.raises(openai.NotFoundError) as unknown:
            await sdk.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError) as bad_temperature:
            await sdk.chat.completions.create(model=MOCK, messages=[{"role": "user", "content": "hi"}], temperature=-1)
        with pytest.raises(openai.BadRequestError) as too_long:
            await sdk.completions.create(model=MOCK, prompt=list(range(3, 9000)), max_tokens=1)
        with pytest.raises(openai.BadRequestError) as empty:
            await sdk.completions.create(model=MOCK, prompt="", max_tokens=1)
    assert unknown.value.code == "model_not_found"
    assert "temperature" in str(bad_temperature.value)
    assert too_long.value.code == "context_length_exceeded"
    assert empty.value.code == "invalid_request"


async def test_client_disconnect_mid_stream_cancels_the_request(bus: Bus) -> None:
    async with gateway_over(bus, inter_token_s=0.05) as (_, base, decode):
        body = {"model": MOCK, "messages": [{"role": "user", "content": "go on forever"}], "max_tokens": 100000,
                "stream": True}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            async with session.post(f"{base}/v1/chat/completions", json=body) as response:
                assert response.status == 200 and response.headers["x-request-id"].startswith("chatcmpl-")
                await response.content.readline()
                assert decode.engine.load().running_requests == 1  # type: ignore[attr-defined]
        # The connection is closed: the gateway cancels, the decode engine frees the request.
        await wait_until(lambda: decode.engine.load().running_requests == 0, timeout_s=5)  # type: ignore[attr-defined]
        await asyncio.sleep(0)


async def test_a_stopping_gateway_cancels_the_streams_it_cuts(bus: Bus) -> None:
    decode = mock_decode(inter_token_s=0.05)
    body = {"model": MOCK, "messages": [{"role": "user", "content": "go on forever"}], "max_tokens": 100000,
            "stream": True}
    async with running_workers(bus, [(Stage.PROCESSOR, mock_processor()), (Stage.DECODE, decode)]), \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        first_line = asyncio.get_running_loop().create_future()

        async def read_until_cut(base: str) -> bytes:
            async with session.post(f"{base}/v1/chat/completions", json=body) as response:
                first_line.set_result(await response.content.readline())
                return await response.content.read()

        options = GatewayOptions(host="127.0.0.1", port=0, shutdown_grace_s=0.2)
        async with serving(client_of(bus), options) as port:
            reader = asyncio.create_task(read_until_cut(f"http://127.0.0.1:{port}"))
            assert (await first_line).startswith(b"data: ")
            assert decode.engine.load().running_requests == 1  # type: ignore[attr-defined]
            stop_started_s = time.monotonic()
        assert time.monotonic() - stop_started_s < 5  # the grace, not the stream's length
        # The gateway cut the open response on its way out and cancelled what it was streaming.
        await wait_until(lambda: decode.engine.load().running_requests == 0, timeout_s=5)  # type: ignore[attr-defined]
        await asyncio.gather(reader, return_exceptions=True)


@pytest.mark.parametrize("delta", [
    ChatChunkDelta(id="chatcmpl-1", created=7, model=MOCK, role="assistant", content="Hi"),
    ChatChunkDelta(id="chatcmpl-1", created=7, model=MOCK, content=" there \u00e9\"\\n"),
    ChatChunkDelta(id="chatcmpl-1", created=7, model=MOCK, finish_reason="length", usage=Usage.of(3, 2)),
], ids=["role", "content", "finish"])
def test_a_decode_workers_chat_chunk_goes_out_as_the_json_the_gateway_would_build(delta: ChatChunkDelta) -> None:
    frame = REPLY_FRAME.validate_python(unpack(_chunk_payload("chatcmpl-1", 3, {"token_ids": [5], "openai": delta})))
    built = frame.openai.model_dump(mode="json", exclude={"usage"}) | {"id": "chatcmpl-1"}
    sent = _Shape("chatcmpl-1", MOCK, chat=True).chunk(frame)
    # The same bytes, but for non-ASCII text, which goes out as UTF-8 instead of \u escapes (the same JSON).
    assert sent == json.dumps(built, separators=(",", ":"), ensure_ascii=False).encode()


async def test_a_request_after_a_quiet_spell_does_not_wait_for_the_gateways_registry_read(bus: Bus) -> None:
    from workers.gateway import Gateway

    async with running_workers(bus, [(Stage.PROCESSOR, mock_processor()), (Stage.DECODE, mock_decode())]):
        gateway = Gateway(client_of(bus), GatewayOptions(host="127.0.0.1", port=0))
        await gateway._require_model(MOCK)
        await asyncio.sleep(1.5)  # longer than the view's refresh age: before, the next request read the registry
        reads = 0

        async def unreachable_registry() -> list[object]:
            nonlocal reads
            reads += 1
            raise ConnectionError("the registry is slow or away")

        gateway._view._read = unreachable_registry  # type: ignore[assignment]
        await gateway._require_model(MOCK)  # served from the view it has; the read goes on in the background
        await asyncio.sleep(0.05)
        assert reads == 1
