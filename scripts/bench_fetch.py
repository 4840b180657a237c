"""How long a task published to an idle stage waits before its worker has it: a pull of 8 against Conveyor's pull.

A waiting JetStream pull for several messages can hold a delivered message until the rest arrive or the pull
expires (nats-py's `fetch(batch=8)`), so now and then one task waits tens to hundreds of milliseconds at an idle
stage. Conveyor's consumer (bus/consumer.py) asks for one task while it waits and for a batch only after a full
fetch (a backlog). This runs both patterns side by side against one embedded nats-server, publishing single
tasks at random gaps (50–500 ms: an idle stage), and prints delivery latency percentiles and the slow deliveries.

    .venv/bin/python scripts/bench_fetch.py --tasks 100 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nats  # noqa: E402
from nats.errors import TimeoutError as NatsTimeoutError  # noqa: E402

from bus.server import EmbeddedNatsServer  # noqa: E402

SLOW_MS = 5.0


async def deliveries_ms(url: str, name: str, adaptive: bool, num_tasks: int, seed: int) -> list[float]:
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.add_stream(name=name, subjects=[f"{name}.>"])
    subscription = await js.pull_subscribe(f"{name}.task", durable="worker")
    received: list[float] = []

    async def pull() -> None:
        batch = 1 if adaptive else 8
        while True:
            try:
                msgs = await subscription.fetch(batch=batch, timeout=1.0)
            except (TimeoutError, NatsTimeoutError):
                msgs = []
            for msg in msgs:
                received.append(time.perf_counter())
                await msg.ack()
            if adaptive:
                batch = 8 if msgs and len(msgs) == batch else 1

    puller = asyncio.create_task(pull())
    await asyncio.sleep(1.5)
    rng, latencies = random.Random(seed), []
    for index in range(num_tasks):
        await asyncio.sleep(rng.uniform(0.05, 0.5))
        sent = time.perf_counter()
        await js.publish(f"{name}.task", b"task")
        while len(received) <= index:
            await asyncio.sleep(0.0005)
        latencies.append((received[index] - sent) * 1000)
    puller.cancel()
    await asyncio.gather(puller, return_exceptions=True)
    await nc.close()
    return latencies


def summary(latencies: list[float]) -> str:
    ordered = sorted(latencies)
    slow = [round(value) for value in latencies if value > SLOW_MS]
    return (f"p50 {ordered[len(ordered) // 2]:6.2f}  p99 {ordered[int(len(ordered) * 0.99)]:7.2f}  "
            f"max {ordered[-1]:7.2f} ms; over {SLOW_MS:.0f} ms: {len(slow)} {slow}")


async def main(args: argparse.Namespace) -> None:
    results: dict[str, list[float]] = {"pull of 8": [], "conveyor": []}
    with EmbeddedNatsServer() as server:
        for round_index in range(args.rounds):
            # Both at once, on separate streams: the same machine noise for each.
            eight, ours = await asyncio.gather(
                deliveries_ms(server.url, f"eight{round_index}", False, args.tasks, round_index),
                deliveries_ms(server.url, f"ours{round_index}", True, args.tasks, round_index))
            results["pull of 8"] += eight
            results["conveyor"] += ours
            print(f"round {round_index + 1}: pull of 8: {summary(eight)}", file=sys.stderr)
            print(f"round {round_index + 1}: conveyor:  {summary(ours)}", file=sys.stderr)
    print(f"\nidle-stage delivery, {args.rounds} × {args.tasks} tasks, publish → in the worker's hands")
    for name, latencies in results.items():
        print(f"{name:<10} {summary(latencies)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
