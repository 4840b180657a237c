"""The gateway's reading of a model's text as OpenAI's structured fields: tool calls and reasoning.

Formats (SGLang's `--tool-call-parser` / `--reasoning-parser` in our terms):
- **hermes** tool calls (Qwen2.5/3, Hermes, SmolLM3 and most chat templates with tools): each call is
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the text; the text around it is content.
- **mistral** (Mistral 7B v0.3, Mixtral, Mistral Small/Nemo): `[TOOL_CALLS]` then a JSON array of calls, to the end.
- **llama3_json** (Llama 3.1 / 3.2 / 3.3 with JSON tool calling): the answer is `{"name": ..., "parameters": {...}}`,
  several separated by `;`, optionally after `<|python_tag|>`.
- **json** tool call: the whole answer is one `{"name": ..., "arguments": {...}}` — what the processor constrains the
  output to for `tool_choice: "required"` or a named function.
- **think** reasoning (DeepSeek-R1, Qwen3, QwQ): an answer that opens with `<think>` reasons until `</think>`;
  that part goes to `reasoning_content`, the rest is content.

`OutputParser.feed` takes the text deltas as they stream and returns what can be shown so far; a tag split across
deltas is held back until it is whole, and a tool call is given out once its closing tag arrives (whole, as one
delta, which OpenAI's clients accept). A call whose JSON does not parse stays in the content, as the model wrote it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

_CALL_OPEN, _CALL_CLOSE = "<tool_call>", "</tool_call>"
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


class ToolFormat(StrEnum):
    HERMES = "hermes"
    MISTRAL = "mistral"
    LLAMA3_JSON = "llama3_json"
    JSON = "json"


@dataclass(frozen=True, slots=True)
class _Calls:
    """Where a format's calls sit in the text: after `open`, until `close` (None: the end of the answer)."""

    open: str
    close: str | None
    # "object": one call; "array": a JSON list of calls; "objects": calls separated by ';'.
    body: str
    # The calls may also start the answer bare, with no opening marker (Llama 3's JSON calls).
    bare_at_start: bool = False


_FORMATS = {
    ToolFormat.HERMES: _Calls(_CALL_OPEN, _CALL_CLOSE, "object"),
    ToolFormat.MISTRAL: _Calls("[TOOL_CALLS]", None, "array"),
    ToolFormat.LLAMA3_JSON: _Calls("<|python_tag|>", None, "objects", bare_at_start=True),
}


@dataclass(slots=True)
class ParsedDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class OutputParser:
    """One answer's text, read as content, reasoning and tool calls (formats above)."""

    def __init__(self, tools: ToolFormat | None, reasoning: bool) -> None:
        self._tools = tools
        # None: not known yet whether the answer opens with <think>; True: inside it; False: past it or none.
        self._thinking: bool | None = None if reasoning else False
        self._pending = ""
        self._after_reasoning = False
        # Whether the answer has shown content yet (bare calls can only open it).
        self._answered = False
        self.num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        self._pending += text
        return self._drain(final=False)

    def finish(self) -> ParsedDelta:
        """What was held back, at the end of the answer."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> ParsedDelta:
        delta = ParsedDelta()
        while self._pending:
            if self._thinking is None and not self._open_reasoning(final):
                break
            if self._thinking:
                if not self._read_reasoning(delta, final):
                    break
            elif not self._read_content(delta, final):
                break
        return delta

    def _open_reasoning(self, final: bool) -> bool:
        stripped = self._pending.lstrip()
        if stripped.startswith(_THINK_OPEN):
            self._pending, self._thinking = stripped[len(_THINK_OPEN):], True
        elif _THINK_OPEN.startswith(stripped) and not final:
            return False  # maybe the tag, not whole yet
        else:
            self._thinking = False
        return True

    def _read_reasoning(self, delta: ParsedDelta, final: bool) -> bool:
        end = self._pending.find(_THINK_CLOSE)
        if end >= 0:
            delta.reasoning += self._pending[:end]
            self._pending, self._thinking = self._pending[end + len(_THINK_CLOSE):], False
            self._after_reasoning = True
            return True
        keep = 0 if final else _partial_tag(self._pending, _THINK_CLOSE)
        delta.reasoning += self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep:]
        return False

    def _read_content(self, delta: ParsedDelta, final: bool) -> bool:
        if self._after_reasoning:
            # The line breaks after </think> separate, they are not the answer's.
            self._pending = self._pending.lstrip("\n")
            if not self._pending:
                return False
            self._after_reasoning = False
        if self._tools == ToolFormat.JSON:
            # The whole answer is the call: given out at the end.
            if final:
                self._emit(delta, self._pending, self._pending, "object")
                self._pending = ""
            return False
        calls = _FORMATS.get(self._tools) if self._tools is not None else None
        if calls is None:
            delta.content += self._pending
            self._pending = ""
            return False
        start, body_start = self._find_calls(calls, final)
        if start is None:
            return False  # a marker may be forming: held back
        if start < 0:
            keep = 0 if final else _partial_tag(self._pending, calls.open)
            delta.content += self._pending[: len(self._pending) - keep]
            self._pending = self._pending[len(self._pending) - keep:]
            self._answered = self._answered or bool(delta.content.strip())
            return False
        delta.content += self._pending[:start]
        end = len(self._pending) if calls.close is None else self._pending.find(calls.close, body_start)
        if calls.close is None and not final or end < 0:
            if final:  # never closed: the model's text as it is
                delta.content += self._pending[start:]
                self._pending = ""
            else:
                self._pending = self._pending[start:]
            return False
        whole_end = end + len(calls.close or "")
        self._emit(delta, self._pending[body_start:end], self._pending[start:whole_end], calls.body)
        self._pending = self._pending[whole_end:]
        return True

    def _find_calls(self, calls: _Calls, final: bool) -> tuple[int | None, int]:
        """Where the next calls start and where their JSON starts; -1 when none start in the text held, None when
        the answer's start might still become bare calls."""
        start = self._pending.find(calls.open)
        if start >= 0:
            return start, start + len(calls.open)
        if calls.bare_at_start and not self._answered:
            stripped = self._pending.lstrip()
            if stripped.startswith("{"):
                return len(self._pending) - len(stripped), len(self._pending) - len(stripped)
            if not stripped and not final:
                return None, 0
        return -1, 0

    def _emit(self, delta: ParsedDelta, body: str, written: str, shape: str) -> None:
        """The calls in `body`, or the text as written when it does not parse as calls."""
        found = self._calls(body, shape)
        if found is None:
            delta.content += written
        else:
            delta.tool_calls += found
        self._answered = True

    def _calls(self, body: str, shape: str) -> list[dict[str, Any]] | None:
        if shape == "object":
            parts = [body]
        elif shape == "objects":
            parts = [part for part in body.split(";") if part.strip()]
        else:
            try:
                items = json.loads(body)
            except ValueError:
                return None
            parts = [json.dumps(item) for item in items] if isinstance(items, list) and items else []
        first = self.num_calls
        calls = [self._call(part) for part in parts]
        if not calls or any(call is None for call in calls):
            self.num_calls = first  # not calls after all: numbering as if never read
            return None
        return [call for call in calls if call is not None]

    def _call(self, text: str) -> dict[str, Any] | None:
        """OpenAI's streamed tool-call delta for `{"name": ..., "arguments": ...}`, or None when it is not one."""
        try:
            parsed = json.loads(text)
        except ValueError:
            return None
        if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
            return None
        arguments = parsed.get("arguments", parsed.get("parameters", {}))
        call = {"index": self.num_calls, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": parsed["name"],
                             "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}
        self.num_calls += 1
        return call


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
