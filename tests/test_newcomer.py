"""The first hour, as a new user meets it: `conveyor up` in one terminal and `ask` in another with no
flags, an unreachable server told in one sentence, and the bundled model converted once when two
workers start together."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from bus.server import STANDARD_PORT, free_port, port_is_free

REPO_ROOT = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("CONVEYOR_")}
    return {**env, "PYTHONPATH": str(REPO_ROOT), **extra}


def test_ask_with_no_server_says_what_to_do_in_one_line() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "workers.cli", "ask", "hi", "--nats", f"nats://127.0.0.1:{free_port()}"],
        cwd=REPO_ROOT, env=_env(CONVEYOR_NATS_INITIAL_CONNECT_TIMEOUT_S="2"), capture_output=True, text=True, timeout=60)
    assert completed.returncode == 1
    lines = [line for line in completed.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, completed.stderr
    assert "cannot reach NATS" in lines[0] and "conveyor server" in lines[0]


@pytest.mark.skipif(not port_is_free("127.0.0.1", STANDARD_PORT), reason="port 4222 is in use on this machine")
def test_up_serves_on_the_standard_port_so_ask_and_the_gateway_need_no_flags() -> None:
    gateway_port = free_port()
    up = subprocess.Popen([sys.executable, "-m", "workers.cli", "up", "--engine", "mock", "--gateway",
                           "--gateway-port", str(gateway_port)], cwd=REPO_ROOT, env=_env(),
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert up.stderr is not None
        seen = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and "pipeline running" not in "".join(seen):
            seen.append(up.stderr.readline())
        said = "".join(seen)
        assert "pipeline running" in said and "reach it with no flags" in said and "OpenAI API on" in said, said
        asked = subprocess.run([sys.executable, "-m", "workers.cli", "ask", "hello there", "--model", "mock",
                                "--max-tokens", "3"], cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=60)
        assert asked.returncode == 0, asked.stderr
        assert len(asked.stdout.split()) == 3
        with urllib.request.urlopen(f"http://127.0.0.1:{gateway_port}/v1/models", timeout=10) as response:
            assert b'"mock"' in response.read()
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=60)
    assert port_is_free("127.0.0.1", STANDARD_PORT)


def test_two_workers_starting_together_convert_the_bundled_model_once(tmp_path: Path) -> None:
    code = "from workers.engines.torch_engine.loader import bundled_smollm2; print(bundled_smollm2())"
    env = _env(CONVEYOR_MODEL_CACHE=str(tmp_path))
    starters = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [starter.communicate(timeout=300) for starter in starters]
    assert all(starter.returncode == 0 for starter in starters), outputs
    stderr = "".join(err for _, err in outputs)
    assert stderr.count("(first use only)") == 1 and "waiting for another process" in stderr
    assert {out.strip() for out, _ in outputs} == {str(tmp_path / "SmolLM2-135M-Instruct")}
    assert (tmp_path / "SmolLM2-135M-Instruct" / "model.safetensors").exists()
