"""compose.yaml as `docker compose` would read it (no Docker engine here): every stage waits for a
healthy JetStream server, runs a worker of its stage, and can be scaled."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

COMPOSE = Path(__file__).resolve().parents[1] / "compose.yaml"


def test_compose_file_declares_nats_and_one_scalable_service_per_stage() -> None:
    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    assert "js-enabled-only=true" in " ".join(services["nats"]["healthcheck"]["test"])
    assert "nats-data:/data" in services["nats"]["volumes"]
    for stage in ("processor", "decode", "prefill"):
        service = services[stage]
        assert service["command"][:2] == ["worker", stage]
        assert service["depends_on"]["nats"]["condition"] == "service_healthy"
        assert service["environment"]["CONVEYOR_NATS_URLS"] == "nats://nats:4222"
        assert "container_name" not in service and "ports" not in service  # `--scale decode=3` must work
    assert services["prefill"]["profiles"] == ["disaggregated"]


@pytest.mark.skipif(shutil.which("docker") is None, reason="no docker client")
def test_docker_compose_parses_the_file_when_the_plugin_is_present() -> None:
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("the docker compose plugin is not installed")
    result = subprocess.run(["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
