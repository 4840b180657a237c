"""The reply journal: what a worker records of a request's reply stream, so another replica can take
the request over mid-stream (migration) without repeating or contradicting what the client has seen.

A worker that journals a request publishes every reply frame it sends (the same bytes, just before
they go to the inbox) to `{ns}.progress.{request_id}`, in a memory stream. Now and then it writes a
`ProgressSnapshot` instead, with a rollup header that drops the subject's older records: everything
streamed so far in one record. The terminal frame ends the journal (also as a rollup).

A replica that gets the request again reads the subject: a terminal record means the request already
ended (only its ack was lost); otherwise the tokens and text the client has, the next `seq` to send,
and the raw bytes of the last frame (sent again: the client drops it if it has it).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from schemas.base import WireModel
from schemas.client import RequestId


class ProgressSnapshot(WireModel):
    kind: Literal["progress"] = "progress"
    request_id: RequestId
    # The seq the next frame gets.
    next_seq: int = Field(ge=0)
    # Every token id and all the text the client has been sent, in order.
    token_ids: list[int]
    text: str = ""
    # The last frame sent (msgpack bytes), to be sent again by a replica that takes over.
    last_frame: bytes | None = None
    # Takeovers so far; bounded by the decode workers' migration limit.
    migrations: int = Field(default=0, ge=0)
    # The writer stopped (shutdown) and handed the request back: take it over at once.
    released: bool = False
