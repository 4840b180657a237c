"""Declaring streams and consumers is idempotent; publishing is size-checked and deduplicated."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from nats.js.api import RetentionPolicy

from bus.connection import connect
from bus.errors import PayloadTooLarge
from bus.publish import TaskPublisher
from bus.server import EmbeddedNatsServer, sweep_orphaned_stores
from bus.settings import BusSettings, NatsSettings
from bus.streams import (StoreTooSmall, declare_all, declare_all_when_ready, ensure_work_consumer, report,
                         work_consumer_config)
from bus.subjects import Names, model_token
from bus.tracing import TraceContext
from schemas.registry import Stage
from schemas.tasks import DecodeTask, PreprocessedRequest, TaskHeader
from tests.conftest import Bus
from tests.helpers import decode_task, stream_len


async def test_declaring_everything_twice_changes_nothing(bus: Bus) -> None:
    before = {r.name: r for r in await report(bus.js, bus.names)}
    await declare_all(bus.js, bus.names, bus.settings, bus.nc.max_payload)
    after = {r.name: r for r in await report(bus.js, bus.names)}
    assert before.keys() == after.keys() == set(bus.names.all_streams)
    work = await bus.js.stream_info(bus.names.work_stream(Stage.DECODE))
    assert work.config.retention == RetentionPolicy.WORK_QUEUE
    assert work.config.duplicate_window == bus.settings.dedupe_window_s


async def test_changed_limits_update_the_existing_stream(bus: Bus) -> None:
    changed = bus.settings.model_copy(update={"work_max_age_s": 120.0})
    await declare_all(bus.js, bus.names, changed, bus.nc.max_payload)
    info = await bus.js.stream_info(bus.names.work_stream(Stage.PREFILL))
    assert info.config.max_age == 120.0


async def test_declaring_the_shared_consumer_twice_keeps_one(bus: Bus) -> None:
    config = work_consumer_config(bus.names, Stage.DECODE, "org/model.v1", bus.settings, max_ack_pending=64)
    stream = bus.names.work_stream(Stage.DECODE)
    await ensure_work_consumer(bus.js, config, stream)
    await ensure_work_consumer(bus.js, config, stream)
    consumers = await bus.js.consumers_info(stream)
    assert [c.name for c in consumers] == [config.durable_name]
    assert consumers[0].config.filter_subject == bus.names.work_subject(Stage.DECODE, "org/model.v1")


def test_model_names_become_safe_distinct_subject_tokens() -> None:
    assert model_token("SmolLM2-135M") == "SmolLM2-135M"
    dotted, underscored = model_token("org/m.1"), model_token("org_m_1")
    assert dotted != underscored
    assert "." not in dotted and "/" not in dotted
    names = Names("acme")
    assert names.work_subject(Stage.DECODE, "org/m.1") == f"acme.work.decode.{dotted}"
    assert names.work_stream(Stage.DECODE) == "ACME_WORK_DECODE"


async def test_oversize_task_is_refused_before_it_reaches_the_server(bus: Bus) -> None:
    publisher = TaskPublisher(bus.js, bus.names, max_message_bytes=64 * 1024)
    huge = DecodeTask(
        header=TaskHeader(request_id="huge", reply_to="_INBOX.x", created_at_s=0.0),
        request=PreprocessedRequest(model="m", token_ids=list(range(100_000, 130_000))),
    )
    with pytest.raises(PayloadTooLarge, match="over the limit of 65536 bytes"):
        await publisher.publish(Stage.DECODE, huge, "huge", TraceContext.new())
    assert await stream_len(bus, Stage.DECODE) == 0


async def test_republished_request_id_is_dropped_as_a_duplicate(bus: Bus) -> None:
    publisher = TaskPublisher(bus.js, bus.names, bus.settings.max_message_bytes)
    task = decode_task("once")
    assert await publisher.publish(Stage.DECODE, task, task.request_id, TraceContext.new())
    assert not await publisher.publish(Stage.DECODE, task, task.request_id, TraceContext.new())
    assert await stream_len(bus, Stage.DECODE) == 1


async def test_a_publish_stored_but_unacknowledged_is_not_mistaken_for_another_requests(tmp_path: Path) -> None:
    # The server is paused while the task is in flight: the first attempt's ack never comes in time, the task
    # is stored once the server resumes, and the retry is answered "duplicate" — of this very task.
    with EmbeddedNatsServer(store_dir=tmp_path) as server:
        nc = await connect(NatsSettings(urls=[server.url]), "lost-ack-test")
        try:
            names, settings = Names("lostack"), BusSettings(namespace="lostack")
            await declare_all(nc.jetstream(), names, settings, nc.max_payload)
            publisher = TaskPublisher(nc.jetstream(), names, settings.max_message_bytes, ack_timeout_s=0.5)
            task = decode_task("lost-ack")
            assert server.pid is not None
            os.kill(server.pid, signal.SIGSTOP)
            asyncio.get_running_loop().call_later(0.8, os.kill, server.pid, signal.SIGCONT)
            assert await publisher.publish(Stage.DECODE, task, task.request_id, TraceContext.new())
            info = await nc.jetstream().stream_info(names.work_stream(Stage.DECODE))
            assert info.state.messages == 1
        finally:
            await nc.close()


async def test_message_limit_is_capped_by_the_servers_max_payload() -> None:
    with EmbeddedNatsServer(max_payload_bytes=256 * 1024) as server:
        from bus.connection import connect
        from bus.settings import NatsSettings

        nc = await connect(NatsSettings(urls=[server.url]), "small")
        try:
            settings = BusSettings(namespace="capped", work_max_bytes=1 << 20)
            await declare_all(nc.jetstream(), Names("capped"), settings, nc.max_payload)
            info = await nc.jetstream().stream_info("CAPPED_WORK_DECODE")
            assert info.config.max_msg_size == 256 * 1024
        finally:
            await nc.close()


async def test_a_store_too_small_for_the_streams_fails_at_once_saying_which_setting_to_change(tmp_path: Path) -> None:
    # The server reserves every stream's cap up front; a full disk gives it the same small limit as this config.
    config = tmp_path / "small-store.conf"
    config.write_text("jetstream { max_file_store: 16MB }\n")
    with EmbeddedNatsServer(store_dir=tmp_path / "store", config_file=config) as server:
        nc = await connect(NatsSettings(urls=[server.url]), "small-store")
        try:
            settings = BusSettings(namespace="cramped", work_max_bytes=8 << 20)
            started_s = asyncio.get_running_loop().time()
            with pytest.raises(StoreTooSmall, match="CONVEYOR_WORK_MAX_BYTES") as refused:
                await declare_all_when_ready(nc.jetstream(), Names("cramped"), settings, nc.max_payload,
                                             timeout_s=30)
            # Not retried for the whole timeout: waiting makes no room.
            assert asyncio.get_running_loop().time() - started_s < 5
            assert "CRAMPED_" in str(refused.value) and "max_file_store" in str(refused.value)
        finally:
            await nc.close()


async def test_a_server_we_start_on_a_nearly_full_disk_still_takes_the_streams(tmp_path: Path) -> None:
    # Caps summing past 75% of the free disk stand for the default caps on a nearly full disk.
    free_bytes = shutil.disk_usage(tmp_path).free
    settings = BusSettings(namespace="roomy", work_max_bytes=free_bytes // 4)
    for floor_bytes, fits in ((0, False), (4 * free_bytes, True)):
        store = tmp_path / f"floor-{floor_bytes}"
        store.mkdir()
        with EmbeddedNatsServer(store_dir=store, file_store_floor_bytes=floor_bytes) as server:
            assert server.file_store_raised is fits
            assert (server.store_note() is not None) is fits
            nc = await connect(NatsSettings(urls=[server.url]), "roomy")
            try:
                if fits:
                    await declare_all(nc.jetstream(), Names("roomy"), settings, nc.max_payload)
                    assert len(await report(nc.jetstream(), Names("roomy"))) == len(Names("roomy").all_streams)
                else:
                    with pytest.raises(StoreTooSmall):
                        await declare_all(nc.jetstream(), Names("roomy"), settings, nc.max_payload)
            finally:
                await nc.close()


async def test_a_payload_limit_and_a_config_file_apply_together(tmp_path: Path) -> None:
    config = tmp_path / "conf" / "named.conf"
    config.parent.mkdir()
    config.write_text("server_name: named-by-file\n")
    with EmbeddedNatsServer(store_dir=tmp_path / "store", config_file=config, max_payload_bytes=256 * 1024) as server:
        nc = await connect(NatsSettings(urls=[server.url]), "both")
        try:
            assert nc.max_payload == 256 * 1024
            assert nc._server_info["server_name"] == "named-by-file"
        finally:
            await nc.close()


def test_a_killed_processs_temporary_store_is_removed_by_the_next_server_started(tmp_path: Path) -> None:
    # A process makes a temporary store the way EmbeddedNatsServer does, then dies without cleaning up.
    make_store = ("import sys, tempfile; from pathlib import Path; from bus import server; "
                  "store = Path(tempfile.mkdtemp(prefix='conveyor-nats-', dir=sys.argv[1])); "
                  "lock = server._own_store(store); print(store)")
    orphan = Path(subprocess.run([sys.executable, "-c", make_store, str(tmp_path)], capture_output=True, text=True,
                                 check=True, cwd=Path(__file__).resolve().parents[1]).stdout.strip())
    with EmbeddedNatsServer(store_dir=tmp_path / "kept") as kept:  # a store the caller named: never swept
        assert kept.store_dir.exists()
    alive = EmbeddedNatsServer()  # a live process's temporary store, in the default temp folder
    unknown = tmp_path / "conveyor-nats-without-a-lock"
    unknown.mkdir()
    try:
        assert sweep_orphaned_stores(tmp_path) == [orphan]
        assert not orphan.exists() and unknown.exists() and (tmp_path / "kept").exists()
        assert alive.store_dir not in sweep_orphaned_stores() and alive.store_dir.exists()
    finally:
        alive.stop()


def test_a_temporary_store_is_removed_on_stop() -> None:
    with EmbeddedNatsServer() as server:
        store = server.store_dir
        assert store.exists()
    assert not store.exists()
