"""`conveyor ask`, `cancel`, `status`, `lora`: a NATS client of the pipeline in a terminal."""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from bus.client import AdapterRollout, PipelineClient, open_client
from bus.errors import RemoteError, ReplyStreamBroken
from bus.registry import ready_models
from bus.settings import BusSettings, NatsSettings
from schemas.client import ChatMessage, ChatRequest, EmbeddingRequest, ImageRequest, StreamFormat
from schemas.control import LoraAdapter
from schemas.registry import Stage, WorkerCard
from schemas.replies import EmbeddingResult, FinalFrame, ImageResult


class NoWorkerServes(RuntimeError):
    """Nothing would answer: said at once instead of waiting for a timeout."""


@dataclass(frozen=True, slots=True)
class AskResult:
    text: str
    final: FinalFrame
    first_token_s: float
    elapsed_s: float


async def ensure_model_ready(client: PipelineClient, bus: BusSettings, model: str) -> None:
    cards = await client.live_workers()
    if model not in ready_models(cards):
        serving = sorted({card.model for card in cards})
        raise NoWorkerServes(
            f"no ready pipeline serves {model!r} in namespace {bus.namespace!r}"
            + (f" (models with live workers: {', '.join(serving)})" if serving else " (no workers are running)")
            + "; start one with `conveyor up` or `conveyor worker ...`"
        )


async def ask(nats: NatsSettings, bus: BusSettings, model: str, prompt: str, max_tokens: int | None,
              temperature: float | None, timeout_s: float, echo: bool = True) -> AskResult:
    """Send a chat request through the pipeline and stream the answer to stdout."""
    async with open_client(nats, bus, "conveyor-ask") as client:
        await ensure_model_ready(client, bus, model)
        messages = [ChatMessage(role="user", content=prompt)]
        return await _ask_once(client, model, messages, max_tokens, temperature, timeout_s, echo)


async def chat_loop(nats: NatsSettings, bus: BusSettings, model: str, max_tokens: int | None,
                    temperature: float | None, timeout_s: float) -> None:
    """Read questions from stdin, keep the conversation, stream each answer; end on EOF or /exit."""
    async with open_client(nats, bus, "conveyor-chat") as client:
        await ensure_model_ready(client, bus, model)
        history: list[ChatMessage] = []
        print(f"[conveyor] chatting with {model}; an empty line or Ctrl-D ends", file=sys.stderr)
        while True:
            line = await asyncio.to_thread(_prompt)
            if line is None or not line.strip() or line.strip() == "/exit":
                return
            history.append(ChatMessage(role="user", content=line))
            try:
                result = await _ask_once(client, model, history, max_tokens, temperature, timeout_s, echo=True)
            except Exception as error:
                print(f"[conveyor] {explain(error)}", file=sys.stderr)
                history.pop()
                continue
            history.append(ChatMessage(role="assistant", content=result.text))


def _prompt() -> str | None:
    try:
        return input("> " if sys.stdin.isatty() else "")
    except EOFError:
        return None


async def embed(nats: NatsSettings, bus: BusSettings, model: str, texts: list[str], dimensions: int | None,
                timeout_s: float) -> EmbeddingResult:
    """Embed texts through the pipeline (processor → embed worker)."""
    async with open_client(nats, bus, "conveyor-embed") as client:
        await ensure_model_ready(client, bus, model)
        request = EmbeddingRequest(request_id=f"embed-{uuid.uuid4().hex[:16]}", reply_to=client.new_inbox(),
                                   model=model, input=texts, dimensions=dimensions)
        async with await client.submit(request, first_frame_timeout_s=timeout_s) as stream:
            _, result = await stream.collect()
    assert isinstance(result, EmbeddingResult)
    return result


async def generate_images(nats: NatsSettings, bus: BusSettings, model: str, request_for: Callable[[str], ImageRequest],
                          on_progress: Callable[[int, int], None], timeout_s: float) -> tuple[list[bytes], ImageResult]:
    """Images through the pipeline (processor → image worker); `request_for(inbox)` is the request (PNG bytes in
    the reply frames: `b64_json`)."""
    async with open_client(nats, bus, "conveyor-image") as client:
        await ensure_model_ready(client, bus, model)
        async with await client.submit(request_for(client.new_inbox()), first_frame_timeout_s=timeout_s) as stream:
            images, result = await stream.collect_images(on_progress)
    if not isinstance(result, ImageResult):
        raise RuntimeError(f"the image request ended without images ({result.finish_reason.value})")
    return [image for image in images if isinstance(image, bytes)], result


async def _ask_once(client: PipelineClient, model: str, messages: list[ChatMessage], max_tokens: int | None,
                    temperature: float | None, timeout_s: float, echo: bool) -> AskResult:
    request = ChatRequest(
        request_id=f"ask-{uuid.uuid4().hex[:16]}", reply_to=client.new_inbox(), model=model, messages=messages,
        max_tokens=max_tokens, temperature=temperature, stream_format=StreamFormat.TEXT,
    )
    started = time.perf_counter()
    first_token_s = 0.0
    parts: list[str] = []
    async with await client.submit(request, first_frame_timeout_s=timeout_s) as stream:
        async for chunk in stream:
            if not parts:
                first_token_s = time.perf_counter() - started
            parts.append(chunk.text or "")
            if echo:
                print(chunk.text or "", end="", flush=True)
    if echo:
        print()
    assert isinstance(stream.terminal, FinalFrame)
    return AskResult("".join(parts), stream.terminal, first_token_s, time.perf_counter() - started)


def report(result: AskResult) -> None:
    usage = result.final.usage
    print(
        f"[conveyor] {result.final.finish_reason.value}: {usage.prompt_tokens} prompt "
        f"({usage.cached_tokens} cached) + {usage.completion_tokens} completion tokens, "
        f"first token {1000 * result.first_token_s:.0f} ms, total {result.elapsed_s:.2f} s",
        file=sys.stderr,
    )


def explain(error: Exception) -> str:
    if isinstance(error, RemoteError):
        return f"the pipeline refused the request: {error.code.value}: {error.frame.message}"
    if isinstance(error, ReplyStreamBroken):
        return f"the reply stream broke: {error}"
    return str(error)


async def cancel(nats: NatsSettings, bus: BusSettings, request_id: str) -> None:
    async with open_client(nats, bus, "conveyor-cancel") as client:
        await client.cancel(request_id)


async def status(nats: NatsSettings, bus: BusSettings) -> str:
    async with open_client(nats, bus, "conveyor-status") as client:
        cards = await client.live_workers()
    if not cards:
        return f"no live workers in namespace {bus.namespace!r}"
    lines = [f"{'worker':<40} {'stage':<10} {'model':<28} {'mode':<20} {'pool':<10} {'engine':<7} {'ready':<6} "
             f"{'kv used':>9}  metrics"]
    for card in cards:
        kv = f"{card.kv.used_blocks}/{card.kv.total_blocks}" if card.kv else "-"
        lines.append(f"{card.worker_id:<40} {card.stage.value:<10} {card.model:<28} {card.mode.value:<20} "
                     f"{card.pool or '-':<10} {card.engine:<7} {'yes' if card.ready else 'no':<6} {kv:>9}  "
                     f"{card.metrics_url or '-'}")
    models = ready_models(cards)
    lines.append("")
    lines.append("ready models: " + (", ".join(f"{m} ({mode.value})" for m, mode in sorted(models.items())) or "none"))
    return "\n".join(lines)


async def lora_load(nats: NatsSettings, bus: BusSettings, name: str, path: str, base_model: str | None,
                    timeout_s: float) -> str:
    """Serve a LoRA adapter on every LLM worker of its base model; what each worker did, one line each."""
    async with open_client(nats, bus, "conveyor-lora") as client:
        base = base_model or _only_base_model(await client.live_workers())
        rollout = await client.load_lora(LoraAdapter(name=name, base_model=base, path=path), timeout_s)
        if rollout.refused:
            raise RuntimeError(f"no worker could load {name!r}: {rollout.failures()}")
    return _rollout_lines(f"{name} (on {base}, from {path})", "loaded", rollout)


async def lora_unload(nats: NatsSettings, bus: BusSettings, name: str, timeout_s: float) -> str:
    async with open_client(nats, bus, "conveyor-lora") as client:
        rollout = await client.unload_lora(name, timeout_s)
    if rollout is None:
        raise RuntimeError(f"no LoRA adapter named {name!r} is served (see `conveyor lora list`)")
    return _rollout_lines(name, "unloaded", rollout)


async def lora_list(nats: NatsSettings, bus: BusSettings) -> str:
    async with open_client(nats, bus, "conveyor-lora") as client:
        adapters = await (await client.adapters()).all()
        cards = await client.live_workers()
    if not adapters:
        return f"no LoRA adapters served in namespace {bus.namespace!r}; add one with `conveyor lora load NAME PATH`"
    lines = [f"{'adapter':<24} {'base model':<28} {'loaded on':>9}  path"]
    for adapter in adapters:
        loaded = sum(1 for card in cards if adapter.name in card.lora_adapters)
        lines.append(f"{adapter.name:<24} {adapter.base_model:<28} {loaded:>9}  {adapter.path}")
        lines += [f"    {card.worker_id}: {card.lora_failures[adapter.name]}" for card in cards
                  if adapter.name in card.lora_failures]
    return "\n".join(lines)


def _only_base_model(cards: list[WorkerCard]) -> str:
    models = sorted({card.model for card in cards if card.stage in (Stage.DECODE, Stage.PREFILL)})
    if len(models) != 1:
        raise RuntimeError("name the adapter's base model with --model (LLM workers serve "
                           + (", ".join(models) if models else "no model: none are running") + ")")
    return models[0]


def _rollout_lines(what: str, done: str, rollout: AdapterRollout) -> str:
    lines = [f"{what}: {done} on {len(rollout.done)} worker(s)"]
    lines += [f"  failed on {worker}: {reason}" for worker, reason in rollout.failed.items()]
    if rollout.pending:
        lines.append(f"  still pending on {', '.join(rollout.pending)} (they go on in the background)")
    if not (rollout.done or rollout.failed or rollout.pending):
        lines.append("  no LLM worker of the model is running; workers that start later load it")
    return "\n".join(lines)
