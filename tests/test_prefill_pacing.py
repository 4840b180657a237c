"""Prefill pacing (workers/engines/pacing.py): a burst reaches the engine a budget's worth of prompt at a time, in
arrival order, the next share once the last has started decoding, and a cancelled request never reaches it; and how
the SGLang adapter uses it, driven through a stand-in for SGLang's `async_generate` (sglang itself needs a GPU)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from schemas.replies import FinishReason
from schemas.tasks import BootstrapInfo
from workers.engines.pacing import PrefillBudget, Withdrawn
from workers.engines.protocol import DisaggregationRole, GenerateRequest
from workers.engines.sglang_engine import SGLangEngine, SGLangEngineConfig


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_burst_is_admitted_a_budgets_worth_at_a_time_in_arrival_order() -> None:
    budget = PrefillBudget(1000)
    admitted: list[str] = []
    admissions = {}

    async def arrive(name: str, num_tokens: int) -> None:
        admissions[name] = await budget.admit(name, num_tokens)
        admitted.append(name)

    tasks = [asyncio.create_task(arrive(name, n)) for name, n in
             [("a", 600), ("b", 400), ("c", 700), ("d", 100), ("e", 200)]]
    await _settle()
    assert admitted == ["a", "b"] and budget.pending_tokens == 1000
    admissions["a"].release()
    await _settle()
    # c (700) does not fit beside b (400); d, small enough, still waits behind it.
    assert admitted == ["a", "b"] and budget.num_waiting == 3
    admissions["b"].release()
    await _settle()
    assert admitted == ["a", "b", "c", "d", "e"] and budget.pending_tokens == 1000
    await asyncio.gather(*tasks)


async def test_a_prompt_longer_than_the_budget_goes_alone() -> None:
    budget = PrefillBudget(100)
    first = await budget.admit("long", 5000)
    waiting = asyncio.create_task(budget.admit("short", 10))
    await _settle()
    assert not waiting.done()
    first.release()
    first.release()  # a second release gives nothing back twice
    second = await waiting
    assert budget.pending_tokens == 10 and budget.num_pending == 1
    second.release()
    assert budget.pending_tokens == 0 and budget.num_pending == 0


async def test_a_withdrawn_request_stops_waiting_and_lets_the_next_in() -> None:
    budget = PrefillBudget(100)
    held = await budget.admit("held", 90)
    withdrawn = asyncio.create_task(budget.admit("withdrawn", 50))
    after = asyncio.create_task(budget.admit("after", 10))
    await _settle()
    assert budget.withdraw("withdrawn") and not budget.withdraw("withdrawn") and not budget.withdraw("held")
    with pytest.raises(Withdrawn):
        await withdrawn
    assert (await after).num_tokens == 10  # 90 + 10 fit once the head left
    held.release()


async def test_a_waiter_cancelled_after_its_grant_gives_its_share_back() -> None:
    budget = PrefillBudget(100)
    held = await budget.admit("held", 100)
    waiter = asyncio.create_task(budget.admit("w", 100))
    await _settle()
    held.release()  # grants w ...
    waiter.cancel()  # ... which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert budget.pending_tokens == 0 and budget.num_pending == 0


class _StandInSGLang:
    """What the adapter calls on `sglang.Engine`: `async_generate` streams a request's three tokens one engine step
    at a time, as the test steps it (`step(rid)`), the last with its finish; `tokenizer_manager.abort_request` is
    recorded."""

    def __init__(self) -> None:
        self.submitted: list[str] = []
        self.steps: dict[str, asyncio.Semaphore] = {}
        self.aborted: list[str] = []
        self.tokenizer_manager = self

    def abort_request(self, rid: str) -> None:
        self.aborted.append(rid)

    def step(self, rid: str, num_steps: int = 1) -> None:
        for _ in range(num_steps):
            self.steps[rid].release()

    async def async_generate(self, *, rid: str, input_ids: list[int], **_: Any) -> AsyncIterator[dict[str, Any]]:
        self.submitted.append(rid)
        self.steps[rid] = asyncio.Semaphore(0)

        async def items() -> AsyncIterator[dict[str, Any]]:
            yield {"output_ids": [], "meta_info": {}}  # an idle tick before the prefill ends
            for token in (7, 8):
                await self.steps[rid].acquire()
                yield {"output_ids": [token], "meta_info": {}}
            await self.steps[rid].acquire()
            yield {"output_ids": [9], "meta_info": {"finish_reason": {"type": "length"},
                                                    "prompt_tokens": len(input_ids), "completion_tokens": 3}}

        return items()


async def _collect(engine: SGLangEngine, request: GenerateRequest) -> list[Any]:
    return [output async for output in engine.generate(request)]


async def test_sglang_gets_the_next_prompts_once_the_first_ones_took_a_decode_step() -> None:
    engine = SGLangEngine(SGLangEngineConfig(model_path="/models/x", prefill_budget_tokens=1000))
    engine._engine = sglang = _StandInSGLang()
    runs = {rid: asyncio.create_task(_collect(engine, GenerateRequest(rid, list(range(400)))))
            for rid in ["r1", "r2", "r3", "r4"]}
    await _settle()
    assert sglang.submitted == ["r1", "r2"]  # 800 of 1000 tokens; a third would not fit
    load = engine.load()
    assert (load.waiting_requests, load.waiting_prompt_tokens) == (2, 800)  # held here, counted as SGLang's queue is
    sglang.step("r1")
    await _settle()
    assert sglang.submitted == ["r1", "r2"]  # r1's prefill is done, but no decode step has run after it yet
    sglang.step("r1")
    await _settle()
    assert sglang.submitted == ["r1", "r2", "r3"]  # its second token is out: its share goes to r3
    sglang.step("r2", 2)
    await _settle()
    assert sglang.submitted == ["r1", "r2", "r3", "r4"]
    for rid, num_steps in [("r1", 1), ("r2", 1), ("r3", 3), ("r4", 3)]:
        sglang.step(rid, num_steps)
    outputs = {rid: await run for rid, run in runs.items()}
    assert all([o.token_ids for o in out] == [[7], [8], [9]] for out in outputs.values())


async def test_a_request_cancelled_while_it_waits_ends_cancelled_without_reaching_sglang() -> None:
    engine = SGLangEngine(SGLangEngineConfig(model_path="/models/x", prefill_budget_tokens=100))
    engine._engine = sglang = _StandInSGLang()
    first = asyncio.create_task(_collect(engine, GenerateRequest("first", list(range(100)))))
    waiting = asyncio.create_task(_collect(engine, GenerateRequest("waiting", list(range(50)))))
    await _settle()
    await engine.abort("waiting")
    outputs = await waiting
    assert [o.finish_reason for o in outputs] == [FinishReason.CANCELLED]
    assert "waiting" not in sglang.submitted and "waiting" not in sglang.aborted
    sglang.step("first", 3)
    assert [o.token_ids for o in await first] == [[7], [8], [9]]


async def test_only_an_aggregated_engine_paces_and_zero_turns_pacing_off() -> None:
    for role, budget_tokens in [(DisaggregationRole.DECODE, 100), (DisaggregationRole.PREFILL, 100),
                                (DisaggregationRole.NONE, 0)]:
        engine = SGLangEngine(SGLangEngineConfig(model_path="/models/x", role=role,
                                                 prefill_budget_tokens=budget_tokens))
        engine._engine = sglang = _StandInSGLang()
        disaggregated = role != DisaggregationRole.NONE
        bootstrap = (BootstrapInfo(bootstrap_host="10.0.0.1", bootstrap_port=8998, bootstrap_room=1)
                     if disaggregated else None)
        runs = [asyncio.create_task(_collect(engine, GenerateRequest(f"r{i}", list(range(100)), bootstrap=bootstrap)))
                for i in range(3)]
        await _settle()
        assert len(sglang.submitted) == 3, role
        for rid in sglang.submitted:
            sglang.step(rid, 3)
        await asyncio.gather(*runs)


async def test_prompt_blocks_the_engine_holds_are_not_counted_against_the_budget() -> None:
    from workers.engines.sglang_engine import KvEventRelay, decode_event_frames
    from tests.test_sglang_adapter import sglang_frame

    engine = SGLangEngine(SGLangEngineConfig(model_path="/models/x", prefill_budget_tokens=100))
    engine._engine = sglang = _StandInSGLang()
    engine._relay = relay = KvEventRelay("tcp://127.0.0.1:1")
    prefix = list(range(1000, 1096))  # six pages of 16, held by the engine
    stored = decode_event_frames(sglang_frame(0, [["BlockStored", [1, 2, 3, 4, 5, 6], None, prefix, 16, None, None]]))
    assert stored is not None
    relay.translated(stored[1])
    assert relay.keys.cached_prefix_tokens(prefix + [1, 2, 3], 16) == 96
    runs = [asyncio.create_task(_collect(engine, GenerateRequest(f"r{i}", prefix + [i] * 40))) for i in range(3)]
    await _settle()
    assert len(sglang.submitted) == 2  # 40 new tokens each: two fit in 100, though each prompt is 136 long
    for rid in list(sglang.submitted):
        sglang.step(rid, 3)
    await _settle()
    assert len(sglang.submitted) == 3
    sglang.step("r2", 3)
    await asyncio.gather(*runs)
