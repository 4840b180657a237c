"""Time to first token at one stream, paired request by request between OpenAI-compatible servers.

bench_serving alternates whole runs between two servers, so a few milliseconds of difference drown in what changes
between runs (prompt mix, GPU clocks, the machine's other load). This client sends each prompt to every target in
turn, one request at a time (the order alternating prompt by prompt), and prints each target's TTFT percentiles and
the median of the per-prompt differences against the first target: the latency one system adds over another.

Prompts are random token ids of the model's tokenizer, 1/4 to all of `--prompt-tokens` long, sent as text; a target
written `URL#ids` gets the same prompts as token ids instead (no tokenizer on its path). Each request streams
`--max-tokens` tokens; TTFT is the time to the first `data:` event that carries text.

    # SGLang's own server against Conveyor's gateway, both serving .gpu/smol (docs/gpu.md):
    python scripts/bench_ttft.py --model .gpu/smol http://127.0.0.1:30000 http://127.0.0.1:8000
    # the same with token-id prompts (tokenization left out of both):
    python scripts/bench_ttft.py --model .gpu/smol 'http://127.0.0.1:30000#ids' 'http://127.0.0.1:8000#ids'
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from dataclasses import dataclass

import aiohttp


@dataclass(frozen=True, slots=True)
class Target:
    url: str
    as_ids: bool

    @classmethod
    def parse(cls, text: str) -> Target:
        url, _, form = text.partition("#")
        if form not in ("", "ids"):
            raise argparse.ArgumentTypeError(f"{text!r}: a target is URL or URL#ids")
        return cls(url.rstrip("/"), form == "ids")

    def __str__(self) -> str:
        return self.url + ("#ids" if self.as_ids else "")


async def first_token_ms(session: aiohttp.ClientSession, target: Target, model: str, text: str, ids: list[int],
                         max_tokens: int) -> float:
    body = {"model": model, "prompt": ids if target.as_ids else text, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    started = time.perf_counter()
    first_ms: float | None = None
    async with session.post(f"{target.url}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{target}: HTTP {response.status}: {(await response.text())[:300]}")
        async for line in response.content:  # read to the end: the next request starts on an idle server
            if first_ms is None and line.startswith(b"data: ") and b'"text"' in line:
                first_ms = (time.perf_counter() - started) * 1000
    if first_ms is None:
        raise RuntimeError(f"{target}: the stream ended without a token")
    return first_ms


def random_prompts(model: str, count: int, max_tokens: int, seed: int) -> list[tuple[str, list[int]]]:
    """(text, its token ids) pairs: random ids decoded, then encoded again, so both forms are the same prompt."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    rng = random.Random(seed)
    top = min(tokenizer.vocab_size, 30000)
    prompts = []
    for _ in range(count):
        text = tokenizer.decode([rng.randrange(100, top) for _ in range(rng.randint(max(1, max_tokens // 4), max_tokens))])
        prompts.append((text, tokenizer.encode(text)))
    return prompts


def percentiles(values: list[float]) -> str:
    deciles = statistics.quantiles(values, n=10)
    return f"p10 {deciles[0]:6.2f}  p50 {statistics.median(values):6.2f}  p90 {deciles[-1]:6.2f} ms"


async def run(args: argparse.Namespace) -> None:
    prompts = random_prompts(args.model, args.warmup + args.requests, args.prompt_tokens, args.seed)
    print(f"[bench-ttft] prompts from seed {args.seed}", file=sys.stderr, flush=True)
    samples: dict[Target, list[float]] = {target: [] for target in args.targets}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.request_timeout_s)) as session:
        for index, (text, ids) in enumerate(prompts):
            order = args.targets if index % 2 == 0 else args.targets[::-1]
            for target in order:
                samples[target].append(await first_token_ms(session, target, args.model, text, ids, args.max_tokens))
            done = index + 1 - args.warmup
            if done > 0 and done % 50 == 0:
                print(f"[bench-ttft] {done}/{args.requests} prompts", file=sys.stderr, flush=True)
    kept = {target: values[args.warmup:] for target, values in samples.items()}
    print(f"TTFT at one stream, {args.requests} prompts of up to {args.prompt_tokens} tokens "
          f"(after {args.warmup} discarded), {args.max_tokens} tokens each")
    for target, values in kept.items():
        print(f"  {str(target):40s} {percentiles(values)}")
    base = args.targets[0]
    for target in args.targets[1:]:
        differences = [b - a for a, b in zip(kept[base], kept[target], strict=True)]
        print(f"  added by {target} over {base}, per prompt: median {statistics.median(differences):+.2f} ms, "
              f"mean {statistics.mean(differences):+.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("targets", nargs="+", type=Target.parse,
                        help="Server base URLs (the first is the baseline); URL#ids sends token ids.")
    parser.add_argument("--model", required=True, help="Model name the servers serve, and its tokenizer's folder.")
    parser.add_argument("--requests", type=int, default=200, help="Prompts measured (each goes to every target).")
    parser.add_argument("--warmup", type=int, default=5, help="Prompts sent first and not counted.")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="Longest prompt, in tokens.")
    parser.add_argument("--max-tokens", type=int, default=4, help="Tokens each request streams.")
    # Drawn per run: a server kept since an earlier run has its prompts in its prefix cache, a stack started since
    # has not, and a cached prompt's first token comes sooner.
    parser.add_argument("--seed", type=int, default=random.SystemRandom().randrange(1 << 30),
                        help="Prompt seed (default: drawn per run, so no target has the prompts cached).")
    parser.add_argument("--request-timeout-s", type=float, default=60.0)
    args = parser.parse_args()
    if args.requests < 2:
        parser.error("--requests must be at least 2 (percentiles)")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
