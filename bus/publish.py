"""Publishing tasks to work streams: size-checked, deduplicated, traced."""

from __future__ import annotations

import asyncio

import structlog
from nats.js import JetStreamContext
from nats.js.api import PubAck
from nats.js.errors import NoStreamResponseError, ServiceUnavailableError
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from bus.errors import PayloadTooLarge, QueueFull
from bus.metrics import MESSAGES_OUT
from bus.subjects import Names
from bus.tracing import TRACEPARENT_HEADER, TraceContext
from schemas.base import WireModel
from schemas.codec import WIRE_VERSION, WIRE_VERSION_HEADER, encode
from schemas.registry import Stage

log = structlog.get_logger(__name__)

MSG_ID_HEADER = "Nats-Msg-Id"
# On a task moved from a gone worker's pinned subject to the shared queue: how often it was delivered there.
PRIOR_DELIVERIES_HEADER = "Conveyor-Prior-Deliveries"
# JetStream's answers to a publish into a stream at max_msgs / max_bytes with discard: new.
_STREAM_FULL = {10077, 10078}
# A publish that got no answer, or no stream's: sent again (the same Nats-Msg-Id) after this, then backing off.
_UNACKNOWLEDGED = (NoStreamResponseError, TimeoutError)
_FIRST_RETRY_S = 0.1


class TaskPublisher:
    """Puts tasks on a stage's work subject.

    `Nats-Msg-Id` is the request id, so JetStream drops a second copy published within the dedupe
    window: a client retrying a publish, or a stage redelivered after it already forwarded a task,
    does not run the request twice. That is also why a publish JetStream did not acknowledge (a
    server restarting, a cluster electing a stream leader) is simply sent again, for up to
    `retry_for_s`.
    """

    def __init__(self, js: JetStreamContext, names: Names, max_message_bytes: int, retry_for_s: float = 15.0,
                 ack_timeout_s: float | None = None) -> None:
        self._js = js
        self._names = names
        self.max_message_bytes = max_message_bytes
        self._retry_for_s = retry_for_s
        # How long one attempt waits for JetStream's ack (None: the JetStream context's own timeout).
        self._ack_timeout_s = ack_timeout_s

    async def publish(
        self, stage: Stage, task: WireModel, request_id: str, trace: TraceContext, model: str | None = None,
        worker_id: str | None = None, pool: str | None = None, msg_id: str | None = None,
    ) -> bool:
        """Publish (to one replica's pinned subject when `worker_id` is given: bus/router.py; else to the queue of
        `pool`, when given: bus/pools.py); returns False when JetStream discarded it as a duplicate. `msg_id` (the
        deduplication key) defaults to the request id; a task sent again on purpose (a retry on another pool)
        needs its own."""
        subject = (self._names.work_subject(stage, model, pool) if worker_id is None
                   else self._names.pinned_subject(stage, model, worker_id))
        payload = encode(task)
        if len(payload) > self.max_message_bytes:
            raise PayloadTooLarge(subject, len(payload), self.max_message_bytes)
        headers = {
            MSG_ID_HEADER: msg_id or request_id,
            WIRE_VERSION_HEADER: str(WIRE_VERSION),
            TRACEPARENT_HEADER: trace.traceparent,
        }
        try:
            ack, attempts = await self._publish_until_acked(subject, payload, headers)
        except ServiceUnavailableError as error:
            if error.err_code in _STREAM_FULL:
                raise QueueFull(subject, error.description or "stream limit reached") from error
            raise
        MESSAGES_OUT.labels(stage=stage.value).inc()
        if ack.duplicate and attempts > 1:
            # An earlier attempt went unacknowledged (a node dying, a leader election) yet was stored: the copy
            # JetStream kept is this one, not another request's (seen in a 3-node cluster losing a node).
            log.info("publish.stored_before_its_ack_was_lost", subject=subject, request_id=request_id, attempts=attempts)
            return True
        if ack.duplicate:
            log.info("publish.duplicate_dropped", subject=subject, request_id=request_id)
        return not ack.duplicate

    async def _publish_until_acked(self, subject: str, payload: bytes, headers: dict[str, str]) -> tuple[PubAck, int]:
        """The ack, and how many attempts it took. The first attempt is made without the retry loop, whose
        bookkeeping costs about as much as the publish itself and is nearly always unneeded."""
        try:
            return await self._js.publish(subject, payload, timeout=self._ack_timeout_s, headers=headers), 1
        except _UNACKNOWLEDGED as error:
            log.warning("publish.unacknowledged", subject=subject, error=repr(error))
        await asyncio.sleep(_FIRST_RETRY_S)
        retrying = AsyncRetrying(
            wait=wait_exponential(multiplier=_FIRST_RETRY_S, max=1.0), reraise=True,
            stop=stop_after_delay(max(0.0, self._retry_for_s - _FIRST_RETRY_S)),
            retry=retry_if_exception_type(_UNACKNOWLEDGED),
            before_sleep=lambda state: log.warning("publish.unacknowledged", subject=subject,
                                                   error=repr(state.outcome.exception())))
        async for attempt in retrying:
            with attempt:
                ack = await self._js.publish(subject, payload, timeout=self._ack_timeout_s, headers=headers)
                return ack, attempt.retry_state.attempt_number + 1
        raise AssertionError("unreachable: tenacity re-raises the last error")
