"""What relaying SGLang's KV events costs the decode worker's process, per request, without SGLang or a GPU.

At 64 steady streams on the H100, Conveyor's token rate read 0.84-0.91x of SGLang's own server with SGLang's KV events
on and 1.00x with them off (docs/performance.md, twenty-first stop); side by side with equal KV pools, the relay on and
off later read 1.01x (twenty-second stop). The events cost in two places: SGLang records them
in its scheduler, and our `KvEventRelay` decodes and translates them in the decode worker, on the loop that streams
tokens. This measures the second. It builds the frames SGLang's `ZmqEventPublisher` sends for one request (a prompt's
pages stored after its prefill, its output's pages chained on them when it finishes, and as many pages evicted, as
a full cache does) in SGLang's wire format, and times `decode_event_frames` and `KvEventRelay.translated` on them:

    .venv/bin/python scripts/bench_sglang_relay.py                       # 640-token prompts, 320 output tokens
    .venv/bin/python scripts/bench_sglang_relay.py --prompt-tokens 1024 --output-tokens 512 --requests-per-s 35

Publishing the translated batches to the KV-events stream is measured by scripts/bench_kv_relay.py.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.engines.sglang_engine import KvEventRelay, decode_event_frames  # noqa: E402

PAGE_TOKENS = 16


class SGLangEvents:
    """Event batches as SGLang 0.5 sends them: msgspec tagged arrays, one `BlockStored` per page, chained."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._next_hash = 1
        self._seq = 0
        self._stored: list[int] = []

    def request(self, prompt_tokens: int, output_tokens: int) -> list[bytes]:
        """One request's frames: its prompt's and output's pages stored, and as many of the oldest evicted."""
        prompt, last = self._chain(None, prompt_tokens // PAGE_TOKENS)
        output, _ = self._chain(last, output_tokens // PAGE_TOKENS)
        events = prompt + output
        evicted = self._stored[: len(events)] if len(self._stored) > 4 * len(events) else []
        if evicted:
            del self._stored[: len(evicted)]
            events.append(["BlockRemoved", evicted, "GPU"])
        self._seq += 1
        return [b"kv-events", self._seq.to_bytes(8, "big"), msgpack.packb([time.time(), events, 0])]

    def _chain(self, parent: int | None, num_pages: int) -> tuple[list[list[object]], int | None]:
        events: list[list[object]] = []
        for _ in range(num_pages):
            block = self._next_hash
            self._next_hash += 1
            tokens = [self._rng.randrange(30000) for _ in range(PAGE_TOKENS)]
            events.append(["BlockStored", [block], parent, tokens, PAGE_TOKENS, None, "GPU"])
            self._stored.append(block)
            parent = block
        return events, parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--prompt-tokens", type=int, default=640)
    parser.add_argument("--output-tokens", type=int, default=320)
    parser.add_argument("--requests-per-s", type=float, default=35.0,
                        help="the rate to express the cost at (64 streams of this model on the H100: ~35)")
    args = parser.parse_args()
    source, relay = SGLangEvents(seed=0), KvEventRelay("tcp://127.0.0.1:1")  # never started: only translating
    seconds = []
    for _ in range(args.requests):
        frames = source.request(args.prompt_tokens, args.output_tokens)
        started_s = time.perf_counter()
        decoded = decode_event_frames(frames)
        assert decoded is not None
        relay.translated(decoded[1])
        seconds.append(time.perf_counter() - started_s)
    kept = seconds[args.requests // 10:]  # the cache's first fill has no evictions
    median_s = statistics.median(kept)
    pages = (args.prompt_tokens + args.output_tokens) // PAGE_TOKENS
    print(f"{pages} pages stored and {pages} evicted per request: decode + translate median {median_s * 1e6:.0f} µs, "
          f"p90 {statistics.quantiles(kept, n=10)[-1] * 1e6:.0f} µs")
    print(f"at {args.requests_per_s:.0f} requests/s: {100 * median_s * args.requests_per_s:.2f}% of a core")


if __name__ == "__main__":
    main()
