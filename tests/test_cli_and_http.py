"""The command line and the health endpoint, as a user meets them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from typer.testing import CliRunner

from bus.metrics import MESSAGES_IN
from bus.server import EmbeddedNatsServer
from workers.cli import app
from workers.http import HealthServer

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_schema_command_writes_one_json_schema_per_message(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["schema", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    written = {path.stem for path in tmp_path.glob("*.json")}
    assert {"ChatRequest", "DecodeTask", "TokenChunk", "FinalFrame", "Cancel", "KvEventBatch", "WorkerCard"} <= written
    chat = json.loads((tmp_path / "ChatRequest.json").read_text())
    assert "messages" in chat["required"]


def test_commands_run_on_uvloop_unless_asyncio_is_asked_for(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    from workers.cli import run_loop

    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert run_loop(loop_module()).startswith("uvloop")
    monkeypatch.setenv("CONVEYOR_EVENT_LOOP", "asyncio")
    assert run_loop(loop_module()).startswith("asyncio")


async def test_a_blocked_event_loop_shows_in_the_lag_histogram() -> None:
    import asyncio
    import time

    from bus.lifecycle import event_loop_lag_observed
    from tests.helpers import metric

    slow_before = metric("conveyor_event_loop_lag_seconds_count") - metric("conveyor_event_loop_lag_seconds_bucket", le="0.1")
    async with event_loop_lag_observed(interval_s=0.02):
        await asyncio.sleep(0.05)
        time.sleep(0.3)  # a handler holding the loop: the timer fires ~0.28 s late
        await asyncio.sleep(0.05)
    slow_after = metric("conveyor_event_loop_lag_seconds_count") - metric("conveyor_event_loop_lag_seconds_bucket", le="0.1")
    assert slow_after - slow_before == 1
    assert metric("conveyor_event_loop_lag_seconds_sum") >= 0.25


async def wakes_in(seconds: float) -> float:
    """How many times the loop's timer fired in `seconds` (under the settings in the environment now)."""
    import asyncio

    from bus.lifecycle import event_loop_lag_observed
    from tests.helpers import metric

    before = metric("conveyor_event_loop_lag_seconds_count")
    async with event_loop_lag_observed():
        await asyncio.sleep(seconds)
    return metric("conveyor_event_loop_lag_seconds_count") - before


async def test_the_loop_tick_setting_sets_how_often_an_idle_loop_wakes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic import ValidationError

    monkeypatch.setattr("bus.lifecycle._last_work_s", float("-inf"))  # no work yet in this process
    assert await wakes_in(0.3) <= 3  # the default: every 100 ms
    monkeypatch.setenv("CONVEYOR_LOOP_TICK_MS", "5")
    assert await wakes_in(0.3) >= 20
    monkeypatch.setenv("CONVEYOR_LOOP_TICK_MS", "0")
    with pytest.raises(ValidationError, match="loop_tick_ms"):
        await wakes_in(0.01)


async def test_a_process_that_just_had_work_keeps_its_loop_warm_for_a_while(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from bus.lifecycle import note_work

    monkeypatch.setenv("CONVEYOR_STAY_WARM_S", "0.5")
    note_work()
    assert await wakes_in(0.2) >= 50  # warm: about every millisecond
    await asyncio.sleep(0.4)
    assert await wakes_in(0.3) <= 3  # the work is over half a second old: back to every 100 ms
    monkeypatch.setenv("CONVEYOR_STAY_WARM_S", "0")
    note_work()
    assert await wakes_in(0.3) <= 3  # never warm


def test_smoke_command_streams_a_reply_through_an_embedded_server() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "workers.cli", "smoke", "one two three"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.split() == ["one", "two", "three"]
    assert "finish_reason=stop" in completed.stderr


def test_streams_command_declares_and_lists_the_namespace(nats_server: EmbeddedNatsServer) -> None:
    result = CliRunner().invoke(app, ["streams", "--nats", nats_server.url, "--namespace", "clitest", "--declare"])
    assert result.exit_code == 0, result.output
    assert "CLITEST_WORK_DECODE" in result.output and "KV_clitest_workers" in result.output
    CliRunner().invoke(app, ["streams", "--nats", nats_server.url, "--namespace", "clitest", "--delete"])


def test_a_server_with_no_room_for_the_streams_is_one_message_and_exit_code_1(tmp_path: Path) -> None:
    config = tmp_path / "small-store.conf"
    config.write_text("jetstream { max_file_store: 4MB }\n")
    with EmbeddedNatsServer(store_dir=tmp_path / "store", config_file=config) as server:
        result = CliRunner().invoke(app, ["streams", "--nats", server.url, "--namespace", "full", "--declare"],
                                    env={"CONVEYOR_WORK_MAX_BYTES": str(8 << 20)})
    assert result.exit_code == 1
    assert "no room to reserve stream FULL_" in result.output and "CONVEYOR_WORK_MAX_BYTES" in result.output
    assert "Traceback" not in result.output


def test_unreachable_nats_is_reported_with_the_url() -> None:
    result = CliRunner().invoke(app, ["streams", "--nats", "nats://127.0.0.1:1"], env={"CONVEYOR_NATS_INITIAL_CONNECT_TIMEOUT_S": "2"})
    assert result.exit_code != 0
    assert "cannot reach NATS at nats://127.0.0.1:1" in str(result.exception)


async def test_health_server_serves_metrics_live_and_ready() -> None:
    reason: list[str | None] = ["engine warming up"]
    server = HealthServer("127.0.0.1", 0, readiness=lambda: reason[0])
    await server.start()
    MESSAGES_IN.labels(stage="decode").inc(0)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{server.url}/live") as live:
                assert live.status == 200
            async with session.get(f"{server.url}/ready") as not_ready:
                assert not_ready.status == 503
                assert (await not_ready.json())["reason"] == "engine warming up"
            reason[0] = None
            async with session.get(f"{server.url}/ready") as ready:
                assert ready.status == 200
            async with session.get(f"{server.url}/metrics") as metrics:
                assert "conveyor_messages_in_total" in await metrics.text()
    finally:
        await server.stop()


def test_dlq_command_lists_dead_letters_and_replays_one(nats_server: EmbeddedNatsServer) -> None:
    import asyncio

    from bus.connection import connect
    from bus.settings import BusSettings, NatsSettings
    from bus.streams import declare_all, delete_all
    from bus.subjects import Names

    names = Names("clidlq")

    async def plant() -> None:
        nc = await connect(NatsSettings(urls=[nats_server.url]), "plant")
        js = nc.jetstream()
        await declare_all(js, names, BusSettings(namespace="clidlq", work_max_bytes=8 << 20), nc.max_payload)
        await js.publish(names.dead_letter_subject("decode"), b"payload", headers={
            "Conveyor-Dead-Reason": "max_deliver", "Conveyor-Dead-Detail": "ConnectionError('engine unreachable')",
            "Conveyor-Dead-Subject": "clidlq.work.decode.m", "Conveyor-Dead-Deliveries": "5"})
        await nc.close()

    async def work_queue_length() -> int:
        nc = await connect(NatsSettings(urls=[nats_server.url]), "check")
        info = await nc.jetstream().stream_info("CLIDLQ_WORK_DECODE")
        await delete_all(nc.jetstream(), names)
        await nc.close()
        return info.state.messages

    asyncio.run(plant())
    args = ["dlq", "--nats", nats_server.url, "--namespace", "clidlq"]
    listed = CliRunner().invoke(app, args)
    assert listed.exit_code == 0, listed.output
    assert "max_deliver" in listed.output and "engine unreachable" in listed.output and "decode" in listed.output
    replayed = CliRunner().invoke(app, [*args, "--replay", "1"])
    assert replayed.exit_code == 0, replayed.output
    assert "no dead letters" in CliRunner().invoke(app, args).output
    assert asyncio.run(work_queue_length()) == 1
