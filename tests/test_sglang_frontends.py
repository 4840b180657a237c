"""Several processes streaming one SGLang engine (workers/engines/frontends.py), testable without sglang: the engine
arguments, the settings refused, the handle file, and the frontend processes' start, watch and stop."""

from __future__ import annotations

import asyncio
import os
import pickle
import stat
import sys
from pathlib import Path

import pytest
import structlog
from pydantic import ValidationError

from workers.engines.frontends import ATTACH_VARIABLE, EngineHandle, Frontends, frontend_command, read_handle, write_handle
from workers.engines.protocol import DisaggregationRole
from workers.engines.sglang_engine import SGLangEngineConfig, server_args

# A stand-in frontend: writes the handle path it was given where the test reads it, then waits for its SIGTERM.
_FRONTEND = """
import os, signal, sys, time
open(sys.argv[1] + "." + str(os.getpid()), "w").write(os.environ["CONVEYOR_SGLANG_ATTACH"])
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
time.sleep(60)
"""


def _handle(num_frontends: int) -> EngineHandle:
    return EngineHandle(port_args={"scheduler_input_ipc_name": "ipc:///tmp/x"}, server_args={"model_path": "/m"},
                        scheduler_info={"max_req_input_len": 4096}, kv_events_port=5557, num_frontends=num_frontends)


def test_several_frontends_start_sglang_with_as_many_tokenizer_workers() -> None:
    assert server_args(SGLangEngineConfig(model_path="/m", frontends=3), 1, 2)["tokenizer_worker_num"] == 3
    assert "tokenizer_worker_num" not in server_args(SGLangEngineConfig(model_path="/m"), 1, 2)


@pytest.mark.parametrize("settings, named", [
    ({"role": DisaggregationRole.PREFILL}, "prefill engine streams no tokens"),
    ({"enable_lora": True}, "LoRA adapters are served with one frontend"),
])
def test_frontends_are_refused_where_they_cannot_work_with_the_setting_named(settings: dict, named: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValidationError, match=named):
        SGLangEngineConfig(model_path="/m", frontends=2, **settings)
    SGLangEngineConfig(model_path="/m", frontends=1, **settings)  # one frontend: as before


def test_the_frontends_setting_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CONVEYOR_SGLANG_FRONTENDS", "4")
    monkeypatch.setenv(ATTACH_VARIABLE, str(tmp_path / "h"))
    config = SGLangEngineConfig(model_path="/m")
    assert (config.frontends, config.attach) == (4, tmp_path / "h")


def test_the_handle_round_trips_through_a_file_only_its_user_reads(tmp_path: Path) -> None:
    path = write_handle(_handle(3))
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert read_handle(path) == _handle(3)
    finally:
        path.unlink()
    other = tmp_path / "other"
    other.write_bytes(pickle.dumps({"not": "a handle"}))
    with pytest.raises(ValueError, match="does not hold an engine handle"):
        read_handle(other)


def test_a_frontend_runs_this_processs_own_command_line() -> None:
    assert frontend_command() == [sys.executable, *sys.orig_argv[1:]]


async def _written(prefix: Path, count: int, timeout_s: float = 20.0) -> list[Path]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        found = sorted(prefix.parent.glob(prefix.name + ".*"))
        if len(found) == count:
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"{count} frontends did not start within {timeout_s} s")


async def test_frontends_get_the_handle_and_stop_with_it_removed(tmp_path: Path) -> None:
    seen = tmp_path / "seen"
    frontends = Frontends.start(_handle(3), [sys.executable, "-c", _FRONTEND, str(seen)])
    written = await _written(seen, 2)  # the first frontend is the process that started the others
    handle_path = Path(written[0].read_text())
    assert {Path(path.read_text()) for path in written} == {handle_path}
    assert read_handle(handle_path) == _handle(3)
    assert sorted(int(path.suffix[1:]) for path in written) == sorted(frontends.pids)
    await frontends.stop(grace_s=10)
    assert not handle_path.exists()
    for pid in frontends.pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


async def test_a_frontend_that_exits_by_itself_is_reported_once() -> None:
    with structlog.testing.capture_logs() as logs:
        frontends = Frontends.start(_handle(2), [sys.executable, "-c", "import sys; sys.exit(3)"])
        await asyncio.sleep(2.5)
        await frontends.stop(grace_s=5)
    exits = [entry for entry in logs if entry["event"] == "sglang.frontend_exited"]
    assert [(entry["pid"], entry["code"]) for entry in exits] == [(frontends.pids[0], 3)]
