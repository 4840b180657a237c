"""Prefill → decode KV handoff over NIXL, with a small HTTP bootstrap server on the prefill side.

The prefill engine registers its whole KV cache with a NIXL agent. When a prompt with bootstrap
room R is computed, its blocks stay pinned and the room is *offered* on the bootstrap server:
the agent's metadata, the cache layout, the block ids, and the first sampled token. A decode engine
asks `GET /rooms/R` (long-polling, so it may ask before the prefill is done), allocates blocks of
its own, READs the remote blocks into them with NIXL (UCX; host memory here, GPU memory on CUDA),
and sends the NIXL notification `room:R`, on which the prefill side frees its blocks.
"""

from __future__ import annotations

import asyncio
import base64
import importlib
import threading
import time
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Any

import aiohttp
import structlog
import torch
from aiohttp import web

from schemas.registry import BootstrapEndpoint
from schemas.tasks import BootstrapInfo
from workers.engines.network import advertised_host
from workers.engines.protocol import TransferFailed

log = structlog.get_logger(__name__)


def _nixl() -> ModuleType:
    """NIXL's Python API: `nixl` where the meta package is installed, else a CUDA-variant wheel."""
    for name in ("nixl._api", "nixl_cu13", "nixl_cu12"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise RuntimeError("disaggregated serving needs NIXL: pip install nixl (or nixl-cu12)")


def agent_config(nixl: ModuleType) -> Any:
    """UCX without NIXL's progress thread: it spins on a core, and on a small CPU host it took half the
    engine's token rate (measured: 12 tokens with an image, 1.9 s with it, 0.95 s without). Our reads poll
    their transfer to completion and owners poll their notifications, which drives UCX as far as needed."""
    return nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])


@dataclass(frozen=True, slots=True)
class KvLayout:
    """Where each block of a [layers, 2, slots, kv_heads, head_dim] cache lies in memory."""

    base_address: int
    num_layers: int
    num_slots: int
    block_size: int
    bytes_per_token: int
    device_id: int

    @classmethod
    def of(cls, kv_cache: torch.Tensor, block_size: int) -> KvLayout:
        layers, _, slots, kv_heads, head_dim = kv_cache.shape
        return cls(
            base_address=kv_cache.data_ptr(),
            num_layers=layers,
            num_slots=slots,
            block_size=block_size,
            bytes_per_token=kv_heads * head_dim * kv_cache.element_size(),
            device_id=kv_cache.device.index or 0,
        )

    def regions(self, blocks: list[int]) -> list[tuple[int, int, int]]:
        """(address, length, device) of every (layer, K/V, block), in one fixed order."""
        length = self.block_size * self.bytes_per_token
        return [
            (self.base_address + ((layer * 2 + kv) * self.num_slots + block * self.block_size) * self.bytes_per_token,
             length, self.device_id)
            for layer in range(self.num_layers)
            for kv in (0, 1)
            for block in blocks
        ]


@dataclass(frozen=True, slots=True)
class RoomOffer:
    """What a decode engine needs to read one prompt's KV from a prefill engine."""

    agent_name: str
    agent_metadata_b64: str
    layout: KvLayout
    block_ids: list[int]
    num_prompt_tokens: int
    first_token_id: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RoomOffer:
        return cls(**{**data, "layout": KvLayout(**data["layout"])})


class KvTransferAgent:
    """A NIXL agent with this engine's KV cache registered."""

    def __init__(self, name: str, kv_cache: torch.Tensor, block_size: int) -> None:
        nixl = _nixl()
        self.name = name
        self._agent = nixl.nixl_agent(name, agent_config(nixl))
        self._memory_type = "VRAM" if kv_cache.is_cuda else "DRAM"
        self._registered = self._agent.register_memory(kv_cache)
        self.layout = KvLayout.of(kv_cache, block_size)
        self._remote_agents: dict[str, str] = {}
        # Reads run in worker threads, several at once; one NIXL agent is driven by one of them at a time.
        self._lock = threading.Lock()

    @property
    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    def read_blocks(self, offer: RoomOffer, local_blocks: list[int], notification: bytes, timeout_s: float) -> None:
        """Copy the offered blocks into ours; blocks until done, then notifies the owner."""
        with self._lock:
            self._read_blocks(offer, local_blocks, notification, timeout_s)

    def _read_blocks(self, offer: RoomOffer, local_blocks: list[int], notification: bytes, timeout_s: float) -> None:
        remote = self._remote_agents.get(offer.agent_name)
        if remote is None:
            remote = self._agent.add_remote_agent(base64.b64decode(offer.agent_metadata_b64))
            self._remote_agents[offer.agent_name] = remote
        local_descs = self._agent.get_xfer_descs(self.layout.regions(local_blocks), self._memory_type)
        remote_descs = self._agent.get_xfer_descs(offer.layout.regions(offer.block_ids), self._memory_type)
        nixl_read(self._agent, local_descs, remote_descs, remote, notification, timeout_s, offer.agent_name)

    def notifications(self) -> list[bytes]:
        return [message for messages in self._agent.get_new_notifs().values() for message in messages]

    def close(self) -> None:
        self._agent.deregister_memory(self._registered)


def nixl_read(agent: Any, local_descs: Any, remote_descs: Any, remote: str, notification: bytes, timeout_s: float,
              owner: str) -> None:
    """One blocking NIXL READ of `remote_descs` into `local_descs`; the owner gets `notification` when done.
    Raises `TransferFailed` however it fails (NIXL's own errors, e.g. a dead owner's
    `nixlRemoteDisconnectError`, share no base class)."""
    try:
        handle = agent.initialize_xfer("READ", local_descs, remote_descs, remote, notification)
    except Exception as error:
        raise TransferFailed(f"NIXL read from {owner} could not start: {error!r}") from error
    try:
        state = agent.transfer(handle)
        deadline = time.monotonic() + timeout_s
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(0.0002)
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise TransferFailed(f"NIXL read from {owner} ended in state {state}")
    except TransferFailed:
        raise
    except Exception as error:
        raise TransferFailed(f"NIXL read from {owner} failed: {error!r}") from error
    finally:
        try:
            agent.release_xfer_handle(handle)
        except Exception as error:  # the owner is gone; nothing left to release on its side
            log.debug("nixl.release_failed", owner=owner, error=repr(error))


def room_notification(room: int) -> bytes:
    return f"room:{room}".encode()


def room_of_notification(message: bytes) -> int | None:
    text = message.decode(errors="replace")
    return int(text[5:]) if text.startswith("room:") and text[5:].isdigit() else None


class BootstrapServer:
    """Serves room offers to decode engines. Offers and failures may come from any thread."""

    def __init__(self, host: str, port: int) -> None:
        self._host = host
        self._port = port
        self._rooms: dict[int, asyncio.Future[RoomOffer]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self.endpoint: BootstrapEndpoint | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        app = web.Application()
        app.add_routes([web.get("/rooms/{room}", self._get_room)])
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        server = site._server
        assert server is not None and server.sockets
        self.endpoint = BootstrapEndpoint(host=advertised_host(self._host), port=int(server.sockets[0].getsockname()[1]))

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def offer(self, room: int, offer: RoomOffer) -> None:
        self._settle(room, lambda future: future.set_result(offer))

    def fail(self, room: int, reason: str) -> None:
        def settle(future: asyncio.Future[RoomOffer]) -> None:
            future.set_exception(TransferFailed(reason))
            # Often nobody asks for a withdrawn room (its decode task was never published): not worth a
            # "never retrieved" error in the log. A decode engine that asks later still gets the exception.
            future.exception()

        self._settle(room, settle)

    def forget(self, room: int, after_s: float = 0.0) -> None:
        """Drop a settled room, after a while when a late decode engine may still ask for it."""
        assert self._loop is not None
        loop = self._loop
        loop.call_soon_threadsafe(lambda: loop.call_later(after_s, self._rooms.pop, room, None))

    def _settle(self, room: int, settle: Any) -> None:
        def apply() -> None:
            future = self._future(room)
            if not future.done():
                settle(future)

        assert self._loop is not None
        self._loop.call_soon_threadsafe(apply)

    def _future(self, room: int) -> asyncio.Future[RoomOffer]:
        assert self._loop is not None
        if room not in self._rooms:
            self._rooms[room] = self._loop.create_future()
        return self._rooms[room]

    async def _get_room(self, request: web.Request) -> web.Response:
        room = int(request.match_info["room"])
        wait_s = float(request.query.get("wait_s", "30"))
        future = self._future(room)
        try:
            offer = await asyncio.wait_for(asyncio.shield(future), timeout=wait_s)
        except TimeoutError:
            return web.json_response({"error": f"room {room} not ready after {wait_s} s"}, status=404)
        except TransferFailed as failure:
            return web.json_response({"error": str(failure)}, status=410)
        return web.json_response(offer.to_json())


async def fetch_offer(bootstrap: BootstrapInfo, timeout_s: float) -> RoomOffer:
    url = f"http://{bootstrap.bootstrap_host}:{bootstrap.bootstrap_port}/rooms/{bootstrap.bootstrap_room}"
    timeout = aiohttp.ClientTimeout(total=timeout_s + 5)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(url, params={"wait_s": str(timeout_s)}) as response:
                body = await response.json()
                if response.status != 200:
                    raise TransferFailed(f"bootstrap {url}: {body.get('error', response.status)}")
                return RoomOffer.from_json(body)
    except (aiohttp.ClientError, TimeoutError) as error:
        raise TransferFailed(f"bootstrap {url} unreachable: {error!r}") from error
