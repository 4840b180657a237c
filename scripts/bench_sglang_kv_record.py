"""What SGLang's KV events cost its scheduler per request: the radix cache's work with `enable_kv_cache_events` on and
off, side by side, on the CPU.

A request costs SGLang's radix cache a prefix match, an insert of its prompt after prefill, an insert of prompt and
output when it ends, and evictions once the pool is full. With KV events on, each insert also hashes every new page
and records a `BlockStored` for it, each eviction a `BlockRemoved`; the scheduler hands the batch to the publisher
thread, which encodes it with msgpack. This replays issue 11's load on the cache alone (prompts of 128–1024 tokens
after a shared 17-token chat prefix, outputs of 128–512, pages of 16 tokens, a pool of POOL tokens), rounds with events
off and on alternating, and prints each one's microseconds per request and the ratio, on versus off.

    python scripts/bench_sglang_kv_record.py --requests 3000 --rounds 4

`--with-publisher` asks what the events cost a scheduler whose thread is busy, publisher thread included: each
request runs a forward-shaped load on the main thread (many small torch ops holding the interpreter lock, ~15 ms
here, as a small model's eager prefill is on the H100) and decode-shaped steps, against four radix caches fed the
same requests in a shuffled order: one without events, one recording them, one also handing them to SGLang's own
`ZmqEventPublisher` thread (which encodes and sends them while the main thread works), and one sending them from the
main thread with Conveyor's `InlineKvEventPublisher` (`CONVEYOR_SGLANG_KV_EVENTS_PUBLISHER=inline`). It prints each
one's time a request, paired request by request with the cache without events.

    python scripts/bench_sglang_kv_record.py --with-publisher --requests 1500

It needs SGLang importable (on the GPU machine: `bash scripts/gpu_run.sh python3 scripts/bench_sglang_kv_record.py`).
"""

from __future__ import annotations

import argparse
import enum
import random
import statistics
import tempfile
import time
from array import array

import msgspec
import torch
from sglang.srt.disaggregation.kv_events import KVEventBatch, ZmqEventPublisher
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from workers.engines.sglang_events import InlineKvEventPublisher

PAGE_TOKENS = 16
CHAT_PREFIX_TOKENS = 17  # what every prompt of the goal runs shares (SGLang's logs: ~17 cached tokens a prefill)


class FreeingNothing:
    """The pool allocator the cache frees evicted pages to: here only its interface."""
    device = "cpu"

    def free_segment(self, value: torch.Tensor, start_pos: int = 0) -> None:
        pass


def goal_request(rng: random.Random, prefix: list[int]) -> tuple[list[int], list[int]]:
    """One request of issue 11's load: its prompt (the shared chat prefix, then 128-1024 tokens) and the whole
    sequence the cache holds when it ends (128-512 output tokens more)."""
    prompt = prefix + [rng.randrange(50_000) for _ in range(rng.randint(128, 1024))]
    return prompt, prompt + [rng.randrange(50_000) for _ in range(rng.randint(128, 512))]


def one_round(events: bool, num_requests: int, pool_tokens: int, seed: int) -> tuple[float, float, float]:
    """(cache microseconds per request, publisher's encode microseconds per request, events per request)."""
    rng = random.Random(seed)
    cache = RadixCache.create_simulated(mock_allocator=FreeingNothing(), page_size=PAGE_TOKENS,
                                        enable_kv_cache_events=events)
    prefix = [rng.randrange(50_000) for _ in range(CHAT_PREFIX_TOKENS)]
    encoder = msgspec.msgpack.Encoder()
    cache_s = encode_s = 0.0
    num_events = 0
    for _ in range(num_requests):
        prompt, whole = goal_request(rng, prefix)
        start = time.perf_counter()
        cache.match_prefix(MatchPrefixParams(key=RadixKey(token_ids=array("q", prompt))))
        cache.insert(InsertParams(key=RadixKey(token_ids=array("q", prompt)), value=torch.arange(len(prompt))))
        cache.insert(InsertParams(key=RadixKey(token_ids=array("q", whole)), value=torch.arange(len(whole))))
        if (over := cache.evictable_size() - pool_tokens) > 0:
            cache.evict(EvictParams(num_tokens=over))
        batch = cache.take_events()
        cache_s += time.perf_counter() - start
        if batch:
            start = time.perf_counter()
            encoder.encode(KVEventBatch(ts=time.time(), events=batch))
            encode_s += time.perf_counter() - start
            num_events += len(batch)
    return 1e6 * cache_s / num_requests, 1e6 * encode_s / num_requests, num_events / num_requests


# The --with-publisher load: torch ops on a tiny tensor stand for a forward's launches, which hold the interpreter lock.
FORWARD_OPS, DECODE_STEP_OPS, DECODE_STEPS = 3000, 300, 8
# Requests before the caches' pools are full and evict: not counted.
FILL_REQUESTS = 200


class Events(enum.Enum):
    """What a --with-publisher cache does with its KV events."""
    OFF = "off"  # none recorded
    RECORD = "record"  # recorded and taken each step, then dropped
    PUBLISH = "publish"  # recorded and handed to SGLang's publisher thread
    INLINE = "inline"  # recorded and sent from the main thread (Conveyor's inline publisher)


def busy(num_ops: int) -> None:
    tensor = torch.zeros(16)
    for _ in range(num_ops):
        tensor = tensor + 1


class BusyScheduler:
    """Four radix caches given the same requests: without events, recording them, publishing them through SGLang's
    thread, and publishing them inline."""

    def __init__(self, pool_tokens: int) -> None:
        self.pool_tokens = pool_tokens
        self.caches = {mode: RadixCache.create_simulated(mock_allocator=FreeingNothing(), page_size=PAGE_TOKENS,
                                                         enable_kv_cache_events=mode is not Events.OFF)
                       for mode in Events}
        self.publisher = ZmqEventPublisher(attn_dp_rank=0, endpoint=f"ipc://{tempfile.mkdtemp()}/kv-events",
                                           topic="kv-events")
        self.inline = InlineKvEventPublisher(endpoint=f"ipc://{tempfile.mkdtemp()}/kv-events", topic="kv-events")

    def request(self, mode: Events, prompt: list[int], whole: list[int]) -> float:
        """Seconds one request took: its prefix match, forward, prompt insert, decode steps, whole insert, evictions."""
        cache = self.caches[mode]
        start = time.perf_counter()
        cache.match_prefix(MatchPrefixParams(key=RadixKey(token_ids=array("q", prompt))))
        busy(FORWARD_OPS)
        cache.insert(InsertParams(key=RadixKey(token_ids=array("q", prompt)), value=torch.arange(len(prompt))))
        self.hand_over(mode, cache)
        for _ in range(DECODE_STEPS):
            busy(DECODE_STEP_OPS)
        cache.insert(InsertParams(key=RadixKey(token_ids=array("q", whole)), value=torch.arange(len(whole))))
        if (over := cache.evictable_size() - self.pool_tokens) > 0:
            cache.evict(EvictParams(num_tokens=over))
        self.hand_over(mode, cache)
        return time.perf_counter() - start

    def hand_over(self, mode: Events, cache: RadixCache) -> None:
        events = cache.take_events() if mode is not Events.OFF else []
        if events and mode is Events.PUBLISH:
            self.publisher.publish(KVEventBatch(ts=time.time(), events=events))
        elif events and mode is Events.INLINE:
            self.inline.publish(KVEventBatch(ts=time.time(), events=events))


def with_publisher(num_requests: int, pool_tokens: int) -> None:
    scheduler = BusyScheduler(pool_tokens)
    rng = random.Random(1)
    prefix = [rng.randrange(50_000) for _ in range(CHAT_PREFIX_TOKENS)]
    seconds: dict[Events, list[float]] = {mode: [] for mode in Events}
    for index in range(FILL_REQUESTS + num_requests):
        prompt, whole = goal_request(rng, prefix)
        order = list(Events)
        rng.shuffle(order)  # no mode always first after another's publish
        for mode in order:
            seconds[mode].append(scheduler.request(mode, prompt, whole))
        if (index + 1) % 500 == 0:
            print(f"{index + 1} requests", flush=True)
    scheduler.publisher.shutdown()
    scheduler.inline.shutdown()
    counted = {mode: times[FILL_REQUESTS:] for mode, times in seconds.items()}
    for mode in Events:
        paired_ms = [1e3 * (mine - off) for mine, off in zip(counted[mode], counted[Events.OFF])]
        print(f"{mode.value:8s} {1e3 * statistics.median(counted[mode]):8.3f} ms a request; paired with off: median "
              f"{statistics.median(paired_ms):+.3f} ms, mean {statistics.fmean(paired_ms):+.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000, help="requests per round")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of each setting, alternating")
    parser.add_argument("--pool-tokens", type=int, default=300_000, help="the KV pool (the goal runs': 300k)")
    parser.add_argument("--with-publisher", action="store_true",
                        help="each request on a busy main thread, SGLang's publisher thread included (see above)")
    args = parser.parse_args()
    if args.with_publisher:
        with_publisher(args.requests, args.pool_tokens)
        return
    one_round(True, 50, args.pool_tokens, seed=0)  # SGLang compiles its page hash on first use: not a request's cost
    cache_us: dict[bool, list[float]] = {False: [], True: []}
    encode_us: list[float] = []
    for round_index in range(args.rounds):
        for events in (False, True) if round_index % 2 == 0 else (True, False):
            cache, encode, per_request = one_round(events, args.requests, args.pool_tokens, seed=round_index + 1)
            cache_us[events].append(cache)
            if events:
                encode_us.append(encode)
            print(f"round {round_index + 1}, events {'on ' if events else 'off'}: radix cache {cache:7.1f} us a "
                  f"request" + (f", publisher's encode {encode:5.1f} us, {per_request:.0f} events" if events else ""),
                  flush=True)
    off, on = statistics.median(cache_us[False]), statistics.median(cache_us[True])
    added_us = on - off + statistics.median(encode_us)
    print(f"\nmedians: off {off:.1f} us, on {on:.1f} us a request ({on / off:.2f}x); KV events add {added_us:.0f} us "
          f"a request to the scheduler's process (cache and encode)")


if __name__ == "__main__":
    main()
