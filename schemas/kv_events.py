"""KV-cache events in SGLang's shapes (`sglang.srt.disaggregation.kv_events`), batched per worker.

A worker publishes `KvEventBatch`es to `{ns}.kv.{worker_id}` with `seq` increasing by one per
batch from 0, so a consumer (a KV-aware router) that sees `seq > last + 1` knows it missed events.
Block hashes are SGLang's (64-bit, signed or unsigned as the engine produced them).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from schemas.base import WireModel


class BlockStored(WireModel):
    type: Literal["BlockStored"] = "BlockStored"
    block_hashes: list[int] = Field(min_length=1)
    parent_block_hash: int | None = None
    # The tokens of every stored block, concatenated: len == len(block_hashes) * block_size.
    token_ids: list[int]
    block_size: int = Field(ge=1)
    lora_id: int | None = None
    # Where the blocks live: "GPU", "CPU", ... (SGLang's medium); None means device memory.
    medium: str | None = None


class BlockRemoved(WireModel):
    type: Literal["BlockRemoved"] = "BlockRemoved"
    block_hashes: list[int] = Field(min_length=1)
    medium: str | None = None


class AllBlocksCleared(WireModel):
    type: Literal["AllBlocksCleared"] = "AllBlocksCleared"


KvEvent = Annotated[BlockStored | BlockRemoved | AllBlocksCleared, Field(discriminator="type")]


class KvEventBatch(WireModel):
    worker_id: str
    seq: int = Field(ge=0)
    # Unix time when the engine emitted the batch.
    ts: float
    data_parallel_rank: int = Field(default=0, ge=0)
    events: list[KvEvent] = Field(min_length=1)
