"""msgpack encoding of wire models, and the header that carries the wire version.

Models are dumped in Python mode (bytes stay bytes, which JSON mode would base64) with `None`
fields left out to keep frames small; decoding restores them from the defaults.
"""

from __future__ import annotations

import threading
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


_packers = threading.local()


def pack(value: Any) -> bytes:
    """msgpack of plain Python values, as `msgpack.packb(value, use_bin_type=True)` makes it. One packer per thread,
    kept: `packb` builds a packer, with a 1 MiB buffer, per call, and a streaming worker packs a frame per token."""
    packer = getattr(_packers, "packer", None)
    if packer is None:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    return packer.pack(value)


def encode(model: BaseModel) -> bytes:
    return pack(model.model_dump(mode="python", exclude_none=True))


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
