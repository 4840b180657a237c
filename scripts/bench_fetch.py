"""How long a task published to an idle stage waits before its worker has it: nats-py's pulls against Conveyor's.

A waiting JetStream pull for several messages could hold a delivered message until the rest arrived or the pull
expired (nats-py's `fetch(batch=8)`), so now and then one task waited tens to hundreds of milliseconds at an idle
stage. Conveyor's consumer (bus/consumer.py) asks for one task while it waits and for a batch only after a full
fetch (a backlog), and since the sixteenth stop it pulls with its own requests on its own inbox (bus/pull.py) instead
of nats-py's `fetch`. This runs the patterns side by side against one embedded nats-server, publishing single tasks
at random gaps (50–500 ms: an idle stage), and prints delivery latency percentiles and the slow deliveries:
`pull of 8` (nats-py), `fetch 1/8` (nats-py's fetch with Conveyor's batch rule: what the consumer did before),
`conveyor` (bus/pull.py with that rule).

    .venv/bin/python scripts/bench_fetch.py --tasks 100 --rounds 3
    .venv/bin/python scripts/bench_fetch.py --tasks 100 --rounds 3 --floor   # + push consumer, core NATS
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nats  # noqa: E402
from nats.aio.msg import Msg  # noqa: E402
from nats.errors import TimeoutError as NatsTimeoutError  # noqa: E402
from nats.js.api import AckPolicy, ConsumerConfig  # noqa: E402

from bus.pull import Puller  # noqa: E402
from bus.server import EmbeddedNatsServer  # noqa: E402

SLOW_MS = 5.0


async def deliveries_ms(url: str, name: str, pattern: str, num_tasks: int, seed: int) -> list[float]:
    """Publish → received latencies of single tasks at random gaps, for one delivery pattern: `pull of 8`,
    `fetch 1/8` (nats-py's fetch of one while idle, of 8 after a full fetch), `conveyor` (the same rule through
    bus/pull.py), `push` (a JetStream push consumer shared by a queue group)
    or `core` (a core-NATS queue subscription: no stream, the floor of a hop)."""
    nc = await nats.connect(url)  # the worker's connection
    publisher = await nats.connect(url)
    js = nc.jetstream()
    await js.add_stream(name=name, subjects=[f"{name}.>"])
    received: list[float] = []
    pulling: asyncio.Task[None] | None = None

    async def take(msg: Msg) -> None:
        received.append(time.perf_counter())
        if pattern != "core":
            await msg.ack()

    if pattern == "push":
        await js.subscribe(f"{name}.task", queue="workers", durable="workers", cb=take, manual_ack=True,
                           config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, max_ack_pending=64))
    elif pattern == "core":
        await nc.subscribe(f"{name}.core", queue="workers", cb=take)
    else:
        subscription = await js.pull_subscribe(f"{name}.task", durable="worker")  # declares the durable consumer
        adaptive = pattern != "pull of 8"
        fetch: Callable[[int], Awaitable[list[Msg]]] = lambda batch: subscription.fetch(batch=batch, timeout=1.0)
        if pattern == "conveyor":
            await subscription.unsubscribe()  # the consumer stays; Conveyor's puller pulls from it instead
            puller = Puller(nc, "$JS.API", name, "worker")
            await puller.start()
            fetch = partial(puller.fetch, timeout_s=1.0)

        async def pull() -> None:
            batch = 1 if adaptive else 8
            while True:
                try:
                    msgs = await fetch(batch)
                except (TimeoutError, NatsTimeoutError):
                    msgs = []
                for msg in msgs:
                    await take(msg)
                if adaptive:
                    batch = 8 if msgs and len(msgs) == batch else 1

        pulling = asyncio.create_task(pull())
    await asyncio.sleep(1.5)
    rng, latencies = random.Random(seed), []
    for index in range(num_tasks):
        await asyncio.sleep(rng.uniform(0.05, 0.5))
        sent = time.perf_counter()
        if pattern == "core":
            await publisher.publish(f"{name}.core", b"task")
            await publisher.flush()
        else:
            await publisher.jetstream().publish(f"{name}.task", b"task")
        while len(received) <= index:
            await asyncio.sleep(0.0002)
        latencies.append((received[index] - sent) * 1000)
    if pulling is not None:
        pulling.cancel()
        await asyncio.gather(pulling, return_exceptions=True)
    await publisher.close()
    await nc.close()
    return latencies


def summary(latencies: list[float]) -> str:
    ordered = sorted(latencies)
    slow = [round(value) for value in latencies if value > SLOW_MS]
    return (f"p50 {ordered[len(ordered) // 2]:6.2f}  p99 {ordered[int(len(ordered) * 0.99)]:7.2f}  "
            f"max {ordered[-1]:7.2f} ms; over {SLOW_MS:.0f} ms: {len(slow)} {slow}")


async def main(args: argparse.Namespace) -> None:
    patterns = ["pull of 8", "fetch 1/8", "conveyor"] + (["push", "core"] if args.floor else [])
    results: dict[str, list[float]] = {pattern: [] for pattern in patterns}
    with EmbeddedNatsServer() as server:
        for round_index in range(args.rounds):
            # All at once, on separate streams (the same machine noise for each), at gaps of their own.
            rounds = await asyncio.gather(*(
                deliveries_ms(server.url, f"p{index}r{round_index}", pattern, args.tasks, 100 * round_index + index)
                for index, pattern in enumerate(patterns)))
            for pattern, latencies in zip(patterns, rounds):
                results[pattern] += latencies
                print(f"round {round_index + 1}: {pattern:<10} {summary(latencies)}", file=sys.stderr)
    print(f"\nidle-stage delivery, {args.rounds} × {args.tasks} tasks, publish → in the worker's hands")
    for name, latencies in results.items():
        print(f"{name:<10} {summary(latencies)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--floor", action="store_true",
                        help="also a JetStream push consumer and a core-NATS queue subscription (no stream)")
    asyncio.run(main(parser.parse_args()))
