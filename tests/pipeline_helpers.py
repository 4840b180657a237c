"""Running real stage workers inside the test process, against the test's NATS namespace."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bus.client import PipelineClient
from bus.errors import RemoteError, ReplyStreamBroken
from bus.registry import live_workers, ready_models
from schemas.client import ChatMessage, ChatRequest, CompletionRequest, StreamFormat
from schemas.registry import ServingMode, Stage, WorkerCard
from schemas.replies import FinalFrame
from tests.conftest import Bus
from workers.decode import DecodeStage
from workers.engines.factory import EngineKind
from workers.engines.mock import MockEngine, MockEngineConfig
from workers.engines.protocol import GenerateOutput, GenerateRequest
from workers.processor import ProcessorStage
from workers.launcher import stop_processes
from workers.runtime import PipelineStage, WorkerOptions, WorkerRuntime
from workers.stages import served_model

MOCK = "mock"


class RecordingMockEngine(MockEngine):
    """A mock engine that remembers which requests reached it."""

    def __init__(self, config: MockEngineConfig = MockEngineConfig()) -> None:
        super().__init__(config)
        self.seen: list[str] = []

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:  # type: ignore[override]
        if not request.request_id.startswith("canary"):
            self.seen.append(request.request_id)
        async for output in super().generate(request):
            yield output


@dataclass
class Worker:
    runtime: WorkerRuntime
    stage: PipelineStage
    task: asyncio.Task[None] = field(repr=False)


@asynccontextmanager
async def running_workers(bus: Bus, specs: Sequence[tuple[Stage, PipelineStage]], model: str = MOCK,
                          mode: ServingMode = ServingMode.AGGREGATED, grace_s: float = 5.0,
                          max_concurrency: int | None = 32,
                          pools: Sequence[str | None] = (),
                          modes: Sequence[ServingMode] = (),
                          kv_events_interval_s: float = 0.005, kv_events: bool = True,
                          queue_ahead: int | None = None,
                          canary_wait_s: float = 3600) -> AsyncIterator[list[Worker]]:
    """`pools` / `modes`: the pool / serving mode of each worker in `specs`, in order (missing: none / `mode`)."""
    workers: list[Worker] = []
    try:
        for index, (stage_kind, stage) in enumerate(specs):
            options = WorkerOptions(stage=stage_kind, model=model, mode=modes[index] if index < len(modes) else mode,
                                    engine_name="test",
                                    http_host="127.0.0.1", shutdown_grace_s=grace_s, max_concurrency=max_concurrency,
                                    canary_wait_s=canary_wait_s, handle_signals=False,
                                    kv_events=kv_events, kv_events_interval_s=kv_events_interval_s,
                                    queue_ahead=queue_ahead, pool=pools[index] if index < len(pools) else None)
            runtime = WorkerRuntime(stage, options, bus.nats_settings, bus.settings)
            task = asyncio.create_task(runtime.run())
            started = asyncio.create_task(runtime.started.wait())
            await asyncio.wait([task, started], timeout=120, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                task.result()  # raise the startup error
            assert runtime.started.is_set(), f"{stage_kind.value} worker did not start"
            workers.append(Worker(runtime, stage, task))
        await _all_registered(bus, workers)
        yield workers
    finally:
        for worker in reversed(workers):
            worker.runtime.request_stop()
        # Bounded, so a worker that does not stop fails here by name instead of hanging the test.
        _, running = await asyncio.wait([w.task for w in workers], timeout=grace_s + 30)
        stuck = [w.runtime.options.stage.value for w in workers if w.task in running]
        assert not stuck, f"workers still running {grace_s + 30:.0f} s after stop: {stuck}"


async def _all_registered(bus: Bus, workers: list[Worker], timeout_s: float = 30.0) -> None:
    """Every worker's card is live. In-process workers share one event loop: an engine loading its
    weights stalls the others' registry beats, and a card can expire before the first request."""
    expected = {worker.runtime.options.worker_id for worker in workers}
    deadline = asyncio.get_running_loop().time() + timeout_s
    while expected - {card.worker_id for card in await live_workers(bus.registry) if card.ready}:
        assert asyncio.get_running_loop().time() < deadline, "a worker's card did not come back"
        await asyncio.sleep(0.05)


def mock_processor() -> ProcessorStage:
    return ProcessorStage({MOCK: served_model(EngineKind.MOCK, MOCK)})


def mock_decode(**config: float | int) -> DecodeStage:
    return DecodeStage(RecordingMockEngine(MockEngineConfig(**config)), MOCK)  # type: ignore[arg-type]


def client_of(bus: Bus) -> PipelineClient:
    return PipelineClient(bus.nc, bus.js, bus.names, bus.settings)


def chat(client: PipelineClient, text: str, model: str = MOCK, **fields: object) -> ChatRequest:
    return ChatRequest(request_id=f"req-{uuid.uuid4().hex[:12]}", reply_to=client.new_inbox(), model=model,
                       messages=[ChatMessage(role="user", content=text)], stream_format=StreamFormat.TEXT,
                       **fields)  # type: ignore[arg-type]


def completion(client: PipelineClient, prompt: str | list[int], model: str = MOCK, **fields: object) -> CompletionRequest:
    return CompletionRequest(request_id=f"req-{uuid.uuid4().hex[:12]}", reply_to=client.new_inbox(), model=model,
                             prompt=prompt, **fields)  # type: ignore[arg-type]


async def ask_to_the_end(client: PipelineClient, max_tokens: int, timeout_s: float = 20.0) -> FinalFrame:
    """A fresh chat request read to its final frame."""
    request = chat(client, f"hello {uuid.uuid4().hex[:6]}", max_tokens=max_tokens)
    async with await client.submit(request, first_frame_timeout_s=timeout_s) as stream:
        async for _ in stream:
            pass
    assert isinstance(stream.terminal, FinalFrame)
    return stream.terminal


async def seconds_until_served(client: PipelineClient, since_s: float, limit_s: float = 30.0) -> float:
    """After a fault at monotonic `since_s`: how long until a new request is served (asking again until one is)."""
    while True:
        try:
            await ask_to_the_end(client, max_tokens=3, timeout_s=5)
            return time.monotonic() - since_s
        except (RemoteError, ReplyStreamBroken, TimeoutError, ConnectionError):
            assert time.monotonic() - since_s < limit_s, f"no request served {limit_s:.0f} s after the fault"
            await asyncio.sleep(0.5)


def assert_all_whole(outcomes: list[object], completion_tokens: int) -> None:
    """Every stream that was in flight during a fault finished with all its tokens."""
    for outcome in outcomes:
        assert isinstance(outcome, FinalFrame) and outcome.usage.completion_tokens == completion_tokens, outcome


REPO_ROOT = Path(__file__).resolve().parents[1]


@asynccontextmanager
async def worker_processes(urls: list[str], namespace: str, stages: list[str], engine: str = "mock",
                           stderr_dir: Path | None = None, **env: str) -> AsyncIterator[list[subprocess.Popen[bytes]]]:
    """Workers as processes (`conveyor worker STAGE`, the mock engine unless told), stopped (SIGTERM, then
    SIGKILL) on exit. `env`: more CONVEYOR_* settings, e.g. CONVEYOR_STREAM_REPLICAS="3". `stderr_dir`: each
    worker's stderr (its log) goes to `<stage>-<n>.log` there, to read after it stopped."""
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "CONVEYOR_NAMESPACE": namespace,
                   "CONVEYOR_NATS_URLS": ",".join(urls), "CONVEYOR_REGISTRY_TTL_S": "3",
                   "CONVEYOR_MOCK_INTER_TOKEN_S": "0.01", **env}
    # CONVEYOR_TEST_WORKER_LOG_LEVEL=INFO (with pytest -s) shows what each worker did, to read a failure.
    log_level = os.environ.get("CONVEYOR_TEST_WORKER_LOG_LEVEL", "WARNING")
    logs = [open(stderr_dir / f"{stage}-{n}.log", "wb") if stderr_dir else None  # noqa: SIM115 (closed below)
            for n, stage in enumerate(stages)]
    workers = [subprocess.Popen([sys.executable, "-m", "workers.cli", "worker", stage, "--engine", engine,
                                 "--log-level", log_level, "--shutdown-grace-s", "1"], cwd=REPO_ROOT, env=environment,
                                stderr=log)
               for stage, log in zip(stages, logs, strict=True)]
    try:
        yield workers
    finally:
        await stop_processes(workers, grace_s=15)
        for log in logs:
            if log is not None:
                log.close()


async def wait_for_workers(client: PipelineClient, num_workers: int, timeout_s: float,
                           model_ready: bool = True) -> list[WorkerCard]:
    """Until `num_workers` ready cards are live, and the mock model is ready unless `model_ready` is False
    (JetStream may still be recovering); returns those cards."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            cards = [card for card in await client.live_workers() if card.ready]
            if (MOCK in ready_models(cards) or not model_ready) and len(cards) >= num_workers:
                return cards
        except Exception:  # the server is coming back, or a cluster is electing its leaders
            pass
        await asyncio.sleep(0.2)
    raise AssertionError(f"pipeline not ready within {timeout_s} s")


async def run_cli_when_served(url: str, namespace: str, *arguments: str,
                              attempts: int = 120) -> subprocess.CompletedProcess[bytes]:
    """`conveyor ARGUMENTS` against the bus at `url`, run again while it exits 2 (nothing serves the model yet:
    the workers are still starting)."""
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "CONVEYOR_NATS_URLS": url, "CONVEYOR_NAMESPACE": namespace}
    command = [sys.executable, "-m", "workers.cli", *arguments]
    for _ in range(attempts):
        done = await asyncio.to_thread(subprocess.run, command, cwd=REPO_ROOT, env=environment, capture_output=True,
                                       timeout=120)
        if done.returncode != 2:
            return done
        await asyncio.sleep(1)
    return done
