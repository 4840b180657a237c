"""Reading a model's text as OpenAI's tool calls and reasoning, however the text is split into stream deltas."""

from __future__ import annotations

import json

import pytest

from workers.output_parsing import OutputParser, ParsedDelta, ToolFormat

HERMES = ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
          '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call> Done.')


def read(parser: OutputParser, text: str, piece: int) -> ParsedDelta:
    total = ParsedDelta()
    for delta in [parser.feed(text[i:i + piece]) for i in range(0, len(text), piece)] + [parser.finish()]:
        total.content += delta.content
        total.reasoning += delta.reasoning
        total.tool_calls += delta.tool_calls
    return total


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
def test_hermes_tool_calls_come_out_whole_however_the_text_is_split(piece: int) -> None:
    parsed = read(OutputParser(ToolFormat.HERMES, reasoning=False), HERMES, piece)
    assert parsed.content == "Let me check.  Done."
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] == [
        (0, "get_weather", {"city": "Paris"}), (1, "get_time", {"zone": "CET"})]
    assert all(call["id"].startswith("call_") and call["type"] == "function" for call in parsed.tool_calls)


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_reasoning_before_the_answer_goes_to_its_own_field(piece: int) -> None:
    parsed = read(OutputParser(None, reasoning=True), "<think>2 + 2 is 4.</think>\nThe answer is 4.", piece)
    assert (parsed.reasoning, parsed.content) == ("2 + 2 is 4.", "The answer is 4.")
    plain = read(OutputParser(None, reasoning=True), "No thinking here, <think> mid-text stays.", piece)
    assert (plain.reasoning, plain.content) == ("", "No thinking here, <think> mid-text stays.")


def test_a_constrained_answer_is_one_call_and_text_that_is_not_a_call_stays_content() -> None:
    called = read(OutputParser(ToolFormat.JSON, reasoning=False), '{"name": "f", "arguments": {"x": 1}}', 5)
    assert [c["function"]["arguments"] for c in called.tool_calls] == ['{"x": 1}'] and called.content == ""
    broken = read(OutputParser(ToolFormat.HERMES, reasoning=False), "a <tool_call>{not json}</tool_call> b <tool_call>", 3)
    assert broken.tool_calls == [] and broken.content == "a <tool_call>{not json}</tool_call> b <tool_call>"


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_mistral_and_llama3_calls_are_read_in_their_own_formats(piece: int) -> None:
    mistral = read(OutputParser(ToolFormat.MISTRAL, reasoning=False),
                   'Checking. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                   '{"name": "get_time", "arguments": {}}]', piece)
    assert mistral.content == "Checking. "
    assert [(c["index"], c["function"]["name"]) for c in mistral.tool_calls] == [(0, "get_weather"), (1, "get_time")]
    bare = read(OutputParser(ToolFormat.LLAMA3_JSON, reasoning=False),
                ' {"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", "parameters": {}}', piece)
    assert bare.content == " "
    assert [json.loads(c["function"]["arguments"]) for c in bare.tool_calls] == [{"city": "Rome"}, {}]
    tagged = read(OutputParser(ToolFormat.LLAMA3_JSON, reasoning=False),
                  '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}', piece)
    assert [c["function"]["name"] for c in tagged.tool_calls] == ["get_time"] and tagged.content == ""
    # Text that is not a call stays content, as the model wrote it.
    prose = read(OutputParser(ToolFormat.LLAMA3_JSON, reasoning=False), 'It is {"warm": true} in Rome.', piece)
    assert prose.tool_calls == [] and prose.content == 'It is {"warm": true} in Rome.'
    not_calls = read(OutputParser(ToolFormat.MISTRAL, reasoning=False), "[TOOL_CALLS] [oops", piece)
    assert not_calls.tool_calls == [] and not_calls.content == "[TOOL_CALLS] [oops"
