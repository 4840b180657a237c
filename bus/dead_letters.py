"""Dead letters: tasks a stage gave up on, kept with the reason so an operator can look and replay.

A task is dead-lettered when its worker terminates it — not msgpack or another wire version, invalid
with no inbox to answer, failed on every one of `max_deliver` deliveries (a poison message), or failed
after streaming part of its answer. The original payload and headers go to `{NS}_DEAD_LETTERS` on
`{ns}.dead.{stage}`, plus `Conveyor-Dead-*` headers (reason, detail, the subject it came from, how often it
was delivered). `conveyor dlq` lists them; `conveyor dlq --replay SEQ` puts one back on its subject
(a fresh `Nats-Msg-Id`, so the dedupe window does not drop it) and removes the dead letter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from bus.subjects import Names

REASON = "Conveyor-Dead-Reason"
DETAIL = "Conveyor-Dead-Detail"
SUBJECT = "Conveyor-Dead-Subject"
DELIVERIES = "Conveyor-Dead-Deliveries"
_OURS = (REASON, DETAIL, SUBJECT, DELIVERIES)
_MSG_ID = "Nats-Msg-Id"


async def dead_letter(js: JetStreamContext, names: Names, stage: str, msg: Msg, reason: str, detail: str) -> None:
    headers = {key: value for key, value in (msg.headers or {}).items() if key != _MSG_ID}
    headers.update({REASON: reason, DETAIL: detail[:512], SUBJECT: msg.subject,
                    DELIVERIES: str(msg.metadata.num_delivered)})
    await js.publish(names.dead_letter_subject(stage), msg.data, headers=headers)


@dataclass(frozen=True, slots=True)
class DeadLetter:
    seq: int
    stage: str
    reason: str
    detail: str
    subject: str
    deliveries: int
    size_bytes: int
    stored_at_s: float


async def list_dead_letters(js: JetStreamContext, names: Names, limit: int = 100) -> list[DeadLetter]:
    try:
        info = await js.stream_info(names.dead_letter_stream)
    except NotFoundError:
        return []
    letters = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        if len(letters) >= limit:
            break
        try:
            raw = await js.get_msg(names.dead_letter_stream, seq)
        except NotFoundError:
            continue  # replayed or expired
        headers = raw.headers or {}
        letters.append(DeadLetter(
            seq=seq, stage=raw.subject.rsplit(".", 1)[-1], reason=headers.get(REASON, "?"),
            detail=headers.get(DETAIL, ""), subject=headers.get(SUBJECT, "?"),
            deliveries=int(headers.get(DELIVERIES, "0")), size_bytes=len(raw.data or b""),
            stored_at_s=_stored_at(raw),
        ))
    return letters


async def replay(js: JetStreamContext, names: Names, seq: int) -> str:
    """Put dead letter `seq` back on the subject it came from; returns that subject."""
    raw = await js.get_msg(names.dead_letter_stream, seq)
    headers = {key: value for key, value in (raw.headers or {}).items() if key not in _OURS}
    headers[_MSG_ID] = f"replay-{seq}-{time.time_ns()}"
    subject = (raw.headers or {})[SUBJECT]
    await js.publish(subject, raw.data or b"", headers=headers)
    await js.delete_msg(names.dead_letter_stream, seq)
    return subject


def _stored_at(raw: object) -> float:
    stamp = getattr(raw, "time", None)
    return stamp.timestamp() if stamp is not None and hasattr(stamp, "timestamp") else 0.0
