"""Fanning an engine's KV-event batches out to every listener, from whichever thread produced them; merging batches
that are published together."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from workers.engines.protocol import KvEventBatchOut


class KvEventFanout:
    def __init__(self) -> None:
        self._listeners: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue[KvEventBatchOut]]] = []

    def publish(self, batch: KvEventBatchOut) -> None:
        """Safe from any thread: each listener gets the batch on its own event loop."""
        for loop, queue in list(self._listeners):
            loop.call_soon_threadsafe(queue.put_nowait, batch)

    async def listen(self) -> AsyncIterator[KvEventBatchOut]:
        """Every batch published from now on, in order, until the caller stops iterating."""
        listener = (asyncio.get_running_loop(), asyncio.Queue[KvEventBatchOut]())
        self._listeners.append(listener)
        try:
            while True:
                yield await listener[1].get()
        finally:
            self._listeners.remove(listener)


def merged_batches(batches: list[KvEventBatchOut]) -> list[KvEventBatchOut]:
    """Consecutive batches of one data-parallel rank as one, their events in order, stamped with the last one's time."""
    merged: list[KvEventBatchOut] = []
    for batch in batches:
        if merged and merged[-1].data_parallel_rank == batch.data_parallel_rank:
            last = merged.pop()
            batch = KvEventBatchOut(events=[*last.events, *batch.events], ts=batch.ts,
                                    data_parallel_rank=batch.data_parallel_rank)
        merged.append(batch)
    return merged


async def relay_in_windows(batches: AsyncIterator[KvEventBatchOut], publish: Callable[[KvEventBatchOut], Awaitable[None]],
                           interval_s: float) -> None:
    """Publish `batches` as they come, those arriving within `interval_s` of the first merged into one (the torch engine
    emits one at every step that fills a page; each publish has a fixed cost). Runs until cancelled."""
    pending: list[KvEventBatchOut] = []
    arrived = asyncio.Event()

    async def gather() -> None:
        async for batch in batches:
            pending.append(batch)
            arrived.set()

    gatherer = asyncio.create_task(gather(), name="kv-events-gather")
    try:
        while True:
            await arrived.wait()
            await asyncio.sleep(interval_s)
            arrived.clear()
            taken, pending[:] = pending[:], []
            for batch in merged_batches(taken):
                await publish(batch)
    finally:
        gatherer.cancel()
