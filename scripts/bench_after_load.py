"""Does a heavy load leave a running stack costlier per token? Phases of streaming chat load, each process's CPU.

Issue 11's one-runs missed 16 streams only where 16 ran after 256, 128 and 64 on the same engines
(docs/performance.md, thirty-eighth stop). This drives a running gateway through phases of N concurrent streams
for S seconds each (default: 16, 16, 256, 16, 16) and prints, per phase, the output tokens a second, the gap between
a stream's chunks (p50, p99), and the CPU each named process spent per output token: a state the heavy phase leaves
behind in the pipeline shows as the later light phases costing more than the first ones.

    conveyor up --engine mock --gateway          # with CONVEYOR_MOCK_LOCKSTEP=true CONVEYOR_MOCK_INTER_TOKEN_S=0.01
    python scripts/bench_after_load.py http://127.0.0.1:8000 --model mock \\
        gateway=$(pgrep -f "conveyor up") decode=$(pgrep -f "worker decode") nats=$(pgrep -f "nats-server -a")

Prompts are random words (100–800), outputs 128–512 tokens, both drawn per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_sglang import percentile  # noqa: E402
from profile_processes import cpu_seconds, named  # noqa: E402

WORDS = "the of and to in is was that for on as with by at from his her this which have are were be".split()


@dataclass
class PhaseCount:
    output_tokens: int = 0
    chunk_gaps_s: list[float] = field(default_factory=list)


def named_pid(text: str) -> tuple[str, int]:
    name, pid = named(text)
    try:
        return name, int(pid)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=PID (a process id), not {text!r}") from None


def parse_phase(text: str) -> tuple[int, float]:
    streams, _, seconds = text.partition("x")
    try:
        return int(streams), float(seconds)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected STREAMSxSECONDS (e.g. 16x20), not {text!r}") from None


async def stream_until(session: aiohttp.ClientSession, url: str, model: str, stop_at_s: float,
                       count: PhaseCount) -> None:
    """One stream: requests back to back until the phase ends (the last one runs to its end)."""
    while time.monotonic() < stop_at_s:
        prompt = " ".join(random.choice(WORDS) for _ in range(random.randint(100, 800)))
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True,
                "max_tokens": random.randint(128, 512), "stream_options": {"include_usage": True}}
        last_s: float | None = None
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                now_s = time.monotonic()
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    count.output_tokens += chunk["usage"]["completion_tokens"]
                    continue
                if last_s is not None:
                    count.chunk_gaps_s.append(now_s - last_s)
                last_s = now_s


async def run_phase(session: aiohttp.ClientSession, args: argparse.Namespace, streams: int, seconds: float,
                    processes: dict[str, int]) -> str:
    count = PhaseCount()
    cpu_before_s = {name: cpu_seconds(pid) for name, pid in processes.items()}
    started_s = time.monotonic()
    await asyncio.gather(*(stream_until(session, args.url, args.model, started_s + seconds, count)
                           for _ in range(streams)))
    took_s = time.monotonic() - started_s
    gaps = sorted(count.chunk_gaps_s)
    per_token = ", ".join(
        f"{name} {1e6 * (cpu_seconds(pid) - cpu_before_s[name]) / max(count.output_tokens, 1):.0f}"
        for name, pid in processes.items())
    return (f"{streams:>4} streams, {took_s:5.1f} s: {count.output_tokens / took_s:8.0f} tok/s, chunk gap p50 "
            f"{1000 * percentile(gaps, 50):.2f} p99 {1000 * percentile(gaps, 99):.2f} ms; CPU µs per token: {per_token}")


async def main_async(args: argparse.Namespace) -> None:
    processes = dict(args.processes)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        for index, (streams, seconds) in enumerate(args.phases, start=1):
            print(f"[after-load {time.strftime('%H:%M:%S')}] phase {index}/{len(args.phases)}: {streams} streams "
                  f"for {seconds:.0f} s", file=sys.stderr, flush=True)
            print(await run_phase(session, args, streams, seconds, processes), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", help="the gateway's root (no /v1)")
    parser.add_argument("processes", nargs="*", type=named_pid, metavar="NAME=PID",
                        help="processes whose CPU per output token is printed")
    parser.add_argument("--model", default="mock")
    parser.add_argument("--phases", nargs="+", type=parse_phase, default=[(16, 20), (16, 20), (256, 40), (16, 20),
                                                                            (16, 20)],
                        metavar="STREAMSxSECONDS", help="phases in order (default: 16x20 16x20 256x40 16x20 16x20)")
    parser.add_argument("--request-timeout-s", type=float, default=600.0)
    args = parser.parse_args()
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
