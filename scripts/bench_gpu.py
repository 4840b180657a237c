"""Engine alone versus the same engine behind the pipeline, on the GPU machine (or anywhere).

For each engine named (sglang, torch), one run: start the engine once in this process, measure it
called directly (time to first token, inter-token latency, output tokens/s at each concurrency),
then put the *same* engine behind the pipeline — an embedded nats-server, a processor process and a
decode worker in this process — and measure the same load through the bus. Prints both and the
ratios pipeline ÷ direct, checks that KV events reached the KV-events stream and that a cancel
mid-stream stops the engine, and writes everything to $OUT/bench-gpu.json when $OUT is set.

    python scripts/bench_gpu.py --model .gpu/smol --engines sglang torch --concurrency 1 16 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bus.client import PipelineClient, open_client  # noqa: E402
from bus.registry import ready_models  # noqa: E402
from bus.server import EmbeddedNatsServer  # noqa: E402
from bus.settings import BusSettings, NatsSettings  # noqa: E402
from schemas.client import CompletionRequest, StreamFormat  # noqa: E402
from schemas.registry import ServingMode, Stage  # noqa: E402
from schemas.replies import FinalFrame  # noqa: E402
from schemas.sampling import SamplingOptions, StopConditions  # noqa: E402
from workers.decode import DecodeStage  # noqa: E402
from workers.engines.factory import EngineKind, create_engine  # noqa: E402
from workers.engines.protocol import Engine, GenerateRequest  # noqa: E402
from workers.runtime import WorkerOptions, WorkerRuntime  # noqa: E402

PROMPT_TOKENS = 128


class AlreadyStarted:
    """The engine measured directly, handed to the decode worker without a second start."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    async def start(self) -> None:
        return None

    async def shutdown(self) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def prompt(index: int) -> list[int]:
    return [100 + (index * 7 + k) % 20000 for k in range(PROMPT_TOKENS)]


def summary(ttfts: list[float], gaps: list[float], tokens: int, elapsed_s: float) -> dict[str, float]:
    return {"ttft_ms": 1000 * statistics.median(ttfts), "itl_ms": 1000 * statistics.median(gaps) if gaps else 0.0,
            "tokens_per_s": tokens / elapsed_s}


async def direct(engine: Engine, concurrency: int, new_tokens: int) -> dict[str, float]:
    async def one(index: int) -> tuple[float, list[float], int]:
        request = GenerateRequest(f"direct-{uuid.uuid4().hex[:8]}", prompt(index), SamplingOptions(temperature=0.0),
                                  StopConditions(max_tokens=new_tokens, ignore_eos=True))
        started = time.perf_counter()
        stamps: list[float] = []
        async for output in engine.generate(request):
            if output.token_ids:
                stamps.extend([time.perf_counter()] * len(output.token_ids))
        return stamps[0] - started, [b - a for a, b in zip(stamps, stamps[1:]) if b > a], len(stamps)

    started = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(concurrency)))
    return summary([r[0] for r in results], [g for r in results for g in r[1]], sum(r[2] for r in results),
                   time.perf_counter() - started)


async def through_pipeline(client: PipelineClient, model: str, concurrency: int, new_tokens: int) -> dict[str, float]:
    async def one(index: int) -> tuple[float, list[float], int]:
        request = CompletionRequest(request_id=f"pipe-{uuid.uuid4().hex[:12]}", reply_to=client.new_inbox(), model=model,
                                    prompt=prompt(index), max_tokens=new_tokens, ignore_eos=True, temperature=0.0,
                                    stream_format=StreamFormat.TOKENS)
        started = time.perf_counter()
        stamps: list[float] = []
        async with await client.submit(request, first_frame_timeout_s=120) as stream:
            async for chunk in stream:
                stamps.extend([time.perf_counter()] * len(chunk.token_ids))
        return stamps[0] - started, [b - a for a, b in zip(stamps, stamps[1:]) if b > a], len(stamps)

    started = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(concurrency)))
    return summary([r[0] for r in results], [g for r in results for g in r[1]], sum(r[2] for r in results),
                   time.perf_counter() - started)


async def cancel_check(client: PipelineClient, model: str, engine: Engine) -> dict[str, Any]:
    request = CompletionRequest(request_id=f"cancel-{uuid.uuid4().hex[:8]}", reply_to=client.new_inbox(), model=model,
                                prompt=prompt(999), max_tokens=4000, ignore_eos=True, stream_format=StreamFormat.TOKENS)
    async with await client.submit(request, first_frame_timeout_s=120) as stream:
        chunks = stream.__aiter__()
        for _ in range(5):
            await chunks.__anext__()
        sent = time.perf_counter()
        await client.cancel(request.request_id)
        async for _ in chunks:
            pass
        latency_ms = 1000 * (time.perf_counter() - sent)
    final = stream.terminal
    await asyncio.sleep(1.5)
    return {"finish_reason": final.finish_reason.value if isinstance(final, FinalFrame) else None,
            "cancel_to_final_ms": latency_ms, "engine_running_after": engine.load().running_requests}


def _median(results: list[dict[str, float]]) -> dict[str, float]:
    return sorted(results, key=lambda r: r["tokens_per_s"])[len(results) // 2]


async def bench_engine(kind: EngineKind, model_dir: str, levels: list[int], new_tokens: int, rounds: int,
                       coalesce_ms: float) -> dict[str, Any]:
    print(f"\n=== {kind.value} engine, model {model_dir} (dummy weights), reply coalescing {coalesce_ms:g} ms ===", flush=True)
    started = time.perf_counter()
    engine = create_engine(kind, model_dir, load_format="dummy")
    await engine.start()
    report: dict[str, Any] = {"engine": kind.value, "coalesce_ms": coalesce_ms, "start_s": round(time.perf_counter() - started, 1), "levels": {}}
    print(f"engine started in {report['start_s']} s", flush=True)
    for level in levels:
        await direct(engine, level, 16)  # warm-up at this batch size (CUDA graphs, kernels, allocator)
    with EmbeddedNatsServer() as server:
        nats = NatsSettings(urls=[server.url])
        bus = BusSettings(namespace=f"gpu{uuid.uuid4().hex[:6]}")
        env = {**os.environ, "CONVEYOR_NATS_URLS": server.url, "CONVEYOR_NAMESPACE": bus.namespace}
        processor = subprocess.Popen([sys.executable, "-m", "workers.cli", "worker", "processor", "--engine", kind.value,
                                      "--model", model_dir, "--log-level", "WARNING", "--max-concurrency", "256"],
                                     cwd=ROOT, env=env)
        options = WorkerOptions(stage=Stage.DECODE, model=model_dir, mode=ServingMode.AGGREGATED, engine_name=kind.value,
                                http_host="127.0.0.1", max_concurrency=256, handle_signals=False,
                                coalesce_window_s=coalesce_ms / 1000)
        decode = WorkerRuntime(DecodeStage(AlreadyStarted(engine), model_dir), options, nats, bus)  # type: ignore[arg-type]
        decode_task = asyncio.create_task(decode.run())
        try:
            async with open_client(nats, bus, "bench-gpu") as client:
                deadline = time.monotonic() + 180
                while model_dir not in ready_models(await client.live_workers()):
                    if time.monotonic() > deadline or decode_task.done():
                        raise RuntimeError("pipeline not ready")
                    await asyncio.sleep(0.5)
                await through_pipeline(client, model_dir, 4, 8)  # warm-up
                # Direct and pipeline alternate, `rounds` times each; the median round is kept.
                for level in levels:
                    runs: dict[str, list[dict[str, float]]] = {"direct": [], "pipeline": []}
                    for _ in range(rounds):
                        runs["direct"].append(await direct(engine, level, new_tokens))
                        runs["pipeline"].append(await through_pipeline(client, model_dir, level, new_tokens))
                    report["levels"][level] = {mode: _median(results) for mode, results in runs.items()}
                report["cancel"] = await cancel_check(client, model_dir, engine)
            info = await _kv_event_count(nats, bus)
            report["kv_event_batches"] = info
        finally:
            decode.request_stop()
            await asyncio.wait_for(decode_task, timeout=60)
            processor.send_signal(signal.SIGTERM)
            processor.wait(timeout=30)
    await engine.shutdown()
    _print(report)
    return report


async def _kv_event_count(nats: NatsSettings, bus: BusSettings) -> int:
    from bus.connection import connect
    from bus.subjects import Names

    nc = await connect(nats, "kv-count")
    try:
        info = await nc.jetstream().stream_info(Names(bus.namespace).kv_events_stream)
        return int(info.state.messages)
    finally:
        await nc.close()


def _print(report: dict[str, Any]) -> None:
    print(f"{'conc':>5} | {'TTFT ms direct/pipe':>20} | {'ITL ms direct/pipe':>19} | {'tok/s direct/pipe':>19} | ratios (pipe ÷ direct)")
    for level, row in report["levels"].items():
        d, p = row["direct"], row["pipeline"]
        print(f"{level:>5} | {d['ttft_ms']:>8.1f} / {p['ttft_ms']:>8.1f} | {d['itl_ms']:>8.2f} / {p['itl_ms']:>7.2f} | "
              f"{d['tokens_per_s']:>8.0f} / {p['tokens_per_s']:>8.0f} | TTFT {p['ttft_ms'] / d['ttft_ms']:.2f}×, "
              f"ITL {p['itl_ms'] / max(d['itl_ms'], 1e-9):.2f}×, tok/s {p['tokens_per_s'] / d['tokens_per_s']:.2f}×")
    print(f"cancel: {report.get('cancel')}; KV-event batches on the stream: {report.get('kv_event_batches')}", flush=True)


async def main(model: str, engines: list[str], levels: list[int], new_tokens: int, rounds: int,
               coalesce_ms: list[float]) -> None:
    results = []
    for name, window_ms in ((n, w) for n in engines for w in coalesce_ms):
        try:
            results.append(await bench_engine(EngineKind(name), model, levels, new_tokens, rounds, window_ms))
        except Exception as error:  # report and go on to the next engine
            import traceback

            traceback.print_exc()
            results.append({"engine": name, "error": repr(error)})
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench-gpu.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=".gpu/smol")
    parser.add_argument("--engines", nargs="+", default=["sglang", "torch"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="alternating direct/pipeline rounds per level")
    parser.add_argument("--coalesce-ms", type=float, nargs="+", default=[0.0],
                        help="the decode worker's reply coalescing windows to measure (one pass each)")
    args = parser.parse_args()
    asyncio.run(main(args.model, args.engines, args.concurrency, args.tokens, args.rounds, args.coalesce_ms))
