"""Benchmark the pipeline's own cost with the mock engine, side by side with the engine in-process.

One run starts an embedded nats-server, a processor and one decode worker as separate processes
(`conveyor worker ... --engine mock`, exactly as deployed), and a mock engine with the same timing
inside this process. Then, at 1, 16 and 64 concurrent streams, it measures for both:

- time to first token (request sent → first token received),
- inter-token latency (median gap between tokens of a stream),
- output tokens/s through the one decode worker,

and prints pipeline ÷ direct ratios. The TTFT difference divided by the three bus hops a request
makes before its first token reaches the client (client → processor queue, processor → decode
queue, decode → reply inbox) is the added latency per hop.

    .venv/bin/python scripts/bench_pipeline.py
    .venv/bin/python scripts/bench_pipeline.py --concurrency 1 16 64 --tokens 64 --inter-token-ms 10
    .venv/bin/python scripts/bench_pipeline.py --journal-cost      # migration's reply journal on vs off
    .venv/bin/python scripts/bench_pipeline.py --compare gc-freeze # the workers' --freeze-gc on vs off
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
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from bus.client import open_client  # noqa: E402
from bus.registry import ready_models  # noqa: E402
from bus.server import EmbeddedNatsServer  # noqa: E402
from bus.settings import BusSettings, NatsSettings  # noqa: E402
from schemas.client import ChatMessage, ChatRequest, CompletionRequest, StreamFormat  # noqa: E402
from schemas.sampling import StopConditions  # noqa: E402
from workers.engines.mock import MockEngine, MockEngineConfig  # noqa: E402
from workers.engines.protocol import GenerateRequest  # noqa: E402

PROMPT = list(range(1000, 1128))  # 128 prompt tokens
CHAT_PROMPT = "word " * 25  # a chat turn of 125 characters


@dataclass
class StreamTiming:
    ttft_s: float
    gaps_s: list[float]
    tokens: int


@dataclass
class RunResult:
    ttft_ms: float
    itl_ms: float
    tokens_per_s: float
    ttft_p99_ms: float = 0.0
    itl_p99_ms: float = 0.0


def summarize(timings: list[StreamTiming], elapsed_s: float) -> RunResult:
    gaps = sorted(gap for timing in timings for gap in timing.gaps_s)
    ttfts = sorted(t.ttft_s for t in timings)
    return RunResult(
        ttft_ms=1000 * statistics.median(ttfts),
        itl_ms=1000 * statistics.median(gaps) if gaps else 0.0,
        tokens_per_s=sum(t.tokens for t in timings) / elapsed_s,
        ttft_p99_ms=1000 * ttfts[int(0.99 * (len(ttfts) - 1))],
        itl_p99_ms=1000 * gaps[int(0.99 * (len(gaps) - 1))] if gaps else 0.0,
    )


async def direct_stream(engine: MockEngine, tokens: int) -> StreamTiming:
    request = GenerateRequest(f"d-{uuid.uuid4().hex[:8]}", PROMPT, stop=StopConditions(max_tokens=tokens))
    started = time.perf_counter()
    stamps: list[float] = []
    async for output in engine.generate(request):
        if output.token_ids:
            stamps.append(time.perf_counter())
    return StreamTiming(stamps[0] - started, [b - a for a, b in zip(stamps, stamps[1:])], len(stamps))


async def pipeline_stream(client, tokens: int, chat: bool = False) -> StreamTiming:  # type: ignore[no-untyped-def]
    """One request through the pipeline; `chat`: a chat request streamed in OpenAI's chunk shape, as the gateway asks
    for it (the decode worker then builds a `chat.completion.chunk` per token)."""
    request_id, inbox = f"p-{uuid.uuid4().hex[:12]}", client.new_inbox()
    request = (ChatRequest(request_id=request_id, reply_to=inbox, model="mock", max_tokens=tokens,
                           messages=[ChatMessage(role="user", content=CHAT_PROMPT)], stream_format=StreamFormat.OPENAI)
               if chat else
               CompletionRequest(request_id=request_id, reply_to=inbox, model="mock", prompt=PROMPT, max_tokens=tokens,
                                 stream_format=StreamFormat.TOKENS))
    started = time.perf_counter()
    stamps: list[float] = []
    async with await client.submit(request, first_frame_timeout_s=60) as stream:
        async for chunk in stream:
            now = time.perf_counter()
            stamps.extend(now for _ in chunk.token_ids)
    return StreamTiming(stamps[0] - started, [b - a for a, b in zip(stamps, stamps[1:]) if b > a], len(stamps))


async def measure(concurrency: int, tokens: int, stream_once) -> RunResult:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    timings = await asyncio.gather(*(stream_once(tokens) for _ in range(concurrency)))
    return summarize(list(timings), time.perf_counter() - started)


def mock_env(inter_token_ms: float) -> dict[str, str]:
    """The mock engine of these benchmarks: 5 ms to the first token whatever the prompt, then `inter_token_ms`."""
    return {"CONVEYOR_MOCK_INTER_TOKEN_S": str(inter_token_ms / 1000), "CONVEYOR_MOCK_TTFT_BASE_S": "0.005",
            "CONVEYOR_MOCK_TTFT_PER_PROMPT_TOKEN_S": "0", "CONVEYOR_MOCK_MAX_RUNNING_REQUESTS": "256"}


def spawn_workers(url: str, namespace: str, env_mock: dict[str, str],
                  decode_args: tuple[str, ...] = (), worker_args: tuple[str, ...] = (),
                  root: Path = ROOT) -> list[subprocess.Popen[bytes]]:
    """A processor and a decode worker on the mock engine, from the checkout at `root`."""
    env = {**os.environ, **env_mock, "CONVEYOR_NATS_URLS": url, "CONVEYOR_NAMESPACE": namespace,
           "PYTHONPATH": str(root)}
    return [subprocess.Popen([sys.executable, "-m", "workers.cli", "worker", stage, "--engine", "mock",
                              "--log-level", "WARNING", "--max-concurrency", "128", *worker_args,
                              *(decode_args if stage == "decode" else ())], cwd=root, env=env)
            for stage in ("processor", "decode")]


# What `--compare` sets side by side: per variant, (arguments of the decode worker, of both workers).
VARIANTS: dict[str, dict[str, tuple[tuple[str, ...], tuple[str, ...]]]] = {
    "journal": {"journal on": ((), ()), "journal off": (("--migration-limit", "0"), ())},
    "gc-freeze": {"gc frozen": ((), ("--freeze-gc",)), "gc not frozen": ((), ("--no-freeze-gc",))},
}


async def side_by_side(what: str, levels: list[int], tokens: int, inter_token_ms: float, rounds: int) -> None:
    """Two pipelines on one server that differ in one setting (`VARIANTS`), rounds alternating between them."""
    env_mock = mock_env(inter_token_ms)
    variants = VARIANTS[what]
    (first, second) = variants
    with EmbeddedNatsServer() as server:
        spaces = {name: f"v{index}{uuid.uuid4().hex[:6]}" for index, name in enumerate(variants)}
        workers = [worker for name, (decode_args, worker_args) in variants.items()
                   for worker in spawn_workers(server.url, spaces[name], env_mock, decode_args, worker_args)]
        try:
            async with open_client(NatsSettings(urls=[server.url]), BusSettings(namespace=spaces[first]), "a") as a, \
                    open_client(NatsSettings(urls=[server.url]), BusSettings(namespace=spaces[second]), "b") as b:
                clients = {first: a, second: b}
                for client in clients.values():
                    await wait_ready(client)
                    await measure(4, 8, lambda n, c=client: pipeline_stream(c, n))  # warm-up
                print(f"{first} vs {second}: mock engine, inter-token {inter_token_ms:g} ms, {tokens} tokens per "
                      f"stream; medians of {rounds} alternating rounds\n")
                print(f"{'streams':>7} | {'TTFT ms p50 / p99':>27} | {'ITL ms p50 / p99':>27} | {'tok/s':>13} | "
                      f"ratios {first} ÷ {second}")
                for level in levels:
                    runs: dict[str, list[RunResult]] = {name: [] for name in clients}
                    for round_index in range(rounds):
                        order = list(clients) if round_index % 2 == 0 else list(reversed(clients))
                        for name in order:
                            client = clients[name]
                            runs[name].append(await measure(level, tokens, lambda n, c=client: pipeline_stream(c, n)))
                    j, n = _median_run(runs[first]), _median_run(runs[second])
                    ttft_p99 = statistics.median(r.ttft_p99_ms for r in runs[first]), statistics.median(
                        r.ttft_p99_ms for r in runs[second])
                    itl_p99 = statistics.median(r.itl_p99_ms for r in runs[first]), statistics.median(
                        r.itl_p99_ms for r in runs[second])
                    print(f"{level:>7} | {j.ttft_ms:>5.1f} / {ttft_p99[0]:>5.1f} vs {n.ttft_ms:>5.1f} / {ttft_p99[1]:>5.1f} | "
                          f"{j.itl_ms:>5.2f} / {itl_p99[0]:>5.1f} vs {n.itl_ms:>5.2f} / {itl_p99[1]:>5.1f} | "
                          f"{j.tokens_per_s:>5.0f} / {n.tokens_per_s:>5.0f} | TTFT {j.ttft_ms / n.ttft_ms:.2f}× "
                          f"(p99 {ttft_p99[0] / ttft_p99[1]:.2f}×), ITL {j.itl_ms / n.itl_ms:.2f}× "
                          f"(p99 {itl_p99[0] / itl_p99[1]:.2f}×), tok/s {j.tokens_per_s / n.tokens_per_s:.2f}×")
                for name, client in clients.items():
                    pauses = await gc_pauses(client)
                    print(f"  {name}: the workers' garbage collections over the whole run: {pauses}")
        finally:
            for worker in workers:
                worker.send_signal(signal.SIGTERM)
            for worker in workers:
                worker.wait(timeout=30)


async def gc_pauses(client) -> str:  # type: ignore[no-untyped-def]
    """What `conveyor_gc_pause_seconds` of the client's workers adds up to: collections, time, and how many took
    10 ms or more."""
    collections = total_s = under_10_ms = 0.0
    for card in await client.live_workers():
        with urllib.request.urlopen(card.metrics_url, timeout=5) as response:
            text = response.read().decode()
        samples = [sample for family in text_string_to_metric_families(text)
                   if family.name == "conveyor_gc_pause_seconds" for sample in family.samples]
        collections += sum(s.value for s in samples if s.name.endswith("_count"))
        total_s += sum(s.value for s in samples if s.name.endswith("_sum"))
        under_10_ms += sum(s.value for s in samples if s.name.endswith("_bucket") and s.labels["le"] == "0.01")
    return (f"{collections:.0f} collections, {total_s * 1000:.0f} ms in all, "
            f"{collections - under_10_ms:.0f} of 10 ms or more")


async def wait_ready(client) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 120
    while "mock" not in ready_models(await client.live_workers()):
        if time.monotonic() > deadline:
            raise TimeoutError("workers not ready")
        await asyncio.sleep(0.2)


async def main(levels: list[int], tokens: int, inter_token_ms: float, rounds: int) -> None:
    mock = MockEngineConfig(inter_token_s=inter_token_ms / 1000, ttft_base_s=0.005, ttft_per_prompt_token_s=0.0,
                            max_running_requests=256)
    env_mock = mock_env(inter_token_ms)
    engine = MockEngine(mock)
    with EmbeddedNatsServer() as server:
        namespace = f"bench{uuid.uuid4().hex[:6]}"
        workers = spawn_workers(server.url, namespace, env_mock)
        try:
            bus = BusSettings(namespace=namespace)
            async with open_client(NatsSettings(urls=[server.url]), bus, "bench") as client:
                await wait_ready(client)
                await measure(4, 8, lambda n: pipeline_stream(client, n))  # warm-up
                print(f"mock engine: TTFT {1000 * mock.ttft_base_s:.0f} ms, inter-token {inter_token_ms:g} ms, "
                      f"{tokens} tokens per stream, 128-token prompt; medians of {rounds} rounds\n")
                print(f"{'streams':>7} | {'TTFT ms direct/pipeline':>24} | {'ITL ms direct/pipeline':>23} | "
                      f"{'tok/s direct/pipeline':>22} | ratios TTFT, ITL, tok/s")
                for level in levels:
                    direct_runs, pipeline_runs = [], []
                    for _ in range(rounds):
                        direct_runs.append(await measure(level, tokens, lambda n: direct_stream(engine, n)))
                        pipeline_runs.append(await measure(level, tokens, lambda n: pipeline_stream(client, n)))
                    d, p = _median_run(direct_runs), _median_run(pipeline_runs)
                    print(f"{level:>7} | {d.ttft_ms:>10.1f} / {p.ttft_ms:>10.1f} | {d.itl_ms:>10.2f} / {p.itl_ms:>9.2f} | "
                          f"{d.tokens_per_s:>9.0f} / {p.tokens_per_s:>10.0f} | "
                          f"{p.ttft_ms / d.ttft_ms:.2f}×, {p.itl_ms / d.itl_ms:.2f}×, {p.tokens_per_s / d.tokens_per_s:.2f}×")
                    if level == levels[0]:
                        added = (p.ttft_ms - d.ttft_ms) / 3
                        print(f"{'':>7}   TTFT overhead {p.ttft_ms - d.ttft_ms:.1f} ms = {added:.2f} ms per bus hop (3 hops)")
        finally:
            for worker in workers:
                worker.send_signal(signal.SIGTERM)
            for worker in workers:
                worker.wait(timeout=30)


def _median_run(runs: list[RunResult]) -> RunResult:
    return sorted(runs, key=lambda r: r.ttft_ms)[len(runs) // 2]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--inter-token-ms", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compare", choices=sorted(VARIANTS),
                        help="instead: two pipelines side by side that differ in one setting (journal: the reply "
                             "journal on vs off; gc-freeze: the workers' --freeze-gc on vs off)")
    parser.add_argument("--journal-cost", action="store_true", help="the same as --compare journal")
    args = parser.parse_args()
    what = "journal" if args.journal_cost else args.compare
    if what is None:
        asyncio.run(main(args.concurrency, args.tokens, args.inter_token_ms, args.rounds))
    else:
        asyncio.run(side_by_side(what, args.concurrency, args.tokens, args.inter_token_ms, args.rounds))
