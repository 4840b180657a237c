"""Routing benchmark: time to first token with `kv` routing against `round-robin` and `queue`, side by side.

One nats-server; for each routing mode a namespace of its own with one processor (`--router MODE`) and
`--replicas` mock decode workers, all processes. The workload is Dynamo's shared-prefix case: `--prefixes`
system prompts of `--prefix-tokens` tokens, each request one of them plus a short user turn of its own.
Each worker's KV cache holds only `--cache-prefixes` system prompts, so where a prompt lands decides whether its
prefix is computed again. The mock engine charges `--prefill-us-per-token` for every uncached prompt token;
`--engine torch` runs the embedded model (SmolLM2-135M, or `--model DIR`) with its prefix cache instead, each
worker on CPU with cores ÷ replicas threads (one mode's workers run at a time); `--engine sglang --model DIR` runs
SGLang on the GPU, the replicas of every mode sharing it, each engine's KV cache cut to the same size.
Rounds alternate between the modes (these machines are noisy); the first round of each is warm-up.

    .venv/bin/python scripts/bench_routing.py                       # kv vs round-robin vs queue
    .venv/bin/python scripts/bench_routing.py --rounds 6 --concurrency 32
    .venv/bin/python scripts/bench_routing.py --engine torch --prefix-tokens 512 --requests-per-round 48
    bash scripts/gpu_run.sh python3 scripts/bench_routing.py --engine sglang --model .gpu/smol --load-format dummy
    .venv/bin/python scripts/bench_routing.py --router-cost          # decision time of the index alone

`--router-cost` measures the router without NATS: an index of `--cost-workers` workers × `--cost-blocks` blocks
from synthetic events, then the time of one decision (overlap of a 1k-token prompt + the cost function).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import msgpack

from bus.client import PipelineClient, open_client
from bus.kv_index import Candidate, KvIndex, choose
from bus.server import EmbeddedNatsServer
from bus.settings import BusSettings, NatsSettings
from schemas.client import CompletionRequest, StreamFormat
from schemas.replies import FinalFrame
from schemas.kv_events import BlockStored, KvEventBatch
from schemas.kv_hashing import chain_hashes
from schemas.registry import Stage
from workers.launcher import stop_processes

MODES = ["kv", "round-robin", "queue"]


def say(message: str) -> None:
    print(f"[routing] {message}", file=sys.stderr, flush=True)


def spawn(stage: str, namespace: str, url: str, args: argparse.Namespace, mode: str) -> subprocess.Popen[bytes]:
    block_size = 16
    # Room for the cached system prompts plus the requests running at once (their blocks are held).
    kv_blocks = ((args.cache_prefixes + -(-args.concurrency // args.replicas))
                 * ((args.prefix_tokens + args.turn_tokens + args.max_tokens) // block_size + 1))
    threads = str(max(1, (os.cpu_count() or 2) // args.replicas))
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "CONVEYOR_NAMESPACE": namespace, "CONVEYOR_NATS_URLS": url,
           "CONVEYOR_ROUTER": mode, "CONVEYOR_ROUTER_OVERLAP_WEIGHT": str(args.overlap_weight), "CONVEYOR_MOCK_INTER_TOKEN_S": str(args.inter_token_ms / 1000),
           "CONVEYOR_MOCK_TTFT_PER_PROMPT_TOKEN_S": str(args.prefill_us_per_token / 1e6),
           "CONVEYOR_MOCK_BLOCK_SIZE": str(block_size), "CONVEYOR_MOCK_KV_TOTAL_BLOCKS": str(kv_blocks),
           "CONVEYOR_MOCK_MAX_RUNNING_REQUESTS": "64",
           "CONVEYOR_TORCH_KV_CACHE_TOKENS": str(kv_blocks * block_size),
           "CONVEYOR_TORCH_DEVICE": "cpu", "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
           # Every mode's replicas share the GPU; each engine's KV pool is cut to the benchmark's cache size.
           "CONVEYOR_SGLANG_MEM_FRACTION_STATIC": str(round(0.8 / (args.replicas * len(args.modes)), 3)),
           "CONVEYOR_SGLANG_EXTRA_SERVER_ARGS": json.dumps({"max_total_tokens": kv_blocks * block_size})}
    command = [sys.executable, "-m", "workers.cli", "worker", stage, "--engine", args.engine, "--model", args.model,
               "--load-format", args.load_format if stage == "decode" else "auto", "--log-level", "ERROR",
               "--shutdown-grace-s", "0.5"]
    return subprocess.Popen(command, cwd=ROOT, env=env)


async def wait_ready(client: PipelineClient, replicas: int, processes: list[subprocess.Popen[bytes]],
                     timeout_s: float = 400.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(process.poll() is not None for process in processes):
            raise RuntimeError("a worker exited before the pipeline was ready (its error is above)")
        cards = [card for card in await client.live_workers() if card.ready]
        if sum(c.stage == Stage.DECODE for c in cards) >= replicas and any(c.stage == Stage.PROCESSOR for c in cards):
            return
        await asyncio.sleep(0.2)
    raise RuntimeError("workers did not get ready")


async def one(client: PipelineClient, prompt: list[int], args: argparse.Namespace) -> tuple[float, float]:
    """Time to first token, and the share of the prompt the engine found cached."""
    request = CompletionRequest(request_id=f"route-{uuid.uuid4().hex[:12]}", reply_to=client.new_inbox(), model=args.model,
                                prompt=prompt, max_tokens=args.max_tokens, stream_format=StreamFormat.TOKENS,
                                ignore_eos=True)
    started_s = time.monotonic()
    ttft_s = None
    async with await client.submit(request, first_frame_timeout_s=60) as stream:
        async for _ in stream:
            if ttft_s is None:
                ttft_s = time.monotonic() - started_s
    assert ttft_s is not None and isinstance(stream.terminal, FinalFrame)
    return ttft_s, stream.terminal.usage.cached_tokens / len(prompt)


async def run_round(client: PipelineClient, prefixes: list[list[int]], args: argparse.Namespace,
                    rng: random.Random) -> tuple[list[float], list[float], float]:
    prompts = [rng.choice(prefixes) + [rng.randrange(3, 30000) for _ in range(args.turn_tokens)]
               for _ in range(args.requests_per_round)]
    started_s = time.monotonic()
    slots = asyncio.Semaphore(args.concurrency)

    async def limited(prompt: list[int]) -> tuple[float, float]:
        async with slots:
            return await one(client, prompt, args)

    results = await asyncio.gather(*(limited(p) for p in prompts))
    return [r[0] for r in results], [r[1] for r in results], len(prompts) / (time.monotonic() - started_s)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def serving(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(3, 30000) for _ in range(args.prefix_tokens)] for _ in range(args.prefixes)]
    with tempfile.TemporaryDirectory(prefix="conveyor-routing-") as store:
        server = EmbeddedNatsServer(store_dir=Path(store))
        server.start()
        processes: list[subprocess.Popen[bytes]] = []
        clients: dict[str, PipelineClient] = {}
        try:
            namespaces = {mode: f"route{mode.replace('-', '')}{uuid.uuid4().hex[:4]}" for mode in args.modes}
            async with _clients(server.url, namespaces, clients):
                for mode, namespace in namespaces.items():
                    processes.append(spawn("processor", namespace, server.url, args, mode))
                    processes += [spawn("decode", namespace, server.url, args, mode) for _ in range(args.replicas)]
                for client in clients.values():
                    await wait_ready(client, args.replicas, processes)
                say(f"{len(args.modes)} × (1 processor + {args.replicas} {args.engine} decode workers) ready; {args.prefixes} prefixes of "
                    f"{args.prefix_tokens} tokens, {args.cache_prefixes} fit one worker's cache; "
                    f"{args.requests_per_round} requests per round at concurrency {args.concurrency}")
                ttfts: dict[str, list[float]] = {mode: [] for mode in args.modes}
                rates: dict[str, list[float]] = {mode: [] for mode in args.modes}
                cached: dict[str, list[float]] = {mode: [] for mode in args.modes}
                for round_index in range(args.rounds + 1):
                    for mode in args.modes:
                        values, shares, rate = await run_round(clients[mode], prefixes, args, rng)
                        if round_index == 0:
                            continue  # warm-up: every cache starts empty
                        ttfts[mode] += values
                        rates[mode].append(rate)
                        cached[mode] += shares
                        say(f"round {round_index} {mode}: TTFT p50 {pct(values, 0.5) * 1000:.1f} ms, {rate:.1f} req/s")
        finally:
            await stop_processes(processes, grace_s=15)
            server.stop()
    base = args.modes[0]
    print(f"| routing | TTFT p50 ms | TTFT p99 ms | requests/s | prompt found cached | TTFT p50 ÷ {base} |")
    print("|---|---|---|---|---|---|")
    for mode in args.modes:
        p50 = pct(ttfts[mode], 0.5)
        print(f"| {mode} | {p50 * 1000:.1f} | {pct(ttfts[mode], 0.99) * 1000:.1f} | {statistics.mean(rates[mode]):.1f} | "
              f"{statistics.mean(cached[mode]):.0%} | {p50 / pct(ttfts[base], 0.5):.2f}× |")


class _clients:
    """One client per mode, each in a namespace of its own."""

    def __init__(self, url: str, namespaces: dict[str, str], into: dict[str, PipelineClient]) -> None:
        self._url, self._namespaces, self._into = url, namespaces, into
        self._contexts: list[object] = []

    async def __aenter__(self) -> None:
        for mode, namespace in self._namespaces.items():
            context = open_client(NatsSettings(urls=[self._url]), BusSettings(namespace=namespace), f"bench-{mode}")
            self._into[mode] = await context.__aenter__()
            self._contexts.append(context)

    async def __aexit__(self, *exc: object) -> None:
        for context in self._contexts:
            await context.__aexit__(None, None, None)  # type: ignore[attr-defined]


def router_cost(args: argparse.Namespace) -> None:
    """Decision time and index memory with many workers and blocks (synthetic events, no NATS)."""
    rng = random.Random(args.seed)
    tracemalloc.start()
    index = KvIndex()
    blocks_per_batch = 64
    started_s = time.perf_counter()
    events = 0
    for worker in range(args.cost_workers):
        for seq in range(args.cost_blocks // blocks_per_batch):
            hashes = [rng.getrandbits(64) for _ in range(blocks_per_batch)]
            event = BlockStored.model_construct(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=16)
            index.apply(KvEventBatch.model_construct(worker_id=f"w{worker}", seq=seq, ts=0.0, events=[event]))
            events += 1
    ingest_s = time.perf_counter() - started_s
    memory_mb = tracemalloc.get_traced_memory()[0] / 1e6
    tracemalloc.stop()
    # Prompts whose first blocks some workers hold: store a real prefix on a few of them.
    prefix = [rng.randrange(3, 30000) for _ in range(1024)]
    for worker in range(0, args.cost_workers, 8):
        keys = chain_hashes(prefix, 16)
        index.apply(KvEventBatch.model_construct(worker_id=f"w{worker}", seq=10**6, ts=0.0, events=[
            BlockStored.model_construct(block_hashes=keys, parent_block_hash=None, token_ids=[], block_size=16)]))
    workers = [f"w{i}" for i in range(args.cost_workers)]
    times = []
    for _ in range(args.cost_decisions):
        prompt = prefix + [rng.randrange(3, 30000) for _ in range(32)]
        begin = time.perf_counter()
        cached = index.cached_blocks(prompt, workers)
        choose([Candidate(w, cached[w], rng.random() * 10) for w in workers], len(prompt) // 16)
        times.append(time.perf_counter() - begin)
    begin = time.perf_counter()
    snapshot = msgpack.packb(index.snapshot())
    snapshot_s = time.perf_counter() - begin
    begin = time.perf_counter()
    index.forget_worker("w1")
    forget_s = time.perf_counter() - begin
    print("| workers | blocks per worker | index memory MB | events ingested/s | decision p50 ms | decision p99 ms | "
          "snapshot | removing one worker |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {args.cost_workers} | {args.cost_blocks} | {memory_mb:.0f} | {events * blocks_per_batch / ingest_s:,.0f} blocks "
          f"({events / ingest_s:,.0f} batches) | {pct(times, 0.5) * 1000:.2f} | {pct(times, 0.99) * 1000:.2f} | "
          f"{len(snapshot) / 1e6:.0f} MB in {snapshot_s:.2f} s | {forget_s:.2f} s |")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", type=lambda text: text.split(","), default=MODES,
                        help="comma-separated routing modes; the first is the base of the ratios")
    parser.add_argument("--replicas", type=int, default=4, help="decode workers per mode")
    parser.add_argument("--overlap-weight", type=float, default=4.0,
                        help="kv: weight of the prompt blocks to compute against the blocks running requests hold")
    parser.add_argument("--engine", choices=["mock", "torch", "sglang"], default="mock",
                        help="mock (simulated prefill cost), torch (the embedded model on CPU, real prefix cache) or "
                             "sglang (GPU; needs --model)")
    parser.add_argument("--model", help="torch / sglang: a model directory (default for torch: the bundled SmolLM2)")
    parser.add_argument("--load-format", default="auto", help="dummy: random weights from the model's config.json")
    parser.add_argument("--prefixes", type=int, default=16, help="distinct system prompts")
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--cache-prefixes", type=int, default=4, help="system prompts one worker's KV cache holds")
    parser.add_argument("--turn-tokens", type=int, default=32, help="each request's own tokens after its system prompt")
    parser.add_argument("--prefill-us-per-token", type=float, default=200.0,
                        help="the mock engine's prefill time per uncached prompt token")
    parser.add_argument("--inter-token-ms", type=float, default=5.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests-per-round", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--router-cost", action="store_true", help="measure the index and cost function alone")
    parser.add_argument("--cost-workers", type=int, default=64)
    parser.add_argument("--cost-blocks", type=int, default=100_000)
    parser.add_argument("--cost-decisions", type=int, default=2000)
    args = parser.parse_args()
    if args.engine == "mock":
        args.model = "mock"
    elif args.engine == "sglang" and args.model is None:
        parser.error("--engine sglang needs --model DIR")
    elif args.model is None:
        from workers.engines.torch_engine.loader import DEFAULT_MODEL

        args.model = DEFAULT_MODEL
    return args


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.router_cost:
        router_cost(arguments)
    else:
        asyncio.run(serving(arguments))
