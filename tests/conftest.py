"""Fixtures: one real nats-server with JetStream per test session, a fresh namespace per test."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from bus.cancel import CancelRegistry
from bus.connection import connect
from bus.server import EmbeddedNatsServer
from bus.settings import BusSettings, NatsSettings
from bus.streams import declare_all_when_ready, delete_all
from bus.subjects import Names

# Worker processes the tests start read their streams' caps from the environment. JetStream reserves every cap up
# front against 75% of the disk's free space: small caps keep the suite passing on a nearly full disk.
os.environ.setdefault("CONVEYOR_WORK_MAX_BYTES", str(8 << 20))
os.environ.setdefault("CONVEYOR_JOURNAL_MAX_BYTES", str(8 << 20))


@pytest.fixture(scope="session")
def nats_server() -> Iterator[EmbeddedNatsServer]:
    with EmbeddedNatsServer() as server:
        yield server


# How many of the shared server's last log lines a failed test's report carries.
SERVER_LOG_LINES = 30


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test that used the shared nats-server reports the server's last log lines: a JetStream error (e.g.
    "error creating store for stream") says only what failed, the server's log says why, and its store (the log
    with it) is gone once the session ends."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    server = getattr(item, "funcargs", {}).get("nats_server")
    if report.failed and isinstance(server, EmbeddedNatsServer) and server.log_file.exists():
        lines = server.log_file.read_text(errors="replace").splitlines()[-SERVER_LOG_LINES:]
        report.sections.append(("nats-server log (last lines)", "\n".join(lines)))


@pytest.fixture
def nats_settings(nats_server: EmbeddedNatsServer) -> NatsSettings:
    return NatsSettings(urls=[nats_server.url])


@dataclass
class Bus:
    """A connection and a declared namespace of our own, so tests never see each other's streams."""

    nc: Client
    js: JetStreamContext
    names: Names
    settings: BusSettings
    registry: KeyValue
    nats_settings: NatsSettings

    async def cancel_registry(self) -> CancelRegistry:
        registry = CancelRegistry(self.nc, self.js, self.names, self.settings.cancel_ttl_s)
        await registry.start()
        return registry


def bus_settings(**overrides: object) -> BusSettings:
    namespace = f"t{uuid.uuid4().hex[:10]}"
    defaults: dict[str, object] = {
        "namespace": namespace,
        "ack_wait_s": 5.0,
        "max_deliver": 3,
        "retry_base_s": 0.1,
        "retry_max_s": 1.0,
        "heartbeat_interval_s": 0.2,
        "heartbeat_timeout_s": 1.0,
        "registry_ttl_s": 3.0,
        # Every test declares its own namespace; keep the storage each reserves small.
        "work_max_bytes": 8 << 20,
    }
    return BusSettings(**{**defaults, **overrides})  # type: ignore[arg-type]


@pytest.fixture
def settings() -> BusSettings:
    return bus_settings()


@pytest.fixture
async def bus(nats_settings: NatsSettings, settings: BusSettings) -> AsyncIterator[Bus]:
    nc = await connect(nats_settings, name="tests")
    js = nc.jetstream()
    names = Names(settings.namespace)
    # As a worker declares them (workers/runtime.py): JetStream's transient errors retried. One CI run of many saw
    # nats-server answer a fresh namespace's first stream with 'error creating store for stream' (10049) once.
    registry = await declare_all_when_ready(js, names, settings, nc.max_payload, timeout_s=10)
    try:
        yield Bus(nc=nc, js=js, names=names, settings=settings, registry=registry, nats_settings=nats_settings)
    finally:
        await delete_all(js, names)
        await nc.close()

