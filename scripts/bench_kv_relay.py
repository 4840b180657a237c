"""What relaying KV-cache events costs a worker's event loop, with and without merging batches in a window.

The torch engine emits a KV-event batch at every step that fills a page: at 16 streams of 2 ms steps and 16-token
pages, about 500 a second (SGLang emits fewer: after each prefill and every 40th decode step). The worker publishes them to the KV-events stream (JetStream, acknowledged) from the same event
loop that sends every token frame, so each publish's cost is time the token frames wait. This feeds engine-like
batches (one stored page each, chained) at `--batches-per-s` into `relay_in_windows` with the worker's real
`KvEventPublisher` against an embedded nats-server, once per `--interval-ms` (alternating, `--rounds` times), and
prints per setting: messages stored, the CPU time per second of run that publishing takes (this process's, less a
run that drops the batches instead), and how long after its batch each event is stored.

    .venv/bin/python scripts/bench_kv_relay.py                      # 500 batches/s for 4 s, windows 0 and 5 ms
    .venv/bin/python scripts/bench_kv_relay.py --batches-per-s 250 1000 --interval-ms 0 2 5 10
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bus.connection import connect  # noqa: E402
from bus.kv_events import KvEventPublisher  # noqa: E402
from bus.server import EmbeddedNatsServer  # noqa: E402
from bus.settings import BusSettings, NatsSettings  # noqa: E402
from bus.streams import declare_all  # noqa: E402
from bus.subjects import Names  # noqa: E402
from schemas.kv_events import BlockStored  # noqa: E402
from workers.cli import run_loop  # noqa: E402
from workers.engines.events import relay_in_windows  # noqa: E402
from workers.engines.protocol import KvEventBatchOut  # noqa: E402

PAGE_TOKENS = 16
NAMESPACE = "kvbench"


def say(message: str) -> None:
    print(f"[bench-kv-relay {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class Run:
    batches: int
    messages: int
    cpu_ms_per_s: float
    lateness_ms: list[float]


async def engine_batches(batches_per_s: float, seconds: float) -> AsyncIterator[KvEventBatchOut]:
    """One stored page per batch, each chained on the last, paced to the schedule like engine steps."""
    step_s, started_s, parent = 1 / batches_per_s, time.perf_counter(), None
    for index in range(round(batches_per_s * seconds)):
        block = index + 1
        yield KvEventBatchOut(events=[BlockStored(block_hashes=[block], parent_block_hash=parent,
                                                  token_ids=list(range(PAGE_TOKENS)), block_size=PAGE_TOKENS)],
                              ts=time.time())
        parent = block
        delay_s = started_s + (index + 1) * step_s - time.perf_counter()
        if delay_s > 0:
            await asyncio.sleep(delay_s)


async def one_run(url: str, namespace: str, batches_per_s: float, seconds: float, interval_s: float,
                  store: bool = True) -> Run:
    """One relay run; `store=False`: batches are dropped instead of published (the feeder and relay loop alone)."""
    nc = await connect(NatsSettings(urls=[url]), "kv-relay-bench")
    names = Names(namespace)
    js = nc.jetstream()
    publisher = KvEventPublisher(js, names, f"w{time.monotonic_ns()}")
    counts = {"batches": 0, "messages": 0}
    lateness_ms: list[float] = []
    # When each batch not yet published was emitted: a merged message carries one event per batch, in order.
    emitted_s: deque[float] = deque()

    async def publish(batch: KvEventBatchOut) -> None:
        if store:
            await publisher.publish(batch.events, ts=batch.ts)
        counts["messages"] += 1
        now_s = time.time()
        lateness_ms.extend((now_s - emitted_s.popleft()) * 1000 for _ in batch.events)

    async def counted() -> AsyncIterator[KvEventBatchOut]:
        async for batch in engine_batches(batches_per_s, seconds):
            counts["batches"] += 1
            emitted_s.append(batch.ts)
            yield batch

    cpu_s, wall_s = time.process_time(), time.perf_counter()
    relay = asyncio.create_task(relay_in_windows(counted(), publish, interval_s))
    await asyncio.sleep(seconds + 0.2 + interval_s)  # the last window flushed
    cpu_s, wall_s = time.process_time() - cpu_s, time.perf_counter() - wall_s
    relay.cancel()
    await asyncio.gather(relay, return_exceptions=True)
    await nc.close()
    return Run(counts["batches"], counts["messages"], cpu_s * 1000 / wall_s, lateness_ms)


async def declare_streams(url: str, namespace: str) -> None:
    nc = await connect(NatsSettings(urls=[url]), "kv-relay-bench-setup")
    await declare_all(nc.jetstream(), Names(namespace), BusSettings(namespace=namespace), nc.max_payload)
    await nc.close()


async def main(args: argparse.Namespace) -> None:
    with EmbeddedNatsServer() as server:
        await declare_streams(server.url, NAMESPACE)
        for rate in args.batches_per_s:
            say(f"{rate:g} batches/s for {args.seconds:g} s, windows {args.interval_ms} ms, {args.rounds} rounds")
            runs: dict[float, list[Run]] = {interval: [] for interval in args.interval_ms}
            floor: list[Run] = []
            for round_index in range(args.rounds):
                floor.append(await one_run(server.url, NAMESPACE, rate, args.seconds, 0.0, store=False))
                order = args.interval_ms if round_index % 2 == 0 else list(reversed(args.interval_ms))
                for interval_ms in order:
                    runs[interval_ms].append(await one_run(server.url, NAMESPACE, rate, args.seconds, interval_ms / 1000))
            floor_ms = statistics.median(r.cpu_ms_per_s for r in floor)
            base = statistics.median(r.cpu_ms_per_s for r in runs[args.interval_ms[0]]) - floor_ms
            print(f"\n{rate:g} engine batches/s; median of {args.rounds} rounds; CPU of this process per second of run "
                  f"spent on publishing (the feeder alone, batches dropped: {floor_ms:.1f} ms/s, taken off)")
            for interval_ms, done in runs.items():
                cpu = statistics.median(r.cpu_ms_per_s for r in done) - floor_ms
                late = sorted(ms for r in done for ms in r.lateness_ms)
                print(f"  window {interval_ms:>4g} ms: {statistics.median(r.messages for r in done):>6.0f} messages for "
                      f"{statistics.median(r.batches for r in done):.0f} batches, CPU {cpu:6.1f} ms/s "
                      f"({cpu / base:.2f}× window {args.interval_ms[0]:g}), events stored after "
                      f"p50 {late[len(late) // 2]:.1f} / p99 {late[int(len(late) * 0.99)]:.1f} ms; "
                      f"rounds {', '.join(f'{r.cpu_ms_per_s:.0f}' for r in done)} ms/s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches-per-s", type=float, nargs="+", default=[500.0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--interval-ms", type=float, nargs="+", default=[0.0, 5.0],
                        help="relay windows to compare (0: a message per batch); the first is the ratios' base")
    parser.add_argument("--rounds", type=int, default=3)
    run_loop(main(parser.parse_args()))
