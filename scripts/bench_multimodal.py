"""Benchmark multimodal serving: EPD vs E/PD, the embedding cache, encode scale-out, and why embeddings
travel over NIXL rather than inside NATS messages. The torch engine by default; `--engine sglang` with a
Qwen2-VL-shaped model on the GPU machine (the encode workers run its vision tower on the GPU, SGLang takes
the rows as precomputed embeddings).

One run starts an embedded nats-server and the workers as separate processes (`conveyor worker ...`,
exactly as deployed), in turn:

1. EPD  — processor + decode (the decode worker encodes images in-process);
2. E/PD — processor + encode + decode (rows handed over NIXL);
3. E/PD with 2 encode replicas, for the scale-out ratio;

and measures, for 1 and 8 images per request, time to first token with the image cache cold (new
images every request) and warm (the same images again), and requests/s at 8 concurrent requests.
Then, in this process, it moves embedding-sized buffers over NIXL (UCX, host memory) and through NATS
(request/reply of the same bytes) and prints both times.

    .venv/bin/python scripts/bench_multimodal.py
    .venv/bin/python scripts/bench_multimodal.py --requests 8 --image-px 512
    bash scripts/gpu_run.sh python3 scripts/bench_multimodal.py --engine sglang --model .gpu/qwen2vl --load-format dummy
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from PIL import Image  # noqa: E402

from bus.client import PipelineClient, open_client  # noqa: E402
from bus.connection import connect  # noqa: E402
from bus.registry import ready_models  # noqa: E402
from bus.server import EmbeddedNatsServer  # noqa: E402
from bus.settings import BusSettings, NatsSettings  # noqa: E402
from schemas.client import ChatMessage, ChatRequest, ImagePart, MediaUrl, StreamFormat, TextPart  # noqa: E402
from workers.engines.torch_engine.loader import DEFAULT_MODEL  # noqa: E402
from workers.media_transfer import EmbeddingExporter, EmbeddingReader  # noqa: E402


def say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


IMAGE_DIR = Path(tempfile.mkdtemp(prefix="conveyor-bench-images-"))


def random_image_url(size_px: int, rng: random.Random) -> str:
    """A file:// URL of a PNG of noise (incompressible, so decoding costs what a photo's would). Files, not data
    URLs: eight 512 px images as base64 would not fit one NATS message (max_payload, 1 MiB by default)."""
    return _write_noise_png(size_px, rng.getrandbits(64))


def _write_noise_png(size_px: int, seed: int) -> str:
    image = Image.frombytes("RGB", (size_px, size_px), random.Random(seed).randbytes(size_px * size_px * 3))
    path = IMAGE_DIR / f"{uuid.uuid4().hex}.png"
    image.save(path, format="PNG", compress_level=1)
    return path.as_uri()


def image_batches(num_requests: int, images_per_request: int, size_px: int, rng: random.Random) -> list[list[str]]:
    """Fresh images for every request (no cache hits), written by every core before the clock starts: 1,024 PNGs
    of 1,024 px take minutes in one process."""
    seeds = [rng.getrandbits(64) for _ in range(num_requests * images_per_request)]
    with ProcessPoolExecutor() as pool:
        urls = list(pool.map(_write_noise_png, [size_px] * len(seeds), seeds, chunksize=8))
    return [urls[index:index + images_per_request] for index in range(0, len(urls), images_per_request)]


def spawn(stages: list[str], url: str, namespace: str, mode: str, args: argparse.Namespace) -> list[subprocess.Popen[bytes]]:
    python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "CONVEYOR_NATS_URLS": url, "CONVEYOR_NAMESPACE": namespace, "PYTHONPATH": python_path,
           "CONVEYOR_MEDIA_MAX_IMAGE_BYTES": str(64 << 20)}
    if args.threads_per_worker:
        env["OMP_NUM_THREADS"] = str(args.threads_per_worker)
    placement = core_placement(stages, args.cores_per_encode)
    return [subprocess.Popen([sys.executable, "-m", "workers.cli", "worker", stage, "--mode", mode, "--model", args.model,
                              "--engine", args.engine,
                              "--load-format", args.load_format, "--log-level", "ERROR"], cwd=ROOT, env=env,
                             preexec_fn=None if cores is None else functools.partial(os.sched_setaffinity, 0, cores))
            for stage, cores in zip(stages, placement)]


# The cores this benchmark may use, read once: pinning moves this process too.
ALL_CORES = sorted(os.sched_getaffinity(0))


def core_placement(stages: list[str], cores_per_encode: int) -> list[set[int] | None]:
    """With `cores_per_encode`, each encode replica gets cores of its own (as replicas on machines of their own
    would) and every other process, this one included, the rest; without it (0), the OS places them all."""
    if not cores_per_encode:
        return [None] * len(stages)
    num_encoders = stages.count("encode")
    rest = set(ALL_CORES[num_encoders * cores_per_encode:])
    if len(rest) < 2:
        raise SystemExit(f"--cores-per-encode {cores_per_encode} × {num_encoders} leaves {len(rest)} of "
                         f"{len(ALL_CORES)} cores for the rest of the pipeline")
    os.sched_setaffinity(0, rest)
    own = iter(set(ALL_CORES[index * cores_per_encode:(index + 1) * cores_per_encode]) for index in range(num_encoders))
    return [next(own) if stage == "encode" else rest for stage in stages]


async def wait_ready(client: PipelineClient, stages: list[str], workers: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + 180
    while True:
        if any(worker.poll() is not None for worker in workers):
            raise RuntimeError("a worker exited before the pipeline was ready (its error is above)")
        cards = [c for c in await client.live_workers() if c.ready]
        if ready_models(cards) and len(cards) >= len(stages):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers not ready: {[c.stage.value for c in cards]}")
        await asyncio.sleep(0.3)


MODEL = DEFAULT_MODEL


async def ttft_of(client: PipelineClient, images: list[str], max_tokens: int = 4) -> float:
    parts = [TextPart(text="What do these images show?")] + [ImagePart(image_url=MediaUrl(url=u)) for u in images]
    request = ChatRequest(request_id=f"mm-{uuid.uuid4().hex[:12]}", reply_to=client.new_inbox(), model=MODEL,
                          messages=[ChatMessage(role="user", content=parts)], stream_format=StreamFormat.TOKENS,
                          temperature=0.0, max_tokens=max_tokens)
    started = time.perf_counter()
    first: float | None = None
    async with await client.submit(request, first_frame_timeout_s=120) as stream:
        async for _ in stream:
            first = first or time.perf_counter() - started
    return first or time.perf_counter() - started


async def measure_topology(client: PipelineClient, args: argparse.Namespace, rng: random.Random) -> dict[str, float]:
    results: dict[str, float] = {}
    await ttft_of(client, [random_image_url(args.image_px, rng)])  # warm-up
    for count in (1, 8):
        cold, warm = [], []
        for _ in range(args.requests):
            images = [random_image_url(args.image_px, rng) for _ in range(count)]
            cold.append(await ttft_of(client, images))
            warm.append(await ttft_of(client, images))
        results[f"ttft_cold_{count}"] = statistics.median(cold) * 1000
        results[f"ttft_warm_{count}"] = statistics.median(warm) * 1000
    results["req_per_s_8img"] = await throughput(client, args, rng, images_per_request=8)
    return results


async def throughput(client: PipelineClient, args: argparse.Namespace, rng: random.Random, images_per_request: int,
                     num_requests: int | None = None) -> float:
    """Requests/s with `args.concurrency * 2` requests in flight at any time (`num_requests` in all)."""
    in_flight = args.concurrency * 2
    batches = image_batches(num_requests or in_flight, images_per_request, args.image_px, rng)
    slots = asyncio.Semaphore(in_flight)

    async def one(images: list[str]) -> None:
        async with slots:
            await ttft_of(client, images, max_tokens=1)

    started = time.perf_counter()
    await asyncio.gather(*(one(images) for images in batches))
    return len(batches) / (time.perf_counter() - started)


def start_profiles(stages: list[str], workers: list[subprocess.Popen[bytes]], args: argparse.Namespace,
                   label: str) -> list[subprocess.Popen[bytes]]:
    """py-spy records every worker for --profile-s (raw collapsed stacks, one file per worker)."""
    py_spy = shutil.which("py-spy")
    if args.profile_dir is None or py_spy is None:
        return []
    args.profile_dir.mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen([py_spy, "record", "--nonblocking", "--pid", str(worker.pid), "--duration",
                              str(args.profile_s), "--rate", "100", "--format", "raw", "--output",
                              str(args.profile_dir / f"{label}-{index}-{stage}.txt")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for index, (stage, worker) in enumerate(zip(stages, workers))]


async def run_topology(name: str, stages: list[str], mode: str, args: argparse.Namespace,
                       measure: str = "all") -> dict[str, float]:
    with EmbeddedNatsServer() as server:
        namespace = f"mm{uuid.uuid4().hex[:6]}"
        workers = spawn(stages, server.url, namespace, mode, args)
        try:
            async with open_client(NatsSettings(urls=[server.url]), BusSettings(namespace=namespace), "bench") as client:
                say(f"{name}: starting {', '.join(stages)}")
                await wait_ready(client, stages, workers)
                rng = random.Random(7)
                if measure == "throughput":
                    await throughput(client, args, rng, 8)  # warm-up
                    recorders = start_profiles(stages, workers, args, f"encode{stages.count('encode')}")
                    rate = await throughput(client, args, rng, 8, args.throughput_requests)
                    for recorder in recorders:
                        recorder.wait(timeout=args.profile_s + 30)
                    say(f"{name}: {rate:.2f} requests/s")
                    return {"req_per_s_8img": rate}
                measured = await measure_topology(client, args, rng)
                say(f"{name}: " + ", ".join(f"{key} {value:.1f}" for key, value in measured.items()))
                return measured
        finally:
            for worker in workers:
                worker.send_signal(signal.SIGTERM)
            for worker in workers:
                worker.wait(timeout=60)


async def transfer_times(sizes_bytes: list[int]) -> list[tuple[int, float, float]]:
    """(bytes, NIXL ms, NATS ms) per size: median of 5 moves each."""
    exporter, reader = EmbeddingExporter("bench-export", max(sizes_bytes) * 2), EmbeddingReader("bench-read")
    rows: list[tuple[int, float, float]] = []
    with EmbeddedNatsServer(max_payload_bytes=64 << 20) as server:
        settings = NatsSettings(urls=[server.url])
        sender, receiver = await connect(settings, "bench-send"), await connect(settings, "bench-receive")

        async def echo_size(msg) -> None:  # type: ignore[no-untyped-def]
            await msg.respond(str(len(msg.data)).encode())

        await receiver.subscribe("bench.rows", cb=echo_size)
        for size in sizes_bytes:
            tensor = torch.randn(size // 4)
            nixl_ms, nats_ms = [], []
            for attempt in range(6):
                started = time.perf_counter()
                handle = await exporter.offer(f"b{size}-{attempt}", tensor, wait_for_space_s=5)
                await asyncio.to_thread(reader.read, handle, f"b{size}-{attempt}", 10.0)
                nixl_ms.append((time.perf_counter() - started) * 1000)
                exporter.release(f"b{size}-{attempt}")
                payload = tensor.numpy().tobytes()
                started = time.perf_counter()
                await sender.request("bench.rows", payload, timeout=30)
                nats_ms.append((time.perf_counter() - started) * 1000)
            rows.append((size, statistics.median(nixl_ms[1:]), statistics.median(nats_ms[1:])))
        await sender.close()
        await receiver.close()
    await exporter.close()
    return rows


async def main(args: argparse.Namespace) -> None:
    global MODEL
    MODEL = args.model
    if args.only_scale_out:
        await scale_out(args)
        return
    epd = await run_topology("EPD", ["processor", "decode"], "aggregated", args)
    e_pd = await run_topology("E/PD", ["processor", "encode", "decode"], "encode-aggregated", args)
    one_encoder = e_pd["req_per_s_8img"]
    two_encoders = (await run_topology("E/PD ×2 encode", ["processor", "encode", "encode", "decode"], "encode-aggregated",
                                       args, measure="throughput"))["req_per_s_8img"]
    print(f"\n{args.engine} engine, {os.cpu_count()} cores, {args.image_px}px noise PNGs, medians of {args.requests} "
          f"requests\n")
    print(f"{'measure':<34} {'EPD':>10} {'E/PD':>10} {'E/PD ÷ EPD':>11}")
    for key, label in [("ttft_cold_1", "TTFT ms, 1 image, cache cold"), ("ttft_warm_1", "TTFT ms, 1 image, cache warm"),
                       ("ttft_cold_8", "TTFT ms, 8 images, cache cold"), ("ttft_warm_8", "TTFT ms, 8 images, cache warm"),
                       ("req_per_s_8img", f"requests/s, 8 images, {args.concurrency * 2} at once")]:
        print(f"{label:<34} {epd[key]:>10.1f} {e_pd[key]:>10.1f} {e_pd[key] / epd[key]:>10.2f}×")
    for name, result in [("EPD", epd), ("E/PD", e_pd)]:
        print(f"cache speed-up ({name}): 1 image {result['ttft_cold_1'] / result['ttft_warm_1']:.2f}×, "
              f"8 images {result['ttft_cold_8'] / result['ttft_warm_8']:.2f}×")
    print(f"encode replicas 1 → 2: {one_encoder:.2f} → {two_encoders:.2f} requests/s ({two_encoders / one_encoder:.2f}×)")
    await print_transfers()


async def scale_out(args: argparse.Namespace) -> None:
    """Image requests/s with 1, 2 (and 4) encode replicas, where encode is the bottleneck.

    A discarded warm-up run comes first (on a fresh machine the first run is slow: page cache, CPU clocks),
    then rounds in alternating order (1 2, 2 1, ...) so drift does not favour one count.
    """
    if args.warmup_run:
        stages = ["processor", "encode", "decode"]
        await run_topology("warm-up (discarded)", stages, "encode-aggregated", args, measure="throughput")
    results: dict[int, list[float]] = {replicas: [] for replicas in args.encode_replicas}
    for round_index in range(args.rounds):
        order = args.encode_replicas if round_index % 2 == 0 else list(reversed(args.encode_replicas))
        for replicas in order:
            stages = ["processor", *["encode"] * replicas, "decode"]
            result = await run_topology(f"round {round_index + 1}: E/PD ×{replicas} encode", stages,
                                        "encode-aggregated", args, measure="throughput")
            results[replicas].append(result["req_per_s_8img"])
    base_count = args.encode_replicas[0]
    pinned = f", each encode replica pinned to {args.cores_per_encode} cores" if args.cores_per_encode else ""
    print(f"\n{os.cpu_count()} cores{pinned}, {args.threads_per_worker or 'default'} threads per worker, 8 × {args.image_px}px "
          f"images per request, {args.concurrency * 2} requests at once, {args.rounds} rounds in alternating order")
    for round_index in range(args.rounds):
        row = ", ".join(f"×{replicas} {rates[round_index]:.2f}" for replicas, rates in results.items())
        print(f"round {round_index + 1}: {row} requests/s")
    base = statistics.median(results[base_count])
    for replicas, rates in results.items():
        rate = statistics.median(rates)
        print(f"encode replicas {replicas}: median {rate:.2f} requests/s ({rate / base:.2f}× of {base_count})")


async def print_transfers() -> None:
    print(f"\n{'embedding bytes':>16} {'NIXL ms':>9} {'NATS ms':>9}  (one move; NATS needs max_payload raised above 1 MiB)")
    for size, nixl_ms, nats_ms in await transfer_times([16 * 576 * 4, 8 * 16 * 576 * 4, 4 << 20, 32 << 20]):
        print(f"{size:>16,} {nixl_ms:>9.2f} {nats_ms:>9.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=6, help="requests per TTFT measure")
    parser.add_argument("--concurrency", type=int, default=4, help="half the requests sent at once for requests/s")
    parser.add_argument("--image-px", type=int, default=512)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a model directory, or the bundled default")
    parser.add_argument("--engine", default="torch", choices=["torch", "sglang"],
                        help="sglang: a Qwen2-VL-family --model, on a GPU machine")
    parser.add_argument("--load-format", default="auto", help="auto, or dummy (random weights of the config's shape)")
    parser.add_argument("--threads-per-worker", type=int, default=0, help="OMP_NUM_THREADS of each worker (0: torch's)")
    parser.add_argument("--only-scale-out", action="store_true", help="only the encode scale-out measure")
    parser.add_argument("--encode-replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--cores-per-encode", type=int, default=0,
                        help="pin each encode replica to this many cores of its own, the rest of the pipeline to the "
                             "other cores (0: no pinning); encode is then the bottleneck, as with replicas on machines "
                             "of their own")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of the scale-out measure, in alternating order")
    parser.add_argument("--no-warmup-run", dest="warmup_run", action="store_false",
                        help="skip the discarded first run of the scale-out measure")
    parser.add_argument("--throughput-requests", type=int, default=None,
                        help="requests per scale-out measure (default: twice --concurrency, all at once)")
    parser.add_argument("--profile-dir", type=Path, default=None,
                        help="record every worker with py-spy during each scale-out measure, into this directory")
    parser.add_argument("--profile-s", type=int, default=8)
    asyncio.run(main(parser.parse_args()))
