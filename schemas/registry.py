"""Worker cards in the `{ns}_workers` KV bucket: who serves what, and where to reach it.

A worker rewrites its card every few seconds; the bucket's TTL removes the card of a worker that
stopped heartbeating, so the registry only lists live workers.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field

from schemas.base import WireModel


class Stage(StrEnum):
    PROCESSOR = "processor"
    ENCODE = "encode"
    PREFILL = "prefill"
    DECODE = "decode"
    EMBED = "embed"
    IMAGE = "image"


class ServingMode(StrEnum):
    AGGREGATED = "aggregated"  # processor → decode
    DISAGGREGATED = "disaggregated"  # processor → prefill → decode
    ENCODE_AGGREGATED = "encode-aggregated"  # E/PD: processor → encode → decode
    ENCODE_DISAGGREGATED = "encode-disaggregated"  # E/P/D: processor → encode → prefill → decode
    EMBEDDING = "embedding"  # processor → embed
    IMAGE = "image"  # processor → image (a diffusion pipeline)


class BootstrapEndpoint(WireModel):
    host: str
    port: int = Field(ge=1, le=65535)


class KvCapacity(WireModel):
    block_size: int = Field(ge=1)
    total_blocks: int = Field(ge=0)
    used_blocks: int = Field(ge=0)


# A pool's name becomes a subject token and part of a consumer name.
PoolName = Annotated[str, Field(min_length=1, max_length=32, pattern=r"^[A-Za-z0-9_\-]+$")]


class WorkerCard(WireModel):
    worker_id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_\-]+$")
    stage: Stage
    model: str
    mode: ServingMode
    engine: str
    host: str
    pid: int
    started_at_s: float
    metrics_url: str | None = None
    bootstrap: BootstrapEndpoint | None = None
    kv: KvCapacity | None = None
    context_length: int | None = None
    ready: bool = False
    # Takes image requests itself: an encode worker, or an LLM worker that encodes in-process (EPD).
    accepts_media: bool = False
    # A decode worker that can also run a prompt itself (started aggregated, or its engine prefills in the decode role
    # too), so a router may skip the prefill stage for it.
    prefills_locally: bool = False
    # LoRA adapters its engine has loaded (requests may name them as their model), and those it could not load,
    # with the reason.
    lora_adapters: list[str] = Field(default_factory=list)
    # A processor serving several models: the others beside `model` (processors share one queue, so each serves all).
    also_serves: list[str] = Field(default_factory=list)
    # The pool it serves in, when its model is served by several (a routing config names them); None: the model's.
    pool: PoolName | None = None
    lora_failures: dict[str, str] = Field(default_factory=dict)
    wire_version: int


class WorkerLoad(WireModel):
    """An engine's load as it changes, on `{ns}.load.{worker_id}` (core NATS, at most every 50 ms): what a
    KV-aware router weighs against cached prefixes. The registry card's copy is seconds old."""

    worker_id: str
    kv_used_blocks: int = Field(ge=0)
    running_requests: int = Field(ge=0)
    waiting_requests: int = Field(ge=0)
    # Prompt tokens admitted but not yet computed (queued or mid-prefill): how busy a prefill engine is.
    waiting_prompt_tokens: int = Field(default=0, ge=0)
