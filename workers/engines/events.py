"""Fanning an engine's KV-event batches out to every listener, from whichever thread produced them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

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
