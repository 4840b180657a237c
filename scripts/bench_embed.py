"""Benchmark the embedding path: sentences/s of all-MiniLM-L6-v2 called in this process vs through the
pipeline (a processor and embed workers as separate processes, an embedded nats-server), at batch 1, 32
and 256, and with 1 vs 2 embed replicas under concurrent requests. Rounds alternate in one run.

    .venv/bin/python scripts/bench_embed.py
    # On a GPU: SGLang with is_embedding (BERT-shaped config, random weights), workers as processes too
    CONVEYOR_SGLANG_MEM_FRACTION_STATIC=0.2 python scripts/bench_embed.py --engine sglang --model DIR \
        --load-format dummy --rounds 1 --replicas 1
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
from workers.embed import Embedder, TorchEmbedder  # noqa: E402
from workers.engines.torch_engine.embedding import EMBEDDING_MODEL, SentenceEmbedder, bundled_minilm  # noqa: E402

WORDS = "the quick brown fox jumps over a lazy dog while streams of tokens flow through every stage".split()


def sentences(count: int, seed: int) -> list[str]:
    return [" ".join(WORDS[(seed + i + j) % len(WORDS)] for j in range(8 + (i % 9))) for i in range(count)]


MODEL = EMBEDDING_MODEL
WORKER_ARGS: list[str] = []


async def through_pipeline(client: PipelineClient, texts: list[str]) -> None:
    request = EmbeddingRequest(request_id=f"b-{uuid.uuid4().hex[:12]}", reply_to=client.new_inbox(),
                               model=MODEL, input=texts)
    async with await client.submit(request, first_frame_timeout_s=120) as stream:
        await stream.collect()


async def with_workers(replicas: int, body):  # type: ignore[no-untyped-def]
    with EmbeddedNatsServer() as server:
        namespace = f"emb{uuid.uuid4().hex[:6]}"
        env = {**os.environ, "CONVEYOR_NATS_URLS": server.url, "CONVEYOR_NAMESPACE": namespace,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        workers = [subprocess.Popen([sys.executable, "-m", "workers.cli", "worker", stage, "--model", MODEL,
                                     "--mode", "embedding", "--log-level", "ERROR",
                                     *(WORKER_ARGS if stage == "embed" else [])], cwd=ROOT, env=env)
                   for stage in ["processor", *["embed"] * replicas]]
        try:
            async with open_client(NatsSettings(urls=[server.url]), BusSettings(namespace=namespace), "bench") as client:
                while MODEL not in ready_models(cards := await client.live_workers()) or len(
                        [c for c in cards if c.ready]) < 1 + replicas:
                    await asyncio.sleep(0.3)
                return await body(client)
        finally:
            for worker in workers:
                worker.send_signal(signal.SIGTERM)
            for worker in workers:
                worker.wait(timeout=60)


def in_process_embedder(args: argparse.Namespace) -> Embedder:
    if args.engine == "sglang":
        from workers.engines.sglang_engine import SGLangEmbedder

        return SGLangEmbedder(args.model, args.load_format)
    return TorchEmbedder(SentenceEmbedder(bundled_minilm() if args.model == EMBEDDING_MODEL else Path(args.model)))


async def main(args: argparse.Namespace) -> None:
    global MODEL
    MODEL = args.model
    WORKER_ARGS.extend(["--engine", args.engine, "--load-format", args.load_format])
    model_dir = bundled_minilm() if args.model == EMBEDDING_MODEL else Path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    embedder = in_process_embedder(args)
    await embedder.start()

    async def direct(texts: list[str]) -> None:
        await embedder.embed([tokenizer.encode(t) for t in texts])

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
            await direct(texts)
            started = time.perf_counter()
            for _ in range(args.repeats):
                await direct(texts)
            direct_rates.setdefault(batch, []).append(batch * args.repeats / (time.perf_counter() - started))
        for batch, rate in (await with_workers(1, sequential)).items():
            piped_rates.setdefault(batch, []).append(rate)
    await embedder.stop()
    one = await with_workers(1, concurrent)
    two = await with_workers(2, concurrent) if args.replicas > 1 else None
    print(f"\n{Path(args.model).name} on {args.engine} ({os.cpu_count()} cores), sentences of 8–16 words, "
          f"{args.repeats} requests each, medians of {args.rounds} alternating rounds")
    print(f"{'batch':>6} {'in-process /s':>14} {'pipeline /s':>12} {'ratio':>7}")
    for batch in args.batches:
        d, p = statistics.median(direct_rates[batch]), statistics.median(piped_rates[batch])
        print(f"{batch:>6} {d:>14.1f} {p:>12.1f} {p / d:>6.2f}×")
    scaled = f", 2 replicas {two:.1f}/s ({two / one:.2f}×)" if two is not None else ""
    print(f"{args.concurrency * 2} requests of 32 at once: 1 replica {one:.1f}/s{scaled}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--engine", choices=["torch", "sglang"], default="torch")
    parser.add_argument("--model", default=EMBEDDING_MODEL, help="all-MiniLM-L6-v2 (bundled) or a model directory")
    parser.add_argument("--load-format", default="auto", help="auto, or dummy (random weights; sglang)")
    parser.add_argument("--replicas", type=int, choices=[1, 2], default=2, help="most embed replicas to compare")
    asyncio.run(main(parser.parse_args()))
