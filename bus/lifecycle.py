"""Stopping background tasks reliably, child processes that never outlive their parent, and every process's
event-loop timer (its lag, and a loop kept warm while work comes in).

nats-py turns a cancellation that lands inside a request into its own TimeoutError in places, so a
loop that catches `Exception` around NATS calls can swallow a `cancel()`. Loops here therefore stop
on an event, and stopping never waits unboundedly for a task to notice.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import structlog
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from bus.metrics import EVENT_LOOP_LAG, GC_PAUSE

log = structlog.get_logger(__name__)


async def sleep_unless(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep `seconds`; True if `stop` was set meanwhile (the loop should end)."""
    # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancel that arrives as the wait ends.
    try:
        async with asyncio.timeout(seconds):
            await stop.wait()
    except TimeoutError:
        return False
    return True


async def stop_tasks(tasks: Iterable[asyncio.Task[object]], timeout_s: float = 5.0) -> None:
    pending = [task for task in tasks if not task.done()]
    for task in pending:
        task.cancel()
    if not pending:
        return
    _, stuck = await asyncio.wait(pending, timeout=timeout_s)
    for task in stuck:
        log.warning("task.did_not_stop", task=task.get_name(), timeout_s=timeout_s)


_PR_SET_PDEATHSIG = 1


def dies_with_parent(signum: signal.Signals = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` for `subprocess.Popen`: the child gets `signum` when its parent dies, even by
    SIGKILL, so no nats-server or worker is left holding a port or a store. Linux only (None
    elsewhere, where only an orderly stop of the parent stops its children).

    The kernel sends it when the *thread* that forked exits: start such children from the main thread.
    """
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)

    def set_parent_death_signal() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, int(signum))

    return set_parent_death_signal


def freeze_startup_objects() -> int:
    """Collect garbage, then take every object alive now (modules, the engine's tables, settings) out of the garbage
    collector's view, for the life of the process; returns how many. Without it each full collection walks them all
    while the event loop, frames and all, waits: ~227k objects in a mock-engine worker, millions with SGLang and
    torch imported (docs/performance.md). Call once, after startup; SGLang advises the same (its `freeze_gc`)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def observe_gc_pauses() -> None:
    """Time every garbage collection of this process into `conveyor_gc_pause_seconds` (once per process)."""
    if _observe_gc not in gc.callbacks:
        gc.callbacks.append(_observe_gc)


_gc_started_s = 0.0


def _observe_gc(phase: str, info: dict[str, Any]) -> None:
    global _gc_started_s
    if phase == "start":
        _gc_started_s = time.perf_counter()
    else:
        GC_PAUSE.labels(generation=str(info["generation"])).observe(time.perf_counter() - _gc_started_s)


class LoopSettings(BaseSettings):
    """Every process's event-loop timer, read from `CONVEYOR_LOOP_TICK_MS` and `CONVEYOR_STAY_WARM_S`."""

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_", frozen=True)

    # How often an idle loop's lag is sampled, and so how long it sleeps at most.
    loop_tick_ms: float = Field(default=100.0, gt=0, le=60_000)
    # For this long after its last piece of work (a task pulled, an HTTP request), a process's loop wakes every
    # millisecond instead. A process asleep wakes cold: on the H100 machine's virtual CPUs a loop step took 50 µs
    # after 20 ms asleep, 29 µs when woken every millisecond and 4 µs back to back (scripts/bench_idle_wake.py),
    # and a request's first token crosses dozens of such steps in the gateway and the stages. Kept warm, one stream's
    # first token came 0.5-1.3 ms sooner (docs/performance.md, twenty-fifth stop), for ~4% of a core per process
    # while warm; an idle deployment goes back to `loop_tick_ms` after this long. 0: never warm.
    stay_warm_s: float = Field(default=10.0, ge=0)


_WARM_TICK_S = 0.001
# When this process last had work (monotonic seconds; -inf: never). One clock per process, written by whatever
# receives its work (the stage consumer, the gateway) and read by the loop's timer.
_last_work_s = float("-inf")


def note_work() -> None:
    """This process just received work: its loop stays warm for `stay_warm_s`."""
    global _last_work_s
    _last_work_s = time.monotonic()


@contextlib.asynccontextmanager
async def event_loop_lag_observed(interval_s: float | None = None) -> AsyncIterator[None]:
    """While open, a timer records how late it fired into `conveyor_event_loop_lag_seconds`: the wait of any
    callback that became ready meanwhile, a stream's next token included. It fires every `interval_s` (default:
    `CONVEYOR_LOOP_TICK_MS`), and every millisecond for `CONVEYOR_STAY_WARM_S` after `note_work`."""
    settings = LoopSettings()
    idle_s = settings.loop_tick_ms / 1000 if interval_s is None else interval_s
    task = asyncio.create_task(_observe_event_loop_lag(idle_s, settings.stay_warm_s), name="event-loop-lag")
    try:
        yield
    finally:
        task.cancel()


async def _observe_event_loop_lag(idle_s: float, stay_warm_s: float) -> None:
    loop = asyncio.get_running_loop()
    while True:
        interval_s = min(idle_s, _WARM_TICK_S) if time.monotonic() - _last_work_s < stay_warm_s else idle_s
        due_s = loop.time() + interval_s
        await asyncio.sleep(interval_s)
        EVENT_LOOP_LAG.observe(max(0.0, loop.time() - due_s))
