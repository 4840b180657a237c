"""Commands that start children never leave them behind: SIGTERM (or Ctrl-C) to the parent stops
them in order, and on Linux even a SIGKILLed parent takes its nats-server and workers with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from bus.server import EmbeddedNatsServer, free_port

REPO_ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PDEATHSIG is Linux's")


def _children_of(pid: int) -> list[int]:
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name (in parentheses) may hold spaces: the fields after it are fixed.
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == pid:
            children.append(int(entry.name))
    return children


def _descendants_of(pid: int) -> list[int]:
    found, frontier = [], [pid]
    while frontier:
        children = _children_of(frontier.pop())
        found += children
        frontier += children
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_for_line(process: subprocess.Popen[str], needle: str, timeout_s: float) -> None:
    assert process.stderr is not None
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line and process.poll() is not None:
            break
        seen.append(line)
        if needle in line:
            return
    raise AssertionError(f"{needle!r} not printed; stderr was:\n{''.join(seen)[-3000:]}")


def _start(args: list[str], ready_line: str, own_session: bool = False) -> tuple[subprocess.Popen[str], list[int]]:
    """`conveyor ARGS` until it prints `ready_line`, and its descendants then. `own_session`: as a terminal's
    foreground job, whose process group Ctrl-C signals whole."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("CONVEYOR_NATS_URLS", None)
    process = subprocess.Popen([sys.executable, "-m", "workers.cli", *args], cwd=REPO_ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               start_new_session=own_session)
    _wait_for_line(process, ready_line, timeout_s=120)
    return process, _descendants_of(process.pid)


def _assert_all_gone(parent: subprocess.Popen[str], children: list[int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and (parent.poll() is None or any(_alive(pid) for pid in children)):
        time.sleep(0.1)
    assert parent.poll() is not None, "the parent did not exit"
    assert not [pid for pid in children if _alive(pid)], "children left running"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_conveyor_server_takes_its_nats_server_with_it(tmp_path: Path, signum: signal.Signals) -> None:
    port = free_port()
    args = ["server", "--port", str(port), "--monitor-port", str(free_port()), "--store-dir", str(tmp_path)]
    parent, children = _start(args, "nats-server ready")
    assert children, "no nats-server child found"
    parent.send_signal(signum)
    _assert_all_gone(parent, children, timeout_s=15)
    # The port is free again: a second server starts on it.
    again, again_children = _start(args, "nats-server ready")
    again.terminate()
    _assert_all_gone(again, again_children, timeout_s=15)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_conveyor_up_leaves_no_worker_or_server_behind(signum: signal.Signals) -> None:
    parent, children = _start(["up", "--engine", "mock", "--decode-replicas", "2"], "pipeline running")
    assert len(children) >= 4, children  # nats-server, processor, two decode workers
    parent.send_signal(signum)
    _assert_all_gone(parent, children, timeout_s=45)


def test_ctrl_c_on_conveyor_up_stops_the_workers_through_their_server_then_the_server() -> None:
    """Ctrl-C signals the terminal's whole foreground group, the workers and the embedded server with it. The server
    keeps running until the workers are gone, so each deregisters and drains through it: nothing is skipped, nothing
    waits out a timeout (before, the server went at once and each worker logged the bus away, 6 s in all)."""
    parent, children = _start(["up", "--engine", "mock"], "pipeline running", own_session=True)
    assert len(children) >= 3, children  # nats-server, processor, decode worker
    stopping_at = time.monotonic()
    os.killpg(parent.pid, signal.SIGINT)
    _assert_all_gone(parent, children, timeout_s=45)
    stopped_s = time.monotonic() - stopping_at
    assert parent.stderr is not None
    after_ctrl_c = parent.stderr.read()
    assert "workers stopped" in after_ctrl_c
    for sign_of_a_missing_bus in ("not connected to NATS", "Server Shutdown", "Traceback", "nats.error"):
        assert sign_of_a_missing_bus not in after_ctrl_c, after_ctrl_c[-3000:]
    assert stopped_s < 15, stopped_s


def test_conveyor_up_stops_its_children_when_signalled_before_the_pipeline_is_ready() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("CONVEYOR_NATS_URLS", None)
    parent = subprocess.Popen([sys.executable, "-m", "workers.cli", "up", "--engine", "mock"], cwd=REPO_ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _wait_for_line(parent, "starting decode worker", timeout_s=60)
    children = _descendants_of(parent.pid)
    parent.send_signal(signal.SIGTERM)
    _assert_all_gone(parent, children, timeout_s=45)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_gateway_workers_share_one_port_and_go_with_their_parent(signum: signal.Signals) -> None:
    nats_server = EmbeddedNatsServer()
    url = nats_server.start()
    port = free_port()
    try:
        parent, _ = _start(["gateway", "--workers", "2", "--host", "127.0.0.1", "--port", str(port), "--nats", url],
                           "2 gateway processes sharing port")
        for _ in range(2):
            _wait_for_line(parent, "OpenAI API on", timeout_s=60)
        gateways = _descendants_of(parent.pid)
        assert len(gateways) == 2, gateways
        for _ in range(8):  # fresh connections, spread by the kernel over the two
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as response:
                assert response.status == 200 and json.load(response)["status"] == "ok"
        parent.send_signal(signum)
        _assert_all_gone(parent, gateways, timeout_s=45)
    finally:
        nats_server.stop()
