"""A diffusion LM (LLaDA-style masked diffusion, seeded weights) as a decode engine: blockwise denoising
with low-confidence remasking, streamed a block at a time through processor → decode as ordinary token
chunks, stop conditions, cancel between denoising steps, and `conveyor ask` against worker processes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from schemas.registry import Stage
from schemas.replies import FinalFrame, FinishReason
from schemas.sampling import SamplingOptions, StopConditions
from tests.conftest import Bus
from tests.pipeline_helpers import chat, client_of, run_cli_when_served, running_workers, worker_processes
from workers.decode import DecodeStage, MigrationPolicy
from workers.engines.factory import EngineKind, create_engine
from workers.engines.protocol import GenerateOutput, GenerateRequest
from workers.engines.torch_engine.diffusion_lm import SEEDED_DLLM, DiffusionLMEngine, DiffusionSettings
from workers.engines.torch_engine.loader import resolve_model
from workers.media import ImageInputs
from workers.processor import ProcessorStage
from workers.stages import served_model


@pytest.fixture(scope="module")
def engine() -> Iterator[DiffusionLMEngine]:
    built = DiffusionLMEngine(resolve_model(SEEDED_DLLM), SEEDED_DLLM, DiffusionSettings(block_length=8, steps_per_block=8))
    asyncio.run(built.start())
    yield built
    asyncio.run(built.shutdown())


async def run(engine: DiffusionLMEngine, request_id: str, **fields: object) -> list[GenerateOutput]:
    prompt = engine.tokenizer.encode("Write a haiku about message queues.")
    return [output async for output in engine.generate(GenerateRequest(request_id, prompt, **fields))]  # type: ignore[arg-type]


def answer(outputs: list[GenerateOutput]) -> list[int]:
    return [token for output in outputs for token in output.token_ids]


async def test_the_answer_is_denoised_block_by_block_and_streams_a_block_at_a_time(engine: DiffusionLMEngine) -> None:
    greedy = await run(engine, "a", stop=StopConditions(max_tokens=20, ignore_eos=True))
    again = await run(engine, "b", stop=StopConditions(max_tokens=20, ignore_eos=True))
    sampled = await run(engine, "c", stop=StopConditions(max_tokens=20, ignore_eos=True),
                        sampling=SamplingOptions(temperature=1.0, seed=5))
    assert [len(output.token_ids) for output in greedy if output.token_ids] == [8, 8, 4]
    assert engine.mask_token_id not in answer(greedy)
    assert greedy[-1].finish_reason == FinishReason.LENGTH and greedy[-1].completion_tokens == 20
    assert answer(again) == answer(greedy)  # greedy denoising is deterministic
    assert answer(sampled) != answer(greedy)
    assert "".join(output.text for output in greedy) == engine.tokenizer.decode(answer(greedy))


async def test_each_step_keeps_the_most_confident_predictions_and_the_rest_stay_masked(engine: DiffusionLMEngine) -> None:
    import torch

    from workers.engines.torch_engine.diffusion_lm import _Denoising

    prompt = engine.tokenizer.encode("hello")
    tokens = torch.tensor([*prompt, *([engine.mask_token_id] * 8)])
    state = _Denoising(tokens=tokens, generator=None, temperature=0.0)
    filled_per_step = []
    for steps_left in range(4, 0, -1):
        masked_before = int((state.tokens == engine.mask_token_id).sum())
        await asyncio.to_thread(engine._step, state, len(prompt), len(prompt) + 8, -(-masked_before // steps_left))
        filled_per_step.append(masked_before - int((state.tokens == engine.mask_token_id).sum()))
    assert filled_per_step == [2, 2, 2, 2]  # 8 masked over 4 steps: the 2 most confident each step
    assert state.tokens[: len(prompt)].tolist() == prompt  # the prompt is never rewritten


async def test_a_stop_token_ends_the_answer_where_it_is_denoised(engine: DiffusionLMEngine) -> None:
    free = answer(await run(engine, "d", stop=StopConditions(max_tokens=16, ignore_eos=True)))
    stop_token = free[5]
    stopped = await run(engine, "e", stop=StopConditions(max_tokens=16, ignore_eos=True, stop_token_ids=[stop_token]))
    assert answer(stopped) == free[: free.index(stop_token) + 1]
    assert stopped[-1].finish_reason == FinishReason.STOP and stopped[-1].matched_stop == stop_token


async def test_an_abort_lands_between_denoising_steps(engine: DiffusionLMEngine) -> None:
    task = asyncio.create_task(run(engine, "f", stop=StopConditions(max_tokens=256, ignore_eos=True)))
    await asyncio.sleep(0.3)
    aborted_at = time.monotonic()
    await engine.abort("f")
    outputs = await task
    assert outputs[-1].finish_reason == FinishReason.CANCELLED and time.monotonic() - aborted_at < 1.0
    assert len(answer(outputs)) < 256 and engine.load().running_requests == 0


async def test_a_diffusion_lm_answers_through_the_pipeline_and_cancels_mid_answer(bus: Bus) -> None:
    decode = DecodeStage(create_engine(EngineKind.TORCH, SEEDED_DLLM), SEEDED_DLLM, ImageInputs(None, "dllm-images"),
                         MigrationPolicy())
    specs = [(Stage.PROCESSOR, ProcessorStage({SEEDED_DLLM: served_model(EngineKind.TORCH, SEEDED_DLLM)})),
             (Stage.DECODE, decode)]
    async with running_workers(bus, specs, model=SEEDED_DLLM):
        client = client_of(bus)
        async with await client.submit(chat(client, "hi", model=SEEDED_DLLM, max_tokens=64, ignore_eos=True)) as stream:
            chunks, final = await stream.collect()
        long = chat(client, "tell me everything", model=SEEDED_DLLM, max_tokens=256, ignore_eos=True)
        async with await client.submit(long) as stream:
            received = stream.__aiter__()
            await received.__anext__()
            await client.cancel(long.request_id)
            rest = [chunk async for chunk in received]
        cancelled = stream.terminal
    assert isinstance(final, FinalFrame) and final.usage.completion_tokens == 64
    assert [len(chunk.token_ids) for chunk in chunks if chunk.token_ids] == [32, 32]  # a block per chunk
    assert isinstance(cancelled, FinalFrame) and cancelled.finish_reason == FinishReason.CANCELLED
    assert len(rest) < 7


async def test_conveyor_ask_answers_from_a_diffusion_lm_in_worker_processes(bus: Bus) -> None:
    url = bus.nats_settings.urls[0]
    async with worker_processes([url], bus.settings.namespace, ["processor", "decode"], engine="torch",
                                CONVEYOR_MODEL=SEEDED_DLLM):
        done = await run_cli_when_served(url, bus.settings.namespace, "ask", "Say something.", "--model", SEEDED_DLLM,
                                         "--max-tokens", "40")
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().strip()  # the streamed answer: words from the model's vocabulary


async def test_a_confidence_threshold_still_finishes_each_block_within_its_steps() -> None:
    # 32 tokens per block in 4 steps: the predictions above the threshold are too few at random weights, so each
    # step keeps at least the share (8) that fills the block in time, and the answer is never cut short.
    engine = DiffusionLMEngine(resolve_model(SEEDED_DLLM), SEEDED_DLLM,
                               DiffusionSettings(block_length=32, steps_per_block=4, threshold=0.9))
    await engine.start()
    outputs = await run(engine, "threshold", stop=StopConditions(max_tokens=64, ignore_eos=True))
    assert outputs[-1].finish_reason == FinishReason.LENGTH and len(answer(outputs)) == 64
    assert engine.mask_token_id not in answer(outputs)
