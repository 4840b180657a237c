"""Messages on the control subject `{ns}.control.cancel`, which every worker listens to."""

from __future__ import annotations

from pydantic import Field

from schemas.base import WireModel
from schemas.client import RequestId


class Cancel(WireModel):
    """Stop a request wherever it is: queued, prefilling, transferring KV or decoding."""

    request_id: RequestId
    reason: str = Field(default="cancelled by client", max_length=256)
    sent_at_s: float = Field(ge=0.0)
