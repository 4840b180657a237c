"""`conveyor up`: an embedded NATS server (unless one is given) and one process per stage.

Each stage is a `conveyor worker ...` child process, exactly what a user would start by hand on
another machine. `up` waits until the registry shows the model ready, optionally asks one question
through the bus, and on Ctrl-C (or after the question, with --exit) stops the workers with SIGTERM,
so they drain and deregister, then stops the server.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from bus.lifecycle import dies_with_parent
from bus.registry import ready_models
from bus.client import open_client
from bus.settings import BusSettings, NatsSettings
from schemas.registry import ServingMode, Stage
from workers.client_commands import ask, explain, report
from workers.smoke import nats_url_or_embedded, progress


@dataclass(frozen=True, slots=True)
class UpOptions:
    model: str
    engine: str
    mode: ServingMode
    decode_replicas: int = 1
    ready_timeout_s: float = 300.0
    question: str | None = None
    exit_after_question: bool = False
    max_tokens: int = 128
    # The demo answer is greedy, so it is the model's best and the same every run.
    temperature: float = 0.0
    load_format: str = "auto"
    log_level: str = "WARNING"
    # Also serve the OpenAI API on this port (None: no gateway).
    gateway_port: int | None = None
    # The processor's routing mode (queue, kv, round-robin, random).
    router: str = "queue"


def stages_for(mode: ServingMode) -> list[Stage]:
    """The worker processes a serving mode needs (EPD is `aggregated`: the decode worker encodes)."""
    return {
        ServingMode.DISAGGREGATED: [Stage.PROCESSOR, Stage.PREFILL, Stage.DECODE],
        ServingMode.ENCODE_AGGREGATED: [Stage.PROCESSOR, Stage.ENCODE, Stage.DECODE],
        ServingMode.ENCODE_DISAGGREGATED: [Stage.PROCESSOR, Stage.ENCODE, Stage.PREFILL, Stage.DECODE],
        ServingMode.EMBEDDING: [Stage.PROCESSOR, Stage.EMBED],
        ServingMode.IMAGE: [Stage.PROCESSOR, Stage.IMAGE],
    }.get(mode, [Stage.PROCESSOR, Stage.DECODE])


async def run_up(nats: NatsSettings, bus: BusSettings, embedded: bool, options: UpOptions) -> int:
    """Run the pipeline until done; SIGINT / SIGTERM at any point (even while the model loads) stops the
    workers and the embedded server before returning, so nothing is left running."""
    stop = _stop_on_signals()
    body = asyncio.create_task(_run(nats, bus, embedded, options, stop))
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait([body, stopped], return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not body.done():
        progress("stopping")
        body.cancel()
        await asyncio.gather(body, return_exceptions=True)
        return 130
    return body.result()


def _stop_on_signals() -> asyncio.Event:
    """An event that SIGINT or SIGTERM sets, from this process's running loop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    return stop


async def _run(nats: NatsSettings, bus: BusSettings, embedded: bool, options: UpOptions, stop: asyncio.Event) -> int:
    async with nats_url_or_embedded(nats, embedded) as nats:
        workers = [_spawn(stage, nats, bus, options) for stage in stages_for(options.mode)
                   for _ in range(options.decode_replicas if stage == Stage.DECODE else 1)]
        try:
            await _wait_ready(nats, bus, options, workers)
            if options.question is not None:
                try:
                    result = await ask(nats, bus, options.model, options.question, options.max_tokens, options.temperature, 120.0)
                    report(result)
                except Exception as error:
                    progress(explain(error))
                    return 1
            if options.exit_after_question:
                return 0
            async with _gateway(nats, bus, options.gateway_port):
                progress("pipeline running; Ctrl-C stops it")
                await _wait_for_stop_or_exit(workers, stop)
            return 0
        finally:
            # Shielded: a second Ctrl-C must not leave workers behind half-stopped.
            await asyncio.shield(_stop(workers))


@asynccontextmanager
async def _gateway(nats: NatsSettings, bus: BusSettings, port: int | None) -> AsyncIterator[None]:
    """The OpenAI-compatible gateway in this process, when asked for."""
    if port is None:
        yield
        return
    from workers.gateway import GatewayOptions, serving

    async with open_client(nats, bus, "conveyor-up-gateway") as client:
        async with serving(client, GatewayOptions(host="0.0.0.0", port=port)) as bound:
            progress(f"OpenAI API on http://127.0.0.1:{bound}/v1")
            yield


def _spawn(stage: Stage, nats: NatsSettings, bus: BusSettings, options: UpOptions) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "workers.cli", "worker", stage.value, "--model", options.model,
               "--engine", options.engine, "--mode", options.mode.value, "--log-level", options.log_level,
               "--load-format", options.load_format] + (["--router", options.router] if stage == Stage.PROCESSOR else [])
    env = {**os.environ, "CONVEYOR_NATS_URLS": ",".join(nats.urls), "CONVEYOR_NAMESPACE": bus.namespace}
    progress(f"starting {stage.value} worker ({options.engine} engine)")
    # SIGTERM when `up` dies, even by SIGKILL: the worker drains and deregisters instead of lingering.
    return subprocess.Popen(command, env=env, preexec_fn=dies_with_parent(signal.SIGTERM))


async def _wait_ready(nats: NatsSettings, bus: BusSettings, options: UpOptions,
                      workers: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + options.ready_timeout_s
    last_said = ""
    async with open_client(nats, bus, "conveyor-up") as client:
        while time.monotonic() < deadline:
            dead = [w for w in workers if w.poll() is not None]
            if dead:
                raise RuntimeError(f"a worker exited with code {dead[0].returncode} before the pipeline was ready")
            cards = await client.live_workers()
            if options.model in ready_models(cards):
                progress(f"pipeline ready: {options.model} ({options.mode.value}), {len(cards)} workers")
                return
            said = ", ".join(sorted(f"{c.stage.value}{'' if c.ready else ' (starting)'}" for c in cards)) or "none yet"
            if said != last_said:
                progress(f"waiting for workers: {said}")
                last_said = said
            await asyncio.sleep(0.5)
    raise TimeoutError(f"the pipeline was not ready within {options.ready_timeout_s:.0f} s")


async def _wait_for_stop_or_exit(workers: list[subprocess.Popen[bytes]], stop: asyncio.Event,
                                 what: str = "a worker") -> None:
    while not stop.is_set():
        if any(w.poll() is not None for w in workers):
            progress(f"{what} exited; stopping the others")
            return
        try:
            await asyncio.wait_for(stop.wait(), timeout=1.0)
        except TimeoutError:
            continue


async def _stop(workers: list[subprocess.Popen[bytes]], grace_s: float = 30.0) -> None:
    await stop_processes(workers, grace_s)
    progress("workers stopped")


async def stop_processes(processes: list[subprocess.Popen[bytes]], grace_s: float = 30.0) -> None:
    """SIGTERM every process still running, then SIGKILL whichever has not exited after `grace_s`."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in processes:
        remaining = max(0.1, deadline - time.monotonic())
        try:
            await asyncio.to_thread(process.wait, remaining)
        except subprocess.TimeoutExpired:
            process.kill()
            await asyncio.to_thread(process.wait)


async def run_gateway_workers(command: list[str], num_workers: int, port: int) -> int:
    """`conveyor gateway --workers N`: N gateway processes (`command`, each with `--reuse-port`) on one port; the
    kernel spreads the connections over them. Returns when SIGINT / SIGTERM stops them (0), or when one of them exits
    by itself (1: the others are stopped too, for a supervisor to start the whole gateway again)."""
    stop = _stop_on_signals()
    # SIGTERM when this parent dies, even by SIGKILL: no gateway is left holding the port.
    gateways = [subprocess.Popen(command, preexec_fn=dies_with_parent(signal.SIGTERM)) for _ in range(num_workers)]
    progress(f"{num_workers} gateway processes sharing port {port}")
    try:
        await _wait_for_stop_or_exit(gateways, stop, what="a gateway process")
    finally:
        await asyncio.shield(stop_processes(gateways))
    return 0 if stop.is_set() else 1
