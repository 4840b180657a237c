"""Exceptions that cross the boundary between handlers and the bus, each with one outcome."""

from __future__ import annotations

from schemas.replies import ErrorCode, ErrorFrame


class RejectRequest(Exception):
    """Raised by a handler for a request that can never succeed: the client gets an error frame
    with this code and the task is acked (retrying it would fail the same way). Any other exception
    counts as transient: the task is redelivered after a backoff, up to the consumer's max_deliver.
    `retryable` tells the client whether sending it again later may succeed (overloaded: yes)."""

    def __init__(self, code: ErrorCode, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retryable = retryable


class PayloadTooLarge(RejectRequest, ValueError):
    """A message larger than the stream or the server accepts; raised before anything is sent."""

    def __init__(self, subject: str, size_bytes: int, limit_bytes: int) -> None:
        super().__init__(
            ErrorCode.INVALID_REQUEST,
            f"message for {subject} is {size_bytes} bytes, over the limit of {limit_bytes} bytes "
            "(CONVEYOR_MAX_MESSAGE_BYTES, capped by the server's max_payload)",
        )
        self.size_bytes = size_bytes
        self.limit_bytes = limit_bytes


class QueueFull(RejectRequest):
    """A stage's work stream is at its limit (`discard: new`): refused at once, never silently dropped."""

    def __init__(self, subject: str, detail: str) -> None:
        super().__init__(ErrorCode.OVERLOADED, f"the queue for {subject} is full ({detail}); try again shortly",
                         retryable=True)


class RequestIdInUse(ValueError):
    """JetStream dropped a submitted request as a duplicate: its id was used within the dedupe window."""


class RemoteError(Exception):
    """The pipeline answered a request with an error frame."""

    def __init__(self, frame: ErrorFrame) -> None:
        super().__init__(f"{frame.code.value}: {frame.message}")
        self.frame = frame

    @property
    def code(self) -> ErrorCode:
        return self.frame.code


class ReplyStreamBroken(Exception):
    """No frame arrived within the heartbeat window: the sender died or the network split."""


class ReplyGap(Exception):
    """A frame was lost between sender and receiver (a sequence number was skipped)."""
