"""The secured NATS example (docs/security/nats-server.conf): TLS with a certificate made here, one
user per role. A request is served through it, and a client can neither read another client's
inbox nor publish to a stage queue."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from bus.client import open_client
from bus.connection import tls_context
from bus.server import EmbeddedNatsServer
from bus.settings import BusSettings, NatsSettings
from schemas.registry import ServingMode, Stage
from schemas.replies import FinalFrame
from tests.pipeline_helpers import MOCK, chat, mock_decode, mock_processor
from workers.runtime import WorkerOptions, WorkerRuntime

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "security" / "nats-server.conf"
PASSWORDS = {user: f"{user}-change-me" for user in ("alice", "bob", "gateway", "processor", "prefill", "decode")}

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")


def make_certificates(directory: Path) -> None:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca-key.pem", "-out", "ca.pem", "-days", "1",
        "-subj", "/CN=Conveyor test CA")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server-key.pem", "-out", "server.csr", "-subj", "/CN=localhost")
    (directory / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca-key.pem", "-CAcreateserial",
        "-out", "server.pem", "-days", "1", "-extfile", "san.cnf")


@pytest.fixture
def secured_server(tmp_path: Path) -> Iterator[EmbeddedNatsServer]:
    make_certificates(tmp_path)
    config = tmp_path / "nats-server.conf"
    config.write_text(EXAMPLE.read_text().replace("{{CERT_DIR}}", str(tmp_path)))
    with EmbeddedNatsServer(config_file=config, store_dir=tmp_path / "store", scheme="tls") as server:
        yield server


def as_user(server: EmbeddedNatsServer, user: str) -> NatsSettings:
    return NatsSettings(urls=[server.url], user=user, password=PASSWORDS[user], inbox_prefix=f"_INBOX.{user}",
                        tls_ca_file=Path(server.config_file.parent / "ca.pem"))  # type: ignore[union-attr]


async def start_role_workers(server: EmbeddedNatsServer, bus: BusSettings,
                             inter_token_s: float) -> list[tuple[WorkerRuntime, asyncio.Task[None]]]:
    """A processor and a mock decode worker, each connected as its own role's user."""
    runtimes = []
    for stage, built in ((Stage.PROCESSOR, mock_processor()), (Stage.DECODE, mock_decode(inter_token_s=inter_token_s))):
        options = WorkerOptions(stage=stage, model=MOCK, mode=ServingMode.AGGREGATED, engine_name="mock",
                                http_host="127.0.0.1", handle_signals=False, canary_wait_s=3600)
        runtime = WorkerRuntime(built, options, as_user(server, stage.value), bus)
        runtimes.append((runtime, asyncio.create_task(runtime.run())))
        await asyncio.wait_for(runtime.started.wait(), timeout=30)
    return runtimes


async def test_secured_pipeline_serves_a_request_and_enforces_each_roles_rights(secured_server: EmbeddedNatsServer) -> None:
    bus = BusSettings(namespace="conveyor", work_max_bytes=8 << 20, heartbeat_interval_s=0.2)
    runtimes = await start_role_workers(secured_server, bus, inter_token_s=0.001)
    try:
        async with open_client(as_user(secured_server, "alice"), bus, "alice") as client:
            request = chat(client, "hello over TLS", max_tokens=3)
            async with await client.submit(request) as stream:
                chunks, final = await stream.collect()
            assert isinstance(final, FinalFrame) and len(chunks) == 3
            alice_inbox = client.new_inbox()

        violations: list[str] = []

        async def record(error: Exception) -> None:
            violations.append(str(error))

        bob_settings = as_user(secured_server, "bob")
        bob = await nats.connect(servers=bob_settings.urls, user="bob", password=PASSWORDS["bob"],
                                 tls=tls_context(bob_settings), inbox_prefix="_INBOX.bob", error_cb=record,
                                 allow_reconnect=False)
        try:
            await bob.subscribe(alice_inbox.rsplit(".", 1)[0] + ".>")  # eavesdrop on alice's replies
            await bob.publish("conveyor.work.decode.mock", b"\x80")  # skip the processor
            await bob.flush()
            await asyncio.sleep(0.5)
        finally:
            await bob.close()
        assert any("permissions violation for subscription" in v.lower() and "_inbox.alice" in v.lower() for v in violations)
        assert any("permissions violation for publish" in v.lower() and "conveyor.work.decode" in v.lower() for v in violations)
    finally:
        for runtime, task in runtimes:
            runtime.request_stop()
        await asyncio.gather(*(task for _, task in runtimes), return_exceptions=True)


async def test_client_that_does_not_trust_the_ca_cannot_connect(secured_server: EmbeddedNatsServer) -> None:
    plain = NatsSettings(urls=[secured_server.url.replace("tls://", "nats://")], user="alice",
                         password=PASSWORDS["alice"], initial_connect_timeout_s=3)
    with pytest.raises(ConnectionError):
        async with open_client(plain, BusSettings(), "plain"):
            pass


async def raw_connection(server: EmbeddedNatsServer, user: str, violations: list[str]) -> nats.NATS:
    settings = as_user(server, user)

    async def record(error: Exception) -> None:
        violations.append(str(error).lower())

    return await nats.connect(servers=settings.urls, user=user, password=PASSWORDS[user], tls=tls_context(settings),
                              inbox_prefix=f"_INBOX.{user}", error_cb=record, allow_reconnect=False)


async def test_no_client_cancels_anothers_request_reads_the_bus_or_forges_a_card(secured_server: EmbeddedNatsServer) -> None:
    from schemas.codec import encode
    from schemas.control import Cancel
    from schemas.replies import FinishReason

    bus = BusSettings(namespace="conveyor", work_max_bytes=8 << 20, heartbeat_interval_s=0.2)
    runtimes = await start_role_workers(secured_server, bus, inter_token_s=0.01)
    violations: list[str] = []
    try:
        async with open_client(as_user(secured_server, "bob"), bus, "bob") as bob, \
                open_client(as_user(secured_server, "alice"), bus, "alice") as alice:
            bobs = chat(bob, "a long answer, please", max_tokens=150)
            async with await bob.submit(bobs) as bobs_stream:
                await bobs_stream.__aiter__().__anext__()
                intruder = await raw_connection(secured_server, "alice", violations)
                try:
                    cancel = encode(Cancel(request_id=bobs.request_id, reason="mischief", sent_at_s=1.0))
                    await intruder.publish("conveyor.control.cancel", cancel)  # the any-request subject
                    await intruder.publish("conveyor.control.cancel.bob", cancel)  # bob's scope
                    await intruder.publish("conveyor.control.cancel.alice", cancel)  # allowed, but not bob's request
                    await intruder.subscribe("conveyor.kv.>")  # the KV events
                    await intruder.subscribe("$KV.conveyor_workers.>")  # the registry
                    await intruder.publish("$JS.API.STREAM.INFO.CONVEYOR_KV_EVENTS", b"")
                    await intruder.publish("$KV.conveyor_workers.forged-worker", b"{}")  # a forged card
                    await intruder.flush()
                    await asyncio.sleep(0.5)
                finally:
                    await intruder.close()
                chunks = [chunk async for chunk in bobs_stream]
            assert isinstance(bobs_stream.terminal, FinalFrame)
            assert bobs_stream.terminal.finish_reason == FinishReason.LENGTH and len(chunks) == 149

            # A client cancels its own request (scoped to its inboxes) and that works.
            own = chat(alice, "another long one", max_tokens=500)
            async with await alice.submit(own) as own_stream:
                await own_stream.__aiter__().__anext__()
                await alice.cancel(own.request_id)
                _, final = await own_stream.collect()
            assert isinstance(final, FinalFrame) and final.finish_reason == FinishReason.CANCELLED

        # A worker of one role cannot feed another role's queue.
        worker = await raw_connection(secured_server, "decode", violations)
        try:
            await worker.publish("conveyor.work.prefill.mock", b"\x80")
            await worker.publish("conveyor.work.processor", b"\x80")
            await worker.flush()
            await asyncio.sleep(0.5)
        finally:
            await worker.close()
    finally:
        for runtime, task in runtimes:
            runtime.request_stop()
        await asyncio.gather(*(task for _, task in runtimes), return_exceptions=True)

    def refused(kind: str, subject: str) -> bool:
        return any(f"permissions violation for {kind}" in v and subject.lower() in v for v in violations)

    assert refused("publish", '"conveyor.control.cancel"')
    assert refused("publish", "conveyor.control.cancel.bob")
    assert not refused("publish", "conveyor.control.cancel.alice")
    assert refused("subscription", "conveyor.kv.>")
    assert refused("subscription", "$kv.conveyor_workers.>")
    assert refused("publish", "$js.api.stream.info.conveyor_kv_events")
    assert refused("publish", "$kv.conveyor_workers.forged-worker")
    assert refused("publish", "conveyor.work.prefill.mock")
    assert refused("publish", '"conveyor.work.processor"')
