"""Keeping an LLM worker's engine serving the LoRA adapters of its model (runtime infrastructure, not a stage).

The `{ns}_loras` bucket holds the adapters the deployment serves (bus/adapters.py). A prefill or decode worker
loads those of its base model before it takes work, then follows the bucket: an adapter put is loaded, one
removed is unloaded. A task naming an adapter this engine lacks (the watch has not caught up yet) loads it from
the bucket first. Each change is written to the worker's registry card (`lora_adapters`, `lora_failures`);
when that write fails, the load is rolled back, so a card never hides an adapter the engine holds, nor shows one
it does not. The worker's `/engine/load_lora` route loads on this worker only (Dynamo's per-worker endpoint).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from bus.adapters import AdapterBucket
from bus.errors import RejectRequest
from bus.lifecycle import stop_tasks
from schemas.control import LoraAdapter
from schemas.replies import ErrorCode
from workers.engines.protocol import Engine, UnsupportedOption

log = structlog.get_logger(__name__)


class AdapterSync:
    def __init__(self, engine: Engine, model: str, bucket: AdapterBucket,
                 publish_card: Callable[[], Awaitable[None]]) -> None:
        self._engine = engine
        self._model = model
        self._bucket = bucket
        self._publish_card = publish_card
        # Adapters of the bucket this engine could not load, and why (shown on the card).
        self.failures: dict[str, str] = {}
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Load the model's adapters now (before the worker takes work), then follow the bucket."""
        for adapter in await self._bucket.all():
            if adapter.base_model == self._model:
                await self._load_logged(adapter)
        self._watch = asyncio.create_task(self._follow(), name="lora-adapters")

    async def stop(self) -> None:
        if self._watch is not None:
            await stop_tasks([self._watch])

    async def ensure(self, name: str) -> None:
        """Have `name` loaded for a task that names it; `unknown_model` when the deployment does not serve it."""
        if name in self._engine.loras():
            return
        adapter = await self._bucket.get(name)
        if adapter is None or adapter.base_model != self._model:
            raise RejectRequest(ErrorCode.UNKNOWN_MODEL, f"LoRA adapter {name!r} is not served for {self._model} "
                                f"(load it with `conveyor lora load {name} PATH --model {self._model}`)")
        try:
            await self.load(adapter)
        except (ValueError, UnsupportedOption) as error:
            raise RejectRequest(ErrorCode.UNSUPPORTED, f"LoRA adapter {name!r} cannot be loaded: {error}") from error

    async def load(self, adapter: LoraAdapter) -> None:
        """Load into the engine, then show it on the card; if the card cannot be written, unload again."""
        await self._engine.load_lora(adapter.name, adapter.path)
        self.failures.pop(adapter.name, None)
        try:
            await self._publish_card()
        except Exception:
            await self._engine.unload_lora(adapter.name)
            raise

    async def unload(self, name: str) -> None:
        path = self._engine.loras().get(name)
        await self._engine.unload_lora(name)
        self.failures.pop(name, None)
        try:
            await self._publish_card()
        except Exception:
            if path is not None:
                await self._engine.load_lora(name, path)
            raise

    async def _follow(self) -> None:
        async for name, adapter in self._bucket.changes():
            if adapter is None:
                if name in self._engine.loras() or name in self.failures:
                    await self._unload_logged(name)
            elif adapter.base_model == self._model:
                await self._load_logged(adapter)

    async def _load_logged(self, adapter: LoraAdapter) -> None:
        try:
            await self.load(adapter)
        except Exception as error:  # a bad adapter is reported on the card; the worker serves on
            self.failures[adapter.name] = str(error)
            log.warning("lora.load_failed", name=adapter.name, path=adapter.path, error=str(error))
            await self._card_or_log()

    async def _unload_logged(self, name: str) -> None:
        try:
            await self.unload(name)
        except Exception as error:
            log.warning("lora.unload_failed", name=name, error=str(error))

    async def _card_or_log(self) -> None:
        try:
            await self._publish_card()
        except Exception as error:  # the next heartbeat writes the card
            log.warning("lora.card_write_failed", error=repr(error))
