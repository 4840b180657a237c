"""What one event-loop step costs a process that was idle: the first task started after the loop slept, against back
to back.

A stage on an idle pipeline sleeps between requests, and each step of its path then runs cold (docs/performance.md,
twenty-fourth stop). This prints the median time from `create_task` to the task running, after each kind of wait:
none (`hot`), 20 ms asleep in the loop (`sleep`), 20 ms spinning without yielding (`spin`), and 20 ms woken every
millisecond (`tick`).

    .venv/bin/python scripts/bench_idle_wake.py
    bash scripts/gpu_run.sh python3 scripts/bench_idle_wake.py    # the GPU machine
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

WAIT_S = 0.02


async def _started_at() -> float:
    return time.perf_counter()


async def _wait(kind: str) -> None:
    if kind == "sleep":
        await asyncio.sleep(WAIT_S)
    elif kind == "spin":
        end_s = time.perf_counter() + WAIT_S
        while time.perf_counter() < end_s:
            pass
    elif kind == "tick":
        for _ in range(round(WAIT_S / 0.001)):
            await asyncio.sleep(0.001)


async def task_start_us(kind: str, samples: int) -> float:
    """Median microseconds from creating a task to its first line, each after one wait of `kind`."""
    starts_us = []
    for _ in range(samples):
        await _wait(kind)
        created_s = time.perf_counter()
        started_s = await asyncio.create_task(_started_at())
        starts_us.append(1e6 * (started_s - created_s))
    return statistics.median(starts_us)


async def main(samples: int) -> None:
    for kind in ("hot", "sleep", "spin", "tick"):
        print(f"{kind:<6} task start {await task_start_us(kind, samples):7.1f} µs (median of {samples})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=300, help="tasks per kind of wait (default 300)")
    args = parser.parse_args()
    try:
        import uvloop
    except ImportError:  # plain asyncio where uvloop is missing
        asyncio.run(main(args.samples))
    else:
        uvloop.run(main(args.samples))
