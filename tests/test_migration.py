"""Migration: a request whose decode worker dies or stops mid-stream goes on at another replica, and the
client reads one uninterrupted answer (same numbering, same inbox, nothing repeated, nothing lost).

The mock engine's tokens follow from the sequence so far, like a greedy model, so a migrated answer
must equal the uninterrupted one token for token; the torch engine's greedy answer must match in text.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from nats.js.api import ConsumerConfig

from bus.errors import RemoteError
from bus.publish import TaskPublisher
from bus.registry import live_workers
from bus.pull import Puller
from bus.streams import WORK_PRIORITY_GROUP, work_consumer_config
from bus.tracing import TraceContext
from schemas.codec import encode
from schemas.progress import ProgressSnapshot
from schemas.registry import Stage
from schemas.replies import ErrorCode, FinalFrame, FinishReason, Heartbeat, TokenChunk, Usage
from schemas.sampling import SamplingOptions, StopConditions
from schemas.tasks import DecodeTask, PreprocessedRequest, TaskHeader
from tests.conftest import Bus, bus_settings
from tests.helpers import metric, open_stream, stream_len
from tests.pipeline_helpers import MOCK, chat, client_of, mock_decode, mock_processor, running_workers
from workers.decode import DecodeStage, MigrationPolicy
from workers.engines.mock import MockEngine, MockEngineConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
# Redelivery after a SIGKILL waits out the ack wait; clients wait longer than that.
FAULT_SETTINGS = {"ack_wait_s": 1.5, "heartbeat_timeout_s": 8.0}


def worker_process(bus: Bus, *args: str) -> subprocess.Popen[bytes]:
    """A mock decode worker in its own process, on the test's namespace and bus settings."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "CONVEYOR_NATS_URLS": bus.nats_settings.urls[0]}
    env.update({f"CONVEYOR_{name.upper()}": str(value) for name, value in bus.settings.model_dump().items()})
    return subprocess.Popen([sys.executable, "-m", "workers.cli", "worker", "decode", "--engine", "mock",
                             "--log-level", "WARNING", *args], cwd=REPO_ROOT, env=env)


async def wait_for_decode_workers(bus: Bus, count: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(c.stage == Stage.DECODE and c.ready for c in await live_workers(bus.registry)) < count:
        assert time.monotonic() < deadline, "decode workers did not get ready"
        await asyncio.sleep(0.1)


async def read_all(stream) -> tuple[list[int], str, FinalFrame]:  # type: ignore[no-untyped-def]
    chunks, final = await stream.collect()
    assert isinstance(final, FinalFrame)
    return [t for c in chunks for t in c.token_ids], "".join(c.text or "" for c in chunks), final


@pytest.mark.parametrize("settings", [bus_settings(**FAULT_SETTINGS)])
@pytest.mark.parametrize("fault", ["sigkill", "sigterm"])
async def test_a_decode_worker_dying_mid_stream_hands_the_stream_to_a_replica_without_a_seam(bus: Bus, fault: str) -> None:
    doomed = worker_process(bus, "--shutdown-grace-s", "0.2")
    try:
        async with running_workers(bus, [(Stage.PROCESSOR, mock_processor())]):
            await wait_for_decode_workers(bus, 1)
            client = client_of(bus)
            request = chat(client, "tell me a long story", max_tokens=300)
            async with await client.submit(request) as stream:
                chunks = stream.__aiter__()
                head = [await chunks.__anext__() for _ in range(20)]
                async with running_workers(bus, [(Stage.DECODE, mock_decode())]) as replica:
                    doomed.send_signal(signal.SIGKILL if fault == "sigkill" else signal.SIGTERM)
                    stopped_at = time.monotonic()
                    first_after = await chunks.__anext__()
                    resumed_after_s = time.monotonic() - stopped_at
                    rest = [chunk async for chunk in chunks]
                    final = stream.terminal
                    # The same request again, with nobody dying: what the answer should have been.
                    again = chat(client, "tell me a long story", max_tokens=300)
                    async with await client.submit(again) as clean_stream:
                        clean_tokens, clean_text, clean_final = await read_all(clean_stream)
                    assert request.request_id in replica[0].stage.engine.seen  # type: ignore[attr-defined]
        streamed = [*head, first_after, *rest]
        assert [t for c in streamed for t in c.token_ids] == clean_tokens
        assert "".join(c.text or "" for c in streamed) == clean_text
        assert [c.seq for c in streamed] == sorted({c.seq for c in streamed})  # in order, none twice
        assert isinstance(final, FinalFrame) and final.finish_reason == FinishReason.LENGTH
        assert final.migrations == 1 and clean_final.migrations == 0
        assert final.usage.completion_tokens == 300 and final.usage.prompt_tokens == clean_final.usage.prompt_tokens
        # SIGKILL waits out the ack wait (1.5 s); SIGTERM hands the request back at once.
        assert resumed_after_s < (4.0 if fault == "sigkill" else 1.5)
    finally:
        doomed.kill()
        doomed.wait()


@pytest.mark.parametrize("settings", [bus_settings(**FAULT_SETTINGS)])
async def test_with_migration_off_a_dead_worker_ends_the_stream_with_a_retryable_error(bus: Bus) -> None:
    doomed = worker_process(bus, "--migration-limit", "0")
    try:
        async with running_workers(bus, [(Stage.PROCESSOR, mock_processor())]):
            await wait_for_decode_workers(bus, 1)
            client = client_of(bus)
            async with await client.submit(chat(client, "a long story", max_tokens=100000)) as stream:
                chunks = stream.__aiter__()
                await chunks.__anext__()
                no_migration = DecodeStage(MockEngine(MockEngineConfig()), MOCK, migration=MigrationPolicy(limit=0))
                async with running_workers(bus, [(Stage.DECODE, no_migration)]):
                    doomed.kill()
                    killed_at = time.monotonic()
                    with pytest.raises(RemoteError) as raised:
                        async for _ in chunks:
                            pass
                    waited_s = time.monotonic() - killed_at
        assert raised.value.code == ErrorCode.WORKER_LOST and raised.value.frame.retryable
        assert waited_s < 6.0  # the ack wait (1.5 s) plus the replica's fetch, not a hang
    finally:
        doomed.kill()
        doomed.wait()


# Journals written by hand: a task is pulled (and never acked) by the test, as by a worker that died,
# with the journal that worker would have left; the replica gets it after the ack wait.


async def orphan_task(bus: Bus, max_tokens: int = 40) -> tuple[DecodeTask, object]:
    """A decode task delivered once to a 'worker' that then vanished (pulled, never acked)."""
    request_id = f"req-{uuid.uuid4().hex[:12]}"
    stream = await open_stream(bus, request_id)
    task = DecodeTask(header=TaskHeader(request_id=request_id, reply_to=stream.inbox, created_at_s=time.time()),
                      request=PreprocessedRequest(model=MOCK, token_ids=[5, 6, 7, 8],
                                                  stop=StopConditions(max_tokens=max_tokens)))
    config: ConsumerConfig = work_consumer_config(bus.names, Stage.DECODE, MOCK, bus.settings, 1024)
    await bus.js.add_consumer(bus.names.work_stream(Stage.DECODE), config)
    assert config.durable_name is not None
    puller = Puller(bus.nc, "$JS.API", bus.names.work_stream(Stage.DECODE), config.durable_name, WORK_PRIORITY_GROUP)
    await puller.start()
    await TaskPublisher(bus.js, bus.names, bus.nc.max_payload).publish(Stage.DECODE, task, request_id, TraceContext.new(),
                                                                         model=MOCK)
    assert len(await puller.fetch(1, timeout_s=5)) == 1
    return task, stream


def mock_tokens(prompt: list[int], count: int) -> list[int]:
    engine = MockEngine(MockEngineConfig())
    tokens = list(prompt)
    for _ in range(count):
        tokens.append(engine._next_token(tokens[-1], len(tokens)))
    return tokens[len(prompt):]


@pytest.mark.parametrize("settings", [bus_settings(ack_wait_s=1.0, heartbeat_timeout_s=8.0)])
async def test_a_replica_goes_on_from_the_journal_sending_the_last_frame_again(bus: Bus) -> None:
    task, stream = await orphan_task(bus, max_tokens=40)
    streamed = mock_tokens(task.request.token_ids, 6)
    subject = bus.names.progress_subject(task.request_id)
    frames = [TokenChunk(request_id=task.request_id, seq=0, token_ids=streamed[:4]),
              Heartbeat(request_id=task.request_id, seq=1),
              TokenChunk(request_id=task.request_id, seq=2, token_ids=streamed[4:])]
    # The client got frames 0 and 1; the worker journaled frame 2 and died before sending it.
    for frame in frames:
        await bus.nc.publish(subject, encode(frame))
    for frame in frames[:2]:
        await bus.nc.publish(stream.inbox, encode(frame))
    await asyncio.sleep(0.1)
    async with running_workers(bus, [(Stage.DECODE, mock_decode())]):
        tokens, _, final = await read_all(stream)
    assert tokens == mock_tokens(task.request.token_ids, 40)
    assert final.migrations == 1 and final.seq > 2
    assert final.usage.completion_tokens == 40 and final.usage.prompt_tokens == 4


@pytest.mark.parametrize("settings", [bus_settings(ack_wait_s=1.0, heartbeat_timeout_s=8.0)])
async def test_a_request_that_ended_before_its_worker_died_is_acked_not_run_again(bus: Bus) -> None:
    task, stream = await orphan_task(bus)
    final = FinalFrame(request_id=task.request_id, seq=0, finish_reason=FinishReason.STOP, usage=Usage.of(4, 0))
    await bus.nc.publish(bus.names.progress_subject(task.request_id), encode(final))
    await bus.nc.publish(stream.inbox, encode(final))
    ended_before = metric("conveyor_migrations_total", stage="decode", outcome="ended_already")
    async with running_workers(bus, [(Stage.DECODE, mock_decode())]) as workers:
        _, terminal = await stream.collect()
        deadline = time.monotonic() + 10
        while await stream_len(bus, Stage.DECODE) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert await stream_len(bus, Stage.DECODE) == 0  # acked
        assert task.request_id not in workers[0].stage.engine.seen  # type: ignore[attr-defined]
    assert terminal == final
    assert metric("conveyor_migrations_total", stage="decode", outcome="ended_already") == ended_before + 1


@pytest.mark.parametrize("settings", [bus_settings(ack_wait_s=1.0, heartbeat_timeout_s=8.0)])
async def test_a_request_past_the_migration_limit_gets_a_retryable_error_in_sequence(bus: Bus) -> None:
    task, stream = await orphan_task(bus)
    snapshot = ProgressSnapshot(request_id=task.request_id, next_seq=3, token_ids=[9, 9, 9], migrations=3)
    await bus.nc.publish(bus.names.progress_subject(task.request_id), encode(snapshot))
    for seq in range(3):
        await bus.nc.publish(stream.inbox, encode(TokenChunk(request_id=task.request_id, seq=seq, token_ids=[9])))
    async with running_workers(bus, [(Stage.DECODE, mock_decode())]):
        with pytest.raises(RemoteError) as raised:
            await stream.collect()
    assert raised.value.code == ErrorCode.WORKER_LOST and raised.value.frame.retryable
    assert raised.value.frame.seq == 3  # the numbering went on
    assert "over limit" in raised.value.frame.message


@pytest.mark.parametrize("settings", [bus_settings(ack_wait_s=1.0, heartbeat_timeout_s=8.0)])
async def test_a_replica_waits_while_the_journal_is_still_being_written(bus: Bus) -> None:
    """A holder that stalled past the ack wait but lives keeps journaling: nobody else streams meanwhile."""
    task, stream = await orphan_task(bus, max_tokens=10)
    subject = bus.names.progress_subject(task.request_id)
    holder_alive_before = metric("conveyor_migrations_total", stage="decode", outcome="holder_alive")
    async with running_workers(bus, [(Stage.DECODE, mock_decode())]) as workers:
        # The 'stalled' holder heartbeats for 2.5 s (the replica is offered the task after 1 s).
        for seq in range(25):
            frame = encode(Heartbeat(request_id=task.request_id, seq=seq))
            await bus.nc.publish(subject, frame)
            await bus.nc.publish(stream.inbox, frame)
            await asyncio.sleep(0.1)
        assert task.request_id not in workers[0].stage.engine.seen  # type: ignore[attr-defined]
        # Then it dies: the replica takes over.
        tokens, _, final = await read_all(stream)
    assert tokens == mock_tokens(task.request.token_ids, 10) and final.migrations == 1
    assert metric("conveyor_migrations_total", stage="decode", outcome="holder_alive") > holder_alive_before


async def test_a_greedy_torch_answer_moved_mid_stream_reads_as_if_nothing_happened(bus: Bus) -> None:
    from tests.test_pipeline_torch import engine, processor
    from workers.engines.torch_engine.loader import DEFAULT_MODEL

    question = "Write a short poem about the sea."

    def ask() -> object:
        client = client_of(bus)
        return client.submit(chat(client, question, model=DEFAULT_MODEL, temperature=0.0, max_tokens=48),
                             first_frame_timeout_s=60)

    decoders = [(Stage.DECODE, DecodeStage(engine(), DEFAULT_MODEL)) for _ in range(2)]
    async with running_workers(bus, [(Stage.PROCESSOR, processor()), *decoders], model=DEFAULT_MODEL, grace_s=0.1) as workers:
        async with await ask() as stream:  # type: ignore[attr-defined]
            chunks = stream.__aiter__()
            head = [await chunks.__anext__() for _ in range(12)]
            holder = next(worker for worker in workers[1:] if worker.runtime.in_flight)
            holder.runtime.request_stop()  # stops mid-answer: the request is handed over
            rest = [chunk async for chunk in chunks]
            moved = stream.terminal
        async with await ask() as clean_stream:  # type: ignore[attr-defined]
            clean_tokens, clean_text, clean_final = await read_all(clean_stream)
    streamed = [*head, *rest]
    assert isinstance(moved, FinalFrame) and moved.migrations == 1
    assert [t for c in streamed for t in c.token_ids] == clean_tokens
    assert "".join(c.text or "" for c in streamed) == clean_text
    assert moved.usage.completion_tokens == clean_final.usage.completion_tokens
    assert moved.usage.prompt_tokens == clean_final.usage.prompt_tokens


async def test_a_decode_task_whose_prefill_worker_is_gone_runs_the_prompt_on_the_decode_engine(bus: Bus) -> None:
    from bus.server import free_port
    from schemas.tasks import BootstrapInfo
    from tests.test_pipeline_torch import engine
    from workers.engines.protocol import DisaggregationRole
    from workers.engines.torch_engine.loader import DEFAULT_MODEL

    publisher = TaskPublisher(bus.js, bus.names, bus.nc.max_payload)
    gone = BootstrapInfo(bootstrap_host="127.0.0.1", bootstrap_port=free_port(), bootstrap_room=12345)

    async def run(bootstrap: BootstrapInfo | None) -> tuple[list[int], str, FinalFrame]:
        request_id = f"req-{uuid.uuid4().hex[:12]}"
        stream = await open_stream(bus, request_id, first_frame_timeout_s=60)
        task = DecodeTask(header=TaskHeader(request_id=request_id, reply_to=stream.inbox, created_at_s=time.time()),
                          request=PreprocessedRequest(model=DEFAULT_MODEL, token_ids=[1, 504, 3458, 282, 4649, 314],
                                                      sampling=SamplingOptions(temperature=0.0),
                                                      stop=StopConditions(max_tokens=12)),
                          bootstrap=bootstrap)
        await publisher.publish(Stage.DECODE, task, request_id, TraceContext.new(), model=DEFAULT_MODEL)
        async with stream:
            return await read_all(stream)

    async with running_workers(bus, [(Stage.DECODE, DecodeStage(engine(DisaggregationRole.DECODE), DEFAULT_MODEL))],
                               model=DEFAULT_MODEL):
        before = metric("conveyor_migrations_total", stage="prefill", outcome="prefilled_by_decode")
        orphaned = await run(gone)
        local = await run(None)
    assert orphaned[0] == local[0] and orphaned[1] == local[1] and len(local[0]) == 12
    assert metric("conveyor_migrations_total", stage="prefill", outcome="prefilled_by_decode") == before + 1
