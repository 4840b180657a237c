"""A NATS cluster of 3 losing a node under load: streams replicated 3 times, workers and clients on
every node; the streams in flight finish and new requests are served."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from bus.client import PipelineClient, open_client
from bus.connection import connect
from bus.errors import RemoteError, ReplyStreamBroken
from bus.registry import ready_models
from bus.server import EmbeddedNatsCluster
from bus.settings import NatsSettings
from bus.streams import declare_all
from bus.subjects import Names
from schemas.replies import FinalFrame
from tests.conftest import bus_settings
from tests.pipeline_helpers import MOCK, chat

REPO_ROOT = Path(__file__).resolve().parents[1]


def spawn(stage: str, urls: list[str], settings_env: dict[str, str]) -> subprocess.Popen[bytes]:
    env = {**os.environ, **settings_env, "PYTHONPATH": str(REPO_ROOT), "CONVEYOR_NATS_URLS": ",".join(urls),
           "CONVEYOR_MOCK_INTER_TOKEN_S": "0.01"}
    return subprocess.Popen([sys.executable, "-m", "workers.cli", "worker", stage, "--engine", "mock",
                             "--log-level", "WARNING", "--shutdown-grace-s", "1"], cwd=REPO_ROOT, env=env)


async def ask(client: PipelineClient, max_tokens: int, timeout_s: float = 30.0) -> FinalFrame:
    request = chat(client, f"hello {uuid.uuid4().hex[:6]}", max_tokens=max_tokens)
    async with await client.submit(request, first_frame_timeout_s=timeout_s) as stream:
        async for _ in stream:
            pass
    assert isinstance(stream.terminal, FinalFrame)
    return stream.terminal


async def wait_until_served(client: PipelineClient, num_workers: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            cards = [card for card in await client.live_workers() if card.ready]
            if MOCK in ready_models(cards) and len(cards) >= num_workers:
                return
        except Exception:  # JetStream is electing its leaders
            pass
        await asyncio.sleep(0.2)
    raise AssertionError(f"pipeline not ready within {timeout_s} s")


async def declare_when_ready(urls: list[str], settings: object, timeout_s: float = 30.0) -> None:
    """Declare the namespace once the nodes have elected a JetStream meta leader."""
    nc = await connect(NatsSettings(urls=urls), name="cluster-setup")
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                await declare_all(nc.jetstream(), Names(settings.namespace), settings, nc.max_payload)  # type: ignore[attr-defined,arg-type]
                return
            except Exception:
                assert time.monotonic() < deadline, "JetStream did not come up on the cluster"
                await asyncio.sleep(0.5)
    finally:
        await nc.close()


async def test_a_cluster_node_dying_under_load_loses_no_request(tmp_path: Path) -> None:
    settings = bus_settings(stream_replicas=3, registry_ttl_s=3.0, heartbeat_timeout_s=10.0, ack_wait_s=4.0)
    settings_env = {"CONVEYOR_NAMESPACE": settings.namespace, "CONVEYOR_STREAM_REPLICAS": "3",
                    "CONVEYOR_REGISTRY_TTL_S": "3"}
    cluster = EmbeddedNatsCluster(tmp_path, size=3)
    cluster.start()
    workers: list[subprocess.Popen[bytes]] = []
    try:
        await declare_when_ready(cluster.urls, settings)
        async with open_client(NatsSettings(urls=cluster.urls), settings, "cluster-test") as client:
            # One worker per node at least: each connects to a random node of the list.
            workers = [spawn(stage, cluster.urls, settings_env) for stage in ("processor", "processor", "decode", "decode")]
            await wait_until_served(client, num_workers=4, timeout_s=90)
            assert (await ask(client, max_tokens=5)).usage.completion_tokens == 5

            in_flight = [asyncio.create_task(ask(client, max_tokens=300)) for _ in range(20)]
            await asyncio.sleep(0.5)
            cluster.nodes[0].halt(signal.SIGKILL)
            lost_at = time.monotonic()
            outcomes = await asyncio.wait_for(asyncio.gather(*in_flight, return_exceptions=True), timeout=90)
            for outcome in outcomes:
                assert isinstance(outcome, FinalFrame) and outcome.usage.completion_tokens == 300, outcome

            first_served_s = None
            while first_served_s is None:
                try:
                    await ask(client, max_tokens=3, timeout_s=5)
                    first_served_s = time.monotonic() - lost_at
                except (RemoteError, ReplyStreamBroken, TimeoutError, ConnectionError):
                    assert time.monotonic() - lost_at < 30, "no request served 30 s after the node died"
                    await asyncio.sleep(0.5)
            finals = await asyncio.gather(*(ask(client, max_tokens=4) for _ in range(10)))
        assert all(final.usage.completion_tokens == 4 for final in finals)
        assert first_served_s < 15, first_served_s
        assert all(worker.poll() is None for worker in workers), "a worker died with the node"
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            try:
                worker.wait(timeout=15)
            except subprocess.TimeoutExpired:
                worker.kill()
        cluster.stop()

