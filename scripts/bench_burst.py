"""Bursts of simultaneous requests through processor and decode: CPU per request and time to first token, for this
checkout and, side by side, another one.

Under a burst every request queues behind the others' work in each stage's one event loop, so the CPU a request
costs the processor and the decode worker sets how long the last of a burst waits for its first token. One run starts
an embedded nats-server and, per checkout, a processor and a decode worker on the mock engine (5 ms to the first
token, then 10 ms a token) as their own processes, each checkout in its own namespace; then bursts of `--burst`
short requests go to each in turn (alternating which goes first), and it prints per checkout the median of the
bursts' TTFT medians and each worker's CPU time (from /proc) per request. `--chat` sends chat requests streamed as
OpenAI chunks, as the gateway asks for them, instead of token ids. Comparing a change with the commit before
it (a worktree or clone of it as `--against`) measures the change on a noisy machine: both run at the same moments.

    .venv/bin/python scripts/bench_burst.py
    git worktree add /tmp/base HEAD~1 && .venv/bin/python scripts/bench_burst.py --against /tmp/base --rounds 60
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_pipeline import measure, mock_env, pipeline_stream, spawn_workers, wait_ready  # noqa: E402

from bus.client import PipelineClient, open_client  # noqa: E402
from bus.server import EmbeddedNatsServer  # noqa: E402
from bus.settings import BusSettings, NatsSettings  # noqa: E402
from workers.cli import run_loop  # noqa: E402

STAGES = ("processor", "decode")


def say(message: str) -> None:
    print(f"[bench-burst {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class Checkout:
    name: str
    root: Path
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    cpu_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    requests: int = 0
    ttft_ms: list[float] = field(default_factory=list)

    def spawn(self, nats_url: str) -> None:
        self.workers = spawn_workers(nats_url, self.name, mock_env(inter_token_ms=10), root=self.root)

    def cpu_now(self) -> dict[str, float]:
        """Each worker's user + system CPU seconds so far (Linux /proc)."""
        ticks = os.sysconf("SC_CLK_TCK")
        seconds = {}
        for stage, worker in zip(STAGES, self.workers):
            fields = Path(f"/proc/{worker.pid}/stat").read_text().rsplit(")", 1)[1].split()
            seconds[stage] = (int(fields[11]) + int(fields[12])) / ticks
        return seconds

    def stop(self) -> None:
        for worker in self.workers:
            worker.send_signal(signal.SIGTERM)
        for worker in self.workers:
            worker.wait(timeout=30)


async def ready(client: PipelineClient, timeout_s: float = 120.0) -> None:
    """Workers of both checkouts start together on a few cores: the registry may answer slowly at first."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        try:
            await wait_ready(client)
            return
        except Exception as error:
            if time.monotonic() > deadline_s:
                raise
            say(f"waiting for the workers ({error!r})")
            await asyncio.sleep(2)


async def burst(checkout: Checkout, client: PipelineClient, size: int, tokens: int, chat: bool) -> None:
    before = checkout.cpu_now()
    result = await measure(size, tokens, lambda n: pipeline_stream(client, n, chat))
    after = checkout.cpu_now()
    checkout.ttft_ms.append(result.ttft_ms)
    checkout.requests += size
    for stage in STAGES:
        checkout.cpu_s[stage] += after[stage] - before[stage]


async def main(args: argparse.Namespace) -> None:
    checkouts = [Checkout("this", ROOT)]
    if args.against:
        checkouts.append(Checkout("against", Path(args.against).resolve()))
    with EmbeddedNatsServer() as server:
        for checkout in checkouts:
            checkout.spawn(server.url)
        try:
            async with AsyncExitStack() as stack:
                clients = {}
                for checkout in checkouts:
                    clients[checkout.name] = await stack.enter_async_context(
                        open_client(NatsSettings(urls=[server.url]), BusSettings(namespace=checkout.name), checkout.name))
                    await ready(clients[checkout.name])
                    await measure(8, args.tokens, lambda n, c=clients[checkout.name]: pipeline_stream(c, n))  # warm-up
                say(f"{args.rounds} bursts of {args.burst} requests ({args.tokens} tokens each) per checkout: "
                    + ", ".join(f"{c.name} = {c.root}" for c in checkouts))
                for round_index in range(args.rounds):
                    for checkout in (checkouts if round_index % 2 == 0 else list(reversed(checkouts))):
                        await burst(checkout, clients[checkout.name], args.burst, args.tokens, args.chat)
        finally:
            for checkout in checkouts:
                checkout.stop()
    base = checkouts[-1]
    shape = "chat requests in OpenAI's chunk shape" if args.chat else "requests"
    print(f"\n{args.rounds} bursts of {args.burst} simultaneous {shape}, {args.tokens} tokens each, mock engine")
    for checkout in checkouts:
        per_request_ms = {stage: 1000 * checkout.cpu_s[stage] / checkout.requests for stage in STAGES}
        line = (f"  {checkout.name:<8} TTFT {statistics.median(checkout.ttft_ms):6.1f} ms (median of bursts' medians); "
                f"CPU per request: processor {per_request_ms['processor']:.3f} ms, decode {per_request_ms['decode']:.3f} ms")
        if checkout is not base:
            base_ms = {stage: 1000 * base.cpu_s[stage] / base.requests for stage in STAGES}
            line += (f"  | ÷ {base.name}: TTFT {statistics.median(checkout.ttft_ms) / statistics.median(base.ttft_ms):.2f}×, "
                     f"processor {per_request_ms['processor'] / base_ms['processor']:.2f}×, "
                     f"decode {per_request_ms['decode'] / base_ms['decode']:.2f}×")
        print(line)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--burst", type=int, default=64, help="requests sent at once")
    parser.add_argument("--tokens", type=int, default=4, help="new tokens per request (short: the bus's share shows)")
    parser.add_argument("--rounds", type=int, default=30, help="bursts per checkout, alternating which goes first")
    parser.add_argument("--chat", action="store_true",
                        help="chat requests streamed as OpenAI chunks, as the gateway sends them (default: token ids)")
    parser.add_argument("--against", help="another checkout of this repository to run side by side (e.g. a worktree "
                                          "of the commit before a change); its workers use this .venv")
    run_loop(main(parser.parse_args()))
