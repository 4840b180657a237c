"""Benchmark the torch engine, side by side with Hugging Face `generate`, in one run.

Three measurements on the same model and prompts (greedy, fixed output length):

1. tokens/s at batch sizes 1, 8 and 32: the torch engine (all requests submitted at once,
   continuous batching) versus Hugging Face `generate` on the same batch (left-padded);
2. continuous batching: 16 requests of different lengths concurrently versus one after another;
3. prefix caching: time to first token of a request whose 256-token prefix is cached versus the
   same request with an empty cache.

    .venv/bin/python scripts/bench_engine.py                 # CPU, the bundled SmolLM2-135M
    .venv/bin/python scripts/bench_engine.py --device cuda   # on the GPU machine
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from schemas.sampling import SamplingOptions, StopConditions  # noqa: E402
from workers.engines.protocol import GenerateRequest  # noqa: E402
from workers.engines.torch_engine.engine import TorchEngine, TorchEngineConfig  # noqa: E402

GREEDY = SamplingOptions(temperature=0.0)
TOPICS = ["the ocean", "a city at night", "mountains", "a library", "the first snow", "trains", "a garden", "stars"]


def prompts(engine: TorchEngine, count: int) -> list[list[int]]:
    return [engine.tokenizer(f"Write a short story about {TOPICS[i % len(TOPICS)]} (#{i}):").input_ids for i in range(count)]


async def run_one(engine: TorchEngine, request: GenerateRequest) -> tuple[int, float]:
    """(completion tokens, seconds to first token)."""
    started = time.perf_counter()
    first: float | None = None
    async for output in engine.generate(request):
        if first is None and output.token_ids:
            first = time.perf_counter() - started
        if output.finished:
            return output.completion_tokens, first or 0.0
    raise RuntimeError("no final output")


async def engine_throughput(engine: TorchEngine, batch: list[list[int]], new_tokens: int, tag: str) -> float:
    stop = StopConditions(max_tokens=new_tokens, ignore_eos=True)
    started = time.perf_counter()
    results = await asyncio.gather(*(run_one(engine, GenerateRequest(f"{tag}-{i}", ids, GREEDY, stop))
                                     for i, ids in enumerate(batch)))
    return sum(tokens for tokens, _ in results) / (time.perf_counter() - started)


def hf_throughput(model: torch.nn.Module, tokenizer: object, batch: list[list[int]], new_tokens: int, device: str) -> float:
    width = max(len(ids) for ids in batch)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0  # type: ignore[attr-defined]
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in batch], device=device)
    attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch], device=device)
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    return (out.shape[1] - width) * len(batch) / (time.perf_counter() - started)


async def main(device: str, new_tokens: int, batch_sizes: list[int]) -> None:
    engine = TorchEngine(TorchEngineConfig(device=device, max_running_requests=64, max_step_tokens=2048))
    await engine.start()
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(engine._model_dir), dtype=engine.dtype).to(device).eval()
    print(f"model {engine._model_dir.name}, device {device}, dtype {engine.dtype}, torch threads {torch.get_num_threads()}")

    print(f"\n1. output tokens/s, {new_tokens} new tokens per request (greedy)")
    print(f"   {'batch':>5}  {'conveyor torch':>14}  {'HF generate':>11}  {'ratio':>6}")
    for size in batch_sizes:
        batch = prompts(engine, size)
        await engine_throughput(engine, batch[:1], 4, f"warm{size}")  # warm-up
        ours = await engine_throughput(engine, batch, new_tokens, f"tp{size}")
        theirs = hf_throughput(hf, engine.tokenizer, batch, new_tokens, device)
        print(f"   {size:>5}  {ours:>14.1f}  {theirs:>11.1f}  {ours / theirs:>5.2f}×")

    print("\n2. continuous batching: 16 requests of 8..38 new tokens")
    batch = prompts(engine, 16)
    requests = [GenerateRequest(f"cb-{i}", ids, GREEDY, StopConditions(max_tokens=8 + 2 * i, ignore_eos=True))
                for i, ids in enumerate(batch)]
    started = time.perf_counter()
    for request in requests:
        await run_one(engine, GenerateRequest(request.request_id + "-seq", request.token_ids, GREEDY, request.stop))
    sequential_s = time.perf_counter() - started
    started = time.perf_counter()
    await asyncio.gather(*(run_one(engine, request) for request in requests))
    concurrent_s = time.perf_counter() - started
    total = sum(r.stop.max_tokens or 0 for r in requests)
    print(f"   one by one {total / sequential_s:7.1f} tokens/s ({sequential_s:.2f} s)")
    print(f"   concurrent {total / concurrent_s:7.1f} tokens/s ({concurrent_s:.2f} s)  → {sequential_s / concurrent_s:.2f}×")

    print("\n3. prefix caching: time to first token with a 256-token prefix")
    prefix = (engine.tokenizer("The quick brown fox jumps over the lazy dog. ").input_ids * 40)[:256]
    cold, warm = [], []
    for trial in range(3):
        await engine.flush_cache()
        question = engine.tokenizer(f" Question {trial}: what did the fox do?").input_ids
        _, ttft_cold = await run_one(engine, GenerateRequest(f"cold-{trial}", prefix + question, GREEDY, StopConditions(max_tokens=1)))
        other = engine.tokenizer(f" Question {trial}: who was lazy?").input_ids
        _, ttft_warm = await run_one(engine, GenerateRequest(f"warm-{trial}", prefix + other, GREEDY, StopConditions(max_tokens=1)))
        cold.append(ttft_cold)
        warm.append(ttft_warm)
    print(f"   empty cache {1000 * statistics.median(cold):7.1f} ms   prefix cached {1000 * statistics.median(warm):7.1f} ms"
          f"   → {statistics.median(cold) / statistics.median(warm):.2f}× faster")
    await engine.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    args = parser.parse_args()
    asyncio.run(main(args.device, args.new_tokens, args.batch_sizes))
