"""Images through the pipeline against the same pipeline called in this process: seconds per request for the seeded
diffusers model (or a diffusers directory), with 1 and 2 image replicas for concurrent requests. Rounds alternate.

    .venv/bin/python scripts/bench_image.py
    .venv/bin/python scripts/bench_image.py --size 512x512 --steps 20 --model /path/to/stable-diffusion

Workers are processes (`conveyor worker processor|image`) on an embedded nats-server, as deployed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bus.client import PipelineClient, open_client  # noqa: E402
from bus.registry import ready_models  # noqa: E402
from bus.server import EmbeddedNatsServer  # noqa: E402
from bus.settings import BusSettings, NatsSettings  # noqa: E402
from schemas.client import ImageRequest  # noqa: E402
from workers.engines.torch_engine.image_diffusion import (  # noqa: E402
    SEEDED_IMAGE_MODEL,
    ImageGenerator,
    ImageJob,
    resolve_image_model,
)
from workers.launcher import stop_processes  # noqa: E402


async def through_pipeline(client: PipelineClient, args: argparse.Namespace, seed: int) -> None:
    request = ImageRequest(request_id=f"b-{uuid.uuid4().hex[:12]}", reply_to=client.new_inbox(), model=args.model,
                           prompt="a lighthouse on a cliff at dawn", size=args.size, seed=seed,
                           num_inference_steps=args.steps, n=args.n)
    async with await client.submit(request, first_frame_timeout_s=600) as stream:
        images, _ = await stream.collect_images()
    assert len(images) == args.n


async def with_workers(args: argparse.Namespace, replicas: int, body):  # type: ignore[no-untyped-def]
    with EmbeddedNatsServer() as server:
        namespace = f"img{uuid.uuid4().hex[:6]}"
        # The cores shared out between replicas: two torch processes each spinning on every core's OpenMP threads
        # ran 8× slower than one here (2 cores).
        env = {**os.environ, "CONVEYOR_NATS_URLS": server.url, "CONVEYOR_NAMESPACE": namespace,
               "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // replicas)),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        workers = [subprocess.Popen([sys.executable, "-m", "workers.cli", "worker", stage, "--model", args.model,
                                     "--log-level", "ERROR"], cwd=ROOT, env=env)
                   for stage in ["processor", *["image"] * replicas]]
        try:
            async with open_client(NatsSettings(urls=[server.url]), BusSettings(namespace=namespace), "bench") as client:
                while args.model not in ready_models(cards := await client.live_workers()) or len(
                        [card for card in cards if card.ready]) < 1 + replicas:
                    await asyncio.sleep(0.3)
                return await body(client)
        finally:
            await stop_processes(workers, grace_s=30)


async def main(args: argparse.Namespace) -> None:
    generator = ImageGenerator(resolve_image_model(args.model))
    width, height = (generator.default_size if args.size == "auto" else tuple(int(v) for v in args.size.split("x")))

    def direct(seed: int) -> None:
        generator.generate(ImageJob("a lighthouse on a cliff at dawn", None, width, height, args.steps, 7.5, seed, args.n),
                           lambda step, num_steps: False)

    async def sequential(client: PipelineClient) -> list[float]:
        await through_pipeline(client, args, 0)  # warm-up
        timings = []
        for seed in range(args.repeats):
            started = time.perf_counter()
            await through_pipeline(client, args, seed)
            timings.append(time.perf_counter() - started)
        return timings

    async def concurrent(client: PipelineClient) -> float:
        started = time.perf_counter()
        await asyncio.gather(*(through_pipeline(client, args, seed) for seed in range(args.concurrency)))
        return args.concurrency / (time.perf_counter() - started)

    direct_s: list[float] = []
    piped_s: list[float] = []
    direct(0)  # warm-up
    for _ in range(args.rounds):
        for seed in range(args.repeats):
            started = time.perf_counter()
            direct(seed)
            direct_s.append(time.perf_counter() - started)
        piped_s += await with_workers(args, 1, sequential)
    one = await with_workers(args, 1, concurrent)
    two = await with_workers(args, 2, concurrent)
    d, p = statistics.median(direct_s), statistics.median(piped_s)
    print(f"\n{args.model}, {width}x{height}, {args.steps} steps, n={args.n}, {os.cpu_count()} cores, medians of "
          f"{args.rounds} alternating rounds of {args.repeats}")
    print(f"seconds per request: in-process {d:.3f}, pipeline {p:.3f} ({p / d:.2f}×, +{1000 * (p - d):.0f} ms)")
    print(f"{args.concurrency} requests at once: 1 replica {one:.2f} req/s, 2 replicas {two:.2f} req/s ({two / one:.2f}×)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=SEEDED_IMAGE_MODEL)
    parser.add_argument("--size", default="256x256")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("-n", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    asyncio.run(main(parser.parse_args()))
