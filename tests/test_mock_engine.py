"""The mock engine: its simulated timing, batch limit, prefix cache, events and abort."""

from __future__ import annotations

import asyncio
import time

import pytest

from schemas.kv_events import BlockStored
from schemas.replies import FinishReason
from schemas.sampling import StopConditions
from schemas.kv_hashing import chain_hashes
from workers.engines.mock import MockEngine, MockEngineConfig
from workers.engines.protocol import Engine, GenerateOutput, GenerateRequest, MemoryTag


async def run(engine: MockEngine, request: GenerateRequest) -> list[GenerateOutput]:
    return [output async for output in engine.generate(request)]


def test_mock_engine_implements_the_engine_protocol() -> None:
    assert isinstance(MockEngine(), Engine)


async def test_time_to_first_token_and_inter_token_latency_follow_the_config() -> None:
    engine = MockEngine(MockEngineConfig(ttft_base_s=0.05, ttft_per_prompt_token_s=0.001, inter_token_s=0.02))
    started = time.perf_counter()
    stamps: list[float] = []
    async for _ in engine.generate(GenerateRequest("t", list(range(100)), stop=StopConditions(max_tokens=6))):
        stamps.append(time.perf_counter() - started)
    assert 0.14 <= stamps[0] < 0.3  # 0.05 + 100 × 0.001
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    assert len(stamps) == 6 and all(0.015 <= gap < 0.08 for gap in gaps)


async def test_a_stream_interval_sends_the_first_token_alone_and_the_rest_that_many_a_frame() -> None:
    request = GenerateRequest("s", [5, 6, 7], stop=StopConditions(max_tokens=10))
    one_a_frame = await run(MockEngine(MockEngineConfig(inter_token_s=0.0)), request)
    four_a_frame = await run(MockEngine(MockEngineConfig(inter_token_s=0.0, stream_interval=4)), request)
    assert [len(output.token_ids) for output in four_a_frame] == [1, 4, 4, 1]
    assert [t for o in four_a_frame for t in o.token_ids] == [t for o in one_a_frame for t in o.token_ids]
    assert "".join(o.text for o in four_a_frame) == "".join(o.text for o in one_a_frame)
    assert four_a_frame[-1].completion_tokens == 10


async def test_a_cancel_between_frames_sends_the_tokens_already_made_with_the_end() -> None:
    engine = MockEngine(MockEngineConfig(ttft_base_s=0.0, ttft_per_prompt_token_s=0.0, inter_token_s=0.02,
                                         stream_interval=8))

    async def abort_mid_frame() -> None:  # 3-4 tokens into the second frame of 8
        await asyncio.sleep(0.07)
        await engine.abort("c")

    outputs: list[GenerateOutput] = []
    async for output in engine.generate(GenerateRequest("c", [5, 6, 7], stop=StopConditions(max_tokens=100))):
        outputs.append(output)
        if len(outputs) == 1:
            aborting = asyncio.create_task(abort_mid_frame())
    await aborting
    final = outputs[-1]
    assert final.finish_reason == FinishReason.CANCELLED
    assert sum(len(o.token_ids) for o in outputs) == final.completion_tokens > 1


async def test_requests_beyond_the_batch_limit_wait_for_a_slot() -> None:
    engine = MockEngine(MockEngineConfig(max_running_requests=2, ttft_base_s=0.0, ttft_per_prompt_token_s=0.0,
                                         inter_token_s=0.05))
    started = time.perf_counter()
    requests = [GenerateRequest(f"b{i}", [i + 5] * 4, stop=StopConditions(max_tokens=3)) for i in range(4)]
    await asyncio.gather(*(run(engine, request) for request in requests))
    # Two waves of ~0.1 s each.
    assert time.perf_counter() - started >= 0.2


async def test_lockstep_requests_get_their_tokens_in_the_same_steps() -> None:
    # Started 10 ms apart with 30 ms per token: on their own timers their tokens would stay 10 ms apart.
    engine = MockEngine(MockEngineConfig(lockstep=True, ttft_base_s=0.0, ttft_per_prompt_token_s=0.0,
                                         inter_token_s=0.03))
    stamps: dict[str, list[float]] = {}

    async def timed(name: str, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        async for _ in engine.generate(GenerateRequest(name, [7, 8, 9], stop=StopConditions(max_tokens=5))):
            stamps.setdefault(name, []).append(time.perf_counter())

    await asyncio.gather(timed("a", 0.0), timed("b", 0.01), timed("c", 0.02))
    # After each request's first token (its prefill), every later token comes in a step all three share.
    later = {name: times[1:] for name, times in stamps.items()}
    assert all(len(times) == 4 for times in later.values())
    # On their own timers b and c would be 10 and 20 ms off a; within one shared step they are one loop turn apart,
    # which a pause on a busy 2-core machine (a fresh-clone CI run) stretched past 2 ms once: 5 ms still tells
    # them apart.
    for a_time in later["a"][2:]:  # by a's third step the others have joined its clock
        assert any(abs(a_time - other) < 0.005 for other in later["b"])
        assert any(abs(a_time - other) < 0.005 for other in later["c"])


async def test_repeated_prefix_is_reported_cached_and_stored_blocks_are_announced() -> None:
    engine = MockEngine(MockEngineConfig(inter_token_s=0.0))
    events = engine.kv_events()
    first_batch = asyncio.ensure_future(events.__anext__())
    prompt = list(range(10, 74))  # four full blocks of 16
    first = await run(engine, GenerateRequest("p1", prompt, stop=StopConditions(max_tokens=2)))
    second = await run(engine, GenerateRequest("p2", prompt + [5, 6], stop=StopConditions(max_tokens=2)))
    batch = await asyncio.wait_for(first_batch, 1)
    assert first[-1].cached_tokens == 0 and second[-1].cached_tokens == 64
    assert isinstance(batch.events[0], BlockStored)
    assert batch.events[0].block_hashes == chain_hashes(prompt, 16)


@pytest.mark.parametrize("lockstep", [False, True], ids=["own-timer", "lockstep"])
async def test_abort_ends_the_stream_cancelled(lockstep: bool) -> None:
    # In lockstep the abort is seen at the next step, as a batch engine sees it between steps.
    engine = MockEngine(MockEngineConfig(inter_token_s=0.05, lockstep=lockstep))
    outputs: list[GenerateOutput] = []
    async for output in engine.generate(GenerateRequest("a", [1, 2, 3], stop=StopConditions(max_tokens=100))):
        outputs.append(output)
        if len(outputs) == 2:
            await engine.abort("a")
    assert outputs[-1].finish_reason == FinishReason.CANCELLED and len(outputs) == 3
    assert engine.load().kv_used_blocks == 0


async def test_released_memory_refuses_work_until_resumed() -> None:
    engine = MockEngine(MockEngineConfig(inter_token_s=0.0))
    await engine.release_memory([MemoryTag.KV_CACHE])
    with pytest.raises(RuntimeError, match="released"):
        await run(engine, GenerateRequest("r", [1], stop=StopConditions(max_tokens=1)))
    await engine.resume_memory([MemoryTag.KV_CACHE])
    assert (await run(engine, GenerateRequest("r2", [1], stop=StopConditions(max_tokens=1))))[-1].finished


def test_torch_engine_implements_the_engine_protocol() -> None:
    from workers.engines.torch_engine.engine import TorchEngine

    assert isinstance(TorchEngine(), Engine)
