"""LoRA adapters: the torch engine applies PEFT adapters per request (several in one batch), refuses ones that do not
fit, and the bus serves an adapter on every replica of its base model — loaded through the gateway, listed in
/v1/models, named as a request's model, rolled back when the worker cannot publish it, unloaded everywhere."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest
import torch
from safetensors.torch import save_file

from bus.adapters import AdapterBucket, ensure_lora_bucket
from bus.registry import live_workers
from schemas.registry import Stage
from schemas.sampling import SamplingOptions, StopConditions
from tests.conftest import Bus
from tests.pipeline_helpers import client_of, running_workers
from workers.adapters import AdapterSync
from workers.decode import DecodeStage
from workers.engines.factory import EngineKind
from workers.engines.protocol import GenerateRequest
from workers.engines.torch_engine.engine import TorchEngine, TorchEngineConfig
from workers.engines.torch_engine.loader import DEFAULT_MODEL, ModelConfig
from workers.engines.torch_engine.lora import LoraLinear, LoraWeights
from workers.gateway import GatewayOptions, serving
from workers.processor import ProcessorStage
from workers.stages import served_model

GREEDY = SamplingOptions(temperature=0.0)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def make_adapter(directory: Path, config: ModelConfig, rank: int = 8, seed: int = 0,
                 modules: tuple[str, ...] = ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")) -> Path:
    """A PEFT adapter with random A and B (PEFT starts B at zero, which would change nothing)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {"self_attn.q_proj": (config.hidden_size, config.num_heads * config.head_dim),
              "self_attn.v_proj": (config.hidden_size, config.num_kv_heads * config.head_dim),
              "mlp.down_proj": (config.intermediate_size, config.hidden_size)}
    tensors = {}
    for layer in range(config.num_layers):
        for module in modules:
            fan_in, fan_out = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) / fan_in ** 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.2
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none", "use_dora": False,
        "target_modules": sorted({module.split(".")[1] for module in modules})}))
    return directory


@pytest.fixture(scope="module")
def engine() -> Iterator[TorchEngine]:
    engine = TorchEngine(TorchEngineConfig(max_step_tokens=128))
    asyncio.run(engine.start())  # its own thread serves every test's loop
    yield engine
    asyncio.run(engine.shutdown())


def chat_ids(engine: TorchEngine) -> list[int]:
    ids = engine.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


async def answer(engine: TorchEngine, request_id: str, lora_name: str | None = None) -> tuple[str, int]:
    text, cached = "", 0
    request = GenerateRequest(request_id, chat_ids(engine), GREEDY, StopConditions(max_tokens=10), lora_name=lora_name)
    async for output in engine.generate(request):
        text += output.text
        cached = output.cached_tokens
    return text, cached


def test_lora_linear_adds_each_groups_low_rank_update_and_leaves_other_tokens_alone() -> None:
    torch.manual_seed(0)
    layer = LoraLinear(6, 4, bias=True)
    first = LoraWeights(torch.randn(2, 6), torch.randn(4, 2), scale=0.5)
    second = LoraWeights(torch.randn(3, 6), torch.randn(4, 3), scale=2.0)
    layer.adapters = {"first": first, "second": second}
    x = torch.randn(5, 6)
    y = layer(x, (("first", torch.tensor([0, 3])), ("second", torch.tensor([4]))))
    base = x @ layer.weight.T + layer.bias
    expected = base.clone()
    expected[[0, 3]] += 0.5 * (x[[0, 3]] @ (first.b @ first.a).T)
    expected[4] += 2.0 * (x[4] @ (second.b @ second.a).T)
    assert torch.allclose(y, expected, atol=1e-5)
    assert torch.allclose(y[[1, 2]], base[[1, 2]])  # tokens of the base model


async def test_an_adapter_changes_only_its_own_requests_and_unloading_restores_the_base_model(
        engine: TorchEngine, tmp_path: Path) -> None:
    assert engine.model_config is not None
    path = str(make_adapter(tmp_path / "french", engine.model_config))
    await engine.flush_cache()
    base_alone, _ = await answer(engine, "base-alone")
    await engine.load_lora("french", path)
    await engine.load_lora("french", path)  # idempotent
    assert engine.loras() == {"french": path}
    # One batch: two requests on the adapter, one on the base model.
    (base, base_cached), (tuned, tuned_cached), (again, again_cached) = await asyncio.gather(
        answer(engine, "base"), answer(engine, "tuned", "french"), answer(engine, "again", "french"))
    assert base == base_alone and tuned == again and tuned != base
    # The base model's cached prompt is no use to the adapter: its K/V differ (its keys are salted). Whichever adapter
    # request was prefilled first found nothing cached; the other may reuse the first's own K/V where the engine's
    # thread took it up a step later (a busy CI machine), which is the adapter's cache working, not the base model's.
    assert base_cached > 0 and min(tuned_cached, again_cached) == 0
    _, cached_later = await answer(engine, "tuned-later", "french")
    assert cached_later > 0
    await engine.unload_lora("french")
    await engine.unload_lora("french")  # idempotent
    assert engine.loras() == {}
    with pytest.raises(ValueError, match="not loaded"):
        await answer(engine, "gone", "french")
    assert (await answer(engine, "base-after"))[0] == base_alone


async def test_adapters_that_do_not_fit_are_refused_with_the_reason(engine: TorchEngine, tmp_path: Path) -> None:
    assert engine.model_config is not None
    config = engine.model_config
    with pytest.raises(ValueError, match="no adapter_config.json"):
        await engine.load_lora("empty", str(tmp_path))
    dora = make_adapter(tmp_path / "dora", config)
    (dora / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "use_dora": True}))
    with pytest.raises(ValueError, match="DoRA"):
        await engine.load_lora("dora", str(dora))
    wrong = make_adapter(tmp_path / "wrong", config)
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 7),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(7, 8)},
              str(wrong / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="q_proj has A"):
        await engine.load_lora("wrong", str(wrong))
    head = make_adapter(tmp_path / "head", config)
    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(8, config.hidden_size),
               "base_model.model.lm_head.lora_B.weight": torch.zeros(config.vocab_size, 8)},
              str(head / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="lm_head is not applied"):
        await engine.load_lora("head", str(head))
    good = str(make_adapter(tmp_path / "good", config))
    await engine.load_lora("good", good)
    with pytest.raises(ValueError, match="unload it before"):
        await engine.load_lora("good", str(dora))
    await engine.unload_lora("good")
    assert engine.loras() == {}


async def test_a_card_that_cannot_be_written_rolls_the_load_back(bus: Bus, engine: TorchEngine,
                                                                 tmp_path: Path) -> None:
    assert engine.model_config is not None
    bucket = AdapterBucket(await ensure_lora_bucket(bus.js, bus.names, bus.settings))

    async def registry_away() -> None:
        raise ConnectionError("registry unreachable")

    sync = AdapterSync(engine, DEFAULT_MODEL, bucket, registry_away)
    from schemas.control import LoraAdapter

    adapter = LoraAdapter(name="rolled-back", base_model=DEFAULT_MODEL,
                          path=str(make_adapter(tmp_path / "a", engine.model_config)))
    with pytest.raises(ConnectionError):
        await sync.load(adapter)
    assert "rolled-back" not in engine.loras()


async def test_adapters_served_over_the_bus_reach_every_replica_and_requests_that_name_them(
        bus: Bus, tmp_path: Path) -> None:
    config = ModelConfig.from_dir(_default_model_dir())
    french = str(make_adapter(tmp_path / "french", config))
    local_only = str(make_adapter(tmp_path / "local", config, seed=1))
    processor = ProcessorStage({DEFAULT_MODEL: served_model(EngineKind.TORCH, DEFAULT_MODEL)})
    first = DecodeStage(TorchEngine(TorchEngineConfig(max_step_tokens=128)), DEFAULT_MODEL)
    async with running_workers(bus, [(Stage.PROCESSOR, processor), (Stage.DECODE, first)], model=DEFAULT_MODEL):
        options = GatewayOptions(host="127.0.0.1", port=0, allow_lora_updates=True)
        async with serving(client_of(bus), options) as port, aiohttp.ClientSession() as http:
            api = f"http://127.0.0.1:{port}/v1"
            sdk = openai.AsyncOpenAI(base_url=api, api_key="unused", max_retries=0)

            async def ask(model: str) -> str:
                reply = await sdk.chat.completions.create(model=model, messages=QUESTION, temperature=0.0,  # type: ignore[arg-type]
                                                          max_tokens=10)
                return reply.choices[0].message.content or ""

            base = await ask(DEFAULT_MODEL)
            async with http.post(f"{api}/load_lora_adapter", json={"lora_name": "french", "lora_path": french}) as response:
                assert response.status == 200, await response.text()
                assert (await response.json())["loaded_on"] == [first_worker_id(await live_workers(bus.registry))]
            async with http.post(f"{api}/load_lora_adapter", json={"lora_name": "broken", "lora_path": str(tmp_path)}) as response:
                assert response.status == 400 and "adapter_config.json" in await response.text()
            models = {model.id: model for model in (await sdk.models.list()).data}
            assert models["french"].parent == DEFAULT_MODEL and "broken" not in models  # type: ignore[attr-defined]
            tuned = await ask("french")
            assert tuned != base

            # A replica started later loads the adapter before it takes work, and answers alike.
            second = DecodeStage(TorchEngine(TorchEngineConfig(max_step_tokens=128)), DEFAULT_MODEL)
            async with running_workers(bus, [(Stage.DECODE, second)], model=DEFAULT_MODEL) as [late]:
                assert second.engine.loras() == {"french": french}
                # An adapter loaded on one replica only (its /engine route): its requests are pinned there.
                card = next(c for c in await live_workers(bus.registry) if c.worker_id == late.runtime.options.worker_id)
                engine_url = card.metrics_url.replace("/metrics", "/engine")  # type: ignore[union-attr]
                async with http.post(f"{engine_url}/load_lora", json={"lora_name": "local", "lora_path": local_only}) as response:
                    assert response.status == 200, await response.text()
                async with http.get(f"{engine_url}/list_loras") as response:
                    assert (await response.json())["loras"] == {"french": french, "local": local_only}
                async with http.post(f"{engine_url}/start_expert_distribution_record") as response:
                    assert response.status == 409 and "dense" in (await response.json())["message"]
                answers = await asyncio.gather(*(ask(model) for model in ["french", "local"] * 3))
                assert set(answers[0::2]) == {tuned} and len(set(answers[1::2])) == 1
                assert answers[1] not in (base, tuned)

            async with http.post(f"{api}/unload_lora_adapter", json={"lora_name": "french"}) as response:
                assert response.status == 200
            assert first.engine.loras() == {}
            with pytest.raises(openai.NotFoundError):
                await ask("french")
            assert await ask(DEFAULT_MODEL) == base
            await sdk.close()


def first_worker_id(cards: list) -> str:  # type: ignore[type-arg]
    return next(card.worker_id for card in cards if card.stage == Stage.DECODE)


def _default_model_dir() -> Path:
    from workers.engines.torch_engine.loader import resolve_model

    return resolve_model(DEFAULT_MODEL)
