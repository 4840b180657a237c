"""`MockEngine`: simulated timing for benchmarks and scale tests of the pipeline itself.

Like Dynamo's mocker it does no math: time to first token is `ttft_base_s + ttft_per_prompt_token_s ×
uncached prompt tokens`, then one token every `inter_token_s`, with at most `max_running_requests`
generating at once (the rest queue). With `stream_interval` N it sends the first token alone and
the rest N a frame, as SGLang does (CPU benchmarks of the pipeline can carry the GPU stack's
frames). It keeps a real block pool with a prefix cache keyed like the torch engine's, so it emits
the same `BlockStored` / `BlockRemoved` events and reports cached tokens. Output tokens are a
deterministic function of the sequence so far, so runs are reproducible. Never the default engine.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from schemas.registry import BootstrapEndpoint
from schemas.replies import FinishReason
from workers.engines.events import KvEventFanout
from schemas.kv_hashing import chain_hashes
from workers.engines.protocol import (
    EngineInfo,
    EngineLoad,
    ExpertRecording,
    GenerateOutput,
    GenerateRequest,
    KvEventBatchOut,
    MemoryTag,
    UnsupportedOption,
)

EOS_TOKEN_ID = 2


class MockEngineConfig(BaseSettings):
    """Read from CONVEYOR_MOCK_* variables when a worker is started with `--engine mock`."""

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_MOCK_", frozen=True)

    model: str = "mock"
    ttft_base_s: float = Field(default=0.005, ge=0)
    ttft_per_prompt_token_s: float = Field(default=0.00002, ge=0)
    inter_token_s: float = Field(default=0.01, ge=0)
    # Tokens a frame after the first (1: a frame per token). The SGLang engine's default is 8.
    stream_interval: int = Field(default=1, ge=1)
    max_running_requests: int = Field(default=64, ge=1)
    # One clock for every running request, as a real engine steps its whole batch at once: all streams' tokens come
    # in the same instant (and their frames go out together). Off: each request ticks on its own timer.
    lockstep: bool = False
    block_size: int = Field(default=16, ge=1)
    kv_total_blocks: int = Field(default=4096, ge=1)
    context_length: int = Field(default=8192, ge=2)
    vocab_size: int = Field(default=32000, ge=16)


def _text_of(tokens: list[int]) -> str:
    """The mock's text for its tokens: each one's id, so a reader can tell them apart."""
    return "".join(f" t{token}" for token in tokens)


class MockEngine:
    def __init__(self, config: MockEngineConfig = MockEngineConfig()) -> None:
        self.config = config
        self._slots = asyncio.Semaphore(config.max_running_requests)
        self._running: dict[str, asyncio.Event] = {}
        self._waiting = 0
        self._waiting_prompt_tokens = 0
        # Content key -> None for cached blocks, least recently used first; referenced ones separately.
        self._cached: OrderedDict[int, None] = OrderedDict()
        # Blocks held by running requests -> how many hold each (a shared prefix is held once).
        self._refs: dict[int, int] = {}
        self._kv_events = KvEventFanout()
        self._released: set[MemoryTag] = set()
        self._clock = StepClock(config.inter_token_s) if config.lockstep and config.inter_token_s > 0 else None
        # No KV moves between mock engines: every one runs its prompts itself.
        self._info = EngineInfo(name="mock", model=config.model, context_length=config.context_length,
                                eos_token_ids=(EOS_TOKEN_ID,), prefills_in_decode_role=True,
                                max_running_requests=config.max_running_requests)

    @property
    def info(self) -> EngineInfo:
        return self._info

    async def start(self) -> None:
        return None

    async def shutdown(self) -> None:
        for cancelled in self._running.values():
            cancelled.set()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        if request.sampling.n != 1 or request.guided is not None or request.lora_name is not None or request.session:
            raise UnsupportedOption("the mock engine simulates single, unconstrained completions of the base model")
        if self._released:
            raise RuntimeError(f"engine memory released ({', '.join(sorted(self._released))}); resume it first")
        cancelled = asyncio.Event()
        self._running[request.request_id] = cancelled
        self._waiting += 1
        self._waiting_prompt_tokens += len(request.token_ids)
        prefilling = True
        try:
            async with self._slots:
                self._waiting -= 1
                async for output in self._run(request, cancelled):
                    if prefilling:  # the first output ends its prefill
                        self._waiting_prompt_tokens -= len(request.token_ids)
                        prefilling = False
                    yield output
        finally:
            if prefilling:
                self._waiting_prompt_tokens -= len(request.token_ids)
            self._running.pop(request.request_id, None)

    async def _run(self, request: GenerateRequest, cancelled: asyncio.Event) -> AsyncIterator[GenerateOutput]:
        prompt_tokens = len(request.token_ids)
        keys = chain_hashes(request.token_ids, self.config.block_size)
        cached_blocks = self._reference(keys)
        cached_tokens = cached_blocks * self.config.block_size
        max_tokens = request.stop.max_tokens or (self.config.context_length - prompt_tokens)
        produced = 0
        try:
            delay_s = self.config.ttft_base_s + self.config.ttft_per_prompt_token_s * (prompt_tokens - cached_tokens)
            if await _cancelled_within(cancelled, delay_s):
                yield self._final(request, FinishReason.CANCELLED, [], produced, cached_tokens)
                return
            self._publish([BlockStored(block_hashes=keys[cached_blocks:], parent_block_hash=keys[cached_blocks - 1] if cached_blocks else None,
                                       token_ids=request.token_ids[cached_tokens : len(keys) * self.config.block_size],
                                       block_size=self.config.block_size)] if len(keys) > cached_blocks else [])
            token = request.token_ids[-1]
            unsent: list[int] = []  # made, waiting for their frame
            while True:
                token = self._next_token(token, prompt_tokens + produced)
                produced += 1
                unsent.append(token)
                if produced >= max_tokens:
                    yield self._final(request, FinishReason.LENGTH, unsent, produced, cached_tokens)
                    return
                if produced == 1 or len(unsent) >= self.config.stream_interval:
                    yield GenerateOutput(token_ids=unsent, text=_text_of(unsent))
                    unsent = []
                if await self._cancelled_before_next_token(cancelled):
                    # What was made goes out with the end, so the count of tokens matches what the reader got.
                    yield self._final(request, FinishReason.CANCELLED, unsent, produced, cached_tokens)
                    return
        finally:
            self._release(keys)

    async def _cancelled_before_next_token(self, cancelled: asyncio.Event) -> bool:
        if self._clock is None:
            return await _cancelled_within(cancelled, self.config.inter_token_s)
        # A cancel is seen at the next step, as a batch engine sees an abort between steps.
        await self._clock.next_step()
        return cancelled.is_set()

    def _next_token(self, previous: int, position: int) -> int:
        """Each token follows from the one before and its position, like a greedy model: a request that
        goes on from its prompt plus its first k tokens (a migration) yields what it would have."""
        return 3 + (previous * 7919 + position * 104729) % (self.config.vocab_size - 3)

    def _final(self, request: GenerateRequest, reason: FinishReason, tokens: list[int], produced: int,
               cached_tokens: int) -> GenerateOutput:
        return GenerateOutput(token_ids=tokens, text=_text_of(tokens), finish_reason=reason,
                              prompt_tokens=len(request.token_ids), completion_tokens=produced,
                              cached_tokens=cached_tokens)

    def _reference(self, keys: list[int]) -> int:
        """Count the cached leading blocks (held by running requests or kept for reuse, as a real engine shares
        them), take the prompt's blocks, evicting least recently used unreferenced ones if needed."""
        cached = 0
        for key in keys:
            if key not in self._cached and key not in self._refs:
                break
            cached += 1
        needed = len(keys) - cached
        evicted: list[int] = []
        while len(self._refs) + needed + len(self._cached) > self.config.kv_total_blocks and self._cached:
            victim, _ = self._cached.popitem(last=False)
            if victim in keys[:cached]:
                cached = keys.index(victim)  # the prefix ends where its block was just evicted
            evicted.append(victim)
        for key in keys:
            self._cached.pop(key, None)
            self._refs[key] = self._refs.get(key, 0) + 1
        if evicted:
            self._publish([BlockRemoved(block_hashes=evicted)])
        return cached

    def _release(self, keys: list[int]) -> None:
        for key in keys:
            count = self._refs.get(key, 0) - 1
            if count > 0:
                self._refs[key] = count
            else:
                self._refs.pop(key, None)
                self._cached[key] = None

    @property
    def _used_blocks(self) -> int:
        return len(self._refs)

    def _publish(self, events: list[KvEvent]) -> None:
        if not events:
            return
        self._kv_events.publish(KvEventBatchOut(events=events, ts=time.time()))

    async def abort(self, request_id: str) -> None:
        cancelled = self._running.get(request_id)
        if cancelled is not None:
            cancelled.set()

    async def encode(self, inputs: list[list[int]]) -> list[list[float]]:
        return [[float(len(ids)), float(sum(ids) % 997)] for ids in inputs]

    def load(self) -> EngineLoad:
        return EngineLoad(
            running_requests=len(self._running) - self._waiting,
            waiting_requests=self._waiting,
            kv_block_size=self.config.block_size,
            kv_total_blocks=self.config.kv_total_blocks,
            kv_used_blocks=self._used_blocks,
            waiting_prompt_tokens=self._waiting_prompt_tokens,
        )

    def kv_events(self) -> AsyncIterator[KvEventBatchOut]:
        return self._kv_events.listen()

    @property
    def bootstrap_endpoint(self) -> BootstrapEndpoint | None:
        return None

    async def release_memory(self, tags: list[MemoryTag]) -> None:
        if self._running:
            raise RuntimeError("release_memory needs an idle engine: deregister and drain first")
        self._released.update(tags)
        if MemoryTag.KV_CACHE in tags:
            self._cached.clear()
            self._publish([AllBlocksCleared()])

    async def resume_memory(self, tags: list[MemoryTag]) -> None:
        self._released.difference_update(tags)

    async def start_profile(self, output_dir: Path) -> None:
        raise UnsupportedOption("the mock engine runs no model to profile")

    async def stop_profile(self) -> None:
        raise UnsupportedOption("the mock engine runs no model to profile")

    async def update_weights_from_disk(self, model_path: Path) -> None:
        raise UnsupportedOption("the mock engine has no weights")

    async def flush_cache(self) -> None:
        if self._used_blocks:
            raise RuntimeError("cannot flush the prefix cache while requests are running")
        self._cached.clear()
        self._publish([AllBlocksCleared()])

    async def load_lora(self, name: str, path: str) -> None:
        raise UnsupportedOption("the mock engine has no LoRA adapters; use --engine torch or sglang")

    async def unload_lora(self, name: str) -> None:
        return None  # nothing is loaded

    def loras(self) -> dict[str, str]:
        return {}

    async def record_experts(self, action: ExpertRecording) -> None:
        raise UnsupportedOption("the mock engine has no mixture-of-experts layers to record")


class StepClock:
    """Steps every `interval_s` while anyone waits for one; every waiter of a step wakes in the same loop turn."""

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._next_step: asyncio.Future[None] | None = None

    async def next_step(self) -> None:
        if self._next_step is None or self._next_step.done():
            loop = asyncio.get_running_loop()
            self._next_step = loop.create_future()
            loop.call_later(self._interval_s, _resolve, self._next_step)
        # Shielded: one waiter cancelled (its task torn down) must not cancel the step for the others.
        await asyncio.shield(self._next_step)


def _resolve(step: asyncio.Future[None]) -> None:
    if not step.done():
        step.set_result(None)


async def _cancelled_within(cancelled: asyncio.Event, delay_s: float) -> bool:
    """Wait `delay_s`, or less when `cancelled` is set first (True). `asyncio.timeout`, not `wait_for`, which makes
    a task per call: per token here, that was a tenth of a decode worker's CPU in the pipeline benchmarks."""
    try:
        async with asyncio.timeout(delay_s):
            await cancelled.wait()
    except TimeoutError:
        return False
    return True
