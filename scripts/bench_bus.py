"""Benchmark the reply stream against raw nats-py publish/subscribe, side by side in one run.

For each offered rate (chunks per second) it streams chunks from a sender connection to a receiver
connection through one embedded nats-server, first with bare `nc.publish` on an inbox (the floor),
then with Conveyor's `ReplySender` → `ReplyStream` (msgpack frames, sequence numbers, gap checks,
typed decoding), and prints achieved throughput and one-way latency percentiles, plus the ratio
Conveyor ÷ raw. Runs alternate so machine noise hits both alike.

    .venv/bin/python scripts/bench_bus.py                  # 1k, 10k, 50k chunks/s, 2 s each
    .venv/bin/python scripts/bench_bus.py --rates 5000 --seconds 5 --rounds 3

Both ends share one process and one clock (time.perf_counter), so latency is send → delivered to
the receiving coroutine, including the client libraries on both sides.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nats.aio.client import Client  # noqa: E402

from bus.connection import connect  # noqa: E402
from bus.replies import ReplySender, ReplyStream  # noqa: E402
from bus.server import EmbeddedNatsServer  # noqa: E402
from bus.settings import NatsSettings  # noqa: E402
from schemas.replies import FinishReason, Usage  # noqa: E402

TOKEN_TEXT = " token"  # a typical detokenized delta


@dataclass
class Result:
    sent: int
    received: int
    elapsed_s: float
    latencies_us: list[float]

    @property
    def throughput(self) -> float:
        return self.received / self.elapsed_s

    def percentile(self, fraction: float) -> float:
        ordered = sorted(self.latencies_us)
        return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


async def paced(rate: float, total: int, send_one) -> None:  # type: ignore[no-untyped-def]
    """Send `total` items at `rate` per second, in small bursts every millisecond."""
    started = time.perf_counter()
    sent = 0
    while sent < total:
        due = min(total, int((time.perf_counter() - started) * rate) + 1)
        while sent < due:
            await send_one(sent)
            sent += 1
        await asyncio.sleep(0.001)


async def run_raw(sender: Client, receiver: Client, rate: float, total: int) -> Result:
    sent_at = [0.0] * total
    latencies: list[float] = []
    done = asyncio.Event()
    inbox = receiver.new_inbox()

    async def on_msg(msg) -> None:  # type: ignore[no-untyped-def]
        index = int.from_bytes(msg.data[:4], "little")
        latencies.append((time.perf_counter() - sent_at[index]) * 1e6)
        if len(latencies) == total:
            done.set()

    subscription = await receiver.subscribe(inbox, cb=on_msg, pending_msgs_limit=1_000_000)
    await receiver.flush()
    payload_tail = TOKEN_TEXT.encode()

    async def send_one(index: int) -> None:
        sent_at[index] = time.perf_counter()
        await sender.publish(inbox, index.to_bytes(4, "little") + payload_tail)

    started = time.perf_counter()
    await paced(rate, total, send_one)
    await sender.flush()
    try:
        await asyncio.wait_for(done.wait(), timeout=30)
    except TimeoutError:
        pass  # reported as lost chunks
    elapsed = time.perf_counter() - started
    await subscription.unsubscribe()
    return Result(total, len(latencies), elapsed, latencies)


async def run_conveyor(sender: Client, receiver: Client, rate: float, total: int, window_s: float) -> Result:
    sent_at = [0.0] * total
    latencies: list[float] = []
    stream = ReplyStream(receiver, receiver.new_inbox(), "bench", heartbeat_timeout_s=30, first_frame_timeout_s=30)
    await stream.__aenter__()
    await receiver.flush()
    reply = ReplySender(sender, stream.inbox, "bench", coalesce_window_s=window_s)

    async def send_one(index: int) -> None:
        sent_at[index] = time.perf_counter()
        await reply.send_tokens([index], text=TOKEN_TEXT)

    async def read() -> None:
        async for chunk in stream:
            now = time.perf_counter()
            latencies.extend((now - sent_at[token]) * 1e6 for token in chunk.token_ids)

    reader = asyncio.create_task(read())
    started = time.perf_counter()
    await paced(rate, total, send_one)
    await reply.finish(FinishReason.LENGTH, Usage.of(1, total))
    await asyncio.wait_for(reader, timeout=60)
    elapsed = time.perf_counter() - started
    await stream.close()
    return Result(total, len(latencies), elapsed, latencies)


def row(label: str, result: Result) -> str:
    return (
        f"  {label:<26} {result.throughput:>10,.0f}/s  p50 {result.percentile(0.5):>8,.0f} µs"
        f"  p99 {result.percentile(0.99):>9,.0f} µs  lost {result.sent - result.received}"
    )


async def main(rates: list[int], seconds: float, rounds: int, window_ms: float) -> None:
    with EmbeddedNatsServer() as server:
        settings = NatsSettings(urls=[server.url])
        sender, receiver = await connect(settings, "bench-sender"), await connect(settings, "bench-receiver")
        print(f"nats-server {server.url}; {seconds:.0f} s per run, {rounds} round(s), medians of rounds shown")
        for rate in rates:
            total = int(rate * seconds)
            runs: dict[str, list[Result]] = {"raw": [], "conveyor": [], "coalesced": []}
            for _ in range(rounds):
                runs["raw"].append(await run_raw(sender, receiver, rate, total))
                runs["conveyor"].append(await run_conveyor(sender, receiver, rate, total, 0.0))
                runs["coalesced"].append(await run_conveyor(sender, receiver, rate, total, window_ms / 1000))
            best = {name: sorted(results, key=lambda r: r.percentile(0.5))[len(results) // 2] for name, results in runs.items()}
            print(f"\noffered {rate:,} chunks/s ({total:,} chunks)")
            print(row("raw nats-py pub/sub", best["raw"]))
            print(row("conveyor reply stream", best["conveyor"]))
            print(row(f"conveyor, {window_ms:g} ms coalescing", best["coalesced"]))
            raw, ours = best["raw"], best["conveyor"]
            print(
                f"  ratio conveyor ÷ raw: throughput {ours.throughput / raw.throughput:.2f}×, "
                f"p50 latency {ours.percentile(0.5) / raw.percentile(0.5):.2f}×, "
                f"p99 latency {ours.percentile(0.99) / raw.percentile(0.99):.2f}×"
            )
        await sender.close()
        await receiver.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=int, nargs="+", default=[1_000, 10_000, 50_000], help="offered chunks/s")
    parser.add_argument("--seconds", type=float, default=2.0, help="length of each run")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per rate (median shown)")
    parser.add_argument("--window-ms", type=float, default=5.0, help="coalescing window of the third variant")
    args = parser.parse_args()
    asyncio.run(main(args.rates, args.seconds, args.rounds, args.window_ms))
