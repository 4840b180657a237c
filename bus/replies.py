"""Reply streams: a worker sends numbered frames to a client's inbox; the client reads them in order.

Sender side: `ReplySender` numbers frames from 0, can coalesce tokens that arrive within a small
window into one chunk (fewer messages at high token rates), sends a `Heartbeat` frame when it has
been quiet for the heartbeat interval, and probes `{inbox}.alive` so a worker can stop generating
for a client that is gone.

Receiver side: `ReplyStream` subscribes before the request is published, answers liveness probes
with the next `seq` it expects, yields chunks in order and ends at the terminal frame. It raises
`ReplyGap` when a frame is still missing after the heartbeat timeout (frames ahead of it are kept:
after a NATS reconnect the sender sends the lost ones again, `resync`),
`ReplyStreamBroken` when nothing arrives within the window, and `RemoteError` on an error frame
(accepted whatever its number: it may come from an earlier stage), so a client never waits forever.
A frame numbered below the next expected one is a duplicate (a replica that took the request over
sends its predecessor's last frame again) and is dropped.

Journaled streams (bus/journal.py) also record each frame before sending it, so another replica can
take the request over (`resume`) if this worker dies.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from types import TracebackType
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from bus.connection import pub_prefix, publish_frames
from bus.errors import RemoteError, ReplyGap, ReplyStreamBroken
from bus.journal import Progress, ReplyJournal
from bus.lifecycle import sleep_unless
from bus.metrics import CLIENTS_GONE, ERRORS, REPLY_FRAMES
from schemas.codec import decode, decode_as, encode, pack
from schemas.replies import (
    REPLY_FRAME,
    AliveAnswer,
    ChatChunkDelta,
    Embedding,
    EmbeddingResult,
    ErrorCode,
    ErrorFrame,
    FinalFrame,
    FinishReason,
    Heartbeat,
    ImageData,
    ImageProgress,
    ImageResult,
    ReplyFrame,
    TokenChunk,
    TokenLogprob,
    Usage,
)

log = structlog.get_logger(__name__)

# Inbox subscriptions must absorb bursts of tens of thousands of frames without dropping any.
_INBOX_PENDING_MSGS = 1_000_000
_INBOX_PENDING_BYTES = 512 * 1024 * 1024
# Frames a sender keeps until the client's answers to liveness probes confirm them (about one heartbeat
# interval's worth), to send again after a NATS reconnect. Beyond this, the oldest are forgotten.
_UNCONFIRMED_FRAMES = 4096
# Each frame type's counter, looked up once: a frame's `kind` default read per frame cost more than the count.
_FRAMES_SENT = {frame_type: REPLY_FRAMES.labels(kind=frame_type.model_fields["kind"].default) for frame_type in (
    TokenChunk, Heartbeat, FinalFrame, ErrorFrame, EmbeddingResult, ImageProgress, ImageData, ImageResult)}
# Room left in a NATS message for a frame's fields around an image's bytes (request id, seq, index).
_FRAME_OVERHEAD_BYTES = 1024
_TERMINAL_FRAMES = (FinalFrame, ErrorFrame, EmbeddingResult, ImageResult)
# Chunks sent before they are added to `conveyor_reply_frames_total` (and at the stream's end).
_CHUNKS_PER_COUNT = 32


def alive_subject(inbox: str) -> str:
    return f"{inbox}.alive"


class ReplySender:
    """Streams one request's frames to its inbox. Not shared between requests."""

    def __init__(
        self,
        nc: Client,
        reply_to: str,
        request_id: str,
        *,
        coalesce_window_s: float = 0.0,
        heartbeat_interval_s: float = 1.0,
        journal: ReplyJournal | None = None,
    ) -> None:
        self._nc = nc
        self._journal = journal
        self.reply_to = reply_to
        self._reply_prefix = pub_prefix(reply_to)
        self.request_id = request_id
        self._coalesce_window_s = coalesce_window_s
        self._heartbeat_interval_s = heartbeat_interval_s
        self._seq = 0
        self._closed = False
        self._last_sent_s = time.monotonic()
        # Sequence numbers must go out in order, so a frame is numbered and handed to the
        # connection under one lock.
        self._lock = asyncio.Lock()
        # A window flush in progress must finish before a terminal frame goes out.
        self._flush_lock = asyncio.Lock()
        self._pending: list[TokenChunk] = []
        self._flush_task: asyncio.Task[None] | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        self.client_gone = asyncio.Event()
        self._background_stopped = asyncio.Event()
        # (seq, payload) of frames the client has not confirmed yet (bus/replies.py `resync`).
        self._unconfirmed: deque[tuple[int, bytes]] = deque(maxlen=_UNCONFIRMED_FRAMES)
        # Until then, "no responders" on the client's inbox is not taken as gone (it is subscribing again).
        self._probe_grace_until = 0.0
        # A frame went out while the connection was down: it may be lost, even the terminal one.
        self.sent_while_away = False
        self._handover: Callable[[ErrorCode, str], Awaitable[bool]] | None = None
        # Anything but heartbeats went out (tokens, progress, a terminal frame): past this a failure is not handed over.
        self._content_sent = False
        self._chunks_uncounted = 0
        # This worker failed the request (an error frame, or a failure handed to another pool): not a success.
        self.failed = False

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def frames_sent(self) -> int:
        return self._seq

    @property
    def journaled(self) -> bool:
        return self._journal is not None

    @property
    def migrations(self) -> int:
        """Times this request moved to another replica mid-stream (told in the final frame)."""
        return self._journal.migrations if self._journal is not None else 0

    def continue_from(self, seq: int) -> None:
        """Number the stream from `seq`: the frames before it were sent by a worker that handed the task over."""
        assert self._seq == 0
        self._seq = seq

    async def resume(self, progress: Progress) -> None:
        """Take the stream over where a dead replica left it: go on with its numbering, and send its
        last frame again (the client drops it if it already has it)."""
        assert self._journal is not None and self._seq == 0
        self._seq = progress.next_seq
        async with self._lock:
            await self._journal.take_over(self._seq)
            if progress.last_frame is not None:
                await self._nc.publish(self.reply_to, progress.last_frame)

    async def release(self) -> None:
        """This worker is stopping with the request unfinished: tell the journal the next replica may
        take it over at once (no waiting to be sure this one is dead)."""
        if self._journal is None or self._closed:
            return
        await self._flush()
        async with self._lock:
            await self._journal.snapshot(self._seq, released=True)

    async def close_background(self) -> None:
        """Stop heartbeats and drop nothing: pending coalesced tokens are flushed first."""
        if not self._closed:
            await self._flush()
        await self._stop_background()

    async def __aenter__(self) -> ReplySender:
        self._heartbeat_task = asyncio.create_task(self._heartbeat_loop(), name=f"heartbeat-{self.request_id}")
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._stop_background()

    async def send_tokens(
        self,
        token_ids: list[int],
        text: str | None = None,
        logprobs: list[TokenLogprob] | None = None,
        index: int = 0,
        openai: ChatChunkDelta | None = None,
    ) -> None:
        if self._coalesce_window_s <= 0 or openai is not None:
            # An OpenAI chunk is a whole event for its client; it is not merged with others.
            await self._flush()
            await self._publish(TokenChunk, token_ids=token_ids, text=text, logprobs=logprobs, index=index, openai=openai)
            return
        self._pending.append(_PendingTokens(token_ids, text, logprobs, index))
        if self._flush_task is None:
            self._flush_task = asyncio.create_task(self._flush_after_window())

    async def finish(self, reason: FinishReason, usage: Usage, matched_stop: str | int | None = None) -> None:
        await self._flush()
        await self._send_terminal(FinalFrame, finish_reason=reason, usage=usage, matched_stop=matched_stop,
                                  migrations=self.migrations)

    def hand_over_failures(self, handover: Callable[[ErrorCode, str], Awaitable[bool]]) -> None:
        """Offer a failure that comes before anything but heartbeats went out to `handover` first (the task may be
        sent to a faster pool: bus/pools.py). When it takes the request, no error frame is sent: the stream is left
        to the worker that runs it now."""
        self._handover = handover

    async def fail(self, code: ErrorCode, message: str, retryable: bool = False) -> None:
        self.failed = True
        if not self._content_sent and self._handover is not None:
            handover, self._handover = self._handover, None
            # Closed first, so no heartbeat takes a number the next worker will use.
            self._closed = True
            async with self._lock:
                pass  # a frame on its way out is numbered by now
            if await handover(code, message):
                return
            self._closed = False
        ERRORS.labels(code=code.value).inc()
        await self._flush()
        await self._send_terminal(ErrorFrame, code=code, message=message, retryable=retryable)

    async def send_embeddings(self, model: str, data: list[Embedding], usage: Usage) -> None:
        """The one frame of an embedding request: every vector, then the stream is closed."""
        await self._send_terminal(EmbeddingResult, model=model, data=data, usage=usage)

    async def send_image_progress(self, step: int, num_steps: int) -> None:
        await self._publish(ImageProgress, step=step, num_steps=num_steps)

    async def send_image(self, index: int, *, png: bytes | None = None, url: str | None = None) -> None:
        """One image: its URL, or its PNG in as many frames as the connection's message size needs."""
        if url is not None:
            await self._publish(ImageData, index=index, url=url, last=True)
            return
        assert png is not None
        piece_bytes = max(1, self._nc.max_payload - _FRAME_OVERHEAD_BYTES)
        starts = range(0, max(len(png), 1), piece_bytes)
        for start in starts:
            await self._publish(ImageData, index=index, png=png[start:start + piece_bytes],
                                last=start == starts[-1])

    async def send_images_done(self, model: str, num_images: int, width: int, height: int, seed: int) -> None:
        """The end of an image request, after every image's frames."""
        await self._send_terminal(ImageResult, model=model, num_images=num_images, width=width, height=height,
                                  seed=seed)

    async def heartbeat(self) -> None:
        await self._publish(Heartbeat)

    async def client_alive(self, timeout_s: float) -> bool:
        """Ask the client's receiver whether it is still reading.

        No responders means nobody subscribes to the inbox any more: the client is gone (unless a NATS
        reconnect just happened: it may be subscribing again). A slow answer is not taken as gone.
        """
        answer = await self._probe(timeout_s)
        return answer is not _GONE or time.monotonic() < self._probe_grace_until

    async def resync(self, timeout_s: float) -> None:
        """After a NATS reconnect: frames sent around the outage may be lost (the server died holding
        them, or the client was not subscribed again yet). Ask the client which frame it expects next and
        send the rest again; new frames wait meanwhile, so they arrive after the old ones."""
        if not self._unconfirmed:
            return
        self._probe_grace_until = time.monotonic() + timeout_s
        async with self._lock:
            while time.monotonic() < self._probe_grace_until:
                answer = await self._probe(timeout_s=self._heartbeat_interval_s)
                if isinstance(answer, AliveAnswer):
                    break
                if answer is _ALIVE:
                    return  # a receiver that does not tell its position: nothing to go on
                await asyncio.sleep(0.1)  # not subscribed again yet, or slow: ask again
            else:
                return  # the heartbeat loop decides whether the client is gone
            await self._send_again(answer.next_seq)

    async def _send_again(self, from_seq: int) -> None:
        """Publish the kept frames from `from_seq` on (under the lock)."""
        frames = [payload for seq, payload in self._unconfirmed if seq >= from_seq]
        for payload in frames:
            await self._nc.publish(self.reply_to, payload)
        log.info("reply.sent_again", request_id=self.request_id, from_seq=from_seq, frames=len(frames))

    async def _probe(self, timeout_s: float) -> AliveAnswer | object | None:
        """The client's answer: its position (which confirms the frames before it), `_ALIVE` (an answer
        without one), `_GONE` (nobody subscribes, or the client's shared subscription says it closed the stream) or
        None (no answer in time)."""
        try:
            msg = await self._nc.request(alive_subject(self.reply_to), b"", timeout=timeout_s)
        except NoRespondersError:
            return _GONE
        except (NatsTimeoutError, TimeoutError):
            return None
        if not msg.data:
            return _ALIVE
        answer = decode(msg.data, AliveAnswer)
        if answer.closed:
            return _GONE
        while self._unconfirmed and self._unconfirmed[0][0] < answer.next_seq:
            self._unconfirmed.popleft()
        return answer

    async def _heartbeat_loop(self) -> None:
        while not await sleep_unless(self._background_stopped, self._heartbeat_interval_s):
            if self._closed:
                return
            if time.monotonic() - self._last_sent_s >= self._heartbeat_interval_s:
                await self.heartbeat()
            answer = await self._probe(self._heartbeat_interval_s)
            if isinstance(answer, AliveAnswer) and answer.missing:
                # A frame was lost on the way (a cluster node died between us): the client has later ones.
                async with self._lock:
                    await self._send_again(answer.next_seq)
            if answer is _GONE and time.monotonic() >= self._probe_grace_until:
                CLIENTS_GONE.inc()
                log.info("reply.client_gone", request_id=self.request_id)
                self.client_gone.set()
                return

    async def _flush_after_window(self) -> None:
        await asyncio.sleep(self._coalesce_window_s)
        self._flush_task = None
        await self._flush()

    async def _flush(self) -> None:
        if not self._pending and self._flush_task is None and not self._flush_lock.locked():
            return  # nothing coalesced, no window flush under way: the common case, once per chunk
        if self._flush_task is not None and self._flush_task is not asyncio.current_task():
            self._flush_task.cancel()
            self._flush_task = None
        async with self._flush_lock:
            pending, self._pending = self._pending, []
            for merged in _merge_pending(pending):
                await self._publish(
                    TokenChunk, token_ids=merged.token_ids, text=merged.text, logprobs=merged.logprobs,
                    index=merged.index,
                )

    async def _send_terminal(self, frame_type: type[FinalFrame | ErrorFrame | EmbeddingResult | ImageResult],
                             **fields: Any) -> None:
        await self._publish(frame_type, **fields)
        self._closed = True
        await self._stop_background()

    async def _publish(self, frame_type: type[ReplyFrame], **fields: Any) -> None:
        """Number the frame and hand it to the connection, in one step under the lock.

        Frames are not re-validated here: their fields come from typed arguments, and at tens of
        thousands of chunks a second validation would be most of the cost. Receivers validate.
        Reply frames carry no headers (header parsing costs the receiver more than the frame);
        the wire version travels on the task that named this inbox.
        """
        if self._closed:
            raise RuntimeError(f"reply stream of {self.request_id} already ended")
        if frame_type is not Heartbeat:
            self._content_sent = True
        async with self._lock:
            if frame_type is TokenChunk:
                payload = _chunk_payload(self.request_id, self._seq, fields)
            else:
                payload = encode(frame_type.model_construct(request_id=self.request_id, seq=self._seq, **fields))
            self._seq += 1
            if self._journal is not None:
                await self._record(frame_type, payload, fields)
            else:
                await publish_frames(self._nc, (self._reply_prefix, payload))
            self._unconfirmed.append((self._seq - 1, payload))
            if not self._nc.is_connected:
                self.sent_while_away = True
            self._last_sent_s = time.monotonic()
        if frame_type is TokenChunk:
            # Counted in batches: a counter's lock per token was 2% of a decode worker's CPU at 64 streams.
            self._chunks_uncounted += 1
            if self._chunks_uncounted >= _CHUNKS_PER_COUNT:
                self._count_chunks()
        else:
            self._count_chunks()
            _FRAMES_SENT[frame_type].inc()

    def _count_chunks(self) -> None:
        if self._chunks_uncounted:
            _FRAMES_SENT[TokenChunk].inc(self._chunks_uncounted)
            self._chunks_uncounted = 0

    async def _record(self, frame_type: type[ReplyFrame], payload: bytes, fields: dict[str, Any]) -> None:
        """Journal the frame, then send it to the inbox (bus/journal.py says why this order)."""
        assert self._journal is not None
        frame = (self._reply_prefix, payload)
        if frame_type in _TERMINAL_FRAMES:
            await self._journal.end(payload)
            await publish_frames(self._nc, frame)
        else:
            await self._journal.record(payload, self._seq, fields.get("token_ids"), fields.get("text"), then=frame)

    async def _stop_background(self) -> None:
        self._count_chunks()
        self._background_stopped.set()
        current = asyncio.current_task()
        for task in (self._heartbeat_task, self._flush_task):
            if task is not None and task is not current and not task.done():
                task.cancel()
        self._heartbeat_task = None


_GONE, _ALIVE = object(), object()


def _chunk_payload(request_id: str, seq: int, fields: dict[str, Any]) -> bytes:
    """The msgpack of a `TokenChunk`, built directly: the hot path of every stream.

    Produces exactly what `encode(TokenChunk(...))` produces (a test holds the two equal).
    """
    frame: dict[str, Any] = {"kind": "chunk", "request_id": request_id, "seq": seq, "token_ids": fields["token_ids"]}
    if fields.get("text") is not None:
        frame["text"] = fields["text"]
    if fields.get("logprobs") is not None:
        frame["logprobs"] = [item.model_dump(mode="python", exclude_none=True) for item in fields["logprobs"]]
    frame["index"] = fields.get("index", 0)
    if fields.get("openai") is not None:
        frame["openai"] = fields["openai"].wire()
    return pack(frame)


@dataclass(slots=True)
class _PendingTokens:
    token_ids: list[int]
    text: str | None
    logprobs: list[TokenLogprob] | None
    index: int


def _merge_pending(pending: list[_PendingTokens]) -> list[_PendingTokens]:
    """Merge consecutive deltas of the same completion index into one."""
    merged: list[_PendingTokens] = []
    for item in pending:
        if merged and merged[-1].index == item.index:
            last = merged[-1]
            last.token_ids = last.token_ids + item.token_ids
            last.text = _join_optional(last.text, item.text)
            last.logprobs = _join_optional(last.logprobs, item.logprobs)
        else:
            merged.append(_PendingTokens(list(item.token_ids), item.text, item.logprobs, item.index))
    return merged


_Joinable = TypeVar("_Joinable", str, list[TokenLogprob])


def _join_optional(first: _Joinable | None, second: _Joinable | None) -> _Joinable | None:
    if first is None:
        return second
    if second is None:
        return first
    return first + second


class ReplyStream:
    """Reads one request's frames from its inbox, in order; use as an async context manager.

    Subscribe (enter the context) before publishing the request, or early frames are lost.
    `first_frame_timeout_s` bounds the wait while the request is still queued (nothing heartbeats
    a queued request); `heartbeat_timeout_s` bounds every wait after the first frame.
    """

    def __init__(
        self,
        nc: Client,
        inbox: str,
        request_id: str,
        *,
        heartbeat_timeout_s: float = 10.0,
        first_frame_timeout_s: float = 60.0,
        inboxes: ReplyInboxes | None = None,
    ) -> None:
        self._nc = nc
        self.inbox = inbox
        # Read through the client's shared subscription when it covers this inbox; else subscribed on entering.
        self._inboxes = inboxes if inboxes is not None and inboxes.covers(inbox) else None
        self._open = False
        self.request_id = request_id
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._first_frame_timeout_s = first_frame_timeout_s
        # Frames the subscription delivered and the reader has not taken yet, and the reader's wait for more
        # (a bare future and timer: `asyncio.wait_for` on a queue makes a task per frame, most of a frame's cost).
        self._frames: deque[Msg] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._subscriptions: list[Subscription] = []
        self._next_seq = 0
        # Frames that arrived ahead of a missing one, by seq, and when waiting for it ends.
        self._ahead: dict[int, ReplyFrame] = {}
        self._gap_deadline = 0.0
        self.terminal: FinalFrame | EmbeddingResult | ImageResult | None = None
        self._error: ErrorFrame | None = None

    @property
    def ended(self) -> bool:
        """The sender is done with this request: a final, result or error frame arrived."""
        return self.terminal is not None or self._error is not None

    async def __aenter__(self) -> ReplyStream:
        if self._open:
            return self  # already reading (PipelineClient.submit enters it before publishing)
        self._open = True
        if self._inboxes is not None:
            await self._inboxes.add(self)
            return self
        self._subscriptions.append(
            await self._nc.subscribe(
                self.inbox,
                cb=self._on_frame,
                pending_msgs_limit=_INBOX_PENDING_MSGS,
                pending_bytes_limit=_INBOX_PENDING_BYTES,
            )
        )
        self._subscriptions.append(await self._nc.subscribe(alive_subject(self.inbox), cb=self.answer_alive))
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._inboxes is not None:
            self._inboxes.remove(self.inbox)
        for subscription in self._subscriptions:
            await subscription.unsubscribe()
        self._subscriptions.clear()

    async def _on_frame(self, msg: Msg) -> None:
        self.deliver(msg)

    def deliver(self, msg: Msg) -> None:
        """A frame for this stream's inbox (from its own subscription or the client's shared one)."""
        self._frames.append(msg)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def answer_alive(self, msg: Msg) -> None:
        """A liveness probe of this stream's inbox (from its own subscription or the client's shared one)."""
        if msg.reply:
            # Where this reader is, so a sender can send again what a NATS outage lost.
            answer = AliveAnswer(next_seq=self._next_seq, missing=bool(self._ahead))
            await self._nc.publish(msg.reply, encode(answer))

    def __aiter__(self) -> AsyncIterator[TokenChunk]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[TokenChunk]:
        async for frame in self.frames():
            if isinstance(frame, TokenChunk):
                yield frame

    async def frames(self) -> AsyncIterator[TokenChunk | ImageProgress | ImageData]:
        """Every frame but heartbeats, in order, until the terminal one (kept in `terminal`)."""
        while self.terminal is None:
            frame = await self._next_frame()
            if isinstance(frame, ErrorFrame):
                self._error = frame
                raise RemoteError(frame)
            if isinstance(frame, _TERMINAL_FRAMES):
                self.terminal = frame
            elif not isinstance(frame, Heartbeat):
                yield frame

    async def collect_images(self, on_progress: Callable[[int, int], None] | None = None
                             ) -> tuple[list[bytes | str], FinalFrame | ImageResult]:
        """Read an image request's stream: each image's PNG bytes (joined from its pieces) or URL, in index
        order, and the terminal frame (`ImageResult`, or a `FinalFrame` saying it was cancelled).
        `on_progress(step, num_steps)` is called for each progress frame."""
        pieces: dict[int, list[bytes]] = {}
        images: dict[int, bytes | str] = {}
        async for frame in self.frames():
            if isinstance(frame, ImageProgress) and on_progress is not None:
                on_progress(frame.step, frame.num_steps)
            elif isinstance(frame, ImageData) and frame.url is not None:
                images[frame.index] = frame.url
            elif isinstance(frame, ImageData):
                pieces.setdefault(frame.index, []).append(frame.png or b"")
                if frame.last:
                    images[frame.index] = b"".join(pieces.pop(frame.index))
        if not isinstance(self.terminal, FinalFrame | ImageResult):
            raise ValueError(f"reply stream of {self.request_id} ended with {type(self.terminal).__name__}, not images")
        return [images[index] for index in sorted(images)], self.terminal

    async def collect(self) -> tuple[list[TokenChunk], FinalFrame | EmbeddingResult | ImageResult]:
        """Read the whole stream: every chunk, and the terminal frame."""
        chunks = [chunk async for chunk in self]
        assert self.terminal is not None
        return chunks, self.terminal

    async def _next_frame(self) -> ReplyFrame:
        while True:
            if self._next_seq in self._ahead:
                self._next_seq += 1
                return self._ahead.pop(self._next_seq - 1)
            if self._ahead and time.monotonic() > self._gap_deadline:
                raise ReplyGap(f"reply stream of {self.request_id}: frame #{self._next_seq} missing, "
                               f"#{min(self._ahead)} arrived")
            frame = decode_as((await self._receive()).data, REPLY_FRAME)
            if isinstance(frame, ErrorFrame):
                # An error ends the stream whoever sends it (an earlier stage, too).
                return frame
            if frame.seq < self._next_seq:
                continue  # sent again (a migration, a resync after a reconnect): already had it
            if frame.seq > self._next_seq:
                # Around a NATS reconnect frames can be lost and then sent again (`ReplySender.resync`),
                # behind newer ones: keep those until the gap fills, for at most the heartbeat timeout.
                if not self._ahead:
                    self._gap_deadline = time.monotonic() + self._heartbeat_timeout_s
                self._ahead[frame.seq] = frame
                continue
            self._next_seq += 1
            return frame

    async def _receive(self) -> Msg:
        # Under load the next frame is usually there already: no waiting, no timer.
        if self._frames:
            return self._frames.popleft()
        if self._ahead:
            timeout_s = max(0.0, self._gap_deadline - time.monotonic())
        else:
            timeout_s = self._first_frame_timeout_s if self._next_seq == 0 else self._heartbeat_timeout_s
        if await self._frame_arrives(timeout_s):
            return self._frames.popleft()
        if self._ahead:
            raise ReplyGap(f"reply stream of {self.request_id}: frame #{self._next_seq} missing, "
                           f"#{min(self._ahead)} arrived")
        state = "no frame yet" if self._next_seq == 0 else f"last frame was #{self._next_seq - 1}"
        raise ReplyStreamBroken(f"reply stream of {self.request_id} silent for {timeout_s:.1f} s ({state})")

    async def _frame_arrives(self, timeout_s: float) -> bool:
        """Wait until a frame is delivered (True) or `timeout_s` passes (False)."""
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        timer = loop.call_later(timeout_s, _wake, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None
        return bool(self._frames)


class ReplyInboxes:
    """All of one client's reply streams read through one subscription: inboxes `{prefix}.{n}` under a prefix of
    the client's own (a fresh inbox of its connection), subscribed once as `{prefix}.>`, their frames and
    liveness probes handed to the stream that reads each.

    A stream with an inbox of its own subscribes twice and unsubscribes twice per request: on an idle pipeline
    those were 0.14 ms of the gateway's path to publishing a request, and every SUB or UNSUB also clears the
    nats-server's subject caches for every connection. Here a request costs a dict entry. A probe of an inbox
    whose stream has closed is answered `closed`, which a sender takes as the client gone (as it takes no
    responders from an inbox nobody subscribes to)."""

    def __init__(self, nc: Client, prefix: str | None = None) -> None:
        self._nc = nc
        # A fresh inbox of the connection (under its `inbox_prefix`, so a secured client's scope holds), unless given.
        self._prefix = prefix or nc.new_inbox()
        self._streams: dict[str, ReplyStream] = {}
        self._next_index = 0
        self._subscribed: asyncio.Future[Subscription] | None = None

    def new_inbox(self) -> str:
        self._next_index += 1
        return f"{self._prefix}.{self._next_index}"

    def covers(self, inbox: str) -> bool:
        return inbox.startswith(self._prefix + ".") and "." not in inbox[len(self._prefix) + 1:]

    async def add(self, stream: ReplyStream) -> None:
        """Start reading `stream`'s inbox (subscribing the first time, before its request is published)."""
        if self._subscribed is None:
            self._subscribed = asyncio.ensure_future(self._nc.subscribe(
                f"{self._prefix}.>", cb=self._on_message,
                pending_msgs_limit=_INBOX_PENDING_MSGS, pending_bytes_limit=_INBOX_PENDING_BYTES))
        subscribing = self._subscribed
        try:
            # Shielded: a caller cancelled meanwhile must not cancel the subscription the others wait for.
            await asyncio.shield(subscribing)
        except Exception:
            if self._subscribed is subscribing:
                self._subscribed = None  # the next stream tries again (the connection was closed or reconnecting)
            raise
        self._streams[stream.inbox] = stream

    def remove(self, inbox: str) -> None:
        self._streams.pop(inbox, None)

    async def _on_message(self, msg: Msg) -> None:
        subject = msg.subject
        if subject.endswith(_ALIVE_SUFFIX):
            stream = self._streams.get(subject[:-len(_ALIVE_SUFFIX)])
            if stream is not None:
                await stream.answer_alive(msg)
            elif msg.reply:
                await self._nc.publish(msg.reply, encode(AliveAnswer(next_seq=0, closed=True)))
            return
        stream = self._streams.get(subject)
        if stream is not None:
            stream.deliver(msg)
        # else: a frame after its stream closed, dropped as an unsubscribed inbox drops it


_ALIVE_SUFFIX = alive_subject("")


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
