"""OpenAI features through the gateway on the real default model (torch engine), with the openai SDK: structured
output (`chat.completions.parse` with a pydantic model, `json_object`, guided_regex / _choice / _grammar; conflicting
constraints refused), tool calls and reasoning, logprobs, and n > 1."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from schemas.registry import Stage
from tests.conftest import Bus
from tests.pipeline_helpers import client_of, running_workers
from workers.decode import DecodeStage
from workers.engines.factory import EngineKind
from workers.engines.torch_engine.engine import TorchEngine, TorchEngineConfig
from workers.engines.torch_engine.loader import DEFAULT_MODEL
from workers.gateway import GatewayOptions, serving
from workers.processor import ProcessorStage
from workers.stages import served_model


class City(BaseModel):
    name: str = Field(max_length=24)
    country: Literal["France", "Germany", "Italy", "Spain"]
    population_millions: int = Field(ge=0, le=50)


@asynccontextmanager
async def openai_sdk(bus: Bus, engine: TorchEngine | None = None,
                     reasoning_parser: bool = False) -> AsyncIterator[openai.AsyncOpenAI]:
    """The openai SDK on a gateway in front of a processor and a decode worker on the default model."""
    engine = engine or TorchEngine(TorchEngineConfig(max_step_tokens=128))
    specs = [(Stage.PROCESSOR, ProcessorStage({DEFAULT_MODEL: served_model(EngineKind.TORCH, DEFAULT_MODEL)})),
             (Stage.DECODE, DecodeStage(engine, DEFAULT_MODEL))]
    async with running_workers(bus, specs, model=DEFAULT_MODEL):
        options = GatewayOptions(host="127.0.0.1", port=0, reasoning_parser=reasoning_parser)
        async with serving(client_of(bus), options) as port:
            sdk = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
            try:
                yield sdk
            finally:
                await sdk.close()


async def test_every_constraint_holds_through_the_gateway_with_the_openai_sdk(bus: Bus) -> None:
    ask = [{"role": "user", "content": "Name a large European city, its country and its population."}]
    async with openai_sdk(bus) as sdk:
        parsed = await sdk.chat.completions.parse(model=DEFAULT_MODEL, messages=ask, response_format=City,
                                                  temperature=0.0, max_tokens=120)
        as_object = await sdk.chat.completions.create(model=DEFAULT_MODEL, messages=ask, temperature=0.0,
                                                      max_tokens=300, response_format={"type": "json_object"})
        choice = await sdk.chat.completions.create(model=DEFAULT_MODEL, messages=ask, max_tokens=20, temperature=1.0,
                                                   extra_body={"guided_choice": ["Paris", "Rome", "Madrid"]})
        date = await sdk.completions.create(model=DEFAULT_MODEL, prompt="The date today is", max_tokens=20,
                                            extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"})
        streamed = await sdk.chat.completions.create(model=DEFAULT_MODEL, messages=ask, max_tokens=10, stream=True,
                                                     extra_body={"guided_grammar": 'root ::= "yes" | "no"'})
        pieces = [chunk.choices[0].delta.content or "" async for chunk in streamed if chunk.choices]
        with pytest.raises(openai.BadRequestError, match="at most one"):
            await sdk.chat.completions.create(model=DEFAULT_MODEL, messages=ask, max_tokens=5,
                                              response_format={"type": "json_object"},
                                              extra_body={"guided_regex": "a+"})
    city = parsed.choices[0].message.parsed
    assert isinstance(city, City) and parsed.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(as_object.choices[0].message.content or ""), dict)
    assert choice.choices[0].message.content in {"Paris", "Rome", "Madrid"}
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", date.choices[0].text), date.choices[0].text
    assert "".join(pieces) in {"yes", "no"}


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["CET", "UTC"]}}, "required": ["zone"]}}}


async def test_tool_calls_and_reasoning_come_back_in_openai_fields(bus: Bus) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    async with openai_sdk(bus, reasoning_parser=True) as sdk:
        named = await sdk.chat.completions.create(
            model=DEFAULT_MODEL, messages=ask, tools=[WEATHER_TOOL, TIME_TOOL], max_tokens=80, temperature=0.0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        call = named.choices[0].message.tool_calls[0]
        follow_up = ask + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                           {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'}]
        answered = await sdk.chat.completions.create(model=DEFAULT_MODEL, messages=follow_up, max_tokens=20,
                                                     tools=[WEATHER_TOOL], temperature=0.0)
        streamed = await sdk.chat.completions.create(
            model=DEFAULT_MODEL, messages=ask, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required",
            max_tokens=80, temperature=0.0, stream=True)
        chunks = [chunk async for chunk in streamed]
        thought = await sdk.chat.completions.create(
            model=DEFAULT_MODEL, messages=ask, max_tokens=40, temperature=0.0,
            extra_body={"guided_regex": "<think>[a-z ]{5,30}</think>\\n[A-Z][a-z ]{5,30}"})
        with pytest.raises(openai.BadRequestError, match="not among"):
            await sdk.chat.completions.create(model=DEFAULT_MODEL, messages=ask, tools=[WEATHER_TOOL],
                                              tool_choice={"type": "function", "function": {"name": "nope"}})
    assert named.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in {"celsius", "fahrenheit"}
    assert answered.choices[0].message.content  # the tool's answer went into the template; the model replies
    deltas = [call for chunk in chunks if chunk.choices for call in chunk.choices[0].delta.tool_calls or []]
    assert len(deltas) == 1 and deltas[0].function.name in {"get_weather", "get_time"}
    assert json.loads(deltas[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    message = thought.choices[0].message
    reasoning = message.model_extra.get("reasoning_content") if message.model_extra else None
    assert reasoning and "<think>" not in (message.content or "") and message.content


async def test_logprobs_come_back_in_openai_shape_for_chat_and_completions(bus: Bus) -> None:
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    async with openai_sdk(bus) as sdk:
        whole = await sdk.chat.completions.create(model=DEFAULT_MODEL, messages=ask, max_tokens=12, temperature=0.0,
                                                  logprobs=True, top_logprobs=3)
        streamed = await sdk.chat.completions.create(model=DEFAULT_MODEL, messages=ask, max_tokens=12,
                                                     temperature=0.0, logprobs=True, top_logprobs=3, stream=True)
        streamed_entries = [entry async for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
                            for entry in chunk.choices[0].logprobs.content or []]
        completion = await sdk.completions.create(model=DEFAULT_MODEL, prompt="The capital of France is",
                                                  max_tokens=8, temperature=0.0, logprobs=2)
    entries = whole.choices[0].logprobs.content
    assert "".join(entry.token for entry in entries) == whole.choices[0].message.content
    for entry in entries:  # greedy: each chosen token is the most likely one
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.bytes == list(entry.token.encode())
    assert [(e.token, round(e.logprob, 4)) for e in streamed_entries] == [(e.token, round(e.logprob, 4)) for e in entries]
    shaped = completion.choices[0].logprobs
    assert "".join(shaped.tokens) == completion.choices[0].text and len(shaped.token_logprobs) == len(shaped.tokens)
    assert all(len(top) <= 2 for top in shaped.top_logprobs)
    assert shaped.text_offset == [sum(len(t) for t in shaped.tokens[:i]) for i in range(len(shaped.tokens))]


async def test_n_choices_stream_with_their_index_and_share_the_prompt_in_the_cache(bus: Bus) -> None:
    ask = [{"role": "user", "content": "Write one sentence about the sea, in a style of your choosing. " * 6}]
    engine = TorchEngine(TorchEngineConfig(max_step_tokens=256))
    async with openai_sdk(bus, engine) as sdk:
        whole = await sdk.chat.completions.create(model=DEFAULT_MODEL, messages=ask, n=3, max_tokens=16,
                                                  temperature=1.0, seed=7)
        again = await sdk.chat.completions.create(model=DEFAULT_MODEL, messages=ask, n=3, max_tokens=16,
                                                  temperature=1.0, seed=7)
        streamed = await sdk.chat.completions.create(model=DEFAULT_MODEL, messages=ask, n=2, max_tokens=8,
                                                     temperature=1.0, stream=True)
        chunks = [chunk async for chunk in streamed]
        texts = await sdk.completions.create(model=DEFAULT_MODEL, prompt="Once upon a time", n=2, max_tokens=6,
                                             temperature=1.0, seed=1)
    assert [choice.index for choice in whole.choices] == [0, 1, 2]
    contents = [choice.message.content for choice in whole.choices]
    assert len(set(contents)) == 3 and contents == [choice.message.content for choice in again.choices]
    # The prompt counted once, the three completions summed.
    assert 3 <= whole.usage.completion_tokens <= 48 and whole.usage.prompt_tokens < 150
    # The prompt was computed once: the later choices found it in the prefix cache.
    assert engine.load().cache_hit_rate > 0.3
    indexes = {chunk.choices[0].index for chunk in chunks if chunk.choices}
    finishes = [chunk.choices[0] for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert indexes == {0, 1} and sorted(choice.index for choice in finishes) == [0, 1]
    assert [choice.index for choice in texts.choices] == [0, 1] and all(choice.text for choice in texts.choices)


async def test_best_of_returns_the_n_most_likely_of_its_candidates(bus: Bus) -> None:
    async with openai_sdk(bus) as sdk:
        asked = {"model": DEFAULT_MODEL, "prompt": "The three best things about the sea are", "max_tokens": 8,
                 "temperature": 1.0, "seed": 11}
        # Candidate i is drawn with seed + i, as choice i of n = 4 is: the four candidates, each with its logprobs.
        candidates = await sdk.completions.create(**asked, n=4, logprobs=1)
        best = await sdk.completions.create(**asked, n=2, best_of=4)
        best_with_logprobs = await sdk.completions.create(**asked, n=1, best_of=4, logprobs=1)
        with pytest.raises(openai.BadRequestError, match="best_of"):
            await sdk.completions.create(**asked, n=3, best_of=2)

    def mean(choice) -> float:  # type: ignore[no-untyped-def]
        return sum(choice.logprobs.token_logprobs) / len(choice.logprobs.token_logprobs)

    ranked = [choice.text for choice in sorted(candidates.choices, key=mean, reverse=True)]
    assert [choice.text for choice in best.choices] == ranked[:2] and [c.index for c in best.choices] == [0, 1]
    assert best.choices[0].logprobs is None  # not asked for: used for the ranking only
    assert best_with_logprobs.choices[0].text == ranked[0] and best_with_logprobs.choices[0].logprobs is not None
    # Every candidate was generated, so every candidate's tokens count.
    assert best.usage.completion_tokens == candidates.usage.completion_tokens
