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
3. **The scheduler's step rate beside the events.** A scheduler-like loop: Python work holding the GIL, then a wait
   that frees it (the GPU's step), with requests arriving at the rate of 64 steady streams on the H100 (each one's
   prompt cached after its prefill, prompt and output when it finishes, the cache full at 300,000 tokens so that it
   evicts). Events on: SGLang's recording, its `ZmqEventPublisher` thread in the same process, and a subscriber
   draining it. Printed: steps a second, events on ÷ off, rounds alternating.

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


def scheduler_steps_per_s(events: bool, steps: int, requests_per_step: float, cpu_ms: float, gpu_ms: float) -> float:
    """Steps a second of a loop shaped like SGLang's scheduler at 64 streams, with its KV-event code on or off."""
    import threading
    from array import array

    import torch
    import zmq
    from sglang.srt.disaggregation.kv_events import KVEventBatch, ZmqEventPublisher
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    class FreedNowhere:  # eviction hands pages back to an allocator; nothing here holds them
        device = "cpu"

        def free_segment(self, value: object, start_pos: int = 0) -> None:
            pass

    cache = RadixCache.create_simulated(mock_allocator=FreedNowhere(), page_size=16, enable_kv_cache_events=events)
    port, stop = free_port(), threading.Event()
    publisher = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}") if events else None

    def drain() -> None:  # a subscriber, as our relay is: SGLang's PUB socket then really sends
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.connect(f"tcp://127.0.0.1:{port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.RCVTIMEO = 100
        while not stop.is_set():
            try:
                sub.recv_multipart()
            except zmq.Again:
                pass
        sub.close(linger=0)

    if events:
        threading.Thread(target=drain, daemon=True).start()
        time.sleep(0.3)
    rng, due = random.Random(2), 0.0
    started = time.perf_counter()
    for _ in range(steps):
        busy_until = time.perf_counter() + cpu_ms / 1000
        while time.perf_counter() < busy_until:  # the step's Python, holding the GIL
            pass
        due += requests_per_step
        while due >= 1:  # a request's prompt cached after its prefill, prompt and output when it finishes
            due -= 1
            prompt, output = rng.randint(128, 1024), rng.randint(128, 512)
            tokens = array("q", [rng.randrange(100, 30000) for _ in range(prompt + output)])
            prompt_len, whole = prompt // 16 * 16, (prompt + output) // 16 * 16
            if cache.evictable_size() + whole > 300_000:
                cache.evict(EvictParams(num_tokens=whole))
            cache.insert(InsertParams(key=RadixKey(tokens[:prompt_len]), value=torch.arange(prompt_len)))
            cache.insert(InsertParams(key=RadixKey(tokens[:whole]), value=torch.arange(whole)))
            if publisher is not None and (recorded := cache.take_events()):
                publisher.publish(KVEventBatch(ts=time.time(), events=recorded))
        time.sleep(gpu_ms / 1000)  # the GPU's step: the GIL is free, as in a CUDA sync
    rate = steps / (time.perf_counter() - started)
    stop.set()
    if publisher is not None:
        publisher.shutdown()
    return rate


def summary(values: list[float]) -> str:
    cuts = statistics.quantiles(values, n=100)
    return f"p50 {statistics.median(values):6.3f}  p90 {cuts[89]:6.3f}  p99 {cuts[98]:6.3f}  max {max(values):6.3f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", choices=["bench", "scheduler", "worker"], default="bench")
    parser.add_argument("--requests", type=int, default=300, help="Token messages (and event batches) per run.")
    parser.add_argument("--prompt-tokens", type=int, default=640, help="Prompt length each event batch covers.")
    parser.add_argument("--rounds", type=int, default=2, help="Runs of each configuration, alternating.")
    parser.add_argument("--steps", type=int, default=3000, help="Scheduler-like steps per run (part 3).")
    parser.add_argument("--requests-per-step", type=float, default=0.2,
                        help="Requests through the cache per step (part 3): 0.2 at ~185 steps/s is the ~37 requests/s "
                             "of 64 steady streams on the H100.")
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
    rates: dict[bool, list[float]] = {False: [], True: []}
    for round_index in range(args.rounds * 2):
        for events in (False, True) if round_index % 2 == 0 else (True, False):
            say(f"scheduler steps, round {round_index + 1}: events {'on' if events else 'off'}")
            rates[events].append(scheduler_steps_per_s(events, args.steps, args.requests_per_step, 2.5, 2.5))
    off, on = statistics.median(rates[False]), statistics.median(rates[True])
    by_round = ", ".join(f"{a / b:.3f}" for a, b in zip(rates[True], rates[False]))
    print(f"A scheduler-like loop, {args.requests_per_step} requests a step (2.5 ms of Python, 2.5 ms GIL-free wait):")
    print(f"  steps/s events off {off:.1f}, on {on:.1f}: on ÷ off {on / off:.3f} (rounds {by_round})")


if __name__ == "__main__":
    main()
