"""Incremental detokenization: text deltas that never split a multi-byte character, with stop strings
matched across token boundaries and never shown to the client."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from workers.engines.protocol import GenerateRequest

_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Feed generated token ids one batch at a time; get back text that is safe to show.

    Text is held back while the last token ends in the middle of a UTF-8 character (decoding gives
    U+FFFD) or while the text ends with the beginning of a stop string.
    """

    def __init__(self, tokenizer: Decoder, stop: list[str], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._stop = [s for s in stop if s]
        self._skip_special = skip_special_tokens
        self._token_ids: list[int] = []
        # Tokens before `_read_offset` are already in `_text`; decoding starts a few tokens earlier,
        # at `_prefix_offset`, because byte-level tokenizers only render a token right in context.
        self._prefix_offset = 0
        self._read_offset = 0
        self._text = ""  # all text decoded so far
        self._emitted = 0  # characters of _text already returned
        self.matched_stop: str | None = None

    @classmethod
    def resumed(cls, tokenizer: Decoder, stop: list[str], skip_special_tokens: bool, token_ids: list[int],
                shown_text: str) -> IncrementalDetokenizer:
        """Go on with a generation another detokenizer started: it saw `token_ids` and showed `shown_text`;
        the text it held back comes out with the next tokens here."""
        detokenizer = cls(tokenizer, stop, skip_special_tokens)
        detokenizer.add(token_ids)
        detokenizer._emitted = len(shown_text)
        return detokenizer

    @classmethod
    def of_request(cls, tokenizer: Decoder, request: GenerateRequest) -> IncrementalDetokenizer:
        """The detokenizer of one request: its stop strings and special-token setting, going on from what another
        engine showed when the request migrated."""
        stop, skip_special = request.stop.stop, request.output.skip_special_tokens
        if request.resumed is None:
            return cls(tokenizer, stop, skip_special)
        return cls.resumed(tokenizer, stop, skip_special, request.resumed.token_ids, request.resumed.text)

    def add(self, token_ids: list[int]) -> str:
        """The new visible text after these tokens; empty while held back."""
        if self.matched_stop is not None:
            return ""
        self._token_ids.extend(token_ids)
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._token_ids[self._prefix_offset :])
        if full_text.endswith(_REPLACEMENT):
            return ""  # an incomplete character: wait for the next token
        self._text += full_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._token_ids)
        return self._visible_delta()

    def flush(self) -> str:
        """Text still held back at the end of the generation (a partial stop-string match)."""
        if self.matched_stop is not None:
            return ""
        delta, self._emitted = self._text[self._emitted :], len(self._text)
        return delta

    def _visible_delta(self) -> str:
        for stop in self._stop:
            found = self._text.find(stop, max(0, self._emitted - len(stop) + 1))
            if found != -1:
                self.matched_stop = stop
                delta, self._emitted = self._text[self._emitted : found], found
                return delta
        safe_end = len(self._text) - _partial_stop_suffix(self._text, self._stop)
        if safe_end <= self._emitted:
            return ""
        delta, self._emitted = self._text[self._emitted : safe_end], safe_end
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special)


def _partial_stop_suffix(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that is a proper beginning of a stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest
