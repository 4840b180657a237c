"""Pulling tasks from a durable consumer (bus/pull.py) against a real JetStream: what one pull returns, and when."""

from __future__ import annotations

import asyncio
import time

import pytest

from bus.pull import Puller, PullRefused
from bus.streams import WORK_PRIORITY_GROUP, ensure_work_consumer, work_consumer_config
from schemas.registry import Stage
from tests.conftest import Bus
from tests.helpers import stream_len, wait_until_async


async def puller_of(bus: Bus) -> Puller:
    config = work_consumer_config(bus.names, Stage.DECODE, None, bus.settings, max_ack_pending=64)
    stream = bus.names.work_stream(Stage.DECODE)
    await ensure_work_consumer(bus.js, config, stream)
    assert config.durable_name is not None
    puller = Puller(bus.nc, "$JS.API", stream, config.durable_name, WORK_PRIORITY_GROUP)
    await puller.start()
    return puller


async def publish(bus: Bus, *payloads: bytes) -> None:
    for payload in payloads:
        await bus.js.publish(bus.names.work_subject(Stage.DECODE), payload)


async def test_a_pull_for_several_returns_what_is_queued_without_waiting_for_the_rest(bus: Bus) -> None:
    puller = await puller_of(bus)
    await publish(bus, b"a", b"b")
    started_s = time.monotonic()
    msgs = await puller.fetch(8, timeout_s=5.0)
    assert [msg.data for msg in msgs] == [b"a", b"b"]
    assert time.monotonic() - started_s < 1.0  # ended by JetStream's "no messages", not by the 5 s expiry
    for msg in msgs:
        await msg.ack()
    await puller.stop()


async def test_a_waiting_pull_returns_the_first_task_published_while_it_waits(bus: Bus) -> None:
    puller = await puller_of(bus)
    pending = asyncio.create_task(puller.fetch(8, timeout_s=5.0))
    await asyncio.sleep(0.2)
    published_s = time.monotonic()
    await publish(bus, b"late")
    msgs = await pending
    assert [msg.data for msg in msgs] == [b"late"]
    assert time.monotonic() - published_s < 1.0
    await msgs[0].ack()
    await puller.stop()


async def test_a_pull_asks_for_no_more_than_its_batch(bus: Bus) -> None:
    puller = await puller_of(bus)
    await publish(bus, b"1", b"2", b"3")
    first = await puller.fetch(2, timeout_s=2.0)
    second = await puller.fetch(2, timeout_s=2.0)
    assert [msg.data for msg in first] == [b"1", b"2"]
    assert [msg.data for msg in second] == [b"3"]
    for msg in first + second:
        await msg.ack()
    await puller.stop()


async def test_a_pull_with_nothing_queued_returns_empty_at_its_timeout(bus: Bus) -> None:
    puller = await puller_of(bus)
    started_s = time.monotonic()
    assert await puller.fetch(1, timeout_s=0.3) == []
    assert 0.25 < time.monotonic() - started_s < 1.5
    await puller.stop()


async def test_a_pull_from_a_consumer_that_is_gone_is_refused(bus: Bus) -> None:
    puller = Puller(bus.nc, "$JS.API", bus.names.work_stream(Stage.DECODE), "no_such_consumer")
    await puller.start()
    started_s = time.monotonic()
    with pytest.raises(PullRefused) as refused:
        await puller.fetch(1, timeout_s=5.0)
    assert refused.value.status == "503"
    assert time.monotonic() - started_s < 1.0
    await puller.stop()


async def test_tasks_handed_out_stay_delivered_until_acked(bus: Bus) -> None:
    puller = await puller_of(bus)
    await publish(bus, b"kept")
    (msg,) = await puller.fetch(1, timeout_s=2.0)
    assert msg.metadata.num_delivered == 1
    assert await stream_len(bus, Stage.DECODE) == 1  # work-queue retention: gone only once acked
    await msg.ack()
    await wait_until_async(lambda: _stream_is_empty(bus))
    await puller.stop()


async def _stream_is_empty(bus: Bus) -> bool:
    return await stream_len(bus, Stage.DECODE) == 0


async def test_a_waiting_pull_of_priority_0_is_served_before_an_earlier_one_of_priority_1(bus: Bus) -> None:
    behind, first = await puller_of(bus), await puller_of(bus)
    later = asyncio.create_task(behind.fetch(1, timeout_s=0.5, priority=1))
    await asyncio.sleep(0.1)
    sooner = asyncio.create_task(first.fetch(1, timeout_s=5.0, priority=0))
    await asyncio.sleep(0.1)
    await publish(bus, b"task")
    (msg,) = await sooner
    assert msg.data == b"task"
    assert await later == []
    await msg.ack()
    await behind.stop()
    await first.stop()


async def test_a_pull_without_waiting_returns_at_once_with_what_is_queued(bus: Bus) -> None:
    puller = await puller_of(bus)
    started_s = time.monotonic()
    assert await puller.fetch(4, timeout_s=5.0, wait=False) == []
    await publish(bus, b"1", b"2")
    msgs = await puller.fetch(4, timeout_s=5.0, wait=False)
    assert [msg.data for msg in msgs] == [b"1", b"2"]
    assert time.monotonic() - started_s < 1.0  # neither waited for its 5 s
    for msg in msgs:
        await msg.ack()
    await puller.stop()
