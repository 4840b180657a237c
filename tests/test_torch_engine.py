"""The embedded torch engine on the real default model (SmolLM2-135M-Instruct, CPU)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch

from schemas.kv_events import BlockRemoved, BlockStored
from schemas.replies import FinishReason
from schemas.sampling import GuidedDecoding, OutputOptions, SamplingOptions, StopConditions
from workers.engines.protocol import (GenerateOutput, GenerateRequest, KvEventBatchOut, MemoryTag, ResumedOutput,
                                      UnsupportedOption)
from workers.engines.detokenizer import IncrementalDetokenizer
from schemas.kv_hashing import block_hash
from workers.engines.torch_engine.engine import TorchEngine, TorchEngineConfig

GREEDY = SamplingOptions(temperature=0.0)


@pytest.fixture(scope="module")
def engine() -> Iterator[TorchEngine]:
    # A small step budget makes every prompt here go through chunked prefill.
    engine = TorchEngine(TorchEngineConfig(max_step_tokens=64, kv_cache_tokens=8192))
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.shutdown())


async def run(engine: TorchEngine, request: GenerateRequest) -> tuple[list[int], str, GenerateOutput]:
    token_ids: list[int] = []
    text = ""
    async for output in engine.generate(request):
        token_ids += output.token_ids
        text += output.text
        if output.finished:
            return token_ids, text, output
    raise AssertionError("stream ended without a finished output")


def prompt_ids(engine: TorchEngine, text: str) -> list[int]:
    return engine.tokenizer(text).input_ids


def chat_ids(engine: TorchEngine, question: str) -> list[int]:
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


async def test_greedy_output_matches_hugging_face_generate_token_for_token(engine: TorchEngine) -> None:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(engine._model_dir), dtype=torch.float32).eval()
    prompts = ["Once upon a time", "The three primary colors are", "def fibonacci(n):", "Write a haiku about the sea."]
    requests = [
        GenerateRequest(f"hf-{i}", prompt_ids(engine, p), GREEDY, StopConditions(max_tokens=32))
        for i, p in enumerate(prompts)
    ]
    # Run all four concurrently: batching and chunked prefill must not change a single token.
    results = await asyncio.gather(*(run(engine, request) for request in requests))
    for request, (token_ids, _, _) in zip(requests, results, strict=True):
        expected = reference.generate(torch.tensor([request.token_ids]), max_new_tokens=32, do_sample=False)
        assert token_ids == expected[0, len(request.token_ids) :].tolist()


async def test_answers_the_capital_of_france_through_the_chat_template(engine: TorchEngine) -> None:
    request = GenerateRequest("france", chat_ids(engine, "What is the capital of France?"), GREEDY,
                              StopConditions(max_tokens=30))
    _, text, final = await run(engine, request)
    assert "Paris" in text
    assert final.finish_reason == FinishReason.STOP


async def test_sixteen_concurrent_requests_match_their_solo_runs(engine: TorchEngine) -> None:
    base = "Count the animals: cat dog bird fish horse cow sheep goat pig duck hen mouse rat owl fox bee"
    requests = [
        GenerateRequest(f"batch-{i}", prompt_ids(engine, " ".join(base.split()[: 3 + i])), GREEDY,
                        StopConditions(max_tokens=4 + i % 5 * 3, ignore_eos=True))
        for i in range(16)
    ]
    together = await asyncio.gather(*(run(engine, request) for request in requests))
    for request, (token_ids, _, final) in zip(requests, together, strict=True):
        assert len(token_ids) == request.stop.max_tokens and final.finish_reason == FinishReason.LENGTH
    for request, (token_ids, _, _) in list(zip(requests, together, strict=True))[::5]:
        solo, _, _ = await run(engine, GenerateRequest(request.request_id + "-solo", request.token_ids, GREEDY, request.stop))
        assert solo == token_ids


async def collect_events(engine: TorchEngine, action) -> list[KvEventBatchOut]:  # type: ignore[no-untyped-def]
    batches: list[KvEventBatchOut] = []
    started = asyncio.Event()

    async def listen() -> None:
        stream = engine.kv_events()
        first = asyncio.ensure_future(stream.__anext__())
        started.set()
        batches.append(await first)
        async for batch in stream:
            batches.append(batch)

    listener = asyncio.create_task(listen())
    await started.wait()
    await asyncio.sleep(0.01)
    await action()
    await asyncio.sleep(0.2)
    listener.cancel()
    return batches


async def test_shared_prefix_is_served_from_cache_and_events_name_the_stored_blocks(engine: TorchEngine) -> None:
    await engine.flush_cache()
    block_size = engine.config.block_size
    prefix = (prompt_ids(engine, "The quick brown fox jumps over the lazy dog. ") * 40)[:256]
    first = GenerateRequest("prefix-a", prefix + prompt_ids(engine, " Tell me a story about a fox and a dog who become friends in the forest."), GREEDY, StopConditions(max_tokens=2))
    second = GenerateRequest("prefix-b", prefix + prompt_ids(engine, " Write a poem about the sea, the wind, the stars and the long night ahead."), GREEDY, StopConditions(max_tokens=2))
    outputs: list[GenerateOutput] = []

    async def both() -> None:
        outputs.append((await run(engine, first))[2])
        outputs.append((await run(engine, second))[2])

    batches = await collect_events(engine, both)
    assert outputs[0].cached_tokens == 0
    assert outputs[1].cached_tokens == 256
    stored = [event for batch in batches for event in batch.events if isinstance(event, BlockStored)]
    stored_hashes = [h for event in stored for h in event.block_hashes]
    # Recompute the chain the engine should have used for the first request's full blocks.
    expected, parent = [], None
    all_tokens = first.token_ids
    for index in range(len(all_tokens) // block_size):
        parent = block_hash(parent, all_tokens[index * block_size : (index + 1) * block_size])
        expected.append(parent)
    assert stored_hashes[: len(expected)] == expected
    assert stored[0].parent_block_hash is None and stored[0].token_ids == all_tokens[: block_size * len(stored[0].block_hashes)]
    # The second request stored only the blocks after the shared prefix.
    second_hashes = stored_hashes[len(expected) :]
    assert second_hashes and not set(second_hashes) & set(expected[: 256 // block_size])


async def test_abort_mid_generation_frees_its_blocks(engine: TorchEngine) -> None:
    baseline = engine.load().kv_used_blocks
    request = GenerateRequest("abort-me", prompt_ids(engine, "List every prime number:"), GREEDY,
                              StopConditions(max_tokens=500, ignore_eos=True))
    outputs: list[GenerateOutput] = []
    async for output in engine.generate(request):
        outputs.append(output)
        if len(outputs) == 3:
            assert engine.load().kv_used_blocks > baseline
            await engine.abort("abort-me")
    assert outputs[-1].finish_reason == FinishReason.CANCELLED
    assert len(outputs) < 50
    assert engine.load().kv_used_blocks == baseline


async def test_stop_string_ends_generation_and_is_not_shown(engine: TorchEngine) -> None:
    ids = chat_ids(engine, "What is the capital of France?")
    _, free_text, _ = await run(engine, GenerateRequest("nostop", ids, GREEDY, StopConditions(max_tokens=30)))
    stop_word = "Paris"
    assert stop_word in free_text
    _, text, final = await run(engine, GenerateRequest("stop", ids, GREEDY, StopConditions(max_tokens=30, stop=[stop_word])))
    assert final.finish_reason == FinishReason.STOP and final.matched_stop == stop_word
    assert text == free_text[: free_text.index(stop_word)]


async def test_a_migrated_generation_shows_the_text_its_first_engine_held_back(engine: TorchEngine) -> None:
    prompt = chat_ids(engine, "Name three colours.")
    whole_ids, whole_text, _ = await run(engine, GenerateRequest("whole", prompt, GREEDY, StopConditions(max_tokens=12)))
    # A stop string that begins with the text of tokens 5-6 and never completes: at token 6 the first engine
    # holds that text back, then dies.
    split = 6
    held_from = len(engine.tokenizer.decode(whole_ids[:split - 2]))
    stop = whole_text[held_from:len(engine.tokenizer.decode(whole_ids[:split]))] + "\x00"
    first = IncrementalDetokenizer(engine.tokenizer, [stop])
    shown = "".join(first.add([token]) for token in whole_ids[:split])
    assert whole_text.startswith(shown) and len(shown) <= held_from  # the stop's beginning was held back
    resumed = GenerateRequest("second", prompt + whole_ids[:split], GREEDY,
                              StopConditions(max_tokens=12 - split, stop=[stop]),
                              resumed=ResumedOutput(whole_ids[:split], shown))
    _, rest, _ = await run(engine, resumed)
    assert shown + rest == whole_text


async def test_stop_token_max_tokens_and_min_tokens(engine: TorchEngine) -> None:
    ids = prompt_ids(engine, "Once upon a time")
    free, _, _ = await run(engine, GenerateRequest("free", ids, GREEDY, StopConditions(max_tokens=12)))
    stop_token = free[3]
    tokens, _, final = await run(engine, GenerateRequest("stoptok", ids, GREEDY, StopConditions(max_tokens=12, stop_token_ids=[stop_token])))
    assert final.matched_stop == stop_token and tokens == free[: free.index(stop_token) + 1]
    tokens, _, final = await run(engine, GenerateRequest("len", ids, GREEDY, StopConditions(max_tokens=5)))
    assert len(tokens) == 5 and final.finish_reason == FinishReason.LENGTH and final.completion_tokens == 5
    eos = engine.info.eos_token_ids[0]
    tokens, _, _ = await run(engine, GenerateRequest("min", chat_ids(engine, "Say hi."), GREEDY, StopConditions(max_tokens=40, min_tokens=30)))
    assert len(tokens) >= 30 and eos not in tokens[:30]


async def test_seeded_sampling_is_reproducible_and_logprobs_are_reported(engine: TorchEngine) -> None:
    ids = prompt_ids(engine, "My favourite food is")
    sampled = SamplingOptions(temperature=0.9, top_p=0.95, top_k=50, seed=1234, frequency_penalty=0.3)
    request = GenerateRequest("seed-1", ids, sampled, StopConditions(max_tokens=12, ignore_eos=True),
                              OutputOptions(logprobs=True, top_logprobs=2))
    first, _, _ = await run(engine, request)
    second, _, _ = await run(engine, GenerateRequest("seed-2", ids, sampled, request.stop, request.output))
    assert first == second
    outputs = [o async for o in engine.generate(GenerateRequest("lp", ids, sampled, request.stop, request.output))]
    logprobs = [lp for o in outputs for lp in (o.logprobs or [])]
    assert len(logprobs) == 12 and all(lp.logprob <= 0 and len(lp.top) == 2 for lp in logprobs)


async def test_options_the_engine_cannot_honour_are_refused_clearly(engine: TorchEngine) -> None:
    ids = prompt_ids(engine, "Hi")
    with pytest.raises(UnsupportedOption, match="n=1"):
        await run(engine, GenerateRequest("n2", ids, SamplingOptions(n=2)))
    with pytest.raises(UnsupportedOption, match="cannot be compiled"):
        await run(engine, GenerateRequest("bad-regex", ids, guided=GuidedDecoding(regex="(unclosed")))


CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}, "country": {"enum": ["France", "Germany", "Italy"]},
                   "population_millions": {"type": "integer", "minimum": 0, "maximum": 100}},
    "required": ["city", "country", "population_millions"], "additionalProperties": False,
}


@pytest.mark.parametrize("sampling", [GREEDY, SamplingOptions(temperature=1.0, seed=3)], ids=["greedy", "sampled"])
async def test_guided_decoding_output_always_fits_its_constraint(engine: TorchEngine, sampling: SamplingOptions) -> None:
    import json
    import re

    question = chat_ids(engine, "Name a large European city, its country and its population.")
    limit = StopConditions(max_tokens=120)
    _, as_json, json_final = await run(engine, GenerateRequest("schema", question, sampling, limit,
                                                                guided=GuidedDecoding(json_schema=CITY_SCHEMA)))
    _, phone, _ = await run(engine, GenerateRequest("regex", question, sampling, limit,
                                                     guided=GuidedDecoding(regex=r"\+[0-9]{2} [0-9]{3}-[0-9]{4}")))
    _, choice, _ = await run(engine, GenerateRequest("choice", question, sampling, limit,
                                                      guided=GuidedDecoding(choice=["Paris", "Rome (Lazio)", "Berlin"])))
    _, answer, _ = await run(engine, GenerateRequest("grammar", question, sampling, limit,
                                                      guided=GuidedDecoding(grammar='root ::= "yes" | "no"')))
    city = json.loads(as_json)
    assert set(city) == {"city", "country", "population_millions"} and city["country"] in {"France", "Germany", "Italy"}
    assert isinstance(city["population_millions"], int) and len(city["city"]) <= 24
    assert json_final.finish_reason == FinishReason.STOP
    assert re.fullmatch(r"\+[0-9]{2} [0-9]{3}-[0-9]{4}", phone), phone
    assert choice in {"Paris", "Rome (Lazio)", "Berlin"} and answer in {"yes", "no"}


async def test_json_object_output_is_an_object_that_parses(engine: TorchEngine) -> None:
    import json

    # An answer cut by max_tokens cannot parse: what is guaranteed is a complete object when the model ends it.
    _, text, final = await run(engine, GenerateRequest(
        "object", chat_ids(engine, "Describe Paris as JSON."), GREEDY, StopConditions(max_tokens=300),
        guided=GuidedDecoding(json_schema={"type": "object"})))
    assert final.finish_reason == FinishReason.STOP and isinstance(json.loads(text), dict)


async def test_a_grammar_ends_the_answer_even_when_min_tokens_bans_its_stop_token(engine: TorchEngine) -> None:
    _, text, final = await run(engine, GenerateRequest(
        "short-choice", chat_ids(engine, "Yes or no?"), GREEDY, StopConditions(max_tokens=30, min_tokens=10),
        guided=GuidedDecoding(choice=["yes", "no"])))
    assert text in {"yes", "no"} and final.finish_reason == FinishReason.STOP


async def test_release_and_resume_memory_frees_and_restores_the_pool(engine: TorchEngine) -> None:
    await engine.release_memory([MemoryTag.KV_CACHE, MemoryTag.WEIGHTS])
    assert engine._kv_cache is None and engine.model is None
    await engine.resume_memory([MemoryTag.KV_CACHE, MemoryTag.WEIGHTS])
    _, text, _ = await run(engine, GenerateRequest("after-resume", chat_ids(engine, "What is the capital of France?"),
                                                   GREEDY, StopConditions(max_tokens=20)))
    assert "Paris" in text


async def test_evicting_cached_blocks_emits_block_removed() -> None:
    small = TorchEngine(TorchEngineConfig(kv_cache_tokens=64, block_size=16, load_format="dummy"))
    await small.start()
    try:
        async def fill() -> None:
            for index in range(4):
                ids = [100 + index * 50 + k for k in range(40)]
                await run(small, GenerateRequest(f"evict-{index}", ids, GREEDY, StopConditions(max_tokens=1)))

        batches = await collect_events(small, fill)
    finally:
        await small.shutdown()
    stored = {h for b in batches for e in b.events if isinstance(e, BlockStored) for h in e.block_hashes}
    removed = [h for b in batches for e in b.events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed and set(removed) <= stored


async def test_flush_update_weights_and_profile_through_the_engine(engine: TorchEngine, tmp_path) -> None:  # type: ignore[no-untyped-def]
    ids = chat_ids(engine, "What is the capital of France?")
    before, _, _ = await run(engine, GenerateRequest("w-before", ids, GREEDY, StopConditions(max_tokens=8)))
    await engine.start_profile(tmp_path)
    await engine.update_weights_from_disk(engine._model_dir)
    after, _, final = await run(engine, GenerateRequest("w-after", ids, GREEDY, StopConditions(max_tokens=8)))
    await engine.stop_profile()
    assert after == before
    assert final.cached_tokens == 0  # new weights invalidate the prefix cache
    assert list(tmp_path.glob("torch-engine-*.json"))
    await engine.flush_cache()
    assert engine.block_manager is not None and engine.block_manager.num_cached_blocks == 0
