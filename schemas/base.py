"""The base of every wire model: strict about unknown fields, immutable once built."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class WireModel(BaseModel):
    """A message on the wire.

    `extra="forbid"` turns a typo'd field into a validation error instead of a silently ignored
    option (a misspelt `temprature` must not sample greedily without a word). Models are frozen so
    a task can be handed between coroutines without defensive copies.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False)
