"""How to sample and when to stop: the options every generation hop carries.

Field names follow SGLang's `SamplingParams` where they differ from OpenAI's only in spelling,
so the SGLang adapter maps them one to one. `None` means "the engine's default".
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from schemas.base import WireModel


class SamplingOptions(WireModel):
    # 0 means greedy; OpenAI caps at 2, SGLang does not, so neither do we.
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    # None disables top-k; SGLang's -1 sentinel is translated in its adapter.
    top_k: int | None = Field(default=None, ge=1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    seed: int | None = None
    # Number of completions per request (parallel sampling).
    n: int = Field(default=1, ge=1, le=128)


class StopConditions(WireModel):
    # None: generate until EOS or the context is full.
    max_tokens: int | None = Field(default=None, ge=1)
    min_tokens: int = Field(default=0, ge=0)
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
    top_logprobs: int = Field(default=0, ge=0, le=20)
    skip_special_tokens: bool = True


class GuidedDecoding(WireModel):
    """Constrain the output to a JSON schema or a regular expression (exactly one)."""

    json_schema: dict[str, Any] | None = None
    regex: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> GuidedDecoding:
        if (self.json_schema is None) == (self.regex is None):
            raise ValueError("guided decoding needs exactly one of json_schema or regex")
        return self
