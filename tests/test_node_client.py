"""A client in another language: the Node.js example (official `nats` package + msgpack) gets a
streamed answer from the pipeline. Skipped where node/npm are missing."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from schemas.registry import Stage
from tests.conftest import Bus
from tests.pipeline_helpers import MOCK, mock_decode, mock_processor, running_workers

CLIENT_DIR = Path(__file__).resolve().parents[1] / "scripts" / "clients" / "node"

pytestmark = pytest.mark.skipif(shutil.which("node") is None or shutil.which("npm") is None,
                                reason="node and npm are not installed")


def ensure_node_modules() -> None:
    if not (CLIENT_DIR / "node_modules" / "nats").exists():
        subprocess.run(["npm", "install", "--no-audit", "--no-fund"], cwd=CLIENT_DIR, check=True, timeout=300,
                       capture_output=True)


async def test_node_client_streams_an_answer_through_the_pipeline(bus: Bus) -> None:
    await asyncio.to_thread(ensure_node_modules)
    async with running_workers(bus, [(Stage.PROCESSOR, mock_processor()), (Stage.DECODE, mock_decode(inter_token_s=0.001))]):
        env = {**os.environ, "CONVEYOR_NATS_URLS": bus.nats_settings.urls[0], "CONVEYOR_NAMESPACE": bus.settings.namespace,
               "CONVEYOR_MODEL": MOCK, "CONVEYOR_MAX_TOKENS": "7"}
        process = await asyncio.create_subprocess_exec(
            "node", "chat.mjs", "hello from node", cwd=CLIENT_DIR, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 0, stderr.decode()
    assert len(stdout.decode().split()) == 7  # the mock engine's seven tokens, as text
    assert "length: " in stderr.decode() and "7 completion tokens" in stderr.decode()


async def test_node_client_reports_an_error_frame(bus: Bus) -> None:
    await asyncio.to_thread(ensure_node_modules)
    async with running_workers(bus, [(Stage.PROCESSOR, mock_processor())]):
        env = {**os.environ, "CONVEYOR_NATS_URLS": bus.nats_settings.urls[0], "CONVEYOR_NAMESPACE": bus.settings.namespace,
               "CONVEYOR_MODEL": "no-such-model"}
        process = await asyncio.create_subprocess_exec("node", "chat.mjs", "hi", cwd=CLIENT_DIR, env=env,
                                                       stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        _, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 1 and "unknown_model" in stderr.decode()
