"""The text pipeline end to end: real nats-server, real stage workers, mock engine where timing
matters and the torch engine where output must be real."""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
from nats.js.api import AckPolicy, ConsumerConfig

from bus.client import PipelineClient
from bus.errors import RemoteError, RequestIdInUse
from bus.registry import live_workers, ready_models
from schemas.client import ChatMessage, ImagePart, MediaUrl, StreamFormat
from schemas.codec import decode
from schemas.kv_events import BlockStored, KvEventBatch
from schemas.registry import ServingMode, Stage, WorkerCard
from schemas.replies import ErrorCode, FinalFrame, FinishReason
from schemas.kv_hashing import chain_hashes
from tests.conftest import Bus, bus_settings
from tests.helpers import metric, open_stream, stream_len, wait_until
from tests.pipeline_helpers import (
    MOCK,
    ask_to_the_end,
    chat,
    client_of,
    completion,
    mock_decode,
    mock_processor,
    running_workers,
)
from workers.runtime import WorkerOptions, WorkerRuntime, run_in_own_process

REPO_ROOT = Path(__file__).resolve().parents[1]


async def test_chat_request_streams_text_and_ends_with_usage(bus: Bus) -> None:
    async with running_workers(bus, [(Stage.PROCESSOR, mock_processor()), (Stage.DECODE, mock_decode(inter_token_s=0.001))]):
        client = client_of(bus)
        request = chat(client, "hello", max_tokens=5)
        async with await client.submit(request) as stream:
            chunks, final = await stream.collect()
    assert isinstance(final, FinalFrame) and final.finish_reason == FinishReason.LENGTH
    assert sum(len(c.token_ids) for c in chunks) == 5 and all(c.text for c in chunks)
    assert final.usage.completion_tokens == 5 and final.usage.total_tokens == final.usage.prompt_tokens + 5


async def test_frames_of_several_tokens_count_each_tokens_own_gap_as_inter_token_latency(bus: Bus) -> None:
    # An engine sending 4 tokens a frame (SGLang's stream interval), a token every 20 ms: each frame comes ~80 ms after
    # the last, and the worker's inter-token latency must still read ~20 ms a token.
    itl_sum, itl_count = "conveyor_inter_token_latency_seconds_sum", "conveyor_inter_token_latency_seconds_count"
    sum_before, count_before = metric(itl_sum, model=MOCK), metric(itl_count, model=MOCK)
    decode = mock_decode(inter_token_s=0.02, stream_interval=4)
    async with running_workers(bus, [(Stage.PROCESSOR, mock_processor()), (Stage.DECODE, decode)]):
        final = await ask_to_the_end(client_of(bus), max_tokens=13)
    assert final.usage.completion_tokens == 13
    observed = metric(itl_count, model=MOCK) - count_before
    assert observed == 3  # the frames after the first: tokens 2-5, 6-9 and 10-13
    assert 0.015 <= (metric(itl_sum, model=MOCK) - sum_before) / observed < 0.05


async def test_openai_stream_format_sends_chat_completion_chunks(bus: Bus) -> None:
    async with running_workers(bus, [(Stage.PROCESSOR, mock_processor()), (Stage.DECODE, mock_decode(inter_token_s=0.001))]):
        client = client_of(bus)
        request = chat(client, "hello", max_tokens=4).model_copy(update={"stream_format": StreamFormat.OPENAI})
        async with await client.submit(request) as stream:
            chunks, final = await stream.collect()
    shapes = [c.openai for c in chunks]
    assert all(s is not None and s.object == "chat.completion.chunk" and s.id == request.request_id for s in shapes)
    assert shapes[0].choices[0].delta.role == "assistant" and shapes[1].choices[0].delta.role is None
    assert shapes[-1].choices[0].finish_reason == "length" and shapes[-1].usage == final.usage
    assert "".join(s.choices[0].delta.content or "" for s in shapes) == "".join(c.text or "" for c in chunks)


async def expect_error(bus: Bus, request: object) -> RemoteError:
    client = client_of(bus)
    async with await client.submit(request, first_frame_timeout_s=10) as stream:  # type: ignore[arg-type]
        with pytest.raises(RemoteError) as raised:
            await stream.collect()
    return raised.value


async def test_every_bad_input_gets_its_error_frame_and_the_pipeline_keeps_serving(bus: Bus) -> None:
    async with running_workers(bus, [(Stage.PROCESSOR, mock_processor()), (Stage.DECODE, mock_decode(inter_token_s=0.001))]):
        client = client_of(bus)
        assert (await expect_error(bus, chat(client, "hi", model="no-such-model"))).code == ErrorCode.UNKNOWN_MODEL
        assert (await expect_error(bus, completion(client, ""))).code == ErrorCode.INVALID_REQUEST
        assert (await expect_error(bus, chat(client, "   "))).code == ErrorCode.INVALID_REQUEST
        too_long = await expect_error(bus, completion(client, list(range(3, 9000))))
        assert too_long.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED and "8192" in too_long.frame.message
        outside = await expect_error(bus, completion(client, [5, 32000]))
        assert outside.code == ErrorCode.INVALID_REQUEST and "outside the vocabulary" in outside.frame.message
        # A request id in use: refused when submitted, and told (not dropped) when published raw without a Msg-Id.
        first = chat(client, "first", max_tokens=2)
        async with await client.submit(first) as first_stream:
            await first_stream.collect()
        with pytest.raises(RequestIdInUse):
            await client.submit(first)
        reuse = first.model_dump(mode="python", exclude_none=True)
        reuse_stream = await open_stream(bus, first.request_id)
        reuse["reply_to"] = reuse_stream.inbox
        await bus.js.publish(bus.names.work_subject(Stage.PROCESSOR), msgpack.packb(reuse))
        with pytest.raises(RemoteError) as reused:
            await reuse_stream.collect()
        assert reused.value.code == ErrorCode.INVALID_REQUEST and "in use" in reused.value.frame.message
        # Fields valid one by one that do not fit together: refused at once, not retried.
        clash = await expect_error(bus, chat(client, "hi", max_tokens=2, min_tokens=5))
        assert clash.code == ErrorCode.INVALID_REQUEST and "min_tokens" in clash.frame.message
        image = chat(client, "x").model_copy(update={"messages": [
            ChatMessage(role="user", content=[ImagePart(image_url=MediaUrl(url="http://x/cat.png"))])]})
        assert (await expect_error(bus, image)).code == ErrorCode.UNSUPPORTED
        # Out-of-range sampling values, as a client in another language might send them.
        raw = chat(client, "hi").model_dump(mode="python", exclude_none=True) | {"temperature": -3}
        bad_stream = await open_stream(bus, raw["request_id"])
        raw["reply_to"] = bad_stream.inbox
        await bus.js.publish(bus.names.work_subject(Stage.PROCESSOR), msgpack.packb(raw))
        with pytest.raises(RemoteError) as raised:
            await bad_stream.collect()
        assert raised.value.code == ErrorCode.INVALID_REQUEST and "temperature" in raised.value.frame.message
        async with await client.submit(chat(client, "still there?", max_tokens=3)) as stream:
            _, final = await stream.collect()
        assert isinstance(final, FinalFrame) and final.finish_reason == FinishReason.LENGTH


async def test_request_with_no_worker_for_its_stage_is_refused_at_once(bus: Bus) -> None:
    async with running_workers(bus, [(Stage.PROCESSOR, mock_processor())]):
        error = await expect_error(bus, chat(client_of(bus), "hi"))
    assert error.code == ErrorCode.UNKNOWN_MODEL and "no ready decode worker" in error.frame.message


async def test_cancel_during_decode_reaches_the_client_fast_and_frees_the_engine(bus: Bus) -> None:
    decode = mock_decode(inter_token_s=0.05)
    async with running_workers(bus, [(Stage.PROCESSOR, mock_processor()), (Stage.DECODE, decode)]):
        client = client_of(bus)
        request = chat(client, "tell me everything", max_tokens=1000)
        async with await client.submit(request) as stream:
            chunks = stream.__aiter__()
            await chunks.__anext__()
            sent_at = time.monotonic()
            await client.cancel(request.request_id)
            async for _ in chunks:
                pass
            latency_s = time.monotonic() - sent_at
        assert isinstance(stream.terminal, FinalFrame) and stream.terminal.finish_reason == FinishReason.CANCELLED
        assert latency_s < 0.1
        engine = decode.engine
        await wait_until(lambda: engine.load().kv_used_blocks == 0 and engine.load().running_requests == 0)


async def test_cancel_of_a_request_queued_before_the_processor_drops_it(bus: Bus) -> None:
    decode = mock_decode(inter_token_s=0.001)
    client = client_of(bus)
    request = chat(client, "never mind")
    async with running_workers(bus, [(Stage.DECODE, decode)]):
        stream = await client.submit(request)
        await client.cancel(request.request_id)
        async with running_workers(bus, [(Stage.PROCESSOR, mock_processor())]):
            async with stream:
                chunks, final = await stream.collect()
    assert chunks == [] and isinstance(final, FinalFrame) and final.finish_reason == FinishReason.CANCELLED
    assert decode.engine.seen == []


async def test_cancel_of_a_request_queued_before_decode_drops_it_when_pulled(bus: Bus) -> None:
    decode = mock_decode(inter_token_s=0.02)
    async with running_workers(bus, [(Stage.PROCESSOR, mock_processor()), (Stage.DECODE, decode)], max_concurrency=1):
        client = client_of(bus)
        busy, queued = chat(client, "first", max_tokens=1000), chat(client, "second", max_tokens=5)
        busy_stream = await client.submit(busy)
        await busy_stream.__aiter__().__anext__()  # the only decode slot is taken
        queued_stream = await client.submit(queued)
        await asyncio.sleep(0.2)  # routed by the processor, waiting in the decode queue
        await client.cancel(queued.request_id)
        await client.cancel(busy.request_id)  # frees the slot: the queued task is pulled and dropped
        sent_at = time.monotonic()
        async with queued_stream:
            chunks, final = await queued_stream.collect()
        assert chunks == [] and isinstance(final, FinalFrame) and final.finish_reason == FinishReason.CANCELLED
        assert time.monotonic() - sent_at < 0.5
        assert queued.request_id not in decode.engine.seen
        await busy_stream.close()


async def test_two_replicas_of_each_stage_share_the_work(bus: Bus) -> None:
    first, second = mock_decode(inter_token_s=0.01), mock_decode(inter_token_s=0.01)
    specs = [(Stage.PROCESSOR, mock_processor()), (Stage.PROCESSOR, mock_processor()), (Stage.DECODE, first),
             (Stage.DECODE, second)]
    async with running_workers(bus, specs, max_concurrency=2):
        client = client_of(bus)
        requests = [chat(client, f"question {i}", max_tokens=5) for i in range(16)]
        streams = [await client.submit(request) for request in requests]
        finals = []
        for stream in streams:
            async with stream:
                finals.append((await stream.collect())[1])
    assert all(isinstance(f, FinalFrame) and f.finish_reason == FinishReason.LENGTH for f in finals)
    assert first.engine.seen and second.engine.seen
    assert sorted(first.engine.seen + second.engine.seen) == sorted(r.request_id for r in requests)


async def test_kv_events_of_a_request_name_the_blocks_the_engine_stored(bus: Bus) -> None:
    async with running_workers(bus, [(Stage.PROCESSOR, mock_processor()), (Stage.DECODE, mock_decode(inter_token_s=0.001))]) as workers:
        client = client_of(bus)
        prompt = list(range(100, 164))  # four full blocks
        async with await client.submit(completion(client, prompt, max_tokens=2)) as stream:
            await stream.collect()
        decode_worker_id = workers[1].runtime.options.worker_id
        subscription = await bus.js.pull_subscribe(bus.names.kv_events_subject(decode_worker_id),
                                                   stream=bus.names.kv_events_stream,
                                                   config=ConsumerConfig(ack_policy=AckPolicy.NONE))
        batches = [decode(m.data, KvEventBatch) for m in await subscription.fetch(batch=10, timeout=2)]
    stored = [h for b in batches for e in b.events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored == chain_hashes(prompt, 16)
    assert [b.seq for b in batches] == list(range(len(batches)))


async def test_a_worker_with_kv_events_off_serves_and_publishes_none(bus: Bus) -> None:
    async with running_workers(bus, [(Stage.PROCESSOR, mock_processor()), (Stage.DECODE, mock_decode(inter_token_s=0.001))],
                               kv_events=False) as workers:
        client = client_of(bus)
        async with await client.submit(completion(client, list(range(100, 164)), max_tokens=2)) as stream:
            _, final = await stream.collect()
        await asyncio.sleep(0.1)  # past the relay's window, were it running
        stream_info = await bus.js.stream_info(bus.names.kv_events_stream)
    assert isinstance(final, FinalFrame) and final.usage.completion_tokens == 2
    assert workers[1].runtime.options.kv_events is False
    assert stream_info.state.messages == 0


async def test_kv_event_batches_arriving_together_are_published_as_one_message(bus: Bus) -> None:
    # Eight prompts 25 ms apart: the engine emits a batch per prompt; within the relay's 300 ms window they go as
    # one or two messages (without it, one each).
    prompts = [list(range(1000 * k, 1000 * k + 32)) for k in range(1, 9)]
    async with running_workers(bus, [(Stage.PROCESSOR, mock_processor()), (Stage.DECODE, mock_decode())],
                               kv_events_interval_s=0.3) as workers:
        client = client_of(bus)
        streams = []
        for prompt in prompts:
            streams.append(await client.submit(completion(client, prompt, max_tokens=1)))
            await asyncio.sleep(0.025)
        for stream in streams:
            async with stream:
                await stream.collect()
        await asyncio.sleep(0.5)  # past the window
        subscription = await bus.js.pull_subscribe(bus.names.kv_events_subject(workers[1].runtime.options.worker_id),
                                                   stream=bus.names.kv_events_stream,
                                                   config=ConsumerConfig(ack_policy=AckPolicy.NONE))
        batches = [decode(m.data, KvEventBatch) for m in await subscription.fetch(batch=100, timeout=2)]
    stored = [tuple(e.block_hashes) for b in batches for e in b.events if isinstance(e, BlockStored)]
    assert sorted(stored) == sorted(tuple(chain_hashes(prompt, 16)) for prompt in prompts)
    assert len(batches) <= 2
    assert [b.seq for b in batches] == list(range(len(batches)))


@pytest.mark.parametrize("freeze_gc", [True, False])
async def test_a_worker_in_its_own_process_takes_its_startup_objects_out_of_the_collector_once_ready(
        bus: Bus, freeze_gc: bool) -> None:
    options = WorkerOptions(stage=Stage.DECODE, model=MOCK, mode=ServingMode.AGGREGATED, engine_name="test",
                            http_host="127.0.0.1", canary_wait_s=3600, handle_signals=False)
    runtime = WorkerRuntime(mock_decode(), options, bus.nats_settings, bus.settings)
    gc.unfreeze()
    serving = asyncio.create_task(run_in_own_process(runtime, freeze_gc))
    try:
        await asyncio.wait_for(runtime.started.wait(), timeout=60)
        await asyncio.sleep(0.2)
        frozen = gc.get_freeze_count()
        assert (frozen > 10_000) if freeze_gc else frozen == 0
        async with running_workers(bus, [(Stage.PROCESSOR, mock_processor())]):
            client = client_of(bus)
            async with await client.submit(completion(client, [1, 2, 3], max_tokens=3)) as stream:
                chunks, final = await stream.collect()
        assert isinstance(final, FinalFrame) and sum(len(c.token_ids) for c in chunks) == 3
    finally:
        runtime.request_stop()
        await asyncio.wait_for(serving, timeout=30)
        gc.unfreeze()


async def test_a_request_after_a_quiet_spell_is_routed_without_waiting_for_a_registry_read(bus: Bus) -> None:
    processor = mock_processor()
    async with running_workers(bus, [(Stage.PROCESSOR, processor), (Stage.DECODE, mock_decode())]):
        client = client_of(bus)
        await ask_to_the_end(client, max_tokens=2)
        # Quiet for longer than the view's stale limit (the registry TTL): before the watch, the next request waited
        # for a registry read.
        await asyncio.sleep(bus.settings.registry_ttl_s + 0.5)
        assert processor._view is not None
        read = processor._view._read
        reads: list[float] = []

        async def slow_read() -> list[WorkerCard]:
            reads.append(time.monotonic())
            await asyncio.sleep(5.0)
            return await read()

        processor._view._read = slow_read
        started_s = time.monotonic()
        await ask_to_the_end(client, max_tokens=2)
        assert time.monotonic() - started_s < 2.5, "the request waited for the registry read"
        assert reads == [], "the request's routing read the registry: the watched cards were not used"


async def test_registry_lists_ready_workers_and_forgets_them_on_shutdown(bus: Bus) -> None:
    async with running_workers(bus, [(Stage.PROCESSOR, mock_processor()), (Stage.DECODE, mock_decode())]) as workers:
        cards = await live_workers(bus.registry)
        assert {c.stage for c in cards} == {Stage.PROCESSOR, Stage.DECODE} and all(c.ready for c in cards)
        assert ready_models(cards) == {MOCK: ServingMode.AGGREGATED}
        decode_card = next(c for c in cards if c.stage == Stage.DECODE)
        assert decode_card.kv is not None and decode_card.metrics_url
        import aiohttp

        async with aiohttp.ClientSession() as session:
            async with session.get(decode_card.metrics_url.replace("/metrics", "/ready")) as ready:
                assert ready.status == 200
        del workers
    assert await live_workers(bus.registry) == []


async def test_sigterm_lets_in_flight_work_finish_before_exiting(bus: Bus) -> None:
    async with running_workers(bus, [(Stage.PROCESSOR, mock_processor()), (Stage.DECODE, mock_decode(inter_token_s=0.02))],
                               grace_s=10) as workers:
        client = client_of(bus)
        async with await client.submit(chat(client, "finish me", max_tokens=40)) as stream:
            chunks = stream.__aiter__()
            await chunks.__anext__()
            workers[1].runtime.request_stop()  # what SIGTERM does
            async for _ in chunks:
                pass
        assert isinstance(stream.terminal, FinalFrame) and stream.terminal.finish_reason == FinishReason.LENGTH
        await asyncio.wait_for(workers[1].task, timeout=10)
        assert [c.stage for c in await live_workers(bus.registry)] == [Stage.PROCESSOR]


async def test_decode_aborts_when_its_client_disappears(bus: Bus) -> None:
    decode = mock_decode(inter_token_s=0.05)
    async with running_workers(bus, [(Stage.PROCESSOR, mock_processor()), (Stage.DECODE, decode)]):
        client = client_of(bus)
        stream = await client.submit(chat(client, "talk forever", max_tokens=100000))
        await stream.__aiter__().__anext__()
        await stream.close()  # the client goes away without a word
        started = time.monotonic()
        await wait_until(lambda: decode.engine.load().running_requests == 0, timeout_s=5)
        # heartbeat_interval_s is 0.2 s in the tests: noticed within a couple of probes.
        assert time.monotonic() - started < 2


async def test_released_memory_takes_the_worker_out_until_resumed(bus: Bus) -> None:
    import aiohttp

    async with running_workers(bus, [(Stage.PROCESSOR, mock_processor()), (Stage.DECODE, mock_decode())]):
        decode_card = next(c for c in await live_workers(bus.registry) if c.stage == Stage.DECODE)
        base = decode_card.metrics_url.replace("/metrics", "")  # type: ignore[union-attr]
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{base}/engine/release_memory_occupation", json={"tags": ["kv_cache"]}) as response:
                assert response.status == 200
            async with session.get(f"{base}/ready") as ready:
                assert ready.status == 503
            assert ready_models(await live_workers(bus.registry)) == {}
            async with session.post(f"{base}/engine/resume_memory_occupation", json={"tags": ["kv_cache"]}) as response:
                assert response.status == 200
            assert ready_models(await live_workers(bus.registry)) == {MOCK: ServingMode.AGGREGATED}


async def wait_until_async(predicate, timeout_s: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.1)


async def test_cli_chat_keeps_the_conversation_and_ask_refuses_without_workers(bus: Bus) -> None:
    env = {**os.environ, "CONVEYOR_NATS_URLS": bus.nats_settings.urls[0], "CONVEYOR_NAMESPACE": bus.settings.namespace}
    refused = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "workers.cli", "ask", "hi", "--model", MOCK, cwd=REPO_ROOT, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, refusal = await asyncio.wait_for(refused.communicate(), timeout=60)
    assert refused.returncode == 2 and "no ready pipeline serves 'mock'" in refusal.decode()
    async with running_workers(bus, [(Stage.PROCESSOR, mock_processor()), (Stage.DECODE, mock_decode(inter_token_s=0.001))]):
        chat_process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "workers.cli", "chat", "--model", MOCK, "--max-tokens", "3", cwd=REPO_ROOT, env=env,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        stdout, _ = await asyncio.wait_for(chat_process.communicate(b"first question\nsecond question\n"), timeout=60)
    assert chat_process.returncode == 0
    answers = [line for line in stdout.decode().splitlines() if line.strip()]
    assert len(answers) == 2 and all(len(a.split()) == 3 for a in answers)
    assert answers[0] != answers[1]  # the second prompt holds the whole conversation


@pytest.mark.parametrize("settings", [bus_settings(work_max_msgs=3)])
async def test_full_queues_answer_overloaded_at_once_never_drop_silently(bus: Bus) -> None:
    from bus.errors import QueueFull
    from schemas.codec import WIRE_VERSION
    from schemas.codec import encode as encode_wire
    from schemas.registry import WorkerCard

    client = client_of(bus)
    # No processor yet: the processor queue fills, and the fourth publish is refused to the client itself.
    queued = [chat(client, f"queued {i}") for i in range(3)]
    for request in queued:
        await client.submit(request)
    with pytest.raises(QueueFull) as refused:
        await client.submit(chat(client, "one too many"))
    assert refused.value.code == ErrorCode.OVERLOADED and refused.value.retryable
    await bus.js.purge_stream(bus.names.work_stream(Stage.PROCESSOR))
    # A decode worker that is registered but never pulls: the decode queue fills behind the processor,
    # which then answers `overloaded` (retryable) instead of retrying or dropping.
    card = WorkerCard(worker_id="stalled-decode", stage=Stage.DECODE, model=MOCK, mode=ServingMode.AGGREGATED,
                      engine="mock", host="h", pid=1, started_at_s=0.0, ready=True, wire_version=WIRE_VERSION)
    await bus.registry.put(card.worker_id, encode_wire(card))
    async with running_workers(bus, [(Stage.PROCESSOR, mock_processor())]):
        for i in range(3):
            await client.submit(chat(client, f"fills decode {i}"))
        await wait_until_async(lambda: _stream_full(bus, Stage.DECODE), timeout_s=20)
        # The processor acks each request only after JetStream stored its decode task: on a loaded machine the last
        # ack can trail the full decode queue, and the processor's own queue (3 here) would refuse the next request.
        await wait_until_async(lambda: _stream_empty(bus, Stage.PROCESSOR), timeout_s=20)
        started = time.monotonic()
        with pytest.raises(RemoteError) as raised:
            async with await client.submit(chat(client, "refused")) as stream:
                await stream.collect()
        refused_after_s = time.monotonic() - started  # the refusal's own time, not the workers' stop after it
    assert raised.value.code == ErrorCode.OVERLOADED and raised.value.frame.retryable
    assert refused_after_s < 2.0


async def _stream_full(bus: Bus, stage: Stage) -> bool:
    info = await bus.js.stream_info(bus.names.work_stream(stage))
    return info.state.messages >= 3


async def _stream_empty(bus: Bus, stage: Stage) -> bool:
    return await stream_len(bus, stage) == 0


async def test_a_worker_holds_no_more_tasks_than_its_engine_runs(bus: Bus) -> None:
    # The engine runs 2 requests at once (too few to hold any ahead), the worker may hold 64: it takes 2, and the rest
    # stay in the shared queue (where another replica could take them) instead of waiting inside this engine.
    assert await _most_waiting_in_engine(bus, max_running=2, num_requests=6, queue_ahead=None) == 0


async def _most_waiting_in_engine(bus: Bus, max_running: int, num_requests: int, queue_ahead: int | None,
                                  max_concurrency: int | None = 64) -> int:
    decode = mock_decode(max_running_requests=max_running, inter_token_s=0.01)
    async with running_workers(bus, [(Stage.PROCESSOR, mock_processor()), (Stage.DECODE, decode)],
                               max_concurrency=max_concurrency, queue_ahead=queue_ahead):
        client = client_of(bus)
        answers = asyncio.gather(*(_answer(client, max_tokens=20) for _ in range(num_requests)))
        waiting = []
        while not answers.done():
            waiting.append(decode.engine.load().waiting_requests)
            await asyncio.sleep(0.005)
        finals = await answers
    assert all(final.usage.completion_tokens == 20 for final in finals) and len(decode.engine.seen) == num_requests
    return max(waiting)


async def test_a_worker_holds_an_eighth_of_its_engine_s_limit_ahead_so_a_finished_request_is_replaced_at_once(
        bus: Bus) -> None:
    # 16 running at once: 2 more wait in the engine's own queue, the rest in the shared one.
    assert await _most_waiting_in_engine(bus, max_running=16, num_requests=40, queue_ahead=None) == 2


async def test_a_worker_told_no_limit_holds_what_its_engine_runs_and_an_eighth_ahead(bus: Bus) -> None:
    # 80 running at once (more than the old fixed default of 32): 10 more wait in the engine's own queue.
    assert await _most_waiting_in_engine(bus, max_running=80, num_requests=120, queue_ahead=None,
                                         max_concurrency=None) == 10


async def test_a_configured_limit_below_the_engine_s_is_kept(bus: Bus) -> None:
    assert await _most_waiting_in_engine(bus, max_running=16, num_requests=30, queue_ahead=None,
                                         max_concurrency=10) == 0


async def test_queue_ahead_sets_how_many_wait_in_the_engine(bus: Bus) -> None:
    assert await _most_waiting_in_engine(bus, max_running=16, num_requests=40, queue_ahead=5) == 5


async def test_a_task_goes_to_a_replica_with_a_free_place_before_another_s_queue_ahead(bus: Bus) -> None:
    # Two replicas, each engine running 2 at once with 1 more allowed ahead. Three long requests and a short one
    # fill both engines; the short one ends, so one replica has a free place, and its pull is newer than the full
    # replica's. Were the queue ahead pulled for like a free place, that older pull would take the fifth request,
    # which would then wait in the full engine's queue while the other engine had room.
    first, second = (mock_decode(max_running_requests=2, inter_token_s=0.01) for _ in range(2))
    async with running_workers(bus, [(Stage.PROCESSOR, mock_processor()), (Stage.DECODE, first),
                                     (Stage.DECODE, second)], max_concurrency=None, queue_ahead=1):
        client = client_of(bus)
        answers = []
        for max_tokens in (150, 150, 150, 3, 150):
            answers.append(asyncio.ensure_future(_answer(client, max_tokens=max_tokens)))
            await asyncio.sleep(0.15)
        waiting = []
        while not all(answer.done() for answer in answers):
            waiting.append(first.engine.load().waiting_requests + second.engine.load().waiting_requests)
            await asyncio.sleep(0.005)
        finals = await asyncio.gather(*answers)
    assert [final.usage.completion_tokens for final in finals] == [150, 150, 150, 3, 150]
    assert sorted((len(first.engine.seen), len(second.engine.seen))) == [2, 3]
    assert max(waiting) == 0


async def _answer(client: PipelineClient, max_tokens: int) -> FinalFrame:
    async with await client.submit(chat(client, "tell me", max_tokens=max_tokens)) as stream:
        _, final = await stream.collect()
    assert isinstance(final, FinalFrame)
    return final
