"""One stream through one gateway process or several, over one HTTP connection or several used in turn: the first token.

A client with several connections in use (aiperf at several streams: a pool per worker process, 4 in
scripts/bench_aiperf.py) can send a stream's next request on a connection that `conveyor gateway --workers N` gave
to another of its N processes (the kernel hands each connection to one, SO_REUSEPORT); `bench_ttft.py` sends every
request on one kept-alive connection, and so does aiperf at one stream (its workers are capped at the concurrency).
SGLang's server is one process either way. This measures whether spreading costs a stream's first token: an
embedded nats-server, a processor and a decode worker on the mock engine (5 ms to the first token), a gateway of one
process and one of `--workers` processes; each fresh chat prompt goes to
each gateway over one connection and over the next of `--connections` in turn, and it prints, per way of connecting,
the median per-prompt difference of the multi-process gateway over the single one.

    .venv/bin/python scripts/bench_gateway_spread.py --requests 150
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_pipeline import mock_env, spawn_workers  # noqa: E402
from bench_ttft import Target, stream_once  # noqa: E402
from bus.server import EmbeddedNatsServer, free_port  # noqa: E402


def start_gateway(url: str, namespace: str, port: int, processes: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "CONVEYOR_NATS_URLS": url, "CONVEYOR_NAMESPACE": namespace, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "workers.cli", "gateway", "--host", "127.0.0.1", "--port", str(port),
                             "--workers", str(processes), "--log-level", "WARNING"], cwd=ROOT, env=env)


async def wait_ready(session: aiohttp.ClientSession, port: int, timeout_s: float = 120.0) -> None:
    deadline_s = time.monotonic() + timeout_s
    while True:
        try:
            async with session.get(f"http://127.0.0.1:{port}/health") as response:
                if "mock" in (await response.json()).get("ready_models", []):
                    return
        except (OSError, aiohttp.ClientError):
            pass
        if time.monotonic() > deadline_s:
            raise TimeoutError(f"the gateway on port {port} was not ready within {timeout_s:.0f} s")
        await asyncio.sleep(0.3)


async def first_token_ms(session: aiohttp.ClientSession, port: int, prompt: str) -> float:
    """Milliseconds from the post to the first chunk with content (as aiperf counts); read to the end."""
    target = Target(f"http://127.0.0.1:{port}", as_ids=False)
    return (await stream_once(session, target, "mock", prompt, [], num_tokens=4, chat=True)).ttft_ms


async def measure(args: argparse.Namespace, single_port: int, spread_port: int) -> None:
    rng = random.Random(args.seed)
    sessions = [aiohttp.ClientSession() for _ in range(args.connections)]
    ways = {"one connection": lambda index: sessions[0],
            f"{args.connections} connections in turn": lambda index: sessions[index % args.connections]}
    samples: dict[tuple[int, str], list[float]] = {}
    try:
        await wait_ready(sessions[0], single_port)
        await wait_ready(sessions[0], spread_port)
        for index in range(args.warmup + args.requests):
            # Which gateway goes first alternates; every request's prompt is new (the mock caches prefixes).
            ports = (single_port, spread_port) if index % 2 == 0 else (spread_port, single_port)
            for way, session_of in ways.items():
                for port in ports:
                    prompt = "".join(rng.choice("abcdefgh ") for _ in range(args.prompt_chars))
                    samples.setdefault((port, way), []).append(await first_token_ms(session_of(index), port, prompt))
                    await asyncio.sleep(args.gap_s)
            if (index + 1) % 50 == 0:
                print(f"[gateway-spread] {index + 1} prompts", file=sys.stderr, flush=True)
    finally:
        for session in sessions:
            await session.close()
    print(f"first token (chat, mock engine: 5 ms), {args.requests} prompts after {args.warmup}; "
          f"gateway of 1 process against one of {args.processes}")
    for way in ways:
        single, spread = (samples[(port, way)][args.warmup:] for port in (single_port, spread_port))
        differences = [mine - theirs for theirs, mine in zip(single, spread, strict=True)]
        print(f"  {way:24s} 1 process p50 {statistics.median(single):6.2f} ms, {args.processes} processes p50 "
              f"{statistics.median(spread):6.2f} ms; added per prompt: median {statistics.median(differences):+.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=150, help="Prompts measured (each goes every way).")
    parser.add_argument("--warmup", type=int, default=5, help="Prompts sent first and not counted.")
    parser.add_argument("--processes", type=int, default=2, help="Processes of the second gateway.")
    parser.add_argument("--connections", type=int, default=4, help="Connections used in turn (aiperf: one pool per "
                                                                    "worker process, 4 in scripts/bench_aiperf.py).")
    parser.add_argument("--prompt-chars", type=int, default=300)
    parser.add_argument("--gap-s", type=float, default=0.02, help="Idle time after each request.")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    with EmbeddedNatsServer() as server:
        namespace = f"spread{uuid.uuid4().hex[:6]}"
        single_port, spread_port = free_port(), free_port()
        processes = spawn_workers(server.url, namespace, mock_env(inter_token_ms=10))
        processes += [start_gateway(server.url, namespace, single_port, 1),
                      start_gateway(server.url, namespace, spread_port, args.processes)]
        try:
            asyncio.run(measure(args, single_port, spread_port))
        finally:
            for process in processes:
                process.send_signal(signal.SIGTERM)
            for process in processes:
                process.wait(timeout=30)


if __name__ == "__main__":
    main()
