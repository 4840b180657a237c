"""Guided decoding for the torch engine with xgrammar: a JSON schema, any JSON object, a regular expression, a
choice of strings or an EBNF grammar becomes a token mask applied to each step's logits, so every output parses (SGLang uses the same library).

Grammars are compiled once per distinct constraint (an LRU of compiled grammars per engine); each request gets
its own matcher, which follows the tokens it accepts. When the grammar is complete only the stop tokens stay
allowed, so the model ends its answer there; `finished` tells the engine so, for answers whose EOS is banned.

xgrammar's package metadata asks for triton (1 GB of GPU kernels); its CPU path needs none of it, so
scripts/setup.sh installs it without dependencies (plus apache-tvm-ffi, which it does need).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import torch

from schemas.sampling import GuidedDecoding
from workers.engines.protocol import UnsupportedOption, choice_regex

_CACHED_GRAMMARS = 128


class GrammarCompiler:
    """Compiled grammars of one tokenizer, by constraint."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        try:
            import xgrammar
        except ImportError:
            raise UnsupportedOption("guided decoding on the torch engine needs xgrammar: pip install --no-deps "
                                    "xgrammar apache-tvm-ffi (scripts/setup.sh does this)") from None
        self._xgrammar = xgrammar
        self._info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgrammar.GrammarCompiler(self._info)
        self._compiled: OrderedDict[str, Any] = OrderedDict()

    def matcher(self, guided: GuidedDecoding) -> GrammarMatcher:
        key = json.dumps(guided.model_dump(mode="json", exclude_none=True), sort_keys=True)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compile(guided)
            self._compiled[key] = compiled
            if len(self._compiled) > _CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return GrammarMatcher(self._xgrammar, compiled, self._info.vocab_size)

    def _compile(self, guided: GuidedDecoding) -> Any:
        try:
            if guided.regex is not None:
                return self._compiler.compile_regex(guided.regex)
            if guided.choice is not None:
                return self._compiler.compile_regex(choice_regex(guided.choice))
            if guided.grammar is not None:
                return self._compiler.compile_grammar(guided.grammar)
            # Not strict: what the schema leaves open (extra properties unless it says otherwise) stays open, as
            # JSON Schema means it; `{"type": "object"}` is then any object (OpenAI's json_object).
            return self._compiler.compile_json_schema(json.dumps(guided.json_schema), strict_mode=False)
        except (RuntimeError, ValueError) as error:
            # A schema or pattern xgrammar cannot compile is the client's to fix.
            raise UnsupportedOption(f"the constraint cannot be compiled: {error}") from error


class GrammarMatcher:
    """One request's position in its grammar."""

    def __init__(self, xgrammar: Any, compiled: Any, vocab_size: int) -> None:
        self._xgrammar = xgrammar
        self._matcher = xgrammar.GrammarMatcher(compiled)
        self._bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [vocab] with every token the grammar forbids next set to -inf (in place)."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        self._xgrammar.apply_token_bitmask_inplace(logits[None], self._bitmask.to(logits.device))
        return logits

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False when the grammar does not allow it (the matcher stays where it was)."""
        return bool(self._matcher.accept_token(token_id))

    @property
    def finished(self) -> bool:
        """The grammar is complete (a stop token was accepted, or nothing more may follow)."""
        return bool(self._matcher.is_terminated())
