"""The `{ns}_loras` bucket: which LoRA adapters the deployment serves, keyed by adapter name.

It holds the wanted state, not what is loaded: `conveyor lora load` (or the gateway's `/v1/load_lora_adapter`)
puts a `LoraAdapter`, and every LLM worker of its base model watches the bucket and loads it — replicas that
start later too, before they take work. What each worker has loaded (and what failed there, with the reason)
is on its registry card, which is what clients wait on and what the processor routes by.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import structlog
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BadRequestError, KeyNotFoundError, NotFoundError
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue
from pydantic import ValidationError

from bus.registry import live_keys
from bus.settings import BusSettings
from bus.subjects import Names
from schemas.codec import decode, encode
from schemas.control import LoraAdapter

log = structlog.get_logger(__name__)


async def ensure_lora_bucket(js: JetStreamContext, names: Names, settings: BusSettings) -> KeyValue:
    try:
        return await js.key_value(names.lora_bucket)
    except (NotFoundError, BadRequestError):
        config = KeyValueConfig(bucket=names.lora_bucket, description="Conveyor LoRA adapters", history=1,
                                replicas=settings.stream_replicas, storage=StorageType.FILE)
        return await js.create_key_value(config)


class AdapterBucket:
    def __init__(self, bucket: KeyValue) -> None:
        self._bucket = bucket

    async def put(self, adapter: LoraAdapter) -> None:
        await self._bucket.put(adapter.name, encode(adapter))

    async def delete(self, name: str) -> bool:
        """Remove `name`; False when it was not there."""
        if await self.get(name) is None:
            return False
        await self._bucket.delete(name)
        return True

    async def get(self, name: str) -> LoraAdapter | None:
        try:
            entry = await self._bucket.get(name)
        except KeyNotFoundError:
            return None
        return _adapter_of(name, entry.value)

    async def all(self) -> list[LoraAdapter]:
        adapters = [await self.get(name) for name in await live_keys(self._bucket)]
        return sorted((adapter for adapter in adapters if adapter is not None), key=lambda adapter: adapter.name)

    async def changes(self) -> AsyncIterator[tuple[str, LoraAdapter | None]]:
        """Every entry now, then each change as it comes: (name, the adapter) or (name, None) once removed."""
        watcher = await self._bucket.watchall()
        try:
            async for entry in watcher:
                if entry is None:
                    continue  # the marker between the entries there were and the changes to come
                removed = entry.operation in (KV_DEL, KV_PURGE)
                adapter = None if removed else _adapter_of(entry.key, entry.value)
                if removed or adapter is not None:
                    yield entry.key, adapter
        finally:
            await watcher.stop()


def _adapter_of(name: str, value: bytes | None) -> LoraAdapter | None:
    if not value:
        return None
    try:
        return decode(value, LoraAdapter)
    except (ValueError, ValidationError) as error:
        log.warning("adapters.bad_entry", name=name, error=str(error))
        return None
