"""Pools: the grid picks a pool per request, priorities override it, a failure before any output moves the task to a
faster pool; and the load-based conditional-disaggregation rule, both ways."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from bus.errors import RemoteError
from bus.pools import (
    AggregatedPools,
    Axis,
    PoolsConfig,
    PoolsConfigError,
    PrefillPools,
    PriorityOverride,
    RequestTargets,
    TargetDefaults,
)
from bus.router import Router, RouterMode, RouterOptions
from schemas.codec import encode
from schemas.registry import KvCapacity, ServingMode, Stage, WorkerCard, WorkerLoad
from schemas.codec import WIRE_VERSION
from schemas.replies import ErrorCode, FinalFrame, FinishReason
from tests.conftest import Bus
from tests.helpers import metric, wait_until
from tests.pipeline_helpers import MOCK, RecordingMockEngine, client_of, completion, mock_decode, running_workers
from workers.decode import DecodeStage
from workers.engines.factory import EngineKind
from workers.engines.mock import MockEngineConfig
from workers.engines.protocol import GenerateOutput, GenerateRequest
from workers.processor import ProcessorStage
from workers.stages import served_model

NO_DEFAULTS = TargetDefaults()


def two_pools(**fields: object) -> AggregatedPools:
    """fast = index 0, cheap = index 1; a tight TTFT target (first half of 0..1000 ms) always gets fast, a loose one
    gets cheap unless the ITL target is tight too."""
    return AggregatedPools(pools=["fast", "cheap"], ttft_ms=Axis(min=0, max=1000, resolution=2),
                           itl_ms=Axis(min=0, max=50, resolution=2), mapping=[[0, 0], [0, 1]], **fields)  # type: ignore[arg-type]


def test_the_grid_maps_latency_targets_to_pools_and_a_missing_target_to_the_middle() -> None:
    grid = two_pools()
    assert grid.choose(RequestTargets(10, ttft_target_ms=100, itl_target_ms=40), NO_DEFAULTS) == ["fast"]
    assert grid.choose(RequestTargets(10, ttft_target_ms=900, itl_target_ms=5), NO_DEFAULTS) == ["fast"]
    assert grid.choose(RequestTargets(10, ttft_target_ms=900, itl_target_ms=40), NO_DEFAULTS) == ["cheap"]
    # No targets: the middle of each axis (500 ms, 25 ms) falls in the upper buckets; an explicit 0 is the fastest.
    assert grid.choose(RequestTargets(10), NO_DEFAULTS) == ["cheap"]
    assert grid.choose(RequestTargets(10, ttft_target_ms=0), NO_DEFAULTS) == ["fast"]
    # The deployment's default stands in for a missing target; values past the axis clamp to its ends.
    assert grid.choose(RequestTargets(10), TargetDefaults(ttft_ms=50)) == ["fast"]
    assert grid.choose(RequestTargets(10, ttft_target_ms=10**6, itl_target_ms=10**6), NO_DEFAULTS) == ["cheap"]


def test_prefill_pools_split_by_prompt_length() -> None:
    grid = PrefillPools(pools=["short", "long"], isl_tokens=Axis(min=0, max=2048, resolution=2),
                        ttft_ms=Axis(min=0, max=1000, resolution=1), mapping=[[0], [1]])
    assert grid.choose(RequestTargets(prompt_tokens=100), NO_DEFAULTS) == ["short"]
    assert grid.choose(RequestTargets(prompt_tokens=1500), NO_DEFAULTS) == ["long"]


def test_the_first_matching_priority_override_wins_over_the_grid() -> None:
    grid = two_pools(priority_overrides=[PriorityOverride(min_priority=10, max_priority=20, pool="fast"),
                                         PriorityOverride(min_priority=15, max_priority=99, pool="cheap")])
    loose = dict(ttft_target_ms=900, itl_target_ms=40)
    assert grid.choose(RequestTargets(10, priority=20, **loose), NO_DEFAULTS) == ["fast"]  # both ends included
    assert grid.choose(RequestTargets(10, priority=50, ttft_target_ms=0), NO_DEFAULTS) == ["cheap"]
    assert grid.choose(RequestTargets(10, priority=9, **loose), NO_DEFAULTS) == ["cheap"]


def test_retries_go_to_strictly_faster_pools_slower_first() -> None:
    grid = AggregatedPools(pools=["a", "b", "c", "d"], priorities=[0, 2, 1, 2], ttft_ms=Axis(min=0, max=4, resolution=4),
                           itl_ms=Axis(min=0, max=1, resolution=1), mapping=[[0], [1], [2], [3]],
                           retry_on_faster_pool=True)
    assert grid.choose(RequestTargets(1, ttft_target_ms=3.5), NO_DEFAULTS) == ["d", "c", "a"]  # b is as slow as d
    assert grid.choose(RequestTargets(1, ttft_target_ms=0), NO_DEFAULTS) == ["a"]
    assert two_pools().choose(RequestTargets(1), NO_DEFAULTS) == ["cheap"]  # retries off


def test_a_pools_file_is_read_from_toml_or_json_and_its_mistakes_are_named(tmp_path: Path) -> None:
    toml = tmp_path / "pools.toml"
    toml.write_text('[[models]]\nmodel = "m"\n[models.aggregated]\npools = ["fast", "cheap"]\n'
                    'ttft_ms = { min = 0, max = 1000, resolution = 2 }\nitl_ms = { min = 0, max = 50, resolution = 1 }\n'
                    'mapping = [[0], [1]]\n')
    config = PoolsConfig.from_file(toml)
    assert config.of("m") is not None and config.of("other") is None
    bad = tmp_path / "pools.json"
    bad.write_text(json.dumps({"models": [{"model": "m", "aggregated": {
        "pools": ["fast"], "ttft_ms": {"min": 0, "max": 1000, "resolution": 2},
        "itl_ms": {"min": 0, "max": 50, "resolution": 1}, "mapping": [[0]]}}]}))
    with pytest.raises(PoolsConfigError, match=r"pools.json: models.0.aggregated: .*mapping must be 2 rows of 1"):
        PoolsConfig.from_file(bad)
    bad.write_text(json.dumps({"models": [{"model": "m", "aggregated": {
        "pools": ["fast"], "ttft_ms": {"min": 0, "max": 1, "resolution": 1}, "itl_ms": {"min": 0, "max": 1, "resolution": 1},
        "mapping": [[0]], "priority_overrides": [{"min_priority": 0, "max_priority": 1, "pool": "turbo"}]}}]}))
    with pytest.raises(PoolsConfigError, match="names pool 'turbo'"):
        PoolsConfig.from_file(bad)
    with pytest.raises(PoolsConfigError, match="not valid TOML"):
        toml.write_text("[[models]\n")
        PoolsConfig.from_file(toml)
    with pytest.raises(PoolsConfigError, match="cannot read"):
        PoolsConfig.from_file(tmp_path / "missing.toml")


def mock_pools(retry: bool = False) -> PoolsConfig:
    return PoolsConfig(models=[{"model": MOCK, "aggregated": two_pools(retry_on_faster_pool=retry)}])  # type: ignore[list-item]


@pytest.fixture
async def pooled(bus: Bus) -> AsyncIterator[tuple[DecodeStage, DecodeStage]]:
    """A processor with the two pools, one mock decode worker in each."""
    fast, cheap = mock_decode(), mock_decode()
    processor = ProcessorStage({MOCK: served_model(EngineKind.MOCK, MOCK)}, RouterOptions(RouterMode.QUEUE), mock_pools())
    async with running_workers(bus, [(Stage.PROCESSOR, processor), (Stage.DECODE, fast), (Stage.DECODE, cheap)],
                               pools=[None, "fast", "cheap"]):
        yield fast, cheap


async def serve(bus: Bus, **fields: object) -> tuple[int, FinalFrame]:
    client = client_of(bus)
    async with await client.submit(completion(client, [5, 6, 7, 8], max_tokens=3, **fields),
                                   first_frame_timeout_s=20) as stream:
        chunks, final = await stream.collect()
    assert isinstance(final, FinalFrame)
    return sum(len(c.token_ids) for c in chunks), final


async def test_requests_go_to_the_pool_their_targets_and_priority_pick(bus: Bus,
                                                                       pooled: tuple[DecodeStage, DecodeStage]) -> None:
    fast, cheap = (stage.engine for stage in pooled)
    await serve(bus, ttft_target_ms=50)
    await serve(bus, ttft_target_ms=800, itl_target_ms=40)
    await serve(bus)  # no targets: the middle, the cheap pool
    assert (len(fast.seen), len(cheap.seen)) == (1, 2)  # type: ignore[attr-defined]
    assert metric("conveyor_pool_choices_total", stage="decode", pool="fast", why="chosen") >= 1


async def test_a_pool_without_a_ready_worker_is_refused_by_name(bus: Bus) -> None:
    processor = ProcessorStage({MOCK: served_model(EngineKind.MOCK, MOCK)}, RouterOptions(), mock_pools())
    async with running_workers(bus, [(Stage.PROCESSOR, processor), (Stage.DECODE, mock_decode())],
                               pools=[None, "cheap"]):
        client = client_of(bus)
        async with await client.submit(completion(client, [5, 6, 7], max_tokens=2, ttft_target_ms=0),
                                       first_frame_timeout_s=20) as stream:
            with pytest.raises(RemoteError) as caught:
                await stream.collect()
    assert caught.value.code == ErrorCode.UNKNOWN_MODEL and "pool 'fast'" in caught.value.frame.message


class FailingEngine(RecordingMockEngine):
    """Fails every request before its first token, as an engine out of memory would."""

    async def generate(self, request: GenerateRequest):  # type: ignore[no-untyped-def,override]
        if request.request_id.startswith("canary"):
            async for output in super().generate(request):
                yield output
            return
        self.seen.append(request.request_id)
        await asyncio.sleep(0.01)
        yield GenerateOutput([], finish_reason=FinishReason.ERROR, error="device lost")


async def test_a_failure_before_any_output_moves_the_request_to_a_faster_pool(bus: Bus) -> None:
    fast, broken = mock_decode(), DecodeStage(FailingEngine(MockEngineConfig()), MOCK)  # type: ignore[arg-type]
    processor = ProcessorStage({MOCK: served_model(EngineKind.MOCK, MOCK)}, RouterOptions(), mock_pools(retry=True))
    handovers = metric("conveyor_pool_handovers_total", stage="decode", pool="fast")
    async with running_workers(bus, [(Stage.PROCESSOR, processor), (Stage.DECODE, fast), (Stage.DECODE, broken)],
                               pools=[None, "fast", "cheap"]):
        num_tokens, final = await serve(bus)  # the cheap pool's, whose engine fails
    assert num_tokens == 3 and final.finish_reason == FinishReason.LENGTH
    assert len(broken.engine.seen) == 1 and len(fast.engine.seen) == 1  # type: ignore[attr-defined]
    assert metric("conveyor_pool_handovers_total", stage="decode", pool="fast") == handovers + 1


async def test_without_retries_the_client_gets_the_pools_failure(bus: Bus) -> None:
    fast, broken = mock_decode(), DecodeStage(FailingEngine(MockEngineConfig()), MOCK)  # type: ignore[arg-type]
    processor = ProcessorStage({MOCK: served_model(EngineKind.MOCK, MOCK)}, RouterOptions(), mock_pools(retry=False))
    async with running_workers(bus, [(Stage.PROCESSOR, processor), (Stage.DECODE, fast), (Stage.DECODE, broken)],
                               pools=[None, "fast", "cheap"]):
        client = client_of(bus)
        async with await client.submit(completion(client, [5, 6, 7], max_tokens=2), first_frame_timeout_s=20) as stream:
            with pytest.raises(RemoteError, match="device lost"):
                await stream.collect()
    assert len(fast.engine.seen) == 0  # type: ignore[attr-defined]


def card(worker_id: str, stage: Stage, prefills_locally: bool = False) -> WorkerCard:
    return WorkerCard(worker_id=worker_id, stage=stage, model=MOCK, mode=ServingMode.DISAGGREGATED, engine="test",
                      host="h", pid=1, started_at_s=0.0, ready=True, prefills_locally=prefills_locally,
                      kv=KvCapacity(block_size=16, total_blocks=1000, used_blocks=0), wire_version=WIRE_VERSION)


async def test_prompts_run_on_the_decode_worker_while_every_prefill_replica_is_busy(bus: Bus) -> None:
    router = Router(bus.nc, bus.js, bus.names, bus.settings,
                    RouterOptions(RouterMode.KV, local_prefill_max_tokens=32, prefill_busy_tokens=1000,
                                  snapshot_interval_s=0))
    await router.start()
    cards = [card("p1", Stage.PREFILL), card("p2", Stage.PREFILL), card("d1", Stage.DECODE, prefills_locally=True)]
    short, long = list(range(20)), list(range(500))

    async def report(worker_id: str, waiting_prompt_tokens: int) -> None:
        load = WorkerLoad(worker_id=worker_id, kv_used_blocks=0, running_requests=1, waiting_requests=1,
                          waiting_prompt_tokens=waiting_prompt_tokens)
        await bus.nc.publish(bus.names.load_subject(worker_id), encode(load))
        await wait_until(lambda: router._loads.get(worker_id, (0, None))[1] == load, timeout_s=5)

    try:
        await report("p1", 5000)
        await report("p2", 200)
        # One prefill replica has room: the long prompt goes remote, the short one stays local (isl rule).
        assert router.local_prefill(MOCK, long, cards) is None
        assert router.local_prefill(MOCK, short, cards) is not None
        await report("p2", 3000)
        assert router.local_prefill(MOCK, long, cards) is not None  # every replica busy: the load rule
        assert metric("conveyor_disaggregation_decisions_total", where="local", why="prefill_busy") >= 1
        await report("p1", 0)
        assert router.local_prefill(MOCK, long, cards) is None
    finally:
        await router.stop()


async def prompt_tokens_computed(bus: Bus, prompts: list[list[int]], engines: list[Any]) -> list[int]:
    """Send the prompts to the torch model one after another; the prompt tokens each engine computed meanwhile."""
    from workers.engines.torch_engine.loader import DEFAULT_MODEL

    client = client_of(bus)
    before = [engine.block_manager.prompt_tokens_seen for engine in engines]
    for prompt in prompts:
        async with await client.submit(completion(client, prompt, model=DEFAULT_MODEL, max_tokens=2),
                                       first_frame_timeout_s=60) as stream:
            _, final = await stream.collect()
        assert isinstance(final, FinalFrame)
    return [engine.block_manager.prompt_tokens_seen - seen for engine, seen in zip(engines, before, strict=True)]


async def test_a_disaggregated_models_prompts_go_to_the_prefill_pool_their_length_picks(bus: Bus) -> None:
    from workers.engines.protocol import DisaggregationRole
    from workers.engines.torch_engine.engine import TorchEngine, TorchEngineConfig
    from workers.engines.torch_engine.loader import DEFAULT_MODEL
    from workers.prefill import PrefillStage

    def engine(role: DisaggregationRole) -> TorchEngine:
        return TorchEngine(TorchEngineConfig(role=role, max_step_tokens=128))

    config = PoolsConfig(models=[{"model": DEFAULT_MODEL, "prefill": PrefillPools(  # type: ignore[list-item]
        pools=["short", "long"], isl_tokens=Axis(min=0, max=128, resolution=2), ttft_ms=Axis(min=0, max=1, resolution=1),
        mapping=[[0], [1]])}])
    short, long = engine(DisaggregationRole.PREFILL), engine(DisaggregationRole.PREFILL)
    processor = ProcessorStage({DEFAULT_MODEL: served_model(EngineKind.TORCH, DEFAULT_MODEL)}, RouterOptions(), config)
    specs = [(Stage.PROCESSOR, processor), (Stage.DECODE, DecodeStage(engine(DisaggregationRole.DECODE), DEFAULT_MODEL)),
             (Stage.PREFILL, PrefillStage(short, DEFAULT_MODEL)), (Stage.PREFILL, PrefillStage(long, DEFAULT_MODEL))]
    async with running_workers(bus, specs, model=DEFAULT_MODEL, mode=ServingMode.DISAGGREGATED,
                               pools=[None, None, "short", "long"]):
        seen = await prompt_tokens_computed(bus, [list(range(100, 140)), list(range(100, 300))], [short, long])
    assert seen == [40, 200]  # 40 and 200 tokens


def test_the_example_pools_file_in_docs_is_valid() -> None:
    config = PoolsConfig.from_file(Path(__file__).parent.parent / "docs" / "pools.example.toml")
    smol = config.of("SmolLM2-135M-Instruct")
    assert smol is not None and smol.aggregated is not None
    assert smol.aggregated.choose(RequestTargets(10, priority=500), smol.defaults) == ["fast"]


async def test_short_prompts_run_on_an_aggregated_pool_when_the_decode_engines_cannot_prefill(bus: Bus) -> None:
    """SGLang's shape: its decode role cannot run a prompt, so local prefill goes to decode workers started
    aggregated, in a pool of their own; long prompts still take the prefill worker and the decode pool."""
    import dataclasses

    from workers.engines.protocol import DisaggregationRole
    from workers.engines.torch_engine.engine import TorchEngine, TorchEngineConfig
    from workers.engines.torch_engine.loader import DEFAULT_MODEL
    from workers.prefill import PrefillStage

    class DecodeOnly(TorchEngine):
        @property
        def info(self):  # type: ignore[no-untyped-def]
            return dataclasses.replace(super().info, prefills_in_decode_role=False)

    def engine(role: DisaggregationRole, kind: type[TorchEngine] = TorchEngine) -> TorchEngine:
        return kind(TorchEngineConfig(role=role, max_step_tokens=128))

    config = PoolsConfig(models=[{"model": DEFAULT_MODEL, "decode": {  # type: ignore[list-item]
        "pools": ["pd"], "context_tokens": {"min": 0, "max": 8192, "resolution": 1},
        "itl_ms": {"min": 0, "max": 100, "resolution": 1}, "mapping": [[0]]}}])
    prefill, local = engine(DisaggregationRole.PREFILL), engine(DisaggregationRole.NONE)
    processor = ProcessorStage({DEFAULT_MODEL: served_model(EngineKind.TORCH, DEFAULT_MODEL)},
                               RouterOptions(local_prefill_max_tokens=48), config)
    specs = [(Stage.PROCESSOR, processor), (Stage.PREFILL, PrefillStage(prefill, DEFAULT_MODEL)),
             (Stage.DECODE, DecodeStage(engine(DisaggregationRole.DECODE, DecodeOnly), DEFAULT_MODEL)),
             (Stage.DECODE, DecodeStage(local, DEFAULT_MODEL))]
    disaggregated, aggregated = ServingMode.DISAGGREGATED, ServingMode.AGGREGATED
    async with running_workers(bus, specs, model=DEFAULT_MODEL, mode=disaggregated, pools=[None, None, "pd", "local"],
                               modes=[disaggregated, disaggregated, disaggregated, aggregated]):
        seen = await prompt_tokens_computed(bus, [list(range(100, 130)), list(range(100, 300))], [prefill, local])
    assert seen == [200, 30]  # the short prompt on the aggregated pool, the long one through the prefill worker


async def test_status_shows_each_workers_pool(bus: Bus, pooled: tuple[DecodeStage, DecodeStage]) -> None:
    from workers.client_commands import status

    lines = (await status(bus.nats_settings, bus.settings)).splitlines()
    assert lines[0].split()[:5] == ["worker", "stage", "model", "mode", "pool"]
    pools_by_stage = sorted((line.split()[1], line.split()[4]) for line in lines[1:] if line and "ready models" not in line)
    assert pools_by_stage == [("decode", "cheap"), ("decode", "fast"), ("processor", "-")]
