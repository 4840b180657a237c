"""Stopping background tasks reliably.

nats-py turns a cancellation that lands inside a request into its own TimeoutError in places, so a
loop that catches `Exception` around NATS calls can swallow a `cancel()`. Loops here therefore stop
on an event, and stopping never waits unboundedly for a task to notice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import structlog

log = structlog.get_logger(__name__)


async def sleep_unless(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep `seconds`; True if `stop` was set meanwhile (the loop should end)."""
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
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
