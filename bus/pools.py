"""Pools: several sets of replicas serving one model, and which one a request goes to (Dynamo's global router).

A deployment may run one model in several pools — a fast one and a cheap one, a short-prompt one and a
long-context one. A worker joins a pool with `--pool NAME` (its card says so) and pulls that pool's queue,
`{ns}.work.{stage}.{model}.pool.{name}`, instead of the model's. One file, given to the processors with
`--pools FILE` (TOML or JSON), says how requests are spread; its models are validated here with clear errors:

    [[models]]
    model = "SmolLM2-135M-Instruct"
    default_ttft_target_ms = 500        # a request without a target gets this (else the middle of the axis)

    [models.aggregated]                 # decode workers of an aggregated model
    pools = ["fast", "cheap"]
    priorities = [0, 1]                 # lower is faster; default: the list's order
    ttft_ms = { min = 0, max = 1000, resolution = 2 }
    itl_ms = { min = 0, max = 50, resolution = 2 }
    mapping = [[0, 0], [0, 1]]          # mapping[ttft bucket][itl bucket] = index into pools
    retry_on_faster_pool = true         # a failure before any output tries the faster pools
    priority_overrides = [{ min_priority = 10, max_priority = 100, pool = "fast" }]

A disaggregated model has `[models.prefill]` (axes `isl_tokens`, `ttft_ms`) and `[models.decode]` (axes
`context_tokens`, `itl_ms`) instead, chosen independently. Each axis is cut into `resolution` equal buckets
between `min` and `max`; a value outside falls in the first or last. The targets come with the request
(`ttft_target_ms`, `itl_target_ms`; the gateway also reads Dynamo's `nvext.router`); an explicit 0 asks for
the fastest bucket. A request whose `priority` falls in an override's range (both ends included) goes to that
override's pool, the first match winning. Retry order: the chosen pool, then the pools with strictly faster
priorities, slower to faster (ties in list order) — tried only while nothing was streamed to the client.

No NATS here: this is configuration and arithmetic; bus/router.py and the processor act on it.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from schemas.registry import PoolName


class PoolsConfigError(ValueError):
    """The pools file cannot be used; the message says where and why."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Axis(_Strict):
    min: float
    max: float
    resolution: int = Field(gt=0, le=1024)

    @model_validator(mode="after")
    def _ordered(self) -> Axis:
        if self.max <= self.min:
            raise ValueError(f"max ({self.max}) must be above min ({self.min})")
        return self

    @property
    def middle(self) -> float:
        return (self.min + self.max) / 2

    def bucket(self, value: float) -> int:
        step = (self.max - self.min) / self.resolution
        return min(max(int((value - self.min) / step), 0), self.resolution - 1)


class PriorityOverride(_Strict):
    min_priority: int
    max_priority: int
    pool: PoolName

    @model_validator(mode="after")
    def _ordered(self) -> PriorityOverride:
        if self.max_priority < self.min_priority:
            raise ValueError(f"max_priority ({self.max_priority}) is below min_priority ({self.min_priority})")
        return self

    def covers(self, priority: int) -> bool:
        return self.min_priority <= priority <= self.max_priority


@dataclass(frozen=True, slots=True)
class RequestTargets:
    """What pool selection reads of a request."""

    prompt_tokens: int
    ttft_target_ms: float | None = None
    itl_target_ms: float | None = None
    priority: int | None = None


class PoolGrid(_Strict):
    """The pools of one role and how requests map onto them; subclasses name the two axes."""

    pools: list[PoolName] = Field(min_length=1)
    # Lower is faster; default: the order of `pools`.
    priorities: list[int] | None = None
    mapping: list[list[int]] = Field(min_length=1)
    priority_overrides: list[PriorityOverride] = Field(default_factory=list)
    retry_on_faster_pool: bool = False

    # The two axes' field names, in the mapping's order (each role below sets them).
    axis_names: ClassVar[tuple[str, str]]

    def axes(self) -> tuple[Axis, Axis]:
        first, second = self.axis_names
        return getattr(self, first), getattr(self, second)

    @model_validator(mode="after")
    def _consistent(self) -> PoolGrid:
        if len(set(self.pools)) != len(self.pools):
            raise ValueError(f"pools are named twice: {self.pools}")
        if self.priorities is not None and len(self.priorities) != len(self.pools):
            raise ValueError(f"{len(self.priorities)} priorities for {len(self.pools)} pools")
        first, second = self.axes()
        if len(self.mapping) != first.resolution or any(len(row) != second.resolution for row in self.mapping):
            raise ValueError(f"mapping must be {first.resolution} rows of {second.resolution} pool indices "
                             "(the two axes' resolutions)")
        bad = [index for row in self.mapping for index in row if not 0 <= index < len(self.pools)]
        if bad:
            raise ValueError(f"mapping holds pool index {bad[0]}; there are {len(self.pools)} pools (0 to "
                             f"{len(self.pools) - 1})")
        unknown = [o.pool for o in self.priority_overrides if o.pool not in self.pools]
        if unknown:
            raise ValueError(f"priority override names pool {unknown[0]!r}, which is not among {self.pools}")
        return self

    def choose(self, request: RequestTargets, defaults: TargetDefaults) -> list[str]:
        """The pool for this request, then (when retries are on) the faster pools to try should it fail before
        streaming anything."""
        chosen = self._selected(request, defaults)
        if not self.retry_on_faster_pool:
            return [chosen]
        speed = self.priorities or list(range(len(self.pools)))
        mine = speed[self.pools.index(chosen)]
        faster = sorted((i for i, p in enumerate(speed) if p < mine), key=lambda i: (-speed[i], i))
        return [chosen, *(self.pools[i] for i in faster)]

    def _selected(self, request: RequestTargets, defaults: TargetDefaults) -> str:
        if request.priority is not None:
            override = next((o for o in self.priority_overrides if o.covers(request.priority)), None)
            if override is not None:
                return override.pool
        buckets = [axis.bucket(_axis_value(name, axis, request, defaults))
                   for name, axis in zip(self.axis_names, self.axes(), strict=True)]
        return self.pools[self.mapping[buckets[0]][buckets[1]]]


@dataclass(frozen=True, slots=True)
class TargetDefaults:
    ttft_ms: float | None = None
    itl_ms: float | None = None


def _axis_value(name: str, axis: Axis, request: RequestTargets, defaults: TargetDefaults) -> float:
    """Where a request falls on an axis. A latency target: the request's, else the deployment's default, else the
    middle of the axis (an explicit 0 is kept: the fastest bucket)."""
    if name in ("isl_tokens", "context_tokens"):
        return float(request.prompt_tokens)
    given, default = ((request.ttft_target_ms, defaults.ttft_ms) if name == "ttft_ms"
                      else (request.itl_target_ms, defaults.itl_ms))
    if given is not None:
        return given
    return default if default is not None else axis.middle


class AggregatedPools(PoolGrid):
    """Decode workers that run prompts too: by TTFT target × ITL target."""

    axis_names = ("ttft_ms", "itl_ms")
    ttft_ms: Axis
    itl_ms: Axis


class PrefillPools(PoolGrid):
    """Prefill workers: by prompt length × TTFT target."""

    axis_names = ("isl_tokens", "ttft_ms")
    isl_tokens: Axis
    ttft_ms: Axis


class DecodePools(PoolGrid):
    """Decode workers of a disaggregated model: by context length (the prompt) × ITL target."""

    axis_names = ("context_tokens", "itl_ms")
    context_tokens: Axis
    itl_ms: Axis


class ModelPools(_Strict):
    model: str = Field(min_length=1)
    default_ttft_target_ms: float | None = Field(default=None, ge=0)
    default_itl_target_ms: float | None = Field(default=None, ge=0)
    aggregated: AggregatedPools | None = None
    prefill: PrefillPools | None = None
    decode: DecodePools | None = None

    @model_validator(mode="after")
    def _some_role(self) -> ModelPools:
        if self.aggregated is None and self.prefill is None and self.decode is None:
            raise ValueError("give [aggregated] pools, or [prefill] and/or [decode] pools")
        return self

    @property
    def defaults(self) -> TargetDefaults:
        return TargetDefaults(self.default_ttft_target_ms, self.default_itl_target_ms)


class PoolsConfig(_Strict):
    models: list[ModelPools] = Field(min_length=1)

    @model_validator(mode="after")
    def _each_model_once(self) -> PoolsConfig:
        names = [m.model for m in self.models]
        twice = {name for name in names if names.count(name) > 1}
        if twice:
            raise ValueError(f"model {sorted(twice)[0]!r} is configured twice")
        return self

    def of(self, model: str) -> ModelPools | None:
        return next((m for m in self.models if m.model == model), None)

    @classmethod
    def from_file(cls, path: Path) -> PoolsConfig:
        """Read a `.toml` or `.json` pools file; every problem is one `PoolsConfigError` naming the file and field."""
        try:
            text = path.read_text()
        except OSError as error:
            raise PoolsConfigError(f"cannot read the pools file {path}: {error.strerror}") from None
        try:
            raw: Any = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
        except (ValueError, tomllib.TOMLDecodeError) as error:
            raise PoolsConfigError(f"{path} is not valid {'JSON' if path.suffix == '.json' else 'TOML'}: {error}") from None
        try:
            return cls.model_validate(raw)
        except ValidationError as error:
            problems = "; ".join(f"{'.'.join(str(part) for part in e['loc']) or 'file'}: {e['msg']}"
                                 for e in error.errors()[:5])
            raise PoolsConfigError(f"{path}: {problems}") from None
