"""Incremental detokenization: whole characters only, stop strings matched across tokens and hidden."""

from __future__ import annotations

from workers.engines.detokenizer import IncrementalDetokenizer


class ByteTokenizer:
    """Each token is one UTF-8 byte: the hardest case for incremental decoding."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")


def feed(detokenizer: IncrementalDetokenizer, text: str) -> list[str]:
    return [detokenizer.add([byte]) for byte in text.encode()]


def test_multibyte_characters_are_never_split() -> None:
    deltas = feed(IncrementalDetokenizer(ByteTokenizer(), stop=[]), "héllo 世界")
    assert "".join(deltas) == "héllo 世界"
    assert all("\ufffd" not in delta for delta in deltas)
    assert "世" in deltas  # released whole, once its third byte arrived


def test_stop_string_across_tokens_is_matched_and_hidden() -> None:
    detokenizer = IncrementalDetokenizer(ByteTokenizer(), stop=["END"])
    shown = "".join(feed(detokenizer, "abc ENDxyz"))
    assert shown == "abc "
    assert detokenizer.matched_stop == "END"


def test_text_that_only_looks_like_a_stop_start_is_released() -> None:
    detokenizer = IncrementalDetokenizer(ByteTokenizer(), stop=["ENDING"])
    shown = "".join(feed(detokenizer, "the END"))
    assert shown == "the "  # "END" might still become "ENDING"
    assert detokenizer.flush() == "END"


def test_a_resumed_detokenizer_shows_exactly_what_its_predecessor_held_back() -> None:
    text, stops = "abc EN世界 ENDING", ["ENDX"]
    uninterrupted = IncrementalDetokenizer(ByteTokenizer(), stop=stops)
    whole = "".join(feed(uninterrupted, text)) + uninterrupted.flush()
    data = text.encode()
    # Split after every byte: mid-character, inside a partial stop match, anywhere.
    for split in range(1, len(data)):
        first = IncrementalDetokenizer(ByteTokenizer(), stop=stops)
        shown = "".join(first.add([byte]) for byte in data[:split])
        second = IncrementalDetokenizer.resumed(ByteTokenizer(), stops, True, list(data[:split]), shown)
        rest = "".join(second.add([byte]) for byte in data[split:]) + second.flush()
        assert shown + rest == whole == text, split


def test_a_resumed_detokenizer_still_matches_a_stop_string_begun_before_the_split() -> None:
    data = "say END now".encode()
    first = IncrementalDetokenizer(ByteTokenizer(), stop=["END"])
    shown = "".join(first.add([byte]) for byte in data[:5])  # "say E": "E" held back
    second = IncrementalDetokenizer.resumed(ByteTokenizer(), ["END"], True, list(data[:5]), shown)
    rest = "".join(second.add([byte]) for byte in data[5:])
    assert (shown, shown + rest, second.matched_stop) == ("say ", "say ", "END")
