"""Image embedding rows from the encode worker to the LLM worker over NIXL — never inside a task.

The encode worker's `EmbeddingExporter` registers one pool of memory with its NIXL agent at start
(so its agent metadata, which carries the registration's keys, never changes and readers may cache
it), copies each request's rows into a free range of the pool, and puts a `NixlHandle` — agent
metadata, serialized descriptors, shape, dtype — in the next stage's task. The LLM worker's
`EmbeddingReader` READs the range into a tensor of its own and sends the notification
`emb:{request_id}`; on it, the exporter frees the range. A request cancelled, or whose reader never
comes within the handoff timeout, frees its range too. The exporter watches each offer in the background
(one poller for all), so the encode worker's slot is free for the next image request as soon as it has
published the task, not when the LLM worker gets round to reading.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
import torch

from bus.metrics import EMBEDDING_HANDOFFS
from schemas.tasks import NixlHandle
from workers.engines.protocol import TransferFailed
from workers.engines.torch_engine.kv_transfer import _nixl, agent_config, nixl_read

log = structlog.get_logger(__name__)

_NOTIFY_PREFIX = "emb:"
_POLL_S = 0.002


def _notification(request_id: str) -> bytes:
    return f"{_NOTIFY_PREFIX}{request_id}".encode()


class PoolFull(RuntimeError):
    """No free range large enough in the export pool (readers are slow or absent)."""


class _RangeAllocator:
    """First-fit byte ranges in a fixed pool, coalescing on free."""

    def __init__(self, size: int, alignment: int = 256) -> None:
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, length), sorted by offset
        self._alignment = alignment

    def take(self, length: int) -> int:
        length = -(-length // self._alignment) * self._alignment
        for index, (offset, free) in enumerate(self._free):
            if free >= length:
                self._free[index] = (offset + length, free - length)
                if free == length:
                    del self._free[index]
                return offset
        raise PoolFull(f"no free range of {length} bytes")

    def give(self, offset: int, length: int) -> None:
        length = -(-length // self._alignment) * self._alignment
        self._free.append((offset, length))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for start, size in self._free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((start, size))
        self._free = merged


@dataclass
class _Offer:
    offset: int
    length: int
    # Whether the request was cancelled (polled with the notifications; a cancel frees the range at once).
    cancelled: Callable[[], bool]
    expires_at_s: float
    # How the offer ended: "read", "cancelled", "expired", or "released" (never published, so never read).
    outcome: asyncio.Future[str] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class EmbeddingExporter:
    def __init__(self, name: str, pool_bytes: int) -> None:
        nixl = _nixl()
        self.name = name
        self._agent = nixl.nixl_agent(name, agent_config(nixl))
        self._pool = torch.empty(pool_bytes, dtype=torch.uint8)
        self._registered = self._agent.register_memory(self._pool)
        self._metadata = self._agent.get_agent_metadata()
        self._ranges = _RangeAllocator(pool_bytes)
        self._offers: dict[str, _Offer] = {}
        self._space_freed = asyncio.Event()
        self._poller: asyncio.Task[None] | None = None

    @property
    def pending(self) -> int:
        return len(self._offers)

    async def offer(self, request_id: str, rows: torch.Tensor, wait_for_space_s: float,
                    cancelled: Callable[[], bool], hold_s: float) -> NixlHandle:
        """Copy `rows` into the pool and describe them; waits for space up to `wait_for_space_s`.

        The range is freed when the reader notifies, when `cancelled()` turns true, or after `hold_s`.
        """
        data = rows.contiguous().view(torch.uint8).reshape(-1)
        deadline = time.monotonic() + wait_for_space_s
        while True:
            try:
                offset = self._ranges.take(data.numel())
                break
            except PoolFull:
                if time.monotonic() > deadline:
                    raise
                self._space_freed.clear()
                try:
                    await asyncio.wait_for(self._space_freed.wait(), timeout=max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    continue
        self._pool[offset : offset + data.numel()].copy_(data)
        self._offers[request_id] = _Offer(offset, data.numel(), cancelled, time.monotonic() + hold_s)
        descs = self._agent.get_xfer_descs([(self._pool.data_ptr() + offset, data.numel(), 0)], "DRAM")
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll_notifications(), name="embedding-notifications")
        return NixlHandle(agent_name=self.name, agent_metadata=self._metadata,
                          serialized_descriptors=self._agent.get_serialized_descs(descs),
                          shape=list(rows.shape), dtype=str(rows.dtype).removeprefix("torch."))

    async def outcome(self, request_id: str) -> str:
        """How the offer of `request_id` ends: "read", "cancelled", "expired" or "released" (`release`)."""
        return await asyncio.shield(self._offers[request_id].outcome)

    def release(self, request_id: str) -> None:
        """Free the range now (nobody will read it: the task was never published)."""
        self._end(request_id, None)

    def _end(self, request_id: str, outcome: str | None) -> None:
        offer = self._offers.pop(request_id, None)
        if offer is None:
            return
        self._ranges.give(offer.offset, offer.length)
        self._space_freed.set()
        if outcome is not None:
            EMBEDDING_HANDOFFS.labels(outcome=outcome).inc()
        offer.outcome.set_result(outcome or "released")

    async def _poll_notifications(self) -> None:
        while self._offers:
            for messages in self._agent.get_new_notifs().values():
                for message in messages:
                    text = message.decode(errors="replace")
                    if text.startswith(_NOTIFY_PREFIX):
                        self._end(text[len(_NOTIFY_PREFIX):], "read")
            now_s = time.monotonic()
            for request_id, offer in list(self._offers.items()):
                if offer.cancelled():
                    self._end(request_id, "cancelled")
                elif now_s > offer.expires_at_s:
                    log.warning("embedding.expired", request_id=request_id)
                    self._end(request_id, "expired")
            await asyncio.sleep(_POLL_S)

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        self._agent.deregister_memory(self._registered)


class EmbeddingReader:
    """The LLM worker's side: READ offered rows into a tensor of our own, then notify the owner."""

    def __init__(self, name: str) -> None:
        nixl = _nixl()
        self._agent = nixl.nixl_agent(name, agent_config(nixl))
        self._remote_agents: dict[str, str] = {}
        # Reads come from several threads at once; one NIXL agent is not safe to drive from many (seen:
        # failed transfers and heap corruption with 8 concurrent reads).
        self._lock = threading.Lock()

    def read(self, handle: NixlHandle, request_id: str, timeout_s: float) -> torch.Tensor:
        """Blocking (run it in a thread); raises `TransferFailed`."""
        with self._lock:
            return self._read(handle, request_id, timeout_s)

    def _read(self, handle: NixlHandle, request_id: str, timeout_s: float) -> torch.Tensor:
        remote = self._remote_agents.get(handle.agent_name)
        if remote is None:
            remote = self._agent.add_remote_agent(handle.agent_metadata)
            self._remote_agents[handle.agent_name] = remote
        try:
            rows = torch.empty(handle.shape, dtype=getattr(torch, handle.dtype))
        except (AttributeError, TypeError, RuntimeError) as error:
            raise TransferFailed(f"bad embedding handle: shape {handle.shape} dtype {handle.dtype}") from error
        registered = self._agent.register_memory(rows)
        try:
            local = self._agent.get_xfer_descs(rows)
            remote_descs = self._agent.deserialize_descs(handle.serialized_descriptors)
            nixl_read(self._agent, local, remote_descs, remote, _notification(request_id), timeout_s, handle.agent_name)
        finally:
            self._agent.deregister_memory(registered)
        return rows
