"""Benchmark the embedding path: sentences/s of all-MiniLM-L6-v2 called in this process vs through the
pipeline (a processor and embed workers as separate processes, an embedded nats-server), at batch 1, 32
and 256, and with 1 vs 2 embed replicas under concurrent requests. Rounds alternate in one run.

    .venv/bin/python scripts/bench_embed.py
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
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformers import AutoTokenizer  # noqa: E402

from bus.client import PipelineClient, open_client  # noqa: E402
from bus.registry import ready_models  # noqa: E402
from bus.server import EmbeddedNatsServer  # noqa: E402
from bus.settings import BusSettings, NatsSettings  # noqa: E402
from schemas.client import EmbeddingRequest  # noqa: E402
from workers.engines.torch_engine.embedding import EMBEDDING_MODEL, SentenceEmbedder, bundled_minilm  # noqa: E402

WORDS = "the quick brown fox jumps over a lazy dog while streams of tokens flow through every stage".split()


def sentences(count: int, seed: int) -> list[str]:
    return [" ".join(WORDS[(seed + i + j) % len(WORDS)] for j in range(8 + (i % 9))) for i in range(count)]


async def through_pipeline(client: PipelineClient, texts: list[str]) -> None:
    request = EmbeddingRequest(request_id=f"b-{uuid.uuid4().hex[:12]}", reply_to=client.new_inbox(),
                               model=EMBEDDING_MODEL, input=texts)
    async with await client.submit(request, first_frame_timeout_s=120) as stream:
        await stream.collect()


async def with_workers(replicas: int, body):  # type: ignore[no-untyped-def]
    with EmbeddedNatsServer() as server:
        namespace = f"emb{uuid.uuid4().hex[:6]}"
        env = {**os.environ, "CONVEYOR_NATS_URLS": server.url, "CONVEYOR_NAMESPACE": namespace,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        workers = [subprocess.Popen([sys.executable, "-m", "workers.cli", "worker", stage, "--model", EMBEDDING_MODEL,
                                     "--mode", "embedding", "--log-level", "ERROR"], cwd=ROOT, env=env)
                   for stage in ["processor", *["embed"] * replicas]]
        try:
            async with open_client(NatsSettings(urls=[server.url]), BusSettings(namespace=namespace), "bench") as client:
                while EMBEDDING_MODEL not in ready_models(cards := await client.live_workers()) or len(
                        [c for c in cards if c.ready]) < 1 + replicas:
                    await asyncio.sleep(0.3)
                return await body(client)
        finally:
            for worker in workers:
                worker.send_signal(signal.SIGTERM)
            for worker in workers:
                worker.wait(timeout=60)


async def main(args: argparse.Namespace) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(bundled_minilm()))
    embedder = SentenceEmbedder(bundled_minilm())

    def direct(texts: list[str]) -> None:
        embedder.embed([tokenizer.encode(t) for t in texts])

    async def sequential(client: PipelineClient) -> dict[int, float]:
        rates = {}
        for batch in args.batches:
            texts = sentences(batch, batch)
            await through_pipeline(client, texts)  # warm-up
            started = time.perf_counter()
            for _ in range(args.repeats):
                await through_pipeline(client, texts)
            rates[batch] = batch * args.repeats / (time.perf_counter() - started)
        return rates

    async def concurrent(client: PipelineClient) -> float:
        batches = [sentences(32, i) for i in range(args.concurrency * 2)]
        await asyncio.gather(*(through_pipeline(client, b) for b in batches[:2]))
        started = time.perf_counter()
        await asyncio.gather(*(through_pipeline(client, b) for b in batches))
        return 32 * len(batches) / (time.perf_counter() - started)

    direct_rates: dict[int, list[float]] = {}
    piped_rates: dict[int, list[float]] = {}
    for _ in range(args.rounds):
        for batch in args.batches:
            texts = sentences(batch, batch)
            direct(texts)
            started = time.perf_counter()
            for _ in range(args.repeats):
                direct(texts)
            direct_rates.setdefault(batch, []).append(batch * args.repeats / (time.perf_counter() - started))
        for batch, rate in (await with_workers(1, sequential)).items():
            piped_rates.setdefault(batch, []).append(rate)
    one = await with_workers(1, concurrent)
    two = await with_workers(2, concurrent)
    print(f"\nall-MiniLM-L6-v2, CPU ({os.cpu_count()} cores), sentences of 8–16 words, {args.repeats} requests each, "
          f"medians of {args.rounds} alternating rounds")
    print(f"{'batch':>6} {'in-process /s':>14} {'pipeline /s':>12} {'ratio':>7}")
    for batch in args.batches:
        d, p = statistics.median(direct_rates[batch]), statistics.median(piped_rates[batch])
        print(f"{batch:>6} {d:>14.1f} {p:>12.1f} {p / d:>6.2f}×")
    print(f"{args.concurrency * 2} requests of 32 at once: 1 replica {one:.1f}/s, 2 replicas {two:.1f}/s ({two / one:.2f}×)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=4)
    asyncio.run(main(parser.parse_args()))
