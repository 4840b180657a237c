"""Work the processor hands to the other stages: preprocessed requests and the disaggregated handoff.

A task always carries the client's `request_id` and `reply_to`, so whichever stage finishes the
request (or fails it) streams to the client directly, and `created_at_s` so each stage can measure
the time a request spent queued.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from schemas.base import WireModel
from schemas.client import Inbox, MediaUrl, RequestId, SessionId, StreamFormat
from schemas.control import LoraName
from schemas.registry import PoolName
from schemas.sampling import GuidedDecoding, OutputOptions, SamplingOptions, StopConditions


class MediaItem(WireModel):
    modality: Literal["image", "video"]
    source: MediaUrl


class SessionRef(WireModel):
    """A request's place in a session (the processor pinned it to the worker holding the session)."""

    id: SessionId
    # The first request of the session: the engine opens it. Otherwise an engine without the session (its worker
    # restarted) refuses the request rather than answer without the conversation.
    opens: bool = False
    # The last request: the engine closes the session once it finishes.
    closes: bool = False


class PreprocessedRequest(WireModel):
    """A request after the chat template and the tokenizer: what an engine is asked to run."""

    model: str = Field(min_length=1)
    token_ids: list[int] = Field(min_length=1)
    sampling: SamplingOptions = SamplingOptions()
    stop: StopConditions = StopConditions()
    output: OutputOptions = OutputOptions()
    guided: GuidedDecoding | None = None
    # EOS ids of the model's generation config; the engine stops on these unless ignore_eos.
    eos_token_ids: list[int] = Field(default_factory=list)
    media: list[MediaItem] = Field(default_factory=list)
    priority: int | None = None
    # The LoRA adapter to run the model with (the client's `model` named it); None: the base model.
    lora_name: LoraName | None = None
    session: SessionRef | None = None


class TaskHeader(WireModel):
    """Identity and reply path of a task, copied hop to hop."""

    request_id: RequestId
    reply_to: Inbox
    stream_format: StreamFormat = StreamFormat.TEXT
    # Unix time when the client's request entered the pipeline.
    created_at_s: float = Field(ge=0.0)
    # Frames already sent to `reply_to` (heartbeats, by a worker that handed the task over before any output):
    # the stream goes on from this number.
    first_reply_seq: int = Field(default=0, ge=0)


class BootstrapInfo(WireModel):
    """Where a decode engine joins the prefill engine's KV transfer (SGLang's PD bootstrap)."""

    bootstrap_host: str = Field(min_length=1)
    bootstrap_port: int = Field(ge=1, le=65535)
    # SGLang draws rooms as random 63-bit integers.
    bootstrap_room: int = Field(ge=0, lt=2**63)


class NixlHandle(WireModel):
    """Memory another process can read over NIXL: the owner agent's metadata and its descriptors."""

    agent_name: str
    agent_metadata: bytes
    serialized_descriptors: bytes
    shape: list[int]
    dtype: str


class EncodedImages(WireModel):
    """What the encode stage made of a request's images: the prompt with each image placeholder expanded to
    the image's tokens and, while an encode worker holds them, the image rows to read over NIXL (`rows`;
    absent past the stage that read them). The task's `request` keeps the images themselves, so an LLM
    worker that cannot read the rows (their encode worker died) encodes them again instead of failing."""

    token_ids: list[int] = Field(min_length=1)
    rows: NixlHandle | None = None
    # Each image's (t, h, w) patch grid, for models that position image tokens on it (Qwen2-VL's M-RoPE).
    image_grids: list[tuple[int, int, int]] | None = None


class Task(WireModel):
    """A unit of work for one stage; `request_id` and `reply_to` read through to the header."""

    header: TaskHeader

    @property
    def request_id(self) -> str:
        return self.header.request_id

    @property
    def reply_to(self) -> str:
        return self.header.reply_to


class EncodeTask(Task):
    kind: Literal["encode"] = "encode"
    request: PreprocessedRequest
    # The stage that continues once the media is encoded.
    next_stage: Literal["prefill", "decode"]


class PrefillTask(Task):
    kind: Literal["prefill"] = "prefill"
    request: PreprocessedRequest
    # Given by a router that chose it; otherwise the prefill worker draws one.
    bootstrap_room: int | None = Field(default=None, ge=0, lt=2**63)
    encoded_images: EncodedImages | None = None
    # Set when a KV-aware router pinned the task: the prompt tokens it expected cached here.
    predicted_cached_tokens: int | None = Field(default=None, ge=0)
    # Faster prefill pools to hand the task to, in order, should it fail here before anything was streamed.
    retry_pools: list[PoolName] = Field(default_factory=list, max_length=16)
    # The decode pool the decode task goes to, then its retry pools (empty: the model's decode queue).
    decode_pools: list[PoolName] = Field(default_factory=list, max_length=16)


class DecodeTask(Task):
    kind: Literal["decode"] = "decode"
    request: PreprocessedRequest
    # Present in disaggregated mode: join this room and receive the prompt's KV instead of prefilling.
    bootstrap: BootstrapInfo | None = None
    encoded_images: EncodedImages | None = None
    # Set when a KV-aware router pinned the task: the prompt tokens it expected cached here.
    predicted_cached_tokens: int | None = Field(default=None, ge=0)
    # Faster decode pools to hand the task to, in order, should it fail here before anything was streamed.
    retry_pools: list[PoolName] = Field(default_factory=list, max_length=16)


class EmbedTask(Task):
    kind: Literal["embed"] = "embed"
    model: str = Field(min_length=1)
    inputs: list[list[int]] = Field(min_length=1)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)


class ImageTask(Task):
    """An image request as the processor checked it; sizes are the image worker's to check (they are the model's)."""

    kind: Literal["image"] = "image"
    model: str = Field(min_length=1)
    prompt: str = Field(min_length=1)
    negative_prompt: str | None = None
    n: int = Field(ge=1, le=10)
    size: str
    response_format: Literal["b64_json", "url"]
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    num_inference_steps: int = Field(ge=1, le=500)
    guidance_scale: float = Field(ge=0.0, le=50.0)
