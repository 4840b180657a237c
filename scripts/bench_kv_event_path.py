"""What SGLang's KV events cost around the first token, without a GPU: the parts of the path, simulated.

On the H100, Conveyor's one-stream TTFT once read ~5 ms longer with SGLang's KV events on (docs/performance.md,
eighth stop; like-for-like measurements in the tenth stop did not reproduce it, and on the H100 machine's CPU this
script found 0.1 ms per prompt). This benchmark runs the event path's parts on the CPU, with SGLang's own code where
it matters, in one run:

1. **Token latency next to the events.** A "scheduler" process busy-loops in Python (holding the GIL, as SGLang's
   scheduler does) and, every 15–35 ms, sends a token message on a PUSH socket (SGLang's detokenizer → tokenizer
   manager hop), then hands a prefill's worth of `BlockStored` events (`--prompt-tokens`, 16-token pages) to
   SGLang's `ZmqEventPublisher`, whose thread sends them. A "worker" process on uvloop receives the tokens on a
   `zmq.asyncio` PULL socket (as SGLang's `TokenizerManager` does) and, when asked, runs our `KvEventRelay` on the
   events. Printed: the token messages' latency with events off, events on without a relay, and events on with it.
2. **The radix cache's own cost.** SGLang's `RadixCache` inserting random prompts at page 16, with event recording
   off and on (then taking the events and encoding them as the publisher thread does).

Needs SGLang importable (the GPU machine: `bash scripts/gpu_run.sh python3 scripts/bench_kv_event_path.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def say(message: str) -> None:
    print(f"[bench-kv-event-path {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def stored_events(rng: random.Random, num_tokens: int, page: int = 16) -> list:
    from sglang.srt.disaggregation.kv_events import BlockStored

    tokens = [rng.randrange(100, 30000) for _ in range(num_tokens)]
    events, parent = [], None
    for start in range(0, num_tokens - page + 1, page):
        block = rng.getrandbits(63)
        events.append(BlockStored(block_hashes=[block], parent_block_hash=parent, token_ids=tokens[start:start + page],
                                  block_size=page, lora_id=None, medium="GPU"))
        parent = block
    return events


def scheduler(args: argparse.Namespace) -> None:
    """The simulated scheduler: tokens on PUSH, events through SGLang's publisher thread, busy in between."""
    import zmq
    from sglang.srt.disaggregation.kv_events import KVEventBatch, ZmqEventPublisher

    publisher = (ZmqEventPublisher(attn_dp_rank=0, endpoint=f"tcp://*:{args.port}", topic="kv-events")
                 if args.events else None)
    push = zmq.Context().socket(zmq.PUSH)
    push.bind(args.ipc)
    time.sleep(1.0)  # the worker connects
    rng = random.Random(0)
    for _ in range(args.requests):
        push.send(repr(time.time()).encode())
        if publisher is not None:
            publisher.publish(KVEventBatch(ts=time.time(), events=stored_events(rng, args.prompt_tokens)))
        busy_until = time.perf_counter() + rng.uniform(0.015, 0.035)
        while time.perf_counter() < busy_until:
            pass
    push.send(b"end")
    if publisher is not None:
        publisher.shutdown()


async def worker(args: argparse.Namespace) -> None:
    """The simulated decode worker: token latencies on stdout (the last line), our relay when asked."""
    import zmq
    import zmq.asyncio

    from workers.engines.sglang_engine import KvEventRelay

    pull = zmq.asyncio.Context(2).socket(zmq.PULL)
    pull.connect(args.ipc)
    relay = None
    if args.relay:
        relay = KvEventRelay(f"tcp://127.0.0.1:{args.port}")
        await relay.start()

        async def drain() -> None:
            async for _ in relay.batches.listen():
                pass

        draining = asyncio.create_task(drain())
    latencies_ms = []
    while (data := await pull.recv()) != b"end":
        latencies_ms.append((time.time() - float(data)) * 1000)
    if relay is not None:
        draining.cancel()
        await relay.stop()
    print(" ".join(f"{value:.4f}" for value in latencies_ms))


def token_latency(args: argparse.Namespace, events: bool, relay: bool) -> list[float]:
    port, ipc = free_port(), f"ipc://{tempfile.gettempdir()}/kv-event-path-{os.getpid()}-{random.getrandbits(32)}"
    common = ["--port", str(port), "--ipc", ipc, "--requests", str(args.requests),
              "--prompt-tokens", str(args.prompt_tokens)]
    sched = subprocess.Popen([sys.executable, __file__, "scheduler", *common, *(["--events"] if events else [])])
    try:
        out = subprocess.run([sys.executable, __file__, "worker", *common, *(["--relay"] if relay else [])],
                             capture_output=True, text=True, timeout=args.requests * 0.1 + 60, check=True)
    finally:
        sched.wait(timeout=30)
    return [float(value) for value in out.stdout.strip().splitlines()[-1].split()][10:]


def radix_insert_ms(events: bool, prompts: int, prompt_tokens: int) -> tuple[float, float]:
    """Median ms per prompt: SGLang's radix insert, then taking and encoding the events it recorded."""
    from array import array

    import msgspec
    import torch
    from sglang.srt.disaggregation.kv_events import KVEventBatch
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    cache = RadixCache.create_simulated(page_size=16, enable_kv_cache_events=events)
    encoder = msgspec.msgpack.Encoder()
    rng = random.Random(1)
    inserts, takes = [], []
    for _ in range(prompts):
        tokens = array("q", [rng.randrange(100, 30000) for _ in range(rng.randint(prompt_tokens // 4, prompt_tokens))])
        started = time.perf_counter()
        cache.insert(InsertParams(key=RadixKey(tokens), value=torch.arange(len(tokens), dtype=torch.int64)))
        inserted = time.perf_counter()
        recorded = cache.take_events()
        if recorded:
            encoder.encode(KVEventBatch(ts=time.time(), events=recorded))
        inserts.append((inserted - started) * 1000)
        takes.append((time.perf_counter() - inserted) * 1000)
    return statistics.median(inserts[20:]), statistics.median(takes[20:])


def summary(values: list[float]) -> str:
    cuts = statistics.quantiles(values, n=100)
    return f"p50 {statistics.median(values):6.3f}  p90 {cuts[89]:6.3f}  p99 {cuts[98]:6.3f}  max {max(values):6.3f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", choices=["bench", "scheduler", "worker"], default="bench")
    parser.add_argument("--requests", type=int, default=300, help="Token messages (and event batches) per run.")
    parser.add_argument("--prompt-tokens", type=int, default=640, help="Prompt length each event batch covers.")
    parser.add_argument("--rounds", type=int, default=2, help="Runs of each configuration, alternating.")
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ipc", help=argparse.SUPPRESS)
    parser.add_argument("--events", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--relay", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode == "scheduler":
        scheduler(args)
        return
    if args.mode == "worker":
        import uvloop  # every Conveyor process runs on it

        uvloop.run(worker(args))
        return
    configurations = [("events off", False, False), ("events on, no relay", True, False),
                      ("events on, our relay", True, True)]
    latencies: dict[str, list[float]] = {name: [] for name, _, _ in configurations}
    for round_index in range(args.rounds):
        for name, events, relay in configurations if round_index % 2 == 0 else configurations[::-1]:
            say(f"round {round_index + 1}: {name}")
            latencies[name] += token_latency(args, events, relay)
    print(f"Token message latency, scheduler → worker, {args.rounds} × {args.requests} messages:")
    for name, values in latencies.items():
        print(f"  {name:22s} {summary(values)}")
    print(f"SGLang's radix insert per prompt of up to {args.prompt_tokens} tokens (median; events taken and encoded):")
    for events in (False, True):
        insert_ms, take_ms = radix_insert_ms(events, 300, args.prompt_tokens)
        print(f"  events {'on ' if events else 'off'}  insert {insert_ms:.3f} ms, take + encode {take_ms:.3f} ms")


if __name__ == "__main__":
    main()
