"""OpenAI-compatible HTTP gateway: a process of its own and an ordinary NATS client of the pipeline.

Serves `/v1/chat/completions`, `/v1/completions` (streaming over SSE, with
`stream_options.include_usage`, or whole responses), `/v1/embeddings`, `/v1/images/generations`
(`b64_json` or `url`), `/v1/models` (the models the registry shows ready, LoRA adapters with their `parent`),
`/health`, `/metrics` (this process's Prometheus series), and with `allow_lora_updates` vLLM's
`/v1/load_lora_adapter` and `/v1/unload_lora_adapter`. Each HTTP request becomes one `ChatRequest` /
`CompletionRequest` published to `{ns}.work.processor` with its own reply inbox; the reply frames are turned back
into OpenAI JSON. Chat answers to requests with tools, and with `reasoning_parser` any chat answer, are read here
for `tool_calls` and `reasoning_content` (workers/output_parsing.py).

Fails how: pipeline error frames map onto the status codes OpenAI clients expect (400 invalid
request, context too long or unsupported option; 404 unknown model; 503 overloaded or worker lost,
with Retry-After; 504 when no first frame arrives in time; 500 otherwise), in OpenAI's error JSON.
A client that disconnects mid-stream has its request cancelled through the control subject.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from contextlib import asynccontextmanager
from typing import Any

import structlog
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from bus.client import PipelineClient
from bus.errors import RejectRequest, RemoteError, ReplyGap, ReplyStreamBroken
from bus.lifecycle import note_work, stop_tasks
from bus.registry import RegistryView, ready_models, served_adapters
from bus.replies import ReplyStream
from bus.tracing import TraceContext
from schemas.client import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    ImageRequest,
    NamedToolChoice,
    ResponseFormat,
    StreamFormat,
    ToolSpec,
)
from schemas.control import LoraAdapter
from schemas.registry import Stage, WorkerCard
from schemas.replies import EmbeddingResult, ErrorCode, FinalFrame, ImageResult, TokenChunk, TokenLogprob, Usage
from workers.http import metrics
from workers.output_parsing import OutputParser, ParsedDelta, ToolFormat

log = structlog.get_logger(__name__)

_STATUS = {
    ErrorCode.INVALID_REQUEST: 400, ErrorCode.CONTEXT_LENGTH_EXCEEDED: 400, ErrorCode.UNSUPPORTED: 400,
    ErrorCode.UNKNOWN_MODEL: 404, ErrorCode.OVERLOADED: 503, ErrorCode.WORKER_LOST: 503,
    ErrorCode.TIMEOUT: 504, ErrorCode.INTERNAL: 500,
}
_MODELS_REFRESH_S = 1.0


class StreamOptions(BaseModel):
    include_usage: bool = False


class NvExtRouter(BaseModel):
    model_config = ConfigDict(extra="ignore")
    ttft_target: float | None = None
    itl_target: float | None = None


class NvExtAgentHints(BaseModel):
    model_config = ConfigDict(extra="ignore")
    priority: int | None = None


class NvExt(BaseModel):
    """The part of Dynamo's `nvext` extension read here: pool selection targets and priority (ms)."""

    model_config = ConfigDict(extra="ignore")
    router: NvExtRouter | None = None
    agent_hints: NvExtAgentHints | None = None

    def targets(self) -> dict[str, Any]:
        fields = {"ttft_target_ms": self.router.ttft_target if self.router else None,
                  "itl_target_ms": self.router.itl_target if self.router else None,
                  "priority": self.agent_hints.priority if self.agent_hints else None}
        return {name: value for name, value in fields.items() if value is not None}


class _OpenAIBody(BaseModel):
    """Fields both endpoints accept. Unknown fields are ignored, as OpenAI's own server does."""

    model_config = ConfigDict(extra="ignore")

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    # Extensions SGLang and vLLM accept too.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    session_id: str | None = None
    close_session: bool = False
    priority: int | None = None
    # Pool selection targets (bus/pools.py); Dynamo's clients send them as nvext.router.{ttft,itl}_target and
    # nvext.agent_hints.priority, read too.
    ttft_target_ms: float | None = None
    itl_target_ms: float | None = None
    nvext: NvExt | None = None

    def generation_fields(self) -> dict[str, Any]:
        fields = self.model_dump(exclude={"model", "stream", "stream_options", "max_completion_tokens", "messages",
                                          "prompt", "logprobs", "top_logprobs", "response_format", "nvext"},
                                 exclude_none=True)
        if self.nvext is not None:
            fields = self.nvext.targets() | fields  # the plain fields win
        max_tokens = self.max_completion_tokens or self.max_tokens
        return {**fields, "max_tokens": max_tokens} if max_tokens is not None else fields


class ChatBody(_OpenAIBody):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int = 0
    response_format: ResponseFormat | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: str | NamedToolChoice | None = None

    def output_parser(self, reasoning: bool, tool_format: ToolFormat) -> OutputParser | None:
        """How the answer's text is read back: tool calls (in the model's format; a constrained call is plain JSON)
        when tools may be called, reasoning when configured."""
        calls = None
        if self.tools and self.tool_choice != "none":
            calls = tool_format if self.tool_choice in (None, "auto") else ToolFormat.JSON
        return OutputParser(calls, reasoning) if calls is not None or reasoning else None


class CompletionBody(_OpenAIBody):
    prompt: str | list[int]
    logprobs: int | None = None
    best_of: int | None = None


class EmbeddingBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str = "float"
    dimensions: int | None = None


class ImageBody(BaseModel):
    """OpenAI's image-generation body, with the diffusion knobs SGLang's and Dynamo's servers take."""

    model_config = ConfigDict(extra="ignore")

    model: str
    prompt: str
    n: int = 1
    size: str = "auto"
    response_format: str = "b64_json"
    seed: int | None = None
    negative_prompt: str | None = None
    num_inference_steps: int = 50
    guidance_scale: float = 7.5


@dataclass(frozen=True, slots=True)
class GatewayOptions:
    host: str = "0.0.0.0"
    port: int = 8000
    # Longest wait for the first frame of a reply (the request may queue behind others).
    first_token_timeout_s: float = 120.0
    # On shutdown, how long open responses may run before they are cut (and their requests cancelled).
    shutdown_grace_s: float = 30.0
    # Split an answer's leading <think>...</think> into `reasoning_content` (reasoning models).
    reasoning_parser: bool = False
    # Serve /v1/load_lora_adapter and /v1/unload_lora_adapter (off: anyone reaching the API could change models).
    allow_lora_updates: bool = False
    # How models write tool calls (`auto` tool choice): this format, unless the model has one of its own here.
    tool_call_parser: ToolFormat = ToolFormat.HERMES
    tool_call_parsers: dict[str, ToolFormat] = field(default_factory=dict)
    # Share the port with other gateway processes (SO_REUSEPORT, Linux): the kernel spreads connections over them.
    reuse_port: bool = False

    def tool_format(self, model: str) -> ToolFormat:
        return self.tool_call_parsers.get(model, self.tool_call_parser)


class LoadLoraBody(BaseModel):
    lora_name: str
    lora_path: str
    base_model: str | None = None
    timeout_s: float = Field(default=60.0, gt=0, le=600)


class UnloadLoraBody(BaseModel):
    lora_name: str


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.retry_after_s = status, message, kind, code, retry_after_s

    def response(self) -> web.Response:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s else None
        return web.json_response(self.body(), status=self.status, headers=headers)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": None, "code": self.code}}

    @classmethod
    def of_remote(cls, error: RemoteError) -> OpenAIError:
        status = _STATUS.get(error.code, 500)
        kind = "invalid_request_error" if status < 500 else "server_error"
        return cls(status, error.frame.message, kind, error.code.value, retry_after_s=1 if status == 503 else None)

    @classmethod
    def of_rejection(cls, rejection: RejectRequest) -> OpenAIError:
        """Refused before it entered the pipeline (its queue is full, it is too large)."""
        status = _STATUS.get(rejection.code, 500)
        kind = "invalid_request_error" if status < 500 else "server_error"
        return cls(status, rejection.message, kind, rejection.code.value,
                   retry_after_s=1 if rejection.retryable else None)


class Gateway:
    def __init__(self, client: PipelineClient, options: GatewayOptions) -> None:
        self._client = client
        self._options = options
        self._view = RegistryView(client.live_workers, refresh_after_s=_MODELS_REFRESH_S,
                                  stale_limit_s=client.registry_ttl_s)
        # The ready models of the view's last cards (worked out again only when the view has new ones).
        self._ready_of: tuple[list[WorkerCard], dict[str, Any]] | None = None
        self.app = web.Application(middlewares=[self._errors])
        self.app.add_routes([
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/v1/completions", self.completions),
            web.post("/v1/embeddings", self.embeddings),
            web.post("/v1/images/generations", self.images),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.get("/metrics", metrics),  # this process's own: its event loop's lag, its garbage collections
        ])
        if options.allow_lora_updates:
            self.app.add_routes([web.post("/v1/load_lora_adapter", self.load_lora),
                                 web.post("/v1/unload_lora_adapter", self.unload_lora)])

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        note_work()  # this process's loop stays warm for the next request (bus/lifecycle.py)
        try:
            return await handler(request)
        except OpenAIError as error:
            return error.response()
        except RejectRequest as rejection:
            return OpenAIError.of_rejection(rejection).response()

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "ready_models": sorted(await self._ready_models(max_age_s=0.0))})

    async def models(self, request: web.Request) -> web.Response:
        cards = await self._client.live_workers()
        adapters = served_adapters(cards)
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "conveyor", "root": adapters.get(name, name),
                 "parent": adapters.get(name)} for name in sorted(ready_models(cards))]
        return web.json_response({"object": "list", "data": data})

    async def load_lora(self, request: web.Request) -> web.Response:
        """vLLM's route: serve a LoRA adapter on every LLM worker of `base_model` (default: the one served)."""
        body = await _parse(request, LoadLoraBody)
        bases = sorted({c.model for c in await self._client.live_workers() if c.stage in (Stage.DECODE, Stage.PREFILL)})
        base = body.base_model or (bases[0] if len(bases) == 1 else None)
        if base is None:
            raise OpenAIError(400, f"name the adapter's base_model (LLM workers serve: {', '.join(bases) or 'none'})")
        adapter = _build(LoraAdapter, name=body.lora_name, base_model=base, path=body.lora_path)
        rollout = await self._client.load_lora(adapter, body.timeout_s)
        if rollout.refused:
            raise OpenAIError(400, f"no worker could load {body.lora_name!r}: {rollout.failures()}")
        self._view.invalidate()  # the next request sees the adapter
        return web.json_response({"status": "success", "lora_name": adapter.name, "base_model": base,
                                  "loaded_on": rollout.done, "failed_on": rollout.failed, "pending_on": rollout.pending})

    async def unload_lora(self, request: web.Request) -> web.Response:
        body = await _parse(request, UnloadLoraBody)
        rollout = await self._client.unload_lora(body.lora_name)
        if rollout is None:
            raise OpenAIError(404, f"no LoRA adapter named {body.lora_name!r} is served", code="model_not_found")
        self._view.invalidate()
        return web.json_response({"status": "success", "lora_name": body.lora_name, "unloaded_on": rollout.done,
                                  "pending_on": rollout.pending})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await _parse(request, ChatBody)
        await self._require_model(body.model)
        message = _build(
            ChatRequest, request_id=f"chatcmpl-{uuid.uuid4().hex[:24]}", reply_to=self._client.new_inbox(),
            model=body.model, messages=body.messages, stream_format=StreamFormat.OPENAI, logprobs=body.logprobs,
            top_logprobs=body.top_logprobs, response_format=body.response_format, **body.generation_fields(),
        )
        parser = body.output_parser(self._options.reasoning_parser, self._options.tool_format(body.model))
        if parser is not None and body.n > 1:
            raise OpenAIError(400, "n > 1 cannot be combined with tools or the reasoning parser here")
        return await self._serve(request, message, body, chat=True, parser=parser)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await _parse(request, CompletionBody)
        await self._require_model(body.model)
        message = _build(
            CompletionRequest, request_id=f"cmpl-{uuid.uuid4().hex[:24]}", reply_to=self._client.new_inbox(),
            model=body.model, prompt=body.prompt, stream_format=StreamFormat.TEXT, logprobs=bool(body.logprobs),
            top_logprobs=body.logprobs or 0, **body.generation_fields(),
        )
        return await self._serve(request, message, body, chat=False)

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await _parse(request, EmbeddingBody)
        await self._require_model(body.model)
        message = _build(EmbeddingRequest, request_id=f"embd-{uuid.uuid4().hex[:24]}", reply_to=self._client.new_inbox(),
                         model=body.model, input=body.input, encoding_format=body.encoding_format,
                         dimensions=body.dimensions)
        stream = await self._client.submit(message, first_frame_timeout_s=self._options.first_token_timeout_s,
                                           trace=TraceContext.from_headers(request.headers))
        async with stream:
            _, result = await _collect(stream)
        if not isinstance(result, EmbeddingResult):
            raise OpenAIError(500, "the embedding worker answered without vectors", "server_error")
        data = [{"object": "embedding", "index": item.index,
                 "embedding": base64.b64encode(item.vector).decode() if isinstance(item.vector, bytes) else item.vector}
                for item in result.data]
        usage = {"prompt_tokens": result.usage.prompt_tokens, "total_tokens": result.usage.prompt_tokens}
        return web.json_response({"object": "list", "data": data, "model": result.model, "usage": usage},
                                 headers={"x-request-id": message.request_id})

    async def images(self, request: web.Request) -> web.Response:
        body = await _parse(request, ImageBody)
        await self._require_model(body.model)
        message = _build(ImageRequest, request_id=f"img-{uuid.uuid4().hex[:24]}", reply_to=self._client.new_inbox(),
                         **body.model_dump())
        async with await self._client.submit(message, first_frame_timeout_s=self._options.first_token_timeout_s,
                                             trace=TraceContext.from_headers(request.headers)) as stream:
            async with _as_http_errors():
                images, result = await stream.collect_images()
        if not isinstance(result, ImageResult):
            raise OpenAIError(500, "the image request was cancelled", "server_error")
        data = [{"url": image} if isinstance(image, str) else {"b64_json": base64.b64encode(image).decode()}
                for image in images]
        return web.json_response({"created": int(time.time()), "data": data},
                                 headers={"x-request-id": message.request_id, "x-image-seed": str(result.seed)})

    async def _serve(self, http: web.Request, message: ChatRequest | CompletionRequest, body: _OpenAIBody,
                     chat: bool, parser: OutputParser | None = None) -> web.StreamResponse:
        trace = TraceContext.from_headers(http.headers)  # the HTTP client's traceparent, if it sent one
        structlog.contextvars.bind_contextvars(request_id=message.request_id, trace_id=trace.trace_id)
        stream = await self._client.submit(message, first_frame_timeout_s=self._options.first_token_timeout_s,
                                           trace=trace)
        shape = _Shape(message.request_id, body.model, chat, parser)
        try:
            async with stream:
                if body.stream:
                    return await self._stream(http, stream, shape, include_usage=bool(body.stream_options and body.stream_options.include_usage))
                return await self._whole(stream, shape)
        finally:
            if not stream.ended:
                # Left before the answer ended (client gone, gateway stopping, a broken stream): stop the
                # generation wherever it is, even while this handler is being cancelled.
                await asyncio.shield(self._cancel_quietly(message.request_id))

    async def _cancel_quietly(self, request_id: str) -> None:
        try:
            await self._client.cancel(request_id, "HTTP client disconnected")
        except Exception as error:  # NATS away: the worker's liveness probe of the inbox ends it instead
            log.warning("gateway.cancel_failed", error=repr(error))

    async def _whole(self, stream: ReplyStream, shape: _Shape) -> web.Response:
        chunks, final = await _collect(stream)
        assert isinstance(final, FinalFrame)
        return web.json_response(shape.whole(chunks, final), headers={"x-request-id": shape.request_id})

    async def _stream(self, http: web.Request, stream: ReplyStream, shape: _Shape, include_usage: bool) -> web.StreamResponse:
        chunks = stream.__aiter__()
        async with _as_http_errors():  # errors before the first token still get a status code
            try:
                first: TokenChunk | None = await chunks.__anext__()
            except StopAsyncIteration:
                first = None
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "x-request-id": shape.request_id})
        await response.prepare(http)
        try:
            if first is not None:
                await _send_unless_empty(response, shape.chunk(first))
                async for chunk in chunks:
                    await _send_unless_empty(response, shape.chunk(chunk))
            final = stream.terminal
            assert isinstance(final, FinalFrame)
            for event in shape.finish(final):
                await _send(response, event)
            if include_usage:
                await _send(response, shape.usage_chunk(final.usage))
            await response.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, ConnectionError):
            # The HTTP client went away: `_serve` cancels the request, which has no terminal frame.
            log.info("gateway.client_disconnected")
            return response
        except RemoteError as error:
            await _send(response, OpenAIError.of_remote(error).body())
        except (ReplyStreamBroken, ReplyGap) as error:
            await _send(response, OpenAIError(504, str(error), "server_error", "timeout").body())
        await response.write_eof()
        return response

    async def keep_models_fresh(self) -> None:
        """Read the registry every half TTL while serving (bus/registry.py: RegistryView.keep_fresh)."""
        await self._view.keep_fresh(self._client.registry_ttl_s / 2)

    async def _ready_models(self, max_age_s: float | None = None) -> dict[str, Any]:
        """Ready models, from the registry view (bus/registry.py: RegistryView); with `max_age_s`, one read at most
        that long ago."""
        cards = await self._view.cards(max_age_s)
        if self._ready_of is None or self._ready_of[0] is not cards:
            self._ready_of = (cards, dict(ready_models(cards)))
        return self._ready_of[1]

    async def _require_model(self, model: str) -> None:
        # Absent only on a fresh view: the cached one may predate the model's workers getting ready.
        if model not in await self._ready_models() and model not in await self._ready_models(max_age_s=0.0):
            raise OpenAIError(404, f"The model `{model}` does not exist or no ready workers serve it",
                              "invalid_request_error", "model_not_found")


class _Shape:
    """Reply frames as OpenAI JSON: chat.completion(.chunk) or text_completion. With a parser (tools, reasoning) the
    chat chunks are made here from the text; otherwise the decode worker's own chunks go out as they are."""

    def __init__(self, request_id: str, model: str, chat: bool, parser: OutputParser | None = None) -> None:
        self.request_id, self.model, self.chat, self.parser = request_id, model, chat, parser
        self.created = int(time.time())
        # Completions' logprobs count characters from the start of each choice's answer.
        self._text_offsets: dict[int, int] = {}
        # Choices seen in the stream (n > 1), each ended with its own finish event.
        self._indexes: set[int] = set()

    def chunk(self, chunk: TokenChunk) -> dict[str, Any] | bytes | None:
        """The SSE event of one chunk: a dict to serialize, or (the decode worker's own OpenAI chunk as it is) its JSON."""
        self._indexes.add(chunk.index)
        if self.chat and self.parser is not None:
            event = self._parsed_chunk(self.parser.feed(chunk.text or ""), None)
        elif self.chat:
            if chunk.openai is None:
                raise OpenAIError(500, "the decode worker sent no OpenAI chunk", "server_error")
            if chunk.openai.id == self.request_id and not chunk.logprobs:
                # Serialized by pydantic in one step: a dump then json.dumps cost twice as much, per token.
                return chunk.openai.model_dump_json(exclude={"usage"}).encode()
            event = chunk.openai.model_dump(mode="json", exclude={"usage"}) | {"id": self.request_id}
        else:
            event = {"id": self.request_id, "object": "text_completion", "created": self.created, "model": self.model,
                     "choices": [{"index": chunk.index, "text": chunk.text or "", "finish_reason": None,
                                  "logprobs": None}]}
        if event is not None and chunk.logprobs:
            event["choices"][0]["logprobs"] = self._logprobs(chunk.logprobs, chunk.index)
        return event

    def _logprobs(self, entries: list[TokenLogprob], index: int) -> dict[str, Any]:
        """OpenAI's logprobs object: chat's `content` list, or completions' parallel lists with text offsets."""
        if self.chat:
            return {"content": [_chat_logprob(entry) for entry in entries]}
        tokens = [entry.token or "" for entry in entries]
        offsets = []
        for token in tokens:
            offsets.append(self._text_offsets.get(index, 0))
            self._text_offsets[index] = offsets[-1] + len(token)
        return {"tokens": tokens, "token_logprobs": [entry.logprob for entry in entries],
                "top_logprobs": [{top.token or "": top.logprob for top in entry.top} for entry in entries],
                "text_offset": offsets}

    def finish(self, final: FinalFrame) -> list[dict[str, Any]]:
        """The events that end a stream, before the usage chunk: the text the parser held back and the finish reason
        (the decode worker's last chunk carries it when there is no parser)."""
        if not self.chat:
            return [{"id": self.request_id, "object": "text_completion", "created": self.created, "model": self.model,
                     "choices": [{"index": index, "text": "", "finish_reason": _openai_reason(final), "logprobs": None}]}
                    for index in sorted(self._indexes) or [0]]
        if self.parser is None:
            return []
        held = self._parsed_chunk(self.parser.finish(), None)
        return [*([held] if held else []), self._parsed_chunk(None, self._reason(final))]  # type: ignore[list-item]

    def _parsed_chunk(self, delta: ParsedDelta | None, reason: str | None) -> dict[str, Any] | None:
        if delta is not None and not delta:
            return None
        fields: dict[str, Any] = {}
        if delta is not None:
            fields |= {"content": delta.content} if delta.content else {}
            fields |= {"reasoning_content": delta.reasoning} if delta.reasoning else {}
            fields |= {"tool_calls": delta.tool_calls} if delta.tool_calls else {}
        return {"id": self.request_id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "delta": fields, "finish_reason": reason, "logprobs": None}]}

    def _reason(self, final: FinalFrame) -> str:
        called = self.parser is not None and self.parser.num_calls and final.finish_reason.value == "stop"
        return "tool_calls" if called else _openai_reason(final)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model, "choices": [],
                "usage": _usage(usage)}

    def whole(self, chunks: list[TokenChunk], final: FinalFrame) -> dict[str, Any]:
        """The whole response: one choice per `index` the chunks carry (n > 1), in order."""
        by_index: dict[int, list[TokenChunk]] = {}
        for chunk in chunks:
            by_index.setdefault(chunk.index, []).append(chunk)
        choices = [self._whole_choice(index, by_index.get(index, []), final) for index in sorted(by_index) or [0]]
        return {"id": self.request_id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": _usage(final.usage)}

    def _whole_choice(self, index: int, chunks: list[TokenChunk], final: FinalFrame) -> dict[str, Any]:
        text = "".join(chunk.text or "" for chunk in chunks)
        entries = [entry for chunk in chunks for entry in chunk.logprobs or []]
        shaped = self._logprobs(entries, index) if entries else None
        # Each choice's own reason where the worker sent one (its OpenAI finish chunk), else the request's.
        own = next((c.openai.choices[0].finish_reason for c in reversed(chunks)
                    if c.openai is not None and c.openai.choices and c.openai.choices[0].finish_reason), None)
        if self.chat:
            message = self._message(text)  # first: it counts the tool calls the reason depends on
            reason = self._reason(final) if own is None or self.parser is not None else _openai_reason_of(own)
            return {"index": index, "message": message, "finish_reason": reason, "logprobs": shaped}
        return {"index": index, "text": text, "finish_reason": _openai_reason(final), "logprobs": shaped}

    def _message(self, text: str) -> dict[str, Any]:
        if self.parser is None:
            return {"role": "assistant", "content": text}
        parsed = self.parser.feed(text)
        rest = self.parser.finish()
        content, reasoning = parsed.content + rest.content, parsed.reasoning + rest.reasoning
        calls = [{key: value for key, value in call.items() if key != "index"} for call in parsed.tool_calls + rest.tool_calls]
        return ({"role": "assistant", "content": content or (None if calls else "")}
                | ({"reasoning_content": reasoning} if reasoning else {}) | ({"tool_calls": calls} if calls else {}))


def _chat_logprob(entry: TokenLogprob) -> dict[str, Any]:
    token = entry.token or ""
    return {"token": token, "logprob": entry.logprob, "bytes": list(token.encode()),
            "top_logprobs": [{"token": top.token or "", "logprob": top.logprob, "bytes": list((top.token or "").encode())}
                             for top in entry.top]}


def _openai_reason(final: FinalFrame) -> str:
    return _openai_reason_of(final.finish_reason.value)


def _openai_reason_of(reason: str) -> str:
    # OpenAI has no "cancelled"; a cancelled request's client is usually gone anyway.
    return {"cancelled": "stop", "error": "stop"}.get(reason, reason)


def _usage(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


async def _send_unless_empty(response: web.StreamResponse, event: dict[str, Any] | bytes | None) -> None:
    if event is not None:
        await _send(response, event)


async def _send(response: web.StreamResponse, event: dict[str, Any] | bytes) -> None:
    """One SSE event: a dict, or JSON already serialized."""
    data = event if isinstance(event, bytes) else json.dumps(event, separators=(",", ":")).encode()
    await response.write(b"data: " + data + b"\n\n")


async def _collect(stream: ReplyStream) -> tuple[list[TokenChunk], FinalFrame | EmbeddingResult | ImageResult]:
    """The whole reply; an error frame or a broken stream as the HTTP error it means."""
    async with _as_http_errors():
        return await stream.collect()


@asynccontextmanager
async def _as_http_errors() -> AsyncIterator[None]:
    """An error frame or a broken reply stream as the HTTP error it means."""
    try:
        yield
    except RemoteError as error:
        raise OpenAIError.of_remote(error) from None
    except (ReplyStreamBroken, ReplyGap) as error:
        raise OpenAIError(504, str(error), "server_error", "timeout") from None


async def _parse(request: web.Request, model: type[BaseModel]) -> Any:
    try:
        return model.model_validate(await request.json())
    except json.JSONDecodeError:
        raise OpenAIError(400, "the body is not valid JSON") from None
    except ValidationError as error:
        raise OpenAIError(400, _summary(error)) from None


def _build(request_type: type[Any], **fields: Any) -> Any:
    """The pipeline request, its schema's range checks answered as HTTP 400."""
    try:
        return request_type(**fields)
    except ValidationError as error:
        raise OpenAIError(400, _summary(error)) from None


def _summary(error: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors()[:5])


@asynccontextmanager
async def serving(client: PipelineClient, options: GatewayOptions) -> AsyncIterator[int]:
    """Serve while the block runs; gives the bound port."""
    gateway = Gateway(client, options)
    runner = web.AppRunner(gateway.app, access_log=None, shutdown_timeout=options.shutdown_grace_s)
    await runner.setup()
    site = web.TCPSite(runner, options.host, options.port, reuse_port=options.reuse_port or None)
    await site.start()
    server = site._server
    assert server is not None and server.sockets
    # The models' view read on a timer: a request after a quiet spell does not wait for a registry read.
    refresher = asyncio.create_task(gateway.keep_models_fresh(), name="registry-refresh")
    try:
        yield int(server.sockets[0].getsockname()[1])
    finally:
        await stop_tasks([refresher])
        await runner.cleanup()
