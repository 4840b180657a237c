"""Processor stage: turn what users send into work for the engines.

Consumes `ChatRequest` / `CompletionRequest` / `EmbeddingRequest` (OpenAI shapes, msgpack) from
`{ns}.work.processor` — the subject any NATS client publishes to — and `ImageRequest`s. For each it applies the model's
chat template (chat), tokenizes (text prompts; token-id prompts skip both), validates, maps the
OpenAI fields onto sampling options and stop conditions, and routes by the model's serving mode,
read from the live worker cards: aggregated → `DecodeTask` on `{ns}.work.decode.{model}`,
disaggregated → `PrefillTask` on `{ns}.work.prefill.{model}`, embeddings → `EmbedTask`, images → `ImageTask`
on `{ns}.work.image.{model}` (no tokenizer: the image worker's pipeline has its own; a seed is drawn when none
was given). A chat with images
gets one placeholder token per image and goes to `{ns}.work.encode.{model}` (`EncodeTask`, naming prefill or
decode as the next stage, by the encode workers' mode) when encode workers are live, else, with its images, to an
LLM worker that encodes in-process (EPD).

Routing (`--router`, bus/router.py): `queue` leaves a text prompt's task on the stage's shared queue;
`kv` pins it to the replica of the prompt-running stage (decode aggregated, prefill disaggregated) whose
cached prefix, against its load, makes it cheapest (an index built from the KV-event stream);
`round-robin` and `random` pin without looking. With `--local-prefill-max-tokens N` (or `--prefill-busy-tokens N`:
every prefill replica that busy), a disaggregated model's prompt with at most N tokens left to compute runs on a
decode worker that can prefill itself (its decode pool's, else any pool's: SGLang's aggregated workers). A model served
by pools (`--pools FILE`, bus/pools.py) gets each stage's pool from the request's targets and priority. Tasks pinned
to a replica that dies go back to the shared queue. Requests with images use the shared queue (pools: `unsupported`).

A request whose `model` is a LoRA adapter a ready worker has loaded (its card lists it) runs on the adapter's base
model, with `lora_name` set; when only some replicas have it, the task is pinned to one of those. A request with a
`session_id` goes to the decode worker holding the session (`{ns}_sessions`), a new one to the replica the router
(or the least KV use) picks; a session whose worker stopped → `worker_lost` (its conversation is gone).

Emits to the client only errors; the stage that finishes the request streams the reply.

Fails how (each an error frame to the inbox, then ack; the processor goes on serving):
unknown model → `unknown_model`; token ids outside the vocabulary, or a request id another request
used within the dedupe window → `invalid_request`; empty input, or images for a text-only pipeline → `invalid_request`
/ `unsupported` (video: `unsupported`); a full next queue → `overloaded` (retryable); prompt not shorter than the context → `context_length_exceeded`; no live worker for
a stage the model's mode needs, nor one seen in the last three registry TTLs → `unknown_model` naming the
missing stage. Out-of-range sampling
values never reach here: the consumer answers them with `invalid_request` from the schema.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any

import structlog
from pydantic import ValidationError

from bus.consumer import Delivery
from bus.errors import RejectRequest
from bus.lifecycle import stop_tasks
from bus.metrics import POOL_CHOICES, QUEUE_SECONDS, REQUESTS
from bus.pools import PoolsConfig, RequestTargets
from bus.registry import REQUIRED_STAGES, RegistryView, served_adapters
from bus.router import Router, RouterOptions
from schemas.client import (
    CLIENT_REQUEST,
    ChatRequest,
    CompletionRequest,
    ChatMessage,
    EmbeddingRequest,
    ImageRequest,
    NamedToolChoice,
    GenerationRequest,
    ResponseFormat,
    TextPart,
    VideoPart,
)
from schemas.base import WireModel
from schemas.registry import ServingMode, Stage, WorkerCard
from schemas.replies import ErrorCode
from schemas.sampling import GuidedDecoding, OutputOptions, SamplingOptions, StopConditions
from schemas.tasks import (
    DecodeTask,
    EmbedTask,
    EncodeTask,
    ImageTask,
    MediaItem,
    PrefillTask,
    PreprocessedRequest,
    SessionRef,
    TaskHeader,
)
from workers.runtime import StageContext

log = structlog.get_logger(__name__)

# OpenAI's limit on inputs per embedding request (refused before tokenizing them).
MAX_EMBEDDING_INPUTS = 2048
# After this long the routing view of the registry is read again (in the background: bus/registry.py, RegistryView).
_REGISTRY_REFRESH_S = 1.0
# A request is refused for want of a worker only on a view this fresh: the cached one may predate a
# worker that just registered.
_FRESH_VIEW_S = 0.05


@dataclass(frozen=True, slots=True)
class ServedModel:
    name: str
    tokenizer: Any
    context_length: int
    eos_token_ids: tuple[int, ...]
    # The tokens put where an image goes, the encoder's placeholder among them (None: a text-only model).
    image_tokens: tuple[int, ...] | None = None
    # Token ids a client may send are below this (None: not checked).
    vocab_size: int | None = None

    def check_token_ids(self, token_ids: list[int]) -> None:
        """Refuse ids the model has no embedding for: an engine would fail on them (or, at 10^6 and
        up, take them for image pads)."""
        if self.vocab_size is None:
            return
        bad = next((token for token in token_ids if not 0 <= token < self.vocab_size), None)
        if bad is not None:
            raise RejectRequest(ErrorCode.INVALID_REQUEST,
                                f"token id {bad} is outside the vocabulary of {self.name} (0 to {self.vocab_size - 1})")


class ProcessorStage:
    task_type = CLIENT_REQUEST
    accepts_media = False
    journals_replies = False

    def __init__(self, models: dict[str, ServedModel], router: RouterOptions = RouterOptions(),
                 pools: PoolsConfig | None = None) -> None:
        self._models = models
        self._router_options = router
        self._pools = pools
        self._router: Router | None = None
        self._context: StageContext | None = None
        self._view: RegistryView | None = None
        # Each (model, stage) ever seen with a ready worker, and since when the registry has shown none
        # (absent: it shows one now).
        self._seen_ready: set[tuple[str, Stage]] = set()
        self._missing_since_s: dict[tuple[str, Stage], float] = {}
        self._ready_grace_s = 30.0
        self._watcher: asyncio.Task[None] | None = None
        self._follower: asyncio.Task[None] | None = None

    @property
    def engine(self) -> None:
        return None

    @property
    def consumes_model(self) -> None:
        return None

    async def start(self, context: StageContext) -> None:
        self._context = context
        self._ready_grace_s = 3 * context.settings.registry_ttl_s
        self._router = context.make_router(self._router_options)
        await self._router.start()
        self._view = RegistryView(context.list_workers, refresh_after_s=_REGISTRY_REFRESH_S,
                                  stale_limit_s=context.settings.registry_ttl_s, on_read=self._remember_ready)
        self._watcher = asyncio.create_task(self._watch_registry(context.settings.registry_ttl_s / 2))
        if context.registry_changes is not None:
            # Routing on the watched cards: a request after a quiet spell does not wait for a registry read, and a
            # worker that just registered is seen within milliseconds (a view kept by a timer hid it for seconds).
            self._follower = asyncio.create_task(
                self._view.follow(context.registry_changes, context.settings.registry_ttl_s))

    async def stop(self) -> None:
        await stop_tasks([task for task in (self._watcher, self._follower) if task is not None])
        if self._router is not None:
            await self._router.stop()

    async def _watch_registry(self, interval_s: float) -> None:
        """Keep the view of ready stages fresh between requests, so a replica that has routed nothing yet
        still knows which stages were ready just before a registry outage."""
        assert self._view is not None
        while True:
            try:
                # The watch's cards while it is trusted, else a read: no registry read every half TTL beside a
                # live watch, and never a view old enough to forget a worker that registered since.
                cards = await self._view.latest()
                self._remember_ready(cards)
                if self._router is not None:
                    # Gone workers leave the index, and their pinned tasks go back to the shared queue.
                    self._router.forget_gone(cards)
            except Exception as error:  # the registry is recovering; the next look will do
                log.debug("processor.registry_unreadable", error=repr(error))
            await asyncio.sleep(interval_s)

    async def canary(self) -> None:
        for model in self._models.values():
            if not model.tokenizer.encode("canary"):
                raise RuntimeError(f"tokenizer of {model.name} produced no tokens")

    async def handle(self, request: ChatRequest | CompletionRequest | EmbeddingRequest | ImageRequest,
                     delivery: Delivery) -> None:
        assert self._context is not None
        QUEUE_SECONDS.labels(stage=Stage.PROCESSOR.value).observe(delivery.queued_s)
        if isinstance(request, ImageRequest):
            await self._route_image(request, time.time() - delivery.queued_s, delivery)
            REQUESTS.labels(stage=Stage.PROCESSOR.value, model=request.model, outcome="routed").inc()
            return
        model, lora_name = await self._model_of(request.model)
        created_at_s = time.time() - delivery.queued_s
        if isinstance(request, EmbeddingRequest):
            if lora_name is not None:
                raise RejectRequest(ErrorCode.UNSUPPORTED, f"{lora_name!r} is a LoRA adapter: adapters serve generation")
            await self._route_embedding(request, model, created_at_s, delivery)
        else:
            await self._route_generation(request, model, created_at_s, delivery, lora_name)
        REQUESTS.labels(stage=Stage.PROCESSOR.value, model=model.name, outcome="routed").inc()

    async def _model_of(self, name: str) -> tuple[ServedModel, str | None]:
        """The served model a request names, and the LoRA adapter when it names one (run on its base model)."""
        model = self._models.get(name)
        if model is not None:
            return model, None
        # A fresh view when the cached one lacks the adapter: it may have been loaded since.
        for max_age_s in (None, 0.0):
            base = served_adapters(await self._live_cards(max_age_s)).get(name)
            if base in self._models:
                return self._models[base], name
        raise RejectRequest(ErrorCode.UNKNOWN_MODEL,
                            f"model {name!r} is not served here; served: {', '.join(sorted(self._models))}")

    async def _route_generation(self, request: ChatRequest | CompletionRequest, model: ServedModel,
                                created_at_s: float, delivery: Delivery, lora_name: str | None = None) -> None:
        assert self._context is not None
        token_ids, media = self._tokenize(request, model)
        try:
            preprocessed = preprocess(request, token_ids, model).model_copy(update={"media": media,
                                                                                    "lora_name": lora_name})
        except ValidationError as error:
            # Fields valid one by one that do not fit together (min_tokens above max_tokens, ...).
            raise RejectRequest(ErrorCode.INVALID_REQUEST, "; ".join(
                f"{'.'.join(str(part) for part in detail['loc']) or 'request'}: {detail['msg']}"
                for detail in error.errors()[:5])) from error
        header = TaskHeader(request_id=request.request_id, reply_to=request.reply_to,
                            stream_format=request.stream_format, created_at_s=created_at_s)
        if request.session_id is not None:
            await self._route_session(request, header, preprocessed, model, delivery)
            return
        if media:
            await self._route_multimodal(header, preprocessed, model, delivery)
            return
        mode = await self._mode_of(model.name)
        assert self._router is not None
        cards = await self._live_cards()
        targets = RequestTargets(len(token_ids), request.ttft_target_ms, request.itl_target_ms, request.priority)
        # The pools (bus/pools.py) each stage's task goes to, the first with a ready worker, then those to retry on.
        decode_pools = self._pools_for(model.name, mode, Stage.DECODE, targets, cards)
        prefill_pools = (self._pools_for(model.name, mode, Stage.PREFILL, targets, cards)
                         if mode == ServingMode.DISAGGREGATED else [])
        # The stage that runs the prompt is the one whose prefix cache a router can aim at; a short prompt of a
        # disaggregated model may skip the prefill stage (conditional disaggregation).
        local = (self._router.local_prefill(model.name, token_ids, cards, _first(decode_pools), _first(prefill_pools))
                 if mode == ServingMode.DISAGGREGATED else None)
        if mode == ServingMode.DISAGGREGATED and local is None:
            stage, pools = Stage.PREFILL, prefill_pools
        elif local is not None and local.pool != _first(decode_pools):
            stage, pools = Stage.DECODE, [local.pool] if local.pool is not None else []
        else:
            stage, pools = Stage.DECODE, decode_pools
        route = self._router.route(stage, model.name, token_ids, cards, lora_name, pool=_first(pools))
        predicted = route.predicted_cached_tokens if route is not None else None
        task: DecodeTask | PrefillTask = (
            PrefillTask(header=header, request=preprocessed, predicted_cached_tokens=predicted,
                        retry_pools=pools[1:], decode_pools=decode_pools)
            if stage == Stage.PREFILL else
            DecodeTask(header=header, request=preprocessed, predicted_cached_tokens=predicted, retry_pools=pools[1:]))
        await self._forward(stage, task, request.request_id, delivery, model.name,
                            worker_id=route.worker_id if route is not None else None, pool=_first(pools))
        log.info("processor.routed", to=stage.value, prompt_tokens=len(token_ids), mode=mode.value,
                 worker_id=route.worker_id if route is not None else None, pool=_first(pools))

    def _pools_for(self, model: str, mode: ServingMode, stage: Stage, targets: RequestTargets,
                   cards: list[WorkerCard]) -> list[str]:
        """The pool of `stage` this request goes to — the grid's choice, or the first of the faster ones it may
        retry on that has a ready worker — then the rest of those (empty: the model has no pools)."""
        config = self._pools.of(model) if self._pools is not None else None
        if config is None:
            return []
        grid = (config.aggregated if mode == ServingMode.AGGREGATED
                else config.prefill if stage == Stage.PREFILL else config.decode)
        if grid is None:
            return []
        order = grid.choose(targets, config.defaults)
        staffed = {c.pool for c in cards if c.stage == stage and c.model == model and c.ready}
        for index, pool in enumerate(order):
            if pool in staffed:
                POOL_CHOICES.labels(stage=stage.value, pool=pool, why="chosen" if index == 0 else "faster").inc()
                return order[index:]
        raise RejectRequest(ErrorCode.UNKNOWN_MODEL, f"no ready {stage.value} worker in pool {order[0]!r} serves "
                            f"{model!r}; start one with `conveyor worker {stage.value} --model {model} "
                            f"--pool {order[0]}`", retryable=True)

    async def _route_session(self, request: ChatRequest | CompletionRequest, header: TaskHeader,
                             preprocessed: PreprocessedRequest, model: ServedModel, delivery: Delivery) -> None:
        """A session's requests all go to the decode worker holding it: a new session is placed like any prompt
        (the router's choice, else the least busy replica) and written down for every processor."""
        assert self._context is not None and self._context.sessions is not None and self._router is not None
        session_id = request.session_id
        assert session_id is not None
        if await self._mode_of(model.name) != ServingMode.AGGREGATED or request.n > 1 or preprocessed.media:
            raise RejectRequest(ErrorCode.UNSUPPORTED, "sessions run text prompts with n = 1 on aggregated decode "
                                "workers (the conversation stays in one engine)")
        places = self._context.sessions
        holder = await places.worker_of(session_id)
        decoders = [c for c in await self._live_cards(max_age_s=_FRESH_VIEW_S if holder else None)
                    if c.stage == Stage.DECODE and c.model == model.name and c.ready]
        if holder is not None and holder not in {card.worker_id for card in decoders}:
            await places.forget(session_id)
            raise RejectRequest(ErrorCode.WORKER_LOST, f"session {session_id!r} was held by worker {holder}, which "
                                "stopped; its conversation is gone: start a new session")
        opens = holder is None
        if holder is None:
            if not decoders:
                await self._require_stages(model.name, ServingMode.AGGREGATED)
                raise RejectRequest(ErrorCode.UNKNOWN_MODEL, f"no ready decode worker serves {model.name!r}")
            route = self._router.route(Stage.DECODE, model.name, preprocessed.token_ids, decoders,
                                       preprocessed.lora_name)
            chosen = route.worker_id if route is not None else min(decoders, key=_busyness).worker_id
            holder = await places.place(session_id, chosen)
            opens = holder == chosen
        if request.close_session:
            await places.forget(session_id)
        elif not opens:
            await places.touch(session_id, holder)
        session = SessionRef(id=session_id, opens=opens, closes=request.close_session)
        task = DecodeTask(header=header, request=preprocessed.model_copy(update={"session": session}))
        await self._forward(Stage.DECODE, task, request.request_id, delivery, model.name, worker_id=holder)
        log.info("processor.routed_session", session_id=session_id, opens=opens, closes=request.close_session,
                 worker_id=holder)

    async def _route_multimodal(self, header: TaskHeader, request: PreprocessedRequest, model: ServedModel,
                                delivery: Delivery) -> None:
        """Encode workers live → `EncodeTask` (E/PD, or E/P/D when prefill workers are live too);
        else an LLM worker that encodes in-process (EPD) gets the images with its task."""
        assert self._context is not None
        if self._pools is not None and self._pools.of(model.name) is not None:
            raise RejectRequest(ErrorCode.UNSUPPORTED, f"{model.name} is served by pools, which take text prompts; "
                                "images are not routed to pools")
        cards = [card for card in await self._live_cards() if card.model == model.name and card.ready]
        if not any(card.stage == Stage.ENCODE or card.accepts_media for card in cards):
            cards = [card for card in await self._live_cards(max_age_s=_FRESH_VIEW_S)
                     if card.model == model.name and card.ready]
        stages = {card.stage for card in cards}
        next_stage = Stage.PREFILL if Stage.PREFILL in stages else Stage.DECODE
        task: EncodeTask | DecodeTask | PrefillTask
        if Stage.ENCODE in stages:
            # The encode workers' mode names the topology; a prefill worker missing a heartbeat must not
            # turn E/P/D into E/PD for one request (its decode engine would get rows it cannot use).
            encode_modes = {card.mode for card in cards if card.stage == Stage.ENCODE}
            mode = (ServingMode.ENCODE_DISAGGREGATED if ServingMode.ENCODE_DISAGGREGATED in encode_modes
                    else ServingMode.ENCODE_AGGREGATED)
            next_stage = Stage.PREFILL if mode == ServingMode.ENCODE_DISAGGREGATED else Stage.DECODE
            await self._require_stages(model.name, mode)
            task, stage = EncodeTask(header=header, request=request, next_stage=next_stage.value), Stage.ENCODE
        elif any(card.stage == next_stage and card.accepts_media for card in cards):
            task = (PrefillTask(header=header, request=request) if next_stage == Stage.PREFILL
                    else DecodeTask(header=header, request=request))
            stage = next_stage
        else:
            raise RejectRequest(ErrorCode.UNSUPPORTED,
                                f"no worker serving {model.name!r} takes images: start an encode worker "
                                f"(`conveyor worker encode --model {model.name}`) or a multimodal LLM worker")
        await self._forward(stage, task, header.request_id, delivery, model.name)
        log.info("processor.routed", to=stage.value, images=len(request.media), prompt_tokens=len(request.token_ids))

    async def _route_embedding(self, request: EmbeddingRequest, model: ServedModel, created_at_s: float,
                               delivery: Delivery) -> None:
        assert self._context is not None
        await self._require_stages(model.name, ServingMode.EMBEDDING)
        if isinstance(request.input, list) and len(request.input) > MAX_EMBEDDING_INPUTS and not all(
                isinstance(item, int) for item in request.input):
            raise RejectRequest(ErrorCode.INVALID_REQUEST,
                                f"{len(request.input)} inputs; at most {MAX_EMBEDDING_INPUTS} per request")
        texts = [request.input] if isinstance(request.input, str) else request.input
        # As OpenAI: an empty text is refused (a tokenizer that adds [CLS]/[SEP] would make it non-empty).
        if not texts or any(isinstance(item, str) and not item.strip() for item in texts):
            raise RejectRequest(ErrorCode.INVALID_REQUEST, "input is empty, or holds an empty text")
        token_lists = _embedding_inputs(request.input, model)
        for token_ids in token_lists:
            model.check_token_ids(token_ids)
        if not token_lists or not all(token_lists):
            raise RejectRequest(ErrorCode.INVALID_REQUEST, "input is empty")
        header = TaskHeader(request_id=request.request_id, reply_to=request.reply_to, created_at_s=created_at_s)
        task = EmbedTask(header=header, model=model.name, inputs=token_lists, encoding_format=request.encoding_format,
                         dimensions=request.dimensions)
        await self._forward(Stage.EMBED, task, request.request_id, delivery, model.name)

    async def _route_image(self, request: ImageRequest, created_at_s: float, delivery: Delivery) -> None:
        """No tokenizer here: the image workers' pipeline has its own. A processor serves every image model
        that has a live image worker, without loading it."""
        await self._require_stages(request.model, ServingMode.IMAGE)
        header = TaskHeader(request_id=request.request_id, reply_to=request.reply_to, created_at_s=created_at_s)
        # Drawn here, not by the worker, so a redelivered task (its worker died) makes the same images.
        seed = request.seed if request.seed is not None else secrets.randbelow(2**31)
        task = ImageTask(header=header, model=request.model, prompt=request.prompt, negative_prompt=request.negative_prompt,
                         n=request.n, size=request.size, response_format=request.response_format, seed=seed,
                         num_inference_steps=request.num_inference_steps, guidance_scale=request.guidance_scale)
        await self._forward(Stage.IMAGE, task, request.request_id, delivery, request.model)

    async def _forward(self, stage: Stage, task: WireModel, request_id: str, delivery: Delivery, model: str,
                       worker_id: str | None = None, pool: str | None = None) -> None:
        """Publish the next stage's task. JetStream drops a task whose request id it saw within the dedupe
        window: expected when this task was redelivered (it went out before), but on a first delivery it
        means another request used the id, and that request would be dropped without a word."""
        assert self._context is not None
        published = await self._context.publisher.publish(stage, task, request_id, delivery.trace, model=model,
                                                          worker_id=worker_id, pool=pool)
        if not published and delivery.num_delivered == 1:
            raise RejectRequest(ErrorCode.INVALID_REQUEST,
                                f"request id {request_id!r} is in use by another request (within the last "
                                f"{self._context.settings.dedupe_window_s:.0f} s); give each request a fresh id")

    def _tokenize(self, request: ChatRequest | CompletionRequest,
                  model: ServedModel) -> tuple[list[int], list[MediaItem]]:
        media: list[MediaItem] = []
        if isinstance(request, CompletionRequest):
            if isinstance(request.prompt, list):
                token_ids = list(request.prompt)  # already tokenized: no template, no tokenizer
                model.check_token_ids(token_ids)
            else:
                token_ids = list(model.tokenizer.encode(request.prompt))
        else:
            token_ids, media = self._apply_chat_template(request, model)
        if not token_ids:
            raise RejectRequest(ErrorCode.INVALID_REQUEST, "the prompt is empty")
        if len(token_ids) >= model.context_length:
            raise RejectRequest(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"prompt of {len(token_ids)} tokens does not fit the context of {model.context_length} tokens",
            )
        return token_ids, media

    def _apply_chat_template(self, request: ChatRequest, model: ServedModel) -> tuple[list[int], list[MediaItem]]:
        """Token ids of the templated conversation, with one placeholder token where each image goes."""
        # A marker no client text contains stands for each image in the templated text.
        marker = f"<conveyor-image-{uuid.uuid4().hex}>"
        messages, media = [], []
        for message in request.messages:
            if message.content is None or isinstance(message.content, str):
                text = message.content or ""
            else:
                pieces = []
                for part in message.content:
                    if isinstance(part, TextPart):
                        pieces.append(part.text)
                    elif isinstance(part, VideoPart):
                        # Qwen2-VL models can see video, but no video decoder ships here to sample frames with.
                        raise RejectRequest(ErrorCode.UNSUPPORTED, f"video input is not served for {model.name}: "
                                            "send sampled frames as image parts")
                    elif model.image_tokens is None:
                        raise RejectRequest(ErrorCode.UNSUPPORTED,
                                            f"model {model.name} is served text-only: image parts need a multimodal model")
                    else:
                        pieces.append(marker)
                        media.append(MediaItem(modality="image", source=part.image_url))
                text = "".join(pieces)
            messages.append({"role": message.role, "content": text} | _tool_fields(message))
        if not media and not any(m["content"].strip() or m.get("tool_calls") for m in messages):
            raise RejectRequest(ErrorCode.INVALID_REQUEST, "every message is empty")
        # The tools go into the model's own chat template, which tells the model how to call them.
        tools = ([tool.model_dump(mode="json", exclude_none=True) for tool in request.tools]
                 if request.tools and request.tool_choice != "none" else None)
        if not media:
            ids = model.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids), media
        templated = model.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        token_ids: list[int] = []
        for index, piece in enumerate(templated.split(marker)):
            if index:
                token_ids += model.image_tokens
            token_ids += model.tokenizer.encode(piece, add_special_tokens=False) if piece else []
        return token_ids, media

    async def _mode_of(self, model: str) -> ServingMode:
        """Disaggregated when live prefill workers serve the model, else aggregated."""
        cards = [card for card in await self._live_cards() if card.model == model]
        mode = ServingMode.DISAGGREGATED if any(card.stage == Stage.PREFILL for card in cards) else ServingMode.AGGREGATED
        await self._require_stages(model, mode)
        return mode

    async def _require_stages(self, model: str, mode: ServingMode) -> None:
        missing = self._missing_stages(model, mode, await self._live_cards())
        if missing:
            missing = self._missing_stages(model, mode, await self._live_cards(max_age_s=_FRESH_VIEW_S))
        if missing:
            raise RejectRequest(
                ErrorCode.UNKNOWN_MODEL,
                f"no ready {', '.join(sorted(stage.value for stage in missing))} worker serves {model!r} "
                f"({mode.value} mode); start one with `conveyor worker {sorted(missing)[0].value} --model {model}`",
            )

    def _missing_stages(self, model: str, mode: ServingMode, cards: list[WorkerCard]) -> set[Stage]:
        ready = {card.stage for card in cards if card.model == model and card.ready}
        now_s = time.monotonic()
        # A stage that went missing moments ago is taken as still there: its cards may have expired while
        # JetStream recovered (a restart, a cluster electing leaders) or its worker is restarting.
        # The task waits in its queue meanwhile, rather than the request being refused. The moment counts
        # from the first read that lacked the stage, not from the last that had it: reads wait out a
        # registry outage, which says nothing about the workers, and cards lapse during it.
        recent = {stage for (name, stage), since_s in self._missing_since_s.items()
                  if name == model and now_s - since_s < self._ready_grace_s}
        return (REQUIRED_STAGES[mode] - {Stage.PROCESSOR}) - ready - recent

    async def _live_cards(self, max_age_s: float | None = None) -> list[WorkerCard]:
        """The registry's cards (bus/registry.py: RegistryView); with `max_age_s`, as read at most that long ago."""
        assert self._view is not None
        return await self._view.cards(max_age_s)

    def _remember_ready(self, cards: list[WorkerCard]) -> None:
        now_s = time.monotonic()
        ready = {(card.model, card.stage) for card in cards if card.ready}
        self._seen_ready |= ready
        for key in ready:
            self._missing_since_s.pop(key, None)
        for key in self._seen_ready - ready:
            self._missing_since_s.setdefault(key, now_s)


def _first(pools: list[str]) -> str | None:
    return pools[0] if pools else None


def _busyness(card: WorkerCard) -> int:
    """KV blocks in use: how a new session picks a replica when no router pins prompts."""
    return card.kv.used_blocks if card.kv is not None else 0


def preprocess(request: GenerationRequest, token_ids: list[int], model: ServedModel) -> PreprocessedRequest:
    """OpenAI-shaped options onto the engine's sampling options and stop conditions."""
    room = model.context_length - len(token_ids)
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    return PreprocessedRequest(
        model=model.name,
        token_ids=token_ids,
        sampling=SamplingOptions(
            temperature=request.temperature, top_p=request.top_p, top_k=request.top_k, min_p=request.min_p,
            frequency_penalty=request.frequency_penalty, presence_penalty=request.presence_penalty,
            repetition_penalty=request.repetition_penalty, seed=request.seed, n=request.n,
            best_of=request.best_of if isinstance(request, CompletionRequest) else None,
        ),
        stop=StopConditions(
            # Unset means "until the context is full", like OpenAI; a larger ask is clamped to fit.
            max_tokens=min(request.max_tokens or room, room), min_tokens=min(request.min_tokens, room), stop=stop,
            stop_token_ids=request.stop_token_ids, ignore_eos=request.ignore_eos,
        ),
        output=OutputOptions(logprobs=request.logprobs, top_logprobs=request.top_logprobs),
        guided=_guided(request),
        eos_token_ids=list(model.eos_token_ids),
        priority=request.priority,
    )


def _embedding_inputs(raw: str | list[str] | list[int] | list[list[int]], model: ServedModel) -> list[list[int]]:
    """OpenAI's four input shapes: a text, texts, one tokenized input, tokenized inputs."""
    if isinstance(raw, str):
        return [list(model.tokenizer.encode(raw))]
    if raw and all(isinstance(item, int) for item in raw):
        return [list(raw)]  # type: ignore[arg-type]
    return [list(model.tokenizer.encode(item)) if isinstance(item, str) else list(item) for item in raw]  # type: ignore[arg-type]


def _guided(request: GenerationRequest) -> GuidedDecoding | None:
    """The request's one output constraint; two at once (e.g. a JSON schema and a regex) is invalid."""
    extensions = {"regex": request.guided_regex, "choice": request.guided_choice, "grammar": request.guided_grammar}
    constraints = [GuidedDecoding(**{kind: value}) for kind, value in extensions.items() if value is not None]
    constraints += [_json_constraint(request.response_format),
                    _tool_call_constraint(request) if isinstance(request, ChatRequest) else None]
    given = [constraint for constraint in constraints if constraint is not None]
    if len(given) > 1:
        raise RejectRequest(ErrorCode.INVALID_REQUEST, "give at most one of response_format (json), guided_regex, "
                            "guided_choice, guided_grammar and a required or named tool_choice")
    return given[0] if given else None


def _tool_call_constraint(request: ChatRequest) -> GuidedDecoding | None:
    """`tool_choice` "required" or a named function: the answer is one call, `{"name": ..., "arguments": {...}}`,
    whose arguments fit the function's parameters (the gateway turns it into `tool_calls`)."""
    choice = request.tool_choice
    if choice is None or choice in ("none", "auto"):
        return None
    tools = request.tools or []
    if isinstance(choice, NamedToolChoice):
        tools = [tool for tool in tools if tool.function.name == choice.function.name]
        if not tools:
            raise RejectRequest(ErrorCode.INVALID_REQUEST, f"tool_choice names {choice.function.name!r}, "
                                "which is not among the request's tools")
    if not tools:
        raise RejectRequest(ErrorCode.INVALID_REQUEST, "tool_choice 'required' needs tools")
    calls = [{"type": "object", "properties": {"name": {"const": tool.function.name},
                                              "arguments": tool.function.parameters},
              "required": ["name", "arguments"], "additionalProperties": False} for tool in tools]
    return GuidedDecoding(json_schema=calls[0] if len(calls) == 1 else {"anyOf": calls})


def _tool_fields(message: ChatMessage) -> dict[str, Any]:
    """A message's tool calls and tool-call id as chat templates read them (arguments as objects)."""
    fields: dict[str, Any] = {}
    if message.tool_calls:
        fields["tool_calls"] = [{"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": _arguments(call.function.arguments)}} for call in message.tool_calls]
    if message.tool_call_id is not None:
        fields["tool_call_id"] = message.tool_call_id
    return fields


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # not JSON: the template shows it as it came


def _json_constraint(response_format: ResponseFormat | None) -> GuidedDecoding | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_schema" and response_format.json_schema:
        # OpenAI nests the schema: {"name": ..., "schema": {...}}; accept the bare schema too.
        schema = response_format.json_schema.get("schema", response_format.json_schema)
        return GuidedDecoding(json_schema=schema)
    return GuidedDecoding(json_schema={"type": "object"})
