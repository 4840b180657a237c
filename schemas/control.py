"""Control messages: `Cancel` on the control subject `{ns}.control.cancel`, which every worker listens to, and
`LoraAdapter`, an entry of the `{ns}_loras` bucket that every LLM worker of its base model watches and loads."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from schemas.base import WireModel
from schemas.client import RequestId


class Cancel(WireModel):
    """Stop a request wherever it is: queued, prefilling, transferring KV or decoding."""

    request_id: RequestId
    reason: str = Field(default="cancelled by client", max_length=256)
    sent_at_s: float = Field(ge=0.0)


# An adapter's name is what requests send as their `model`, and a key of the `{ns}_loras` bucket.
LoraName = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_\-][A-Za-z0-9_.\-]*$")]


class LoraAdapter(WireModel):
    """A LoRA adapter (PEFT format) to serve on every LLM worker of `base_model`: requests whose `model` is
    `name` run the base model with it. `path` is a directory the workers can read (or, on SGLang, anything its
    `load_lora_adapter` takes)."""

    name: LoraName
    base_model: str = Field(min_length=1)
    path: str = Field(min_length=1, max_length=4096)
