"""How to sample and when to stop: the options every generation hop carries.

Field names follow SGLang's `SamplingParams` where they differ from OpenAI's only in spelling,
so the SGLang adapter maps them one to one. `None` means "the engine's default".
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, model_validator

from schemas.base import WireModel

# The ranges of each option, shared by the OpenAI-shaped client requests and the tasks.
# 0 means greedy; OpenAI caps temperature at 2, SGLang does not, so neither do we.
Temperature = Annotated[float | None, Field(ge=0.0)]
TopP = Annotated[float | None, Field(gt=0.0, le=1.0)]
# None disables top-k; SGLang's -1 for "off" is translated in its adapter.
TopK = Annotated[int | None, Field(ge=1)]
MinP = Annotated[float | None, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float | None, Field(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float | None, Field(gt=0.0, le=2.0)]
# Number of completions per request (parallel sampling).
NumCompletions = Annotated[int, Field(ge=1, le=128)]
MaxTokens = Annotated[int | None, Field(ge=1)]
MinTokens = Annotated[int, Field(ge=0)]
TopLogprobs = Annotated[int, Field(ge=0, le=20)]


class SamplingOptions(WireModel):
    temperature: Temperature = None
    top_p: TopP = None
    top_k: TopK = None
    min_p: MinP = None
    frequency_penalty: Penalty = None
    presence_penalty: Penalty = None
    repetition_penalty: RepetitionPenalty = None
    seed: int | None = None
    n: NumCompletions = 1
    # Generate this many and return the n whose tokens have the highest mean log-probability (OpenAI's best_of).
    best_of: NumCompletions | None = None

    @model_validator(mode="after")
    def _best_of_covers_n(self) -> SamplingOptions:
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        return self


class StopConditions(WireModel):
    # None: generate until EOS or the context is full.
    max_tokens: MaxTokens = None
    min_tokens: MinTokens = 0
    stop: list[str] = Field(default_factory=list, max_length=16)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False

    @model_validator(mode="after")
    def _min_not_above_max(self) -> StopConditions:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})")
        return self


class OutputOptions(WireModel):
    # Return the log-probability of each sampled token, and this many alternatives per position.
    logprobs: bool = False
    top_logprobs: TopLogprobs = 0
    skip_special_tokens: bool = True


class GuidedDecoding(WireModel):
    """Constrain the output (exactly one): to a JSON schema (`{"type": "object"}`: any JSON object), a regular
    expression, one of a list of strings, or an EBNF grammar (GBNF / xgrammar syntax, `root` rule first)."""

    json_schema: dict[str, Any] | None = None
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1, max_length=1024)] | None = None
    grammar: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> GuidedDecoding:
        given = [value for value in (self.json_schema, self.regex, self.choice, self.grammar) if value is not None]
        if len(given) != 1:
            raise ValueError("guided decoding needs exactly one of json_schema, regex, choice or grammar")
        return self
