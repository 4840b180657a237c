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


OBSERVABILITY = COMPOSE.parent / "docs" / "observability"


def test_compose_serves_the_gateway_metrics_and_a_provisioned_dashboard_and_starts_each_profiles_stages() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert services["gateway"]["command"][0] == "gateway" and "8000:8000" in services["gateway"]["ports"]
    assert {stage: services[stage]["profiles"] for stage in ("encode", "embed", "decode-gpu")} == {
        "encode": ["multimodal"], "embed": ["embedding"], "decode-gpu": ["gpu"]}
    device = services["decode-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["capabilities"] == ["gpu"] and services["decode-gpu"]["environment"]["CONVEYOR_ENGINE"] == "sglang"
    # Prometheus finds every replica of every worker service by compose DNS, on the port the workers serve.
    scrape = yaml.safe_load((OBSERVABILITY / "prometheus.yml").read_text())["scrape_configs"][0]["dns_sd_configs"][0]
    workers = {name for name, service in services.items() if service.get("command", [""])[0] == "worker"}
    assert set(scrape["names"]) == workers and scrape["port"] == 9100
    assert all("--http-port" in services[name]["command"] and "9100" in services[name]["command"] for name in workers)
    mounts = " ".join(services["grafana"]["volumes"])
    assert "grafana/provisioning:/etc/grafana/provisioning" in mounts and "grafana/dashboards:" in mounts
    provider = yaml.safe_load((OBSERVABILITY / "grafana/provisioning/dashboards/conveyor.yml").read_text())
    assert provider["providers"][0]["options"]["path"] in mounts


async def test_every_dashboard_query_names_metrics_the_workers_export(bus) -> None:  # type: ignore[no-untyped-def]
    import asyncio
    import json
    import re

    import aiohttp

    from bus.registry import live_workers
    from schemas.registry import Stage
    from tests.pipeline_helpers import chat, client_of, mock_decode, mock_processor, running_workers

    dashboard = json.loads((OBSERVABILITY / "grafana/dashboards/conveyor.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    referenced = {re.sub(r"_(bucket|count|sum)$", "", name) for expr in exprs for name in re.findall(r"conveyor_\w+", expr)}
    # Series a working pipeline has after one request; the rest (migrations, cancels, errors, dead letters) appear
    # when those happen.
    after_a_request = {"conveyor_requests_total", "conveyor_time_to_first_token_seconds", "conveyor_request_seconds",
                       "conveyor_inter_token_latency_seconds", "conveyor_queue_tasks", "conveyor_queue_seconds",
                       "conveyor_kv_cache_usage_ratio", "conveyor_engine_running_requests", "conveyor_worker_ready"}
    async with running_workers(bus, [(Stage.PROCESSOR, mock_processor()), (Stage.DECODE, mock_decode(inter_token_s=0.001))]):
        client = client_of(bus)
        async with await client.submit(chat(client, "hello", max_tokens=4)) as stream:
            await stream.collect()
        url = next(c.metrics_url for c in await live_workers(bus.registry) if c.stage == Stage.DECODE)
        async with aiohttp.ClientSession() as http:
            for _ in range(100):  # the gauges come with each worker's next refresh
                async with http.get(url) as response:
                    exposition = await response.text()
                with_samples = {re.sub(r"_(bucket|count|sum|created)$", "", name)
                                for name in re.findall(r"^(conveyor_\w+)\{", exposition, re.M)}
                if after_a_request <= with_samples:
                    break
                await asyncio.sleep(0.1)
    declared = set(re.findall(r"^# TYPE (conveyor_\w+)", exposition, re.M))
    assert referenced - declared == set(), "the dashboard queries metrics no worker declares"
    assert after_a_request <= referenced and after_a_request - with_samples == set()


def _compose_runner() -> str | None:
    """Why the stack cannot be started here, or None when it can (scripts/compose_local.sh has set this host up)."""
    if shutil.which("podman") is None:
        return ("no container engine: the docker client is here without an engine, and podman is not installed "
                "(`bash scripts/compose_local.sh setup` installs and configures it on a Debian host)")
    if not (COMPOSE.parent / ".compose-venv/bin/podman-compose").exists():
        return "podman-compose is not installed (`bash scripts/compose_local.sh setup`)"
    images = subprocess.run(["podman", "image", "exists", "localhost/conveyor:local"], capture_output=True)
    if images.returncode != 0:
        return "the conveyor:local image is not built (`bash scripts/compose_local.sh setup`)"
    return None


@pytest.mark.timeout(900)
def test_the_compose_stack_answers_through_the_gateway_and_its_dashboard_has_data() -> None:
    reason = _compose_runner()
    if reason is not None:
        pytest.skip(reason)
    script = COMPOSE.parent / "scripts/compose_local.sh"
    env = {**__import__("os").environ, "CONVEYOR_COMPOSE_PROJECT": "conveyor-test"}
    try:
        subprocess.run(["bash", str(script), "up"], check=True, env=env, capture_output=True, timeout=300)
        subprocess.run(["bash", str(script), "scale", "2"], check=True, env=env, capture_output=True, timeout=300)
        # A processor and two decode replicas.
        checked = subprocess.run(["bash", str(script), "check", "--min-targets", "3"], env=env, capture_output=True,
                                 text=True, timeout=600)
    finally:
        subprocess.run(["bash", str(script), "down"], env=env, capture_output=True, timeout=300)
    results = [__import__("json").loads(line) for line in checked.stdout.splitlines() if line.startswith("{")]
    assert checked.returncode == 0, checked.stdout + checked.stderr
    scraped = next(r for r in results if r["check"] == "prometheus scrapes every worker")["detail"]
    assert sum(target.startswith("decode@") for target in scraped) == 2  # --scale decode=2, both found by DNS
    assert next(r for r in results if r["check"] == "gateway answers")["detail"]["answer"]
