"""One stream, paired request by request between OpenAI-compatible servers: first token, token rate, inter-token gaps.

bench_serving and aiperf alternate whole runs between two servers, so a few milliseconds of difference drown in what
changes between runs (prompt mix, GPU clocks, the machine's other load: on the H100 machine one system's per-token
time at one stream moved 1.9 → 2.6 ms from one run to the next). This client sends each prompt to every target in
turn, one request at a time, so every target meets the same machine state, and prints each target's TTFT percentiles
and the median of the per-prompt differences against the first target (with its 95% bootstrap interval): the latency
one system adds over another. The order turns prompt by prompt through every rotation of the targets, forwards and
backwards, so each target takes each place in the order equally often (until the twentieth stop it only alternated
forwards and backwards, which left the middle one of three always second).

Prompts are random token ids of the model's tokenizer, 1/4 to all of `--prompt-tokens` long, sent as text; a target
written `URL#ids` gets the same prompts as token ids instead (no tokenizer on its path). Each request streams
`--max-tokens` tokens (or a number drawn per prompt from `--min-tokens` to `--max-tokens`, the same for every
target); TTFT is the time to the first `data:` event that carries text. With more than a few tokens per request it
also prints what aiperf reports at one stream, paired: output tokens/s (all tokens over all request time), each
request's inter-token latency ((last - first event) / (tokens - 1), p50 and p99 over requests) and the p99 of every
gap between two events, each as a ratio to the first target.

    # SGLang's own server against Conveyor's gateway, both serving .gpu/smol (docs/gpu.md):
    python scripts/bench_ttft.py --model .gpu/smol http://127.0.0.1:30000 http://127.0.0.1:8000
    # the same with token-id prompts (tokenization left out of both):
    python scripts/bench_ttft.py --model .gpu/smol 'http://127.0.0.1:30000#ids' 'http://127.0.0.1:8000#ids'
    # aiperf's path: each prompt as a chat message (the chat template and the tokenizer on both sides)
    python scripts/bench_ttft.py --model .gpu/smol --chat http://127.0.0.1:30000 http://127.0.0.1:8000
    # issue 11's one-stream load (outputs of 128–512 tokens): token rate and inter-token latency, paired
    python scripts/bench_ttft.py --model .gpu/smol --requests 60 --min-tokens 128 --max-tokens 512 \
        http://127.0.0.1:30000 http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass

import aiohttp

# Below this many tokens a request is mostly its first token: no token rate or inter-token latency is printed.
MIN_TOKENS_FOR_RATES = 16


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


@dataclass(frozen=True, slots=True)
class Stream:
    """One request's timing: when each event with text arrived, ms after the request was sent."""

    num_tokens: int
    event_ms: list[float]
    end_ms: float

    @property
    def ttft_ms(self) -> float:
        return self.event_ms[0]

    @property
    def itl_ms(self) -> float:
        """aiperf's per-request inter-token latency: the time after the first token over the tokens after it."""
        return (self.event_ms[-1] - self.event_ms[0]) / max(1, self.num_tokens - 1)

    @property
    def gaps_ms(self) -> list[float]:
        return [later - earlier for earlier, later in zip(self.event_ms, self.event_ms[1:])]


async def stream_once(session: aiohttp.ClientSession, target: Target, model: str, text: str, ids: list[int],
                      num_tokens: int, chat: bool = False) -> Stream:
    if chat:
        route, body = "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": text}]}
    else:
        route, body = "/v1/completions", {"model": model, "prompt": ids if target.as_ids else text}
    body |= {"max_tokens": num_tokens, "stream": True, "ignore_eos": True}
    started = time.perf_counter()
    event_ms: list[float] = []
    async with session.post(f"{target.url}{route}", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{target}: HTTP {response.status}: {(await response.text())[:300]}")
        async for line in response.content:  # read to the end: the next request starts on an idle server
            arrived_ms = (time.perf_counter() - started) * 1000
            if line.startswith(b"data: ") and (has_content(line) if chat else b'"text"' in line):
                event_ms.append(arrived_ms)
    if not event_ms:
        raise RuntimeError(f"{target}: the stream ended without a token")
    return Stream(num_tokens, event_ms, (time.perf_counter() - started) * 1000)


def has_content(line: bytes) -> bool:
    """A chat chunk with text in its delta (as aiperf counts: not the role-only first chunk some servers send)."""
    if not line.startswith(b"data: {"):
        return False
    choices = json.loads(line[len(b"data: "):]).get("choices") or [{}]
    return bool((choices[0].get("delta") or {}).get("content"))


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


def orders(targets: list[Target]) -> list[list[Target]]:
    """Every rotation of the targets and of their reverse: cycled prompt by prompt, each target is in each place of
    the order equally often, and after each other target equally often."""
    rotations = []
    for sequence in (targets, targets[::-1]):
        rotations += [sequence[shift:] + sequence[:shift] for shift in range(len(sequence))]
    return rotations


def median_interval(values: list[float], seed: int, resamples: int = 2000) -> tuple[float, float]:
    """The 95% bootstrap interval of the median: how far this run's prompts leave it uncertain (not the run-to-run
    spread, which on the H100 machine has been wider)."""
    draw = random.Random(seed)
    medians = sorted(statistics.median(draw.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def percentiles(values: list[float]) -> str:
    deciles = statistics.quantiles(values, n=10)
    return f"p10 {deciles[0]:6.2f}  p50 {statistics.median(values):6.2f}  p90 {deciles[-1]:6.2f} ms"


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[-1]


def stream_measures(streams: list[Stream]) -> dict[str, float]:
    """What aiperf reports at one stream, from these requests."""
    itls = [stream.itl_ms for stream in streams]
    return {
        "tok/s": 1000 * sum(stream.num_tokens for stream in streams) / sum(stream.end_ms for stream in streams),
        "ITL p50": statistics.median(itls),
        "ITL p99": p99(itls),
        "gap p99": p99([gap for stream in streams for gap in stream.gaps_ms]),
    }


def print_streams(kept: dict[Target, list[Stream]], base: Target) -> None:
    """Token rate and inter-token latency per target, with each as a ratio to the base's over the same prompts."""
    measures = {target: stream_measures(streams) for target, streams in kept.items()}
    num_tokens = sum(stream.num_tokens for stream in kept[base])
    print(f"whole streams ({num_tokens} tokens per target; ratio = target ÷ {base})")
    print(f"  {'target':40s} " + " ".join(f"{name:>9s}{'':7s}" for name in measures[base]))
    for target, row in measures.items():
        cells = [f"{value:9.2f}" + (f" {value / measures[base][name]:5.2f}×" if target != base else " " * 7)
                 for name, value in row.items()]
        print(f"  {str(target):40s} " + " ".join(cells))


async def run(args: argparse.Namespace) -> None:
    prompts = random_prompts(args.tokenizer or args.model, args.warmup + args.requests, args.prompt_tokens, args.seed)
    # Drawn apart from the prompts, so a run with one output length has the same prompts as before this option.
    lengths = random.Random(args.seed + 1)
    num_tokens = [lengths.randint(args.min_tokens, args.max_tokens) for _ in prompts]
    print(f"[bench-ttft] prompts from seed {args.seed}", file=sys.stderr, flush=True)
    samples: dict[Target, list[Stream]] = {target: [] for target in args.targets}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.request_timeout_s)) as session:
        cycle = orders(args.targets)
        for index, (text, ids) in enumerate(prompts):
            for target in cycle[index % len(cycle)]:
                if args.idle_s:
                    await asyncio.sleep(args.idle_s)
                samples[target].append(await stream_once(session, target, args.model, text, ids, num_tokens[index],
                                                          args.chat))
            done = index + 1 - args.warmup
            if done > 0 and done % args.progress_every == 0:
                print(f"[bench-ttft] {done}/{args.requests} prompts", file=sys.stderr, flush=True)
    kept = {target: streams[args.warmup:] for target, streams in samples.items()}
    tokens = (f"{args.max_tokens}" if args.min_tokens == args.max_tokens else f"{args.min_tokens}–{args.max_tokens}")
    idle = f", {args.idle_s:g} s idle before each" if args.idle_s else ""
    route = "chat completions" if args.chat else "completions"
    print(f"TTFT at one stream ({route}), {args.requests} prompts of up to {args.prompt_tokens} tokens "
          f"(after {args.warmup} discarded), {tokens} tokens each{idle}")
    for target, streams in kept.items():
        print(f"  {str(target):40s} {percentiles([stream.ttft_ms for stream in streams])}")
    base = args.targets[0]
    for target in args.targets[1:]:
        differences = [mine.ttft_ms - theirs.ttft_ms for theirs, mine in zip(kept[base], kept[target], strict=True)]
        low, high = median_interval(differences, args.seed)
        print(f"  added by {target} over {base}, per prompt: median {statistics.median(differences):+.2f} ms "
              f"(95% interval {low:+.2f} to {high:+.2f}), mean {statistics.mean(differences):+.2f} ms")
    if args.min_tokens >= MIN_TOKENS_FOR_RATES:
        print_streams(kept, base)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("targets", nargs="+", type=Target.parse,
                        help="Server base URLs (the first is the baseline); URL#ids sends token ids.")
    parser.add_argument("--model", required=True, help="Model name the servers serve, and its tokenizer's folder.")
    parser.add_argument("--tokenizer", default=None, help="The tokenizer's folder, when --model is not one.")
    parser.add_argument("--requests", type=int, default=200, help="Prompts measured (each goes to every target).")
    parser.add_argument("--warmup", type=int, default=5, help="Prompts sent first and not counted.")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="Longest prompt, in tokens.")
    parser.add_argument("--max-tokens", type=int, default=4, help="Tokens each request streams (the most, with "
                        "--min-tokens).")
    parser.add_argument("--min-tokens", type=int, default=None,
                        help="Fewest tokens a request streams: each prompt's count is drawn from --min-tokens to "
                             f"--max-tokens (default: --max-tokens). At {MIN_TOKENS_FOR_RATES} or more the token rate "
                             "and inter-token latency are printed too.")
    parser.add_argument("--progress-every", type=int, default=50, help="Prompts between progress lines.")
    # Drawn per run: a server kept since an earlier run has its prompts in its prefix cache, a stack started since
    # has not, and a cached prompt's first token comes sooner.
    parser.add_argument("--seed", type=int, default=random.SystemRandom().randrange(1 << 30),
                        help="Prompt seed (default: drawn per run, so no target has the prompts cached).")
    parser.add_argument("--idle-s", type=float, default=0.0,
                        help="Idle time before each request (default 0: it follows the last one's end). A pipeline "
                             "idle longer wakes colder: this separates that from the last request's length.")
    parser.add_argument("--request-timeout-s", type=float, default=60.0)
    parser.add_argument("--chat", action="store_true",
                        help="Send each prompt as one user message to /v1/chat/completions (aiperf's path: the chat "
                             "template and the tokenizer on it) instead of a prompt to /v1/completions.")
    args = parser.parse_args()
    if args.requests < 2:
        parser.error("--requests must be at least 2 (percentiles)")
    args.min_tokens = args.max_tokens if args.min_tokens is None else args.min_tokens
    if not 1 <= args.min_tokens <= args.max_tokens:
        parser.error("--min-tokens must be from 1 to --max-tokens")
    if args.chat and any(target.as_ids for target in args.targets):
        parser.error("--chat sends text messages: no target can take token ids (URL#ids) with it")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
