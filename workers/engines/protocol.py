"""The one protocol every stage uses to talk to an engine, and the values that cross it.

An engine streams a generation as disjoint deltas for a request id, aborts a request id (also one
that has produced nothing yet), encodes text to embeddings, reports its load and KV capacity,
emits KV-cache events, exposes a bootstrap endpoint for disaggregated prefill → decode, and offers
the control operations of Dynamo's handlers (release / resume memory by tag, profiling, weight
updates, cache flush). Implementations: `torch_engine.engine.TorchEngine` (embedded default),
`mock.MockEngine` (simulated timing), `sglang_engine.SGLangEngine` (production GPU engine).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from schemas.kv_events import KvEvent
from schemas.registry import BootstrapEndpoint
from schemas.replies import FinishReason, TokenLogprob
from schemas.sampling import GuidedDecoding, OutputOptions, SamplingOptions, StopConditions
from schemas.tasks import BootstrapInfo


class UnsupportedOption(ValueError):
    """A valid request option this engine cannot honour; the client gets an `unsupported` error."""


class TransferFailed(RuntimeError):
    """A disaggregated KV handoff (prefill → decode) could not complete."""


class MemoryTag(StrEnum):
    KV_CACHE = "kv_cache"
    WEIGHTS = "weights"


class DisaggregationRole(StrEnum):
    NONE = "none"  # aggregated: prefill and decode in one engine
    PREFILL = "prefill"  # computes prompts' KV and hands it to a decode engine
    DECODE = "decode"  # receives prompts' KV, then generates


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    request_id: str
    token_ids: list[int]
    sampling: SamplingOptions = SamplingOptions()
    stop: StopConditions = StopConditions()
    output: OutputOptions = OutputOptions()
    guided: GuidedDecoding | None = None
    # Prefill role: the room this prompt's KV is handed over in. Decode role: where to fetch it.
    bootstrap: BootstrapInfo | None = None
    priority: int | None = None
    # A canary: an engine in a disaggregated role runs it without a real KV transfer.
    health_check: bool = False
    # Multimodal: a tensor [image tokens, hidden] whose rows replace, in order, the input embeddings of
    # the prompt's image pad tokens (ids at or above the text vocabulary); None for text prompts.
    image_rows: Any = None


@dataclass(frozen=True, slots=True)
class GenerateOutput:
    """One delta of a generation. The last one has `finish_reason` set and the final counts."""

    token_ids: list[int]
    text: str = ""
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    # The stop string or stop token that ended the generation.
    matched_stop: str | int | None = None
    # Set on an ERROR finish.
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class EngineLoad:
    running_requests: int
    waiting_requests: int
    kv_block_size: int
    kv_total_blocks: int
    kv_used_blocks: int
    # Prompt tokens served from the prefix cache ÷ prompt tokens seen, since start.
    cache_hit_rate: float = 0.0

    @property
    def kv_usage(self) -> float:
        return self.kv_used_blocks / self.kv_total_blocks if self.kv_total_blocks else 0.0


@dataclass(frozen=True, slots=True)
class KvEventBatchOut:
    """Events of one engine step (or one ZMQ batch from SGLang)."""

    events: list[KvEvent]
    ts: float
    data_parallel_rank: int = 0


@dataclass(frozen=True, slots=True)
class EngineInfo:
    name: str
    model: str
    context_length: int
    role: DisaggregationRole = DisaggregationRole.NONE
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # A decode-role engine that can also run a prompt itself (no KV handoff): how a disaggregated
    # request migrates to it mid-stream.
    prefills_in_decode_role: bool = False


@runtime_checkable
class Engine(Protocol):
    @property
    def info(self) -> EngineInfo: ...

    async def start(self) -> None:
        """Load weights and allocate the KV pool; returns when the engine can take requests."""

    async def shutdown(self) -> None: ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """Stream deltas until a finished output. Raises `UnsupportedOption` before streaming."""

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks; its stream ends with `cancelled`."""

    async def encode(self, inputs: list[list[int]]) -> list[list[float]]: ...

    def load(self) -> EngineLoad: ...

    def kv_events(self) -> AsyncIterator[KvEventBatchOut]:
        """Batches of KV-cache events, in the order the engine produced them."""

    @property
    def bootstrap_endpoint(self) -> BootstrapEndpoint | None:
        """Where decode engines join this prefill engine's KV transfers (prefill role only)."""

    async def release_memory(self, tags: list[MemoryTag]) -> None: ...

    async def resume_memory(self, tags: list[MemoryTag]) -> None: ...

    async def start_profile(self, output_dir: Path) -> None: ...

    async def stop_profile(self) -> None: ...

    async def update_weights_from_disk(self, model_path: Path) -> None: ...

    async def flush_cache(self) -> None: ...
