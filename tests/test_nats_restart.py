"""The pipeline rides out a nats-server restart: worker processes reconnect, re-declare what the
restart lost (the registry bucket lives in memory), re-register, and serve new requests within
seconds — after SIGTERM and after SIGKILL of the server, with streams in flight."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from bus.client import PipelineClient, open_client
from bus.registry import ready_models
from bus.errors import RemoteError, ReplyStreamBroken
from bus.server import EmbeddedNatsServer
from bus.settings import NatsSettings
from schemas.replies import FinalFrame
from tests.conftest import bus_settings
from tests.pipeline_helpers import MOCK, chat

REPO_ROOT = Path(__file__).resolve().parents[1]


def _spawn_worker(stage: str, url: str, namespace: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "CONVEYOR_NAMESPACE": namespace,
           "CONVEYOR_NATS_URLS": url, "CONVEYOR_REGISTRY_TTL_S": "3", "CONVEYOR_MOCK_INTER_TOKEN_S": "0.01"}
    return subprocess.Popen([sys.executable, "-m", "workers.cli", "worker", stage, "--engine", "mock",
                             "--log-level", "WARNING"], cwd=REPO_ROOT, env=env)


@asynccontextmanager
async def worker_processes(url: str, namespace: str, stages: list[str]) -> AsyncIterator[list[subprocess.Popen[bytes]]]:
    workers = [_spawn_worker(stage, url, namespace) for stage in stages]
    try:
        yield workers
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            try:
                worker.wait(timeout=15)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()


async def _wait_ready(client: PipelineClient, num_workers: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            cards = await client.live_workers()
            if MOCK in ready_models(cards) and len([c for c in cards if c.ready]) >= num_workers:
                return
        except Exception:  # the server is still coming back
            pass
        await asyncio.sleep(0.2)
    raise AssertionError(f"pipeline not ready within {timeout_s} s")


async def _ask(client: PipelineClient, max_tokens: int, timeout_s: float = 20.0) -> FinalFrame:
    request = chat(client, f"hello {uuid.uuid4().hex[:6]}", max_tokens=max_tokens)
    async with await client.submit(request, first_frame_timeout_s=timeout_s) as stream:
        async for _ in stream:
            pass
    assert isinstance(stream.terminal, FinalFrame)
    return stream.terminal


@pytest.mark.parametrize(("halt_signal", "fresh_store"), [
    (signal.SIGKILL, False), (signal.SIGTERM, False), (signal.SIGKILL, True),
], ids=["sigkill", "sigterm", "sigkill-empty-store"])
async def test_new_requests_succeed_within_seconds_after_a_nats_restart_under_load(
    tmp_path: Path, halt_signal: signal.Signals, fresh_store: bool
) -> None:
    settings = bus_settings(registry_ttl_s=3.0, heartbeat_timeout_s=10.0)
    server = EmbeddedNatsServer(store_dir=tmp_path / "store")
    server.start()
    try:
        nats = NatsSettings(urls=[server.url])
        async with worker_processes(server.url, settings.namespace, ["processor", "decode", "decode"]):
            async with open_client(nats, settings, "restart-test") as client:
                await _wait_ready(client, num_workers=3, timeout_s=90)
                assert (await _ask(client, max_tokens=5)).usage.completion_tokens == 5

                # Streams in flight when the server goes.
                in_flight = [asyncio.create_task(_ask(client, max_tokens=300)) for _ in range(20)]
                await asyncio.sleep(0.5)
                server.halt(halt_signal)
                await asyncio.sleep(1.0)
                if fresh_store:  # a server replaced by one that knows nothing: every stream re-declared
                    server.move_store(tmp_path / "new-store")
                server.start()
                restarted_at = time.monotonic()
                outcomes = await asyncio.wait_for(asyncio.gather(*in_flight, return_exceptions=True), timeout=60)
                # Streams in flight finish: frames lost with the server are sent again on reconnect.
                for outcome in outcomes:
                    assert isinstance(outcome, FinalFrame) and outcome.usage.completion_tokens == 300, outcome

                # New requests: every one of them is served, the first within seconds.
                first_served_s = None
                while first_served_s is None:
                    try:
                        await _ask(client, max_tokens=3, timeout_s=5)
                        first_served_s = time.monotonic() - restarted_at
                    except (RemoteError, ReplyStreamBroken, TimeoutError, ConnectionError):
                        assert time.monotonic() - restarted_at < 30, "no request served 30 s after the restart"
                        await asyncio.sleep(0.5)
                finals = await asyncio.gather(*(_ask(client, max_tokens=4) for _ in range(10)))
        assert all(final.usage.completion_tokens == 4 for final in finals)
        assert first_served_s < 10, first_served_s
    finally:
        server.stop()
