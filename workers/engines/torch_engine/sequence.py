"""A request's state inside the engine: its tokens, how many have KV in the cache, its blocks."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto

import torch

from schemas.sampling import OutputOptions, SamplingOptions, StopConditions
from workers.engines.detokenizer import IncrementalDetokenizer
from workers.engines.torch_engine.grammar import GrammarMatcher


class SeqStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingOptions
    stop: StopConditions
    output: OutputOptions
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None = None
    # Tokens that may not be sampled before min_tokens completion tokens (EOS and stop tokens).
    banned_before_min_tokens: tuple[int, ...] = ()
    # Prefill role: the room this prompt's KV is offered in.
    bootstrap_room: int | None = None
    status: SeqStatus = SeqStatus.WAITING
    # Tokens whose K/V are in the cache; the rest still have to be computed.
    num_computed_tokens: int = 0
    # Prompt tokens found in the prefix cache at admission (reported to the client as cached).
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Chained hashes of this sequence's full blocks, in order (the prefix-cache keys).
    block_hashes: list[int] = field(default_factory=list)
    # Set by the engine when a delta has been produced but not yet sent.
    pending_token_ids: list[int] = field(default_factory=list)
    # Multimodal: prompt positions of image pad tokens, and their embedding rows (same order).
    image_positions: list[int] = field(default_factory=list)
    image_rows: torch.Tensor | None = None
    # Guided decoding: the request's position in its grammar (grammar.py); None when unconstrained.
    grammar: GrammarMatcher | None = None
    # The LoRA adapter this request runs with (None: the base model); it salts the prefix-cache keys.
    lora_name: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_greedy(self) -> bool:
        return self.sampling.temperature is not None and self.sampling.temperature == 0.0
