"""Sessions through the gateway on the torch engine: each turn's prompt follows the conversation the session holds
(its KV found in the prefix cache), closing forgets it, and a session whose worker is gone is refused by name."""

from __future__ import annotations

import openai
import pytest

from bus.sessions import SessionPlaces, ensure_session_bucket
from tests.conftest import Bus
from tests.test_structured_output import openai_sdk
from workers.engines.torch_engine.loader import DEFAULT_MODEL

STORY = ("Ada Lovelace wrote the first published program for Babbage's Analytical Engine in 1843, "
         "and she saw that the machine could work on symbols as well as numbers. ")


async def turn(sdk: openai.AsyncOpenAI, prompt: str, session_id: str, close: bool = False) -> openai.types.Completion:
    return await sdk.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=6, temperature=0.0,
                                        extra_body={"session_id": session_id, "close_session": close})


async def test_a_sessions_turns_continue_its_conversation_until_it_is_closed(bus: Bus) -> None:
    async with openai_sdk(bus) as sdk:
        first = await turn(sdk, STORY, "ada")
        second = await turn(sdk, " Who wrote the first program?", "ada")
        last = await turn(sdk, " When?", "ada", close=True)
        reopened = await turn(sdk, " When?", "ada")
        alone = await sdk.completions.create(model=DEFAULT_MODEL, prompt=" When?", max_tokens=6, temperature=0.0)
    assert first.usage is not None and second.usage is not None and last.usage is not None
    question = second.usage.prompt_tokens - first.usage.total_tokens
    assert question > 0  # the second prompt is the first turn (prompt and answer) plus the question
    assert second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens >= (first.usage.total_tokens // 16) * 16 > 0
    assert last.usage.prompt_tokens > second.usage.total_tokens
    # Closed: the same id opens a new, empty session.
    assert reopened.usage is not None and alone.usage is not None
    assert reopened.usage.prompt_tokens == alone.usage.prompt_tokens
    assert reopened.choices[0].text == alone.choices[0].text


async def test_a_session_whose_worker_is_gone_is_refused_not_answered_without_its_conversation(bus: Bus) -> None:
    places = SessionPlaces(await ensure_session_bucket(bus.js, bus.names, bus.settings))
    await places.place("orphan", "a-worker-that-stopped")
    async with openai_sdk(bus) as sdk:
        with pytest.raises(openai.APIStatusError, match="a-worker-that-stopped") as refused:
            await turn(sdk, "Hello", "orphan")
        assert refused.value.status_code == 503
        # Forgotten with the refusal: the id can start a new session.
        fresh = await turn(sdk, "Hello", "orphan")
    assert fresh.usage is not None and fresh.choices[0].text
    with pytest.raises(openai.BadRequestError, match="session"):
        async with openai_sdk(bus) as sdk:
            await sdk.completions.create(model=DEFAULT_MODEL, prompt="Hi", n=2, max_tokens=2,
                                         extra_body={"session_id": "two"})
