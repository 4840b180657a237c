"""The pull-consumer loop against a real JetStream: what happens to each kind of message."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import msgpack
import pytest

from bus.cancel import send_cancel
from bus.consumer import ConsumerOptions, Delivery
from bus.errors import RejectRequest, RemoteError
from bus.publish import TaskPublisher
from bus.tracing import TraceContext
from schemas.codec import WIRE_VERSION_HEADER
from schemas.registry import Stage
from schemas.replies import ErrorCode, FinalFrame, FinishReason, Usage
from schemas.tasks import DecodeTask
from tests.conftest import Bus, bus_settings
from tests.helpers import decode_task, metric, open_stream, running_consumer, stream_len, wait_until


async def publish(bus: Bus, task: DecodeTask, trace: TraceContext | None = None) -> None:
    publisher = TaskPublisher(bus.js, bus.names, bus.settings.max_message_bytes)
    await publisher.publish(Stage.DECODE, task, task.request_id, trace or TraceContext.new())


async def publish_raw(bus: Bus, payload: bytes, headers: dict[str, str] | None = None) -> None:
    await bus.js.publish(bus.names.work_subject(Stage.DECODE), payload, headers=headers)


async def test_handler_that_returns_gets_its_task_acked(bus: Bus) -> None:
    seen: list[str] = []

    async def handle(task: DecodeTask, delivery: Delivery) -> None:
        seen.append(task.request_id)

    task = decode_task("ok-1")
    await publish(bus, task)
    async with running_consumer(bus, handle):
        await wait_until(lambda: seen == ["ok-1"])
    assert await stream_len(bus, Stage.DECODE) == 0


async def test_handler_exception_on_one_message_does_not_stop_the_loop(bus: Bus) -> None:
    handled: list[str] = []

    async def handle(task: DecodeTask, delivery: Delivery) -> None:
        if task.request_id == "poison":
            raise RuntimeError("boom")
        handled.append(task.request_id)

    await publish(bus, decode_task("poison"))
    await publish(bus, decode_task("fine-1"))
    await publish(bus, decode_task("fine-2"))
    async with running_consumer(bus, handle):
        await wait_until(lambda: sorted(handled) == ["fine-1", "fine-2"])


async def test_undecodable_payload_is_terminated_and_counted(bus: Bus) -> None:
    handled: list[str] = []

    async def handle(task: DecodeTask, delivery: Delivery) -> None:
        handled.append(task.request_id)

    before = metric("conveyor_terminations_total", stage="decode", reason="undecodable")
    await publish_raw(bus, b"\xc1\xc1 definitely not msgpack")
    await publish(bus, decode_task("after-garbage"))
    async with running_consumer(bus, handle):
        await wait_until(lambda: handled == ["after-garbage"])
        await wait_until(lambda: metric("conveyor_terminations_total", stage="decode", reason="undecodable") == before + 1)
    assert await stream_len(bus, Stage.DECODE) == 0


async def test_other_wire_version_is_terminated(bus: Bus) -> None:
    before = metric("conveyor_terminations_total", stage="decode", reason="wire_version")
    await publish_raw(bus, msgpack.packb({"kind": "decode"}), headers={WIRE_VERSION_HEADER: "999"})

    async def handle(task: DecodeTask, delivery: Delivery) -> None:
        raise AssertionError("must not be called")

    async with running_consumer(bus, handle):
        await wait_until(lambda: metric("conveyor_terminations_total", stage="decode", reason="wire_version") == before + 1)


async def test_invalid_request_with_an_inbox_gets_an_error_frame_and_is_acked(bus: Bus) -> None:
    stream = await open_stream(bus, "bad-temp")
    task = decode_task("bad-temp", reply_to=stream.inbox).model_dump(mode="python")
    task["request"]["sampling"] = {"temperature": -1.0}
    await publish_raw(bus, msgpack.packb(task))

    async def handle(task: DecodeTask, delivery: Delivery) -> None:
        raise AssertionError("must not be called")

    async with running_consumer(bus, handle):
        with pytest.raises(RemoteError) as raised:
            await stream.collect()
    assert raised.value.code == ErrorCode.INVALID_REQUEST
    assert "temperature" in raised.value.frame.message
    assert await stream_len(bus, Stage.DECODE) == 0


async def test_handler_rejection_sends_its_code_and_the_worker_serves_the_next(bus: Bus) -> None:
    bad_stream = await open_stream(bus, "too-long")
    good_stream = await open_stream(bus, "short")

    async def handle(task: DecodeTask, delivery: Delivery) -> None:
        if task.request_id == "too-long":
            raise RejectRequest(ErrorCode.CONTEXT_LENGTH_EXCEEDED, "prompt of 9000 tokens exceeds 8192")
        await delivery.reply.send_tokens([7], text="a")
        await delivery.reply.finish(FinishReason.STOP, Usage.of(3, 1))

    await publish(bus, decode_task("too-long", bad_stream.inbox))
    await publish(bus, decode_task("short", good_stream.inbox))
    async with running_consumer(bus, handle):
        with pytest.raises(RemoteError) as raised:
            await bad_stream.collect()
        chunks, final = await good_stream.collect()
    assert raised.value.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED
    assert [c.token_ids for c in chunks] == [[7]]
    assert isinstance(final, FinalFrame) and final.finish_reason == FinishReason.STOP


async def test_transient_error_is_redelivered_with_backoff_then_given_up(bus: Bus) -> None:
    stream = await open_stream(bus, "flaky")
    attempts: list[tuple[int, float]] = []

    async def handle(task: DecodeTask, delivery: Delivery) -> None:
        attempts.append((delivery.num_delivered, time.monotonic()))
        raise ConnectionError("engine unreachable")

    before = metric("conveyor_messages_handled_total", stage="decode", outcome="max_deliver")
    await publish(bus, decode_task("flaky", stream.inbox))
    async with running_consumer(bus, handle):
        with pytest.raises(RemoteError) as raised:
            await stream.collect()
    # max_deliver=3, retry_base_s=0.1: delays of 0.1 s then 0.2 s between attempts.
    assert [number for number, _ in attempts] == [1, 2, 3]
    gaps = [later - earlier for (_, earlier), (_, later) in zip(attempts, attempts[1:])]
    assert gaps[0] >= 0.09 and gaps[1] >= 0.19
    assert raised.value.code == ErrorCode.INTERNAL and raised.value.frame.retryable
    assert "3 attempts" in raised.value.frame.message
    assert metric("conveyor_messages_handled_total", stage="decode", outcome="max_deliver") == before + 1
    assert await stream_len(bus, Stage.DECODE) == 0


@pytest.mark.parametrize("settings", [bus_settings(ack_wait_s=1.0)])
async def test_long_handler_sending_in_progress_is_not_redelivered(bus: Bus) -> None:
    deliveries: list[int] = []
    finished = asyncio.Event()

    async def handle(task: DecodeTask, delivery: Delivery) -> None:
        deliveries.append(delivery.num_delivered)
        await asyncio.sleep(3.0)  # three ack waits
        finished.set()

    await publish(bus, decode_task("long"))
    async with running_consumer(bus, handle, options=ConsumerOptions(fetch_timeout_s=0.2, max_concurrency=4)):
        await asyncio.wait_for(finished.wait(), timeout=10)
        await asyncio.sleep(0.3)
    assert deliveries == [1]
    assert await stream_len(bus, Stage.DECODE) == 0


async def test_cancel_sent_before_the_request_is_pulled_drops_it(bus: Bus) -> None:
    stream = await open_stream(bus, "cancel-early")
    called: list[str] = []

    async def handle(task: DecodeTask, delivery: Delivery) -> None:
        called.append(task.request_id)

    await publish(bus, decode_task("cancel-early", stream.inbox))
    await send_cancel(bus.js, bus.names, "cancel-early")
    # The worker starts after the cancel: it learns it from the control stream's history.
    async with running_consumer(bus, handle):
        chunks, final = await stream.collect()
    assert called == []
    assert chunks == [] and isinstance(final, FinalFrame) and final.finish_reason == FinishReason.CANCELLED
    assert await stream_len(bus, Stage.DECODE) == 0


async def test_cancel_while_running_notifies_the_handler(bus: Bus) -> None:
    stream = await open_stream(bus, "cancel-late")
    started = asyncio.Event()

    async def handle(task: DecodeTask, delivery: Delivery) -> None:
        async with delivery.reply:
            started.set()
            await asyncio.wait_for(delivery.cancelled.wait(), timeout=5)
            await delivery.reply.finish(FinishReason.CANCELLED, Usage.of(3, 0))

    await publish(bus, decode_task("cancel-late", stream.inbox))
    async with running_consumer(bus, handle):
        await asyncio.wait_for(started.wait(), timeout=5)
        sent_at = time.monotonic()
        await send_cancel(bus.js, bus.names, "cancel-late")
        _, final = await stream.collect()
        latency_s = time.monotonic() - sent_at
    assert isinstance(final, FinalFrame) and final.finish_reason == FinishReason.CANCELLED
    assert latency_s < 0.5


async def test_concurrency_is_bounded_per_worker(bus: Bus) -> None:
    running = 0
    peak = 0
    done: list[str] = []

    async def handle(task: DecodeTask, delivery: Delivery) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.1)
        running -= 1
        done.append(task.request_id)

    for index in range(8):
        await publish(bus, decode_task(f"c{index}"))
    async with running_consumer(bus, handle, options=ConsumerOptions(fetch_timeout_s=0.2, max_concurrency=2)):
        await wait_until(lambda: len(done) == 8, timeout_s=10)
    assert peak == 2


@pytest.mark.parametrize("fetch_batch", [1, 8])
async def test_a_queued_burst_reaches_the_handler_in_groups_of_the_fetch_batch(bus: Bus, fetch_batch: int) -> None:
    # How far the pull loop has spawned ahead of the handlers started: a fetch of n spawns n tasks in one go.
    ahead: list[float] = []
    release = asyncio.Event()
    def in_flight() -> float:
        return metric("conveyor_in_flight", stage="decode")

    base = in_flight()

    async def handle(task: DecodeTask, delivery: Delivery) -> None:
        ahead.append(in_flight() - base - (len(ahead) + 1))
        await release.wait()

    for index in range(8):
        await publish(bus, decode_task(f"burst{index}"))
    options = ConsumerOptions(fetch_timeout_s=0.2, max_concurrency=8, fetch_batch=fetch_batch)
    async with running_consumer(bus, handle, options):
        await wait_until(lambda: len(ahead) == 8, timeout_s=10)
        release.set()
    if fetch_batch == 1:
        assert max(ahead) <= 1  # each pull took one task: at most the next was spawned before this one started
    else:
        assert max(ahead) >= 5  # the second pull took the other seven at once


async def test_two_replicas_share_the_work(bus: Bus) -> None:
    by_worker: dict[str, list[str]] = {"a": [], "b": []}

    def handler_for(worker: str):  # type: ignore[no-untyped-def]
        async def handle(task: DecodeTask, delivery: Delivery) -> None:
            await asyncio.sleep(0.05)
            by_worker[worker].append(task.request_id)

        return handle

    options = ConsumerOptions(fetch_timeout_s=0.2, max_concurrency=2, fetch_batch=2)
    async with running_consumer(bus, handler_for("a"), options, worker_id="a"):
        async with running_consumer(bus, handler_for("b"), options, worker_id="b"):
            for index in range(20):
                await publish(bus, decode_task(f"s{index}"))
            await wait_until(lambda: len(by_worker["a"]) + len(by_worker["b"]) == 20, timeout_s=10)
    assert by_worker["a"] and by_worker["b"]
    assert sorted(by_worker["a"] + by_worker["b"]) == sorted(f"s{index}" for index in range(20))


async def test_stopping_worker_hands_unfinished_work_to_another_replica(bus: Bus) -> None:
    started = asyncio.Event()
    finished_by: list[tuple[str, int]] = []

    async def stuck(task: DecodeTask, delivery: Delivery) -> None:
        started.set()
        await asyncio.sleep(3600)

    async def quick(task: DecodeTask, delivery: Delivery) -> None:
        finished_by.append(("b", delivery.num_delivered))

    await publish(bus, decode_task("handover"))
    async with running_consumer(bus, stuck, worker_id="a") as first:
        await asyncio.wait_for(started.wait(), timeout=5)
        await first.stop(grace_s=0.1)
    async with running_consumer(bus, quick, worker_id="b"):
        await wait_until(lambda: finished_by == [("b", 2)])


async def test_a_task_arriving_while_the_worker_stops_goes_back_to_the_queue_at_once(bus: Bus) -> None:
    ran_on: list[tuple[str, int]] = []

    def handle_as(worker: str) -> Callable[[DecodeTask, Delivery], Awaitable[None]]:
        async def handle(task: DecodeTask, delivery: Delivery) -> None:
            ran_on.append((worker, delivery.num_delivered))
        return handle

    # An idle worker's pull waits up to its fetch timeout; a stop waits for it, and a task published meanwhile reaches
    # the stopping worker, which must not run it nor leave it to the ack wait (5 s here, past the wait below).
    options = ConsumerOptions(fetch_timeout_s=2.0)
    async with running_consumer(bus, handle_as("a"), options=options, worker_id="a") as first:
        await asyncio.sleep(0.3)  # its pull is waiting
        stopping = asyncio.create_task(first.stop(grace_s=1.0))
        await asyncio.sleep(0.1)
        await publish(bus, decode_task("while-stopping"))
        await stopping
    assert ran_on == []
    async with running_consumer(bus, handle_as("b"), worker_id="b"):
        await wait_until(lambda: ran_on == [("b", 2)], timeout_s=3.0)


async def test_trace_context_is_carried_to_the_handler(bus: Bus) -> None:
    traces: list[TraceContext] = []

    async def handle(task: DecodeTask, delivery: Delivery) -> None:
        traces.append(delivery.trace)

    origin = TraceContext.new()
    await publish(bus, decode_task("traced"), trace=origin)
    async with running_consumer(bus, handle):
        await wait_until(lambda: len(traces) == 1)
    assert traces[0].trace_id == origin.trace_id
    assert traces[0].span_id != origin.span_id


async def test_poison_and_garbage_go_to_the_dead_letter_stream_and_replay_puts_them_back(bus: Bus) -> None:
    from bus.dead_letters import list_dead_letters, replay

    stream = await open_stream(bus, "poison")
    healed = asyncio.Event()
    succeeded: list[str] = []

    async def handle(task: DecodeTask, delivery: Delivery) -> None:
        if not healed.is_set():
            raise ConnectionError("engine unreachable")
        succeeded.append(task.request_id)

    await publish_raw(bus, b"\xc1\xc1 definitely not msgpack", headers={"X-Origin": "fuzzer"})
    await publish(bus, decode_task("poison", stream.inbox))
    async with running_consumer(bus, handle):
        with pytest.raises(RemoteError):
            await stream.collect()
        for _ in range(100):
            letters = await list_dead_letters(bus.js, bus.names)
            if len(letters) == 2:
                break
            await asyncio.sleep(0.05)
        by_reason = {letter.reason: letter for letter in letters}
        assert set(by_reason) == {"undecodable", "max_deliver"}
        poison = by_reason["max_deliver"]
        assert poison.stage == "decode" and poison.deliveries == 3 and "engine unreachable" in poison.detail
        assert poison.subject == bus.names.work_subject(Stage.DECODE)
        garbage = await bus.js.get_msg(bus.names.dead_letter_stream, by_reason["undecodable"].seq)
        assert garbage.data == b"\xc1\xc1 definitely not msgpack" and garbage.headers["X-Origin"] == "fuzzer"
        # The engine is back: an operator replays the poison task, and it runs.
        healed.set()
        assert await replay(bus.js, bus.names, poison.seq) == bus.names.work_subject(Stage.DECODE)
        await wait_until(lambda: succeeded == ["poison"])
    assert [letter.reason for letter in await list_dead_letters(bus.js, bus.names)] == ["undecodable"]
