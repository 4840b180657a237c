"""Conditional disaggregation benchmark: time to first token of mixed short and long prompts when every prompt goes
through the prefill worker (`always-remote`), none does (`always-local`), and only long ones do (`isl`: at most
`--local-max-tokens` tokens to compute run on the decode worker), side by side.

One nats-server; for each policy a namespace of its own with one processor, one prefill and one decode worker of the
torch engine (the decode engine can run prompts itself), all processes, on CPU. Prompts are random (no prefix is
shared: where a prompt runs is all that differs). Rounds alternate between the policies (these machines are noisy);
the first round of each is warm-up.

    .venv/bin/python scripts/bench_conditional_disagg.py
    .venv/bin/python scripts/bench_conditional_disagg.py --model .gpu/smol --load-format dummy --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bus.client import PipelineClient, open_client
from bus.server import EmbeddedNatsServer
from bus.settings import BusSettings, NatsSettings
from schemas.client import CompletionRequest, StreamFormat
from schemas.registry import Stage
from workers.launcher import stop_processes

# Policy → the processor's --local-prefill-max-tokens (None: the benchmark's --local-max-tokens).
POLICIES: dict[str, int | None] = {"always-remote": 0, "always-local": 1_000_000, "isl": None}


def say(message: str) -> None:
    print(f"[conditional-disagg] {message}", file=sys.stderr, flush=True)


def spawn(stage: str, namespace: str, url: str, args: argparse.Namespace, local_max: int) -> subprocess.Popen[bytes]:
    threads = str(max(1, (os.cpu_count() or 2) // 2))  # one policy's prefill and decode workers run at a time
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "CONVEYOR_NAMESPACE": namespace, "CONVEYOR_NATS_URLS": url, "CONVEYOR_TORCH_DEVICE": "cpu",
           "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    command = [sys.executable, "-m", "workers.cli", "worker", stage, "--engine", "torch", "--model", args.model,
               "--mode", "disaggregated", "--log-level", "ERROR", "--shutdown-grace-s", "0.5"]
    if stage == "processor":
        command += ["--local-prefill-max-tokens", str(local_max)]
    else:
        command += ["--load-format", args.load_format]
    return subprocess.Popen(command, cwd=ROOT, env=env)


async def wait_ready(client: PipelineClient, processes: list[subprocess.Popen[bytes]], timeout_s: float = 400) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(process.poll() is not None for process in processes):
            raise RuntimeError("a worker exited before the pipeline was ready (its error is above)")
        stages = {card.stage for card in await client.live_workers() if card.ready}
        if {Stage.PROCESSOR, Stage.PREFILL, Stage.DECODE} <= stages:
            return
        await asyncio.sleep(0.2)
    raise RuntimeError("workers did not get ready")


async def one(client: PipelineClient, prompt: list[int], args: argparse.Namespace) -> float:
    request = CompletionRequest(request_id=f"cd-{uuid.uuid4().hex[:12]}", reply_to=client.new_inbox(), model=args.model,
                                prompt=prompt, max_tokens=args.max_tokens, stream_format=StreamFormat.TOKENS,
                                ignore_eos=True)
    started_s = time.monotonic()
    async with await client.submit(request, first_frame_timeout_s=120) as stream:
        async for _ in stream:
            return time.monotonic() - started_s
    raise RuntimeError("the stream ended without a token")


async def run_round(client: PipelineClient, prompts: list[list[int]], args: argparse.Namespace) -> list[float]:
    slots = asyncio.Semaphore(args.concurrency)

    async def limited(prompt: list[int]) -> float:
        async with slots:
            return await one(client, prompt, args)

    return list(await asyncio.gather(*(limited(p) for p in prompts)))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def serving(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="conveyor-cdisagg-") as store:
        server = EmbeddedNatsServer(store_dir=Path(store))
        server.start()
        processes: list[subprocess.Popen[bytes]] = []
        contexts, clients = [], {}
        try:
            for policy, local_max in POLICIES.items():
                namespace = f"cd{policy.replace('-', '')}{uuid.uuid4().hex[:4]}"
                limit = args.local_max_tokens if local_max is None else local_max
                processes += [spawn(stage, namespace, server.url, args, limit) for stage in ("processor", "prefill", "decode")]
                context = open_client(NatsSettings(urls=[server.url]), BusSettings(namespace=namespace), f"bench-{policy}")
                clients[policy] = await context.__aenter__()
                contexts.append(context)
            for client in clients.values():
                await wait_ready(client, processes)
            say(f"{len(POLICIES)} × (processor + prefill + decode) ready; {args.requests_per_round} requests per round, "
                f"{args.long_share:.0%} of {args.long_tokens} tokens, the rest of {args.short_tokens}, concurrency "
                f"{args.concurrency}; isl runs at most {args.local_max_tokens} tokens on the decode worker")
            ttfts: dict[str, dict[str, list[float]]] = {p: {"short": [], "long": []} for p in POLICIES}
            for round_index in range(args.rounds + 1):
                kinds = ["long" if rng.random() < args.long_share else "short" for _ in range(args.requests_per_round)]
                prompts = [[rng.randrange(3, 30000) for _ in range(args.long_tokens if kind == "long" else args.short_tokens)]
                           for kind in kinds]
                for policy in POLICIES:
                    values = await run_round(clients[policy], prompts, args)
                    if round_index == 0:
                        continue  # warm-up
                    for kind, value in zip(kinds, values, strict=True):
                        ttfts[policy][kind].append(value)
                    say(f"round {round_index} {policy}: TTFT p50 {pct(values, 0.5) * 1000:.0f} ms")
        finally:
            for context in contexts:
                await context.__aexit__(None, None, None)
            await stop_processes(processes, grace_s=15)
            server.stop()
    base = "isl"
    print(f"| policy | TTFT p50 ms, all | p99 ms, all | p50 ms, short prompts | p50 ms, long prompts | p50 ÷ {base} |")
    print("|---|---|---|---|---|---|")
    for policy, by_kind in ttfts.items():
        everything = by_kind["short"] + by_kind["long"]
        reference = ttfts[base]["short"] + ttfts[base]["long"]
        print(f"| {policy} | {pct(everything, 0.5) * 1000:.0f} | {pct(everything, 0.99) * 1000:.0f} | "
              f"{statistics.median(by_kind['short']) * 1000:.0f} | {statistics.median(by_kind['long']) * 1000:.0f} | "
              f"{pct(everything, 0.5) / pct(reference, 0.5):.2f}× |")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="the torch engine's model (a directory, or the bundled one)")
    parser.add_argument("--load-format", default="auto", help="dummy: random weights from the model's config.json")
    parser.add_argument("--short-tokens", type=int, default=32)
    parser.add_argument("--long-tokens", type=int, default=768)
    parser.add_argument("--long-share", type=float, default=0.25)
    parser.add_argument("--local-max-tokens", type=int, default=128, help="isl: the most tokens run on the decode worker")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--requests-per-round", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(serving(parse_args()))
