"""The pipeline on the real default model: aggregated and disaggregated (KV over NIXL) agree, and a
cancel during prefill stops the request and frees the prefill engine's blocks."""

from __future__ import annotations

import asyncio
import time

from schemas.registry import ServingMode, Stage
from schemas.replies import FinalFrame, FinishReason
from tests.conftest import Bus
from tests.helpers import metric, wait_until
from tests.pipeline_helpers import chat, client_of, running_workers
from workers.decode import DecodeStage
from workers.engines.factory import EngineKind
from workers.engines.protocol import DisaggregationRole
from workers.engines.torch_engine.engine import TorchEngine, TorchEngineConfig
from workers.engines.torch_engine.loader import DEFAULT_MODEL
from workers.prefill import PrefillStage
from workers.processor import ProcessorStage
from workers.stages import served_model

QUESTIONS = ["What is the capital of France?", "Name three colours of the rainbow."]


def processor() -> ProcessorStage:
    return ProcessorStage({DEFAULT_MODEL: served_model(EngineKind.TORCH, DEFAULT_MODEL)})


def engine(role: DisaggregationRole = DisaggregationRole.NONE) -> TorchEngine:
    return TorchEngine(TorchEngineConfig(role=role, max_step_tokens=128))


async def answer(bus: Bus, question: str) -> tuple[list[int], str, FinalFrame]:
    client = client_of(bus)
    request = chat(client, question, model=DEFAULT_MODEL, temperature=0.0, max_tokens=24)
    async with await client.submit(request, first_frame_timeout_s=60) as stream:
        chunks, final = await stream.collect()
    assert isinstance(final, FinalFrame)
    return [t for c in chunks for t in c.token_ids], "".join(c.text or "" for c in chunks), final


async def test_aggregated_and_disaggregated_give_the_same_greedy_tokens(bus: Bus) -> None:
    async with running_workers(bus, [(Stage.PROCESSOR, processor()), (Stage.DECODE, DecodeStage(engine(), DEFAULT_MODEL))],
                               model=DEFAULT_MODEL):
        aggregated = [await answer(bus, q) for q in QUESTIONS]
    specs = [
        (Stage.PROCESSOR, processor()),
        (Stage.DECODE, DecodeStage(engine(DisaggregationRole.DECODE), DEFAULT_MODEL)),
        (Stage.PREFILL, PrefillStage(engine(DisaggregationRole.PREFILL), DEFAULT_MODEL)),
    ]
    async with running_workers(bus, specs, model=DEFAULT_MODEL, mode=ServingMode.DISAGGREGATED):
        disaggregated = [await answer(bus, q) for q in QUESTIONS]
    assert "Paris" in aggregated[0][1]
    for (agg_tokens, agg_text, agg_final), (dis_tokens, dis_text, dis_final) in zip(aggregated, disaggregated, strict=True):
        assert agg_tokens == dis_tokens and agg_text == dis_text
        assert agg_final.finish_reason == dis_final.finish_reason
        assert agg_final.usage.completion_tokens == dis_final.usage.completion_tokens


async def test_cancel_during_prefill_tells_the_client_and_frees_the_prefill_blocks(bus: Bus) -> None:
    prefill_engine = engine(DisaggregationRole.PREFILL)
    specs = [
        (Stage.PROCESSOR, processor()),
        (Stage.DECODE, DecodeStage(engine(DisaggregationRole.DECODE), DEFAULT_MODEL)),
        (Stage.PREFILL, PrefillStage(prefill_engine, DEFAULT_MODEL)),
    ]
    async with running_workers(bus, specs, model=DEFAULT_MODEL, mode=ServingMode.DISAGGREGATED):
        client = client_of(bus)
        long_question = "Summarize this: " + "the cat sat on the mat and looked at the hat. " * 150
        request = chat(client, long_question, model=DEFAULT_MODEL, temperature=0.0, max_tokens=16)
        async with await client.submit(request, first_frame_timeout_s=60) as stream:
            await wait_until(lambda: prefill_engine.load().running_requests > 0, timeout_s=20)
            sent_at = time.monotonic()
            await client.cancel(request.request_id)
            chunks, final = await stream.collect()
            latency_s = time.monotonic() - sent_at
        assert isinstance(final, FinalFrame) and final.finish_reason == FinishReason.CANCELLED and not chunks
        assert latency_s < 1.0
        await wait_until(lambda: prefill_engine.load().kv_used_blocks == 0, timeout_s=5)
        # The workers keep serving.
        _, text, after = await answer(bus, QUESTIONS[0])
        assert after.finish_reason == FinishReason.STOP and "Paris" in text


async def test_kv_routing_sends_a_repeated_prefix_to_the_torch_replica_that_cached_it(bus: Bus) -> None:
    from bus.router import RouterMode, RouterOptions

    routed = ProcessorStage({DEFAULT_MODEL: served_model(EngineKind.TORCH, DEFAULT_MODEL)}, RouterOptions(RouterMode.KV))
    decoders = [DecodeStage(engine(), DEFAULT_MODEL) for _ in range(2)]
    system = "You are a terse assistant who answers in one short sentence, never more, and never asks back. " * 3
    async with running_workers(bus, [(Stage.PROCESSOR, routed)] + [(Stage.DECODE, d) for d in decoders],
                               model=DEFAULT_MODEL):
        first = await answer(bus, system + "What is the capital of France?")
        assert routed._router is not None
        await wait_until(lambda: routed._router is not None and routed._router.index.num_blocks > 0, timeout_s=10)
        repeats = []
        for question in ("Name a colour.", "Name a fruit.", "Name a city."):
            # Let the last answer's engine report itself idle (load reports come at most every 50 ms): the router
            # weighs a replica's running requests against its cache, and a busy holder may rightly be passed over.
            await asyncio.sleep(0.3)
            repeats.append(await answer(bus, system + question))
    prompt_blocks = first[2].usage.prompt_tokens // 16
    assert first[2].usage.cached_tokens == 0
    # The system prompt's blocks (all but the last few of the prompt) were found cached every time.
    assert all(r[2].usage.cached_tokens >= (prompt_blocks - 3) * 16 for r in repeats), [r[2].usage for r in repeats]


async def test_conditional_disaggregation_runs_short_prompts_on_the_decode_worker(bus: Bus) -> None:
    from bus.router import RouterOptions

    routed = ProcessorStage({DEFAULT_MODEL: served_model(EngineKind.TORCH, DEFAULT_MODEL)},
                            RouterOptions(local_prefill_max_tokens=48))
    specs = [
        (Stage.PROCESSOR, routed),
        (Stage.DECODE, DecodeStage(engine(DisaggregationRole.DECODE), DEFAULT_MODEL)),
        (Stage.PREFILL, PrefillStage(engine(DisaggregationRole.PREFILL), DEFAULT_MODEL)),
    ]
    long_question = "Please answer carefully and briefly, in one sentence only: " * 4 + QUESTIONS[0]
    async with running_workers(bus, specs, model=DEFAULT_MODEL, mode=ServingMode.DISAGGREGATED):
        prefills = prefills_done()
        local_before = metric("conveyor_disaggregation_decisions_total", where="local", why="short")
        short = await answer(bus, QUESTIONS[0])
        assert prefills_done() == prefills
        long = await answer(bus, long_question)
        await wait_until(lambda: prefills_done() == prefills + 1, timeout_s=10)
    assert short[2].usage.prompt_tokens <= 48 < long[2].usage.prompt_tokens
    assert "Paris" in short[1] and long[2].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    assert metric("conveyor_disaggregation_decisions_total", where="local", why="short") == local_before + 1


def prefills_done() -> float:
    return sum(metric("conveyor_requests_total", stage="prefill", model=DEFAULT_MODEL, outcome=outcome)
               for outcome in ("length", "stop"))
