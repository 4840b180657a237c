"""What users publish to `{ns}.work.processor`: OpenAI-shaped chat, completion and embedding requests.

Every request names its `request_id` (also the `Nats-Msg-Id`, so a retried publish is deduplicated)
and its `reply_to` inbox, which travels in the payload because on a JetStream message `msg.reply`
is the ack subject. The `kind` field tells the three apart.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter

from schemas.base import WireModel
from schemas.sampling import (
    MaxTokens,
    MinP,
    MinTokens,
    NumCompletions,
    Penalty,
    RepetitionPenalty,
    Temperature,
    TopK,
    TopLogprobs,
    TopP,
)

RequestId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_\-:.]+$")]
# A NATS subject: tokens separated by dots, no wildcards or whitespace.
Inbox = Annotated[str, Field(min_length=1, max_length=255, pattern=r"^[^\s*>]+$")]


class StreamFormat(StrEnum):
    """What each reply chunk carries besides token ids."""

    TOKENS = "tokens"  # token ids only
    TEXT = "text"  # token ids and the detokenized text delta
    OPENAI = "openai"  # token ids, text, and an OpenAI `chat.completion.chunk`


class TextPart(WireModel):
    type: Literal["text"] = "text"
    text: str


class MediaUrl(WireModel):
    # http(s):// or file:// URL, or a data: URL with base64 content.
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(WireModel):
    type: Literal["image_url"] = "image_url"
    image_url: MediaUrl


class VideoPart(WireModel):
    type: Literal["video_url"] = "video_url"
    video_url: MediaUrl


ContentPart = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]


class FunctionSpec(WireModel):
    name: FunctionName
    description: str | None = None
    # JSON Schema of the arguments object.
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class ToolSpec(WireModel):
    """A tool the model may call (OpenAI's `tools` entries)."""

    type: Literal["function"] = "function"
    function: FunctionSpec


class ChosenFunction(WireModel):
    name: FunctionName


class NamedToolChoice(WireModel):
    """`tool_choice` naming the one function the model must call."""

    type: Literal["function"] = "function"
    function: ChosenFunction


class CalledFunction(WireModel):
    name: str
    # The arguments as a JSON text, as OpenAI sends them.
    arguments: str


class ToolCall(WireModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(WireModel):
    role: Literal["system", "user", "assistant", "tool"]
    # None for an assistant turn that only called tools.
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # An assistant turn's calls, and a tool turn's answer to one of them.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class ResponseFormat(WireModel):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: dict[str, Any] | None = None


SessionId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")]


class GenerationRequest(WireModel):
    """Fields shared by chat and completion requests, with OpenAI's names and ranges."""

    request_id: RequestId
    reply_to: Inbox
    model: str = Field(min_length=1)
    stream_format: StreamFormat = StreamFormat.TEXT
    max_tokens: MaxTokens = None
    min_tokens: MinTokens = 0
    temperature: Temperature = None
    top_p: TopP = None
    top_k: TopK = None
    min_p: MinP = None
    frequency_penalty: Penalty = None
    presence_penalty: Penalty = None
    repetition_penalty: RepetitionPenalty = None
    seed: int | None = None
    n: NumCompletions = 1
    # At most as many as the engines take (StopConditions).
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: TopLogprobs = 0
    response_format: ResponseFormat | None = None
    # Guided decoding beyond response_format (vLLM's and SGLang's extensions): at most one of the four.
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1, max_length=1024)] | None = None
    guided_grammar: str | None = None
    # Higher runs sooner where the engine supports priorities; also picks a pool (bus/pools.py).
    priority: int | None = None
    # Latency targets a deployment with several pools picks a pool by (Dynamo's `nvext.router`); 0: the fastest.
    ttft_target_ms: float | None = Field(default=None, ge=0)
    itl_target_ms: float | None = Field(default=None, ge=0)
    # A session keeps the conversation on one LLM worker: this request's prompt is appended to what the session
    # holds (earlier prompts and answers), whose KV stays cached there. A new id opens a session; `close_session`
    # ends it after this request. Aggregated serving, one request at a time per session.
    session_id: SessionId | None = None
    close_session: bool = False


class ChatRequest(GenerationRequest):
    kind: Literal["chat"] = "chat"
    messages: list[ChatMessage] = Field(min_length=1)
    tools: Annotated[list[ToolSpec], Field(max_length=128)] | None = None
    # None: "auto" when tools are given. "required" or a named function: the answer is constrained to a call.
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None


class CompletionRequest(GenerationRequest):
    """A raw prompt; token ids skip the chat template and the tokenizer."""

    kind: Literal["completion"] = "completion"
    prompt: str | list[int]
    # Candidates generated to return the n most likely (mean token log-probability); they arrive once all finished.
    best_of: NumCompletions | None = None


class EmbeddingRequest(WireModel):
    kind: Literal["embedding"] = "embedding"
    request_id: RequestId
    reply_to: Inbox
    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)


# "WIDTHxHEIGHT" in pixels, or "auto" (the model's own size); the image worker says which sizes it takes.
ImageSize = Annotated[str, Field(pattern=r"^(auto|[1-9][0-9]{1,4}x[1-9][0-9]{1,4})$")]


class ImageRequest(WireModel):
    """OpenAI's `/v1/images/generations`, with the diffusion knobs Dynamo's image worker takes."""

    kind: Literal["image"] = "image"
    request_id: RequestId
    reply_to: Inbox
    model: str = Field(min_length=1)
    prompt: str = Field(min_length=1, max_length=4000)
    negative_prompt: str | None = Field(default=None, max_length=4000)
    n: int = Field(default=1, ge=1, le=10)
    size: ImageSize = "auto"
    # b64_json: the PNG's bytes travel in the reply frames; url: the worker stores the PNG, the frame names it.
    response_format: Literal["b64_json", "url"] = "b64_json"
    # None draws a random seed (reported back), so a result can be reproduced.
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    num_inference_steps: int = Field(default=50, ge=1, le=500)
    guidance_scale: float = Field(default=7.5, ge=0.0, le=50.0)


ClientRequest = Annotated[ChatRequest | CompletionRequest | EmbeddingRequest | ImageRequest, Field(discriminator="kind")]
CLIENT_REQUEST = TypeAdapter(ClientRequest)
