"""msgpack encoding of wire models, and the header that carries the wire version.

Models are dumped in Python mode (bytes stay bytes, which JSON mode would base64) with `None`
fields left out to keep frames small; decoding restores them from the defaults.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgpack
from pydantic import BaseModel, TypeAdapter

# Bump on any change that an older peer would misread; peers reject other versions.
WIRE_VERSION = 1
WIRE_VERSION_HEADER = "Conveyor-Wire"

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


class WireVersionMismatch(ValueError):
    """A message written by a peer that speaks another version of the wire contract."""


def encode(model: BaseModel) -> bytes:
    return msgpack.packb(model.model_dump(mode="python", exclude_none=True), use_bin_type=True)


def decode(data: bytes, model_type: type[M]) -> M:
    return model_type.model_validate(unpack(data))


def decode_as(data: bytes, adapter: TypeAdapter[T]) -> T:
    """Decode into a union (a `TypeAdapter` over a discriminated union)."""
    return adapter.validate_python(unpack(data))


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=True)


def check_wire_version(headers: dict[str, str] | None) -> None:
    """Accept a message without the header (a hand-written client) or with ours."""
    if not headers or WIRE_VERSION_HEADER not in headers:
        return
    version = headers[WIRE_VERSION_HEADER]
    if version != str(WIRE_VERSION):
        raise WireVersionMismatch(f"wire version {version}, this worker speaks {WIRE_VERSION}")
