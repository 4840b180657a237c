"""What a LoRA adapter costs the torch engine, side by side in one run, alternating rounds (these machines are noisy).

Per round, the same prompts (greedy, fixed output length, all at once): every request on the base model; every
request on one adapter; half on the base model and half on each of two adapters (three groups in every step). The
adapters are rank-r PEFT adapters with random weights on q/v/down, made here. Prints output tokens/s per mix, the
median over rounds, and each mix's ratio to the base model.

    .venv/bin/python scripts/bench_lora.py [--batch 8] [--new-tokens 32] [--rank 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from schemas.sampling import SamplingOptions, StopConditions  # noqa: E402
from tests.test_lora import make_adapter  # noqa: E402
from workers.engines.protocol import GenerateRequest  # noqa: E402
from workers.engines.torch_engine.engine import TorchEngine, TorchEngineConfig  # noqa: E402

TOPICS = ["the ocean", "a city at night", "mountains", "a library", "the first snow", "trains", "a garden", "stars"]


async def throughput(engine: TorchEngine, prompts: list[list[int]], adapters: list[str | None], new_tokens: int,
                     tag: str) -> float:
    stop = StopConditions(max_tokens=new_tokens, ignore_eos=True)

    async def one(index: int) -> int:
        request = GenerateRequest(f"{tag}-{index}", prompts[index], SamplingOptions(temperature=0.0), stop,
                                  lora_name=adapters[index])
        async for output in engine.generate(request):
            if output.finished:
                return output.completion_tokens
        raise RuntimeError("no final output")

    await engine.flush_cache()  # every mix computes its prompts
    started_s = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(len(prompts)))))
    return tokens / (time.perf_counter() - started_s)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    engine = TorchEngine(TorchEngineConfig())
    await engine.start()
    assert engine.model_config is not None
    with tempfile.TemporaryDirectory() as folder:
        for seed, name in enumerate(("a", "b")):
            path = make_adapter(Path(folder) / name, engine.model_config, rank=args.rank, seed=seed)
            await engine.load_lora(name, str(path))
        prompts = [engine.tokenizer(f"Write a short story about {TOPICS[i % len(TOPICS)]} (#{i}):").input_ids
                   for i in range(args.batch)]
        mixes = {"base model": [None] * args.batch, "one adapter": ["a"] * args.batch,
                 "base + two adapters": [(None, "a", "b")[i % 3] for i in range(args.batch)]}
        await throughput(engine, prompts, mixes["one adapter"], 4, "warm-up")
        rates: dict[str, list[float]] = {mix: [] for mix in mixes}
        for round_index in range(args.rounds):
            for mix, adapters in mixes.items():
                rates[mix].append(await throughput(engine, prompts, adapters, args.new_tokens, f"{mix}-{round_index}"))
    await engine.shutdown()
    base = statistics.median(rates["base model"])
    print(f"torch engine, {args.batch} requests x {args.new_tokens} tokens, rank {args.rank}, {args.rounds} rounds")
    print(f"{'mix':<22} {'tok/s (median)':>15} {'rounds':>28} {'ratio':>7}")
    for mix, values in rates.items():
        median = statistics.median(values)
        print(f"{mix:<22} {median:>15.1f} {' / '.join(f'{v:.1f}' for v in values):>28} {median / base:>6.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
