"""Frames a worker publishes to a request's reply inbox (core NATS, in order, numbered).

A stream is zero or more `TokenChunk` / `Heartbeat` frames ended by exactly one terminal frame:
`FinalFrame`, `ErrorFrame`, `EmbeddingResult` or `ImageResult` (after `ImageProgress` and
`ImageData` frames). `seq` counts from 0 per request, so a receiver can
detect a lost frame. A replica that takes over a request mid-stream (migration) goes on with the
numbering and first sends again the last frame its predecessor may have sent: a receiver drops a frame
whose `seq` it has already seen. A sender that has been quiet for its heartbeat interval sends a `Heartbeat`
as a request: the receiver answers it, which tells the sender the client is still there.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter

from schemas.base import WireModel
from schemas.client import RequestId


class FinishReason(StrEnum):
    STOP = "stop"  # EOS, a stop string or a stop token
    LENGTH = "length"  # max_tokens or the context limit
    CANCELLED = "cancelled"  # a Cancel on the control subject, or the client went away
    ERROR = "error"  # the engine failed mid-generation
    CONTENT_FILTER = "content_filter"


class ErrorCode(StrEnum):
    INVALID_REQUEST = "invalid_request"  # malformed fields or values out of range
    UNKNOWN_MODEL = "unknown_model"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    UNSUPPORTED = "unsupported"  # a valid option this engine cannot honour
    OVERLOADED = "overloaded"
    TIMEOUT = "timeout"
    WORKER_LOST = "worker_lost"  # the worker serving it died; safe to retry
    INTERNAL = "internal"


class Usage(WireModel):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)
    # Prompt tokens served from the prefix cache instead of recomputed.
    cached_tokens: int = Field(default=0, ge=0)

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            cached_tokens=cached_tokens,
        )


class TopLogprob(WireModel):
    token_id: int
    logprob: float
    # The token's text, as OpenAI's responses show it (None where the engine did not say).
    token: str | None = None


class TokenLogprob(WireModel):
    token_id: int
    logprob: float
    top: list[TopLogprob] = Field(default_factory=list)
    token: str | None = None


class ChatDelta(WireModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(WireModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None


class ChatCompletionChunk(WireModel):
    """OpenAI's streaming `chat.completion.chunk`, for clients that asked for that shape."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# Not frozen, as it is built per token (a frozen dataclass takes 3× as long to build); treated as immutable.
@dataclass(slots=True)
class ChatChunkDelta:
    """One choice's delta of a chat stream, as its sender holds it: the fields of a one-choice `ChatCompletionChunk`,
    not built into the model. A decode worker sends one per token, and building three validated models for each was
    12% of its CPU at 64 streams (docs/performance.md, thirteenth stop). `wire()` is what the model dumps to
    (`model_dump(mode="python", exclude_none=True)`, same keys in the same order); a test holds the two equal.
    Receivers validate the frame, and so read it as a `ChatCompletionChunk`."""

    id: str
    created: int
    model: str
    index: int = 0
    content: str | None = None
    role: Literal["assistant"] | None = None
    finish_reason: str | None = None
    usage: Usage | None = None

    def wire(self) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if self.role is not None:
            delta["role"] = self.role
        if self.content is not None:
            delta["content"] = self.content
        choice: dict[str, Any] = {"index": self.index, "delta": delta}
        if self.finish_reason is not None:
            choice["finish_reason"] = self.finish_reason
        chunk: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                                 "model": self.model, "choices": [choice]}
        if self.usage is not None:
            chunk["usage"] = self.usage.model_dump(mode="python", exclude_none=True)
        return chunk


class TokenChunk(WireModel):
    kind: Literal["chunk"] = "chunk"
    request_id: RequestId
    seq: int = Field(ge=0)
    # Disjoint deltas: the ids generated since the previous chunk.
    token_ids: list[int]
    text: str | None = None
    logprobs: list[TokenLogprob] | None = None
    # Which of n parallel completions these tokens belong to.
    index: int = 0
    openai: ChatCompletionChunk | None = None


class Heartbeat(WireModel):
    kind: Literal["heartbeat"] = "heartbeat"
    request_id: RequestId
    seq: int = Field(ge=0)


class FinalFrame(WireModel):
    kind: Literal["final"] = "final"
    request_id: RequestId
    seq: int = Field(ge=0)
    finish_reason: FinishReason
    usage: Usage
    # The stop string or stop token id that ended generation, when one did.
    matched_stop: str | int | None = None
    # How many times the request moved to another replica mid-stream (its worker died or stopped).
    migrations: int = Field(default=0, ge=0)


class ErrorFrame(WireModel):
    kind: Literal["error"] = "error"
    request_id: RequestId
    seq: int = Field(ge=0)
    code: ErrorCode
    message: str
    # True when sending the same request again may succeed (worker lost, overloaded, timeout).
    retryable: bool = False


class Embedding(WireModel):
    index: int = Field(ge=0)
    # float32 values, or their little-endian bytes when the request asked for base64.
    vector: list[float] | bytes


class EmbeddingResult(WireModel):
    kind: Literal["embedding"] = "embedding"
    request_id: RequestId
    seq: int = Field(ge=0)
    model: str
    data: list[Embedding]
    usage: Usage


class ImageProgress(WireModel):
    """Denoising progress of an image request: `step` of `num_steps` done (for a progress bar)."""

    kind: Literal["image_progress"] = "image_progress"
    request_id: RequestId
    seq: int = Field(ge=0)
    step: int = Field(ge=0)
    num_steps: int = Field(ge=1)


class ImageData(WireModel):
    """One generated image, or a piece of one: a PNG larger than a NATS message travels in several frames
    of the same `index`, to be joined in order until the one marked `last`. With `url` the image was stored
    and only its address travels."""

    kind: Literal["image_data"] = "image_data"
    request_id: RequestId
    seq: int = Field(ge=0)
    index: int = Field(ge=0)
    png: bytes | None = None
    url: str | None = None
    last: bool = True


class ImageResult(WireModel):
    """The end of an image request: every image was sent."""

    kind: Literal["images"] = "images"
    request_id: RequestId
    seq: int = Field(ge=0)
    model: str
    num_images: int = Field(ge=0)
    width: int = Field(ge=1)
    height: int = Field(ge=1)
    # The seed the first image was drawn with (image i used seed + i): the request can be reproduced.
    seed: int = Field(ge=0)


class AliveAnswer(WireModel):
    """A receiver's answer to a liveness probe on `{inbox}.alive` (an empty answer also means alive).

    `next_seq` lets a sender fill a gap: after a NATS reconnect, or when the receiver says frames after it
    arrived (`missing`: the frame was lost, e.g. with a cluster node), it sends again every frame from there.
    `closed`: the client reads many inboxes through one subscription and no longer reads this one; the sender
    stops as it does when nobody answers at all."""

    next_seq: int = Field(ge=0)
    missing: bool = False
    closed: bool = False


ReplyFrame = Annotated[
    TokenChunk | Heartbeat | FinalFrame | ErrorFrame | EmbeddingResult | ImageProgress | ImageData | ImageResult,
    Field(discriminator="kind"),
]
REPLY_FRAME = TypeAdapter(ReplyFrame)
TerminalFrame = FinalFrame | ErrorFrame | EmbeddingResult | ImageResult
