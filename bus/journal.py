"""The reply journal: a request's reply stream recorded in JetStream, so a replica can take it over.

Writer: `ReplyJournal` records each frame a `ReplySender` sends, just before the frame goes to the
inbox, on `{ns}.progress.{request_id}` (the same bytes; one more message per frame, written with the
frame in one command, no ack awaited). Every `snapshot_every` frames it writes a `ProgressSnapshot`
with a rollup header instead, so a subject never holds more than that many records; the terminal
frame is written as a rollup too.

Reader: `read_progress` replays the subject into a `Progress`: what the client has been sent, the
next `seq`, the last frame's bytes, whether the request already ended and how old the last record is.

Why journal before sending: a worker that dies between the two publishes leaves a record of a frame
the client may not have. The successor sends that frame again, and the client drops it if it has it.
The other order could leave the client with a frame the successor knows nothing of.

Records are in a memory stream: they only need to outlive a worker, not the server.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Annotated

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from pydantic import Field, TypeAdapter

from bus.connection import pub_prefix, publish_frames
from bus.subjects import Names
from schemas.codec import decode_as, encode
from schemas.progress import ProgressSnapshot
from schemas.replies import EmbeddingResult, ErrorFrame, FinalFrame, Heartbeat, TokenChunk

ROLLUP_HEADERS = {"Nats-Rollup": "sub"}

_Record = Annotated[TokenChunk | Heartbeat | FinalFrame | ErrorFrame | EmbeddingResult | ProgressSnapshot,
                    Field(discriminator="kind")]
_RECORD: TypeAdapter[TokenChunk | Heartbeat | FinalFrame | ErrorFrame | EmbeddingResult | ProgressSnapshot] = (
    TypeAdapter(_Record))


@dataclass(slots=True)
class Progress:
    """A request's reply stream as far as its journal shows it."""

    next_seq: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    last_frame: bytes | None = None
    migrations: int = 0
    # The terminal frame was sent: the request is over.
    finished: bool = False
    # The last writer handed the request back on shutdown.
    released: bool = False
    # Seconds since the last record was stored (server time).
    age_s: float = 0.0

    @property
    def streamed(self) -> bool:
        return self.next_seq > 0

    def being_written(self, fresh_s: float) -> bool:
        """Whether a live holder may still be writing it: streaming, not ended nor handed back, and
        written to within `fresh_s`."""
        return self.streamed and not self.released and not self.finished and self.age_s < fresh_s


class ReplyJournal:
    """Records one request's frames; used by its `ReplySender`, under the sender's lock."""

    def __init__(self, nc: Client, subject: str, request_id: str, resumed: Progress | None = None,
                 snapshot_every: int = 64) -> None:
        self._nc = nc
        self.subject = subject
        self._prefix = pub_prefix(subject)
        self._request_id = request_id
        self._snapshot_every = snapshot_every
        resumed = resumed or Progress()
        self._token_ids = list(resumed.token_ids)
        self._text_pieces = [resumed.text] if resumed.text else []
        self._last_frame = resumed.last_frame
        self.migrations = resumed.migrations
        self._since_snapshot = 0

    async def record(self, payload: bytes, next_seq: int, token_ids: list[int] | None, text: str | None,
                     then: tuple[bytes, bytes]) -> None:
        """Record a non-terminal frame (`next_seq`: the seq after it). `then`, the frame itself for `publish_frames`
        (to its inbox), goes out right after the record, in the same write unless a snapshot is due."""
        if token_ids:
            self._token_ids.extend(token_ids)
        if text:
            self._text_pieces.append(text)
        self._last_frame = payload
        self._since_snapshot += 1
        if self._since_snapshot >= self._snapshot_every:
            await self.snapshot(next_seq)
            await publish_frames(self._nc, then)
        else:
            await publish_frames(self._nc, (self._prefix, payload), then)

    async def snapshot(self, next_seq: int, released: bool = False) -> None:
        """Everything so far in one record, replacing the subject's older ones."""
        self._since_snapshot = 0
        text = "".join(self._text_pieces)
        self._text_pieces = [text] if text else []
        record = ProgressSnapshot(request_id=self._request_id, next_seq=next_seq, token_ids=self._token_ids, text=text,
                                  last_frame=self._last_frame, migrations=self.migrations, released=released)
        await self._nc.publish(self.subject, encode(record), headers=ROLLUP_HEADERS)

    async def end(self, terminal_payload: bytes) -> None:
        """The terminal frame: the journal now says only that the request is over."""
        await self._nc.publish(self.subject, terminal_payload, headers=ROLLUP_HEADERS)

    async def take_over(self, next_seq: int) -> None:
        """Record the takeover first, so a replica after this one counts it."""
        self.migrations += 1
        await self.snapshot(next_seq)


async def read_progress(js: JetStreamContext, names: Names, request_id: str) -> Progress:
    """Replay a request's journal (an empty `Progress` when nothing was recorded)."""
    progress = Progress()
    subject = names.progress_subject(request_id)
    next_stream_seq = 1
    last_stored: datetime | None = None
    while True:
        try:
            raw = await js.get_msg(names.progress_stream, seq=next_stream_seq, subject=subject, next=True)
        except NotFoundError:
            break
        assert raw.seq is not None
        next_stream_seq = raw.seq + 1
        last_stored = raw.time
        _apply(progress, raw.data or b"")
    if last_stored is not None:
        progress.age_s = max(0.0, time.time() - last_stored.replace(tzinfo=last_stored.tzinfo or UTC).timestamp())
    return progress


def _apply(progress: Progress, payload: bytes) -> None:
    record = decode_as(payload, _RECORD)
    if isinstance(record, ProgressSnapshot):
        progress.next_seq, progress.token_ids, progress.text = record.next_seq, list(record.token_ids), record.text
        progress.last_frame, progress.migrations, progress.released = record.last_frame, record.migrations, record.released
        return
    progress.released = False
    progress.next_seq, progress.last_frame = record.seq + 1, payload
    if isinstance(record, TokenChunk):
        progress.token_ids.extend(record.token_ids)
        progress.text += record.text or ""
    elif not isinstance(record, Heartbeat):
        progress.finished = True
