"""Cancellation: any client publishes `Cancel` on `{ns}.control.cancel`; every worker hears it.

`CancelRegistry` keeps a tombstone per cancelled request id for the cancel TTL, so a request that
is still queued is dropped when a worker pulls it, and a request whose handler is running has its
`watch()` event set. A worker that starts after a cancel was sent replays the control stream (it
keeps cancels for the same TTL), so late starters honour earlier cancels too. Because tombstones
are kept rather than polled for, a cancel that arrives before the engine registered the request is
seen by the handler the moment it starts watching.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from pydantic import ValidationError

from bus.metrics import CANCELS
from bus.subjects import Names
from schemas.codec import WIRE_VERSION, WIRE_VERSION_HEADER, decode, encode
from schemas.control import Cancel

log = structlog.get_logger(__name__)

# Far above any real rate of cancels within a TTL; bounds memory if a client floods the subject.
_MAX_TOMBSTONES = 1_000_000


async def send_cancel(js: JetStreamContext, names: Names, request_id: str, reason: str = "cancelled by client") -> None:
    """Cancel a request wherever it is. Stored in the control stream, so it outlives the publish."""
    cancel = Cancel(request_id=request_id, reason=reason, sent_at_s=time.time())
    await js.publish(names.cancel_subject, encode(cancel), headers={WIRE_VERSION_HEADER: str(WIRE_VERSION)})


class CancelRegistry:
    def __init__(self, nc: Client, js: JetStreamContext, names: Names, ttl_s: float) -> None:
        self._nc = nc
        self._js = js
        self._names = names
        self._ttl_s = ttl_s
        # request id -> expiry (monotonic s); insertion order is expiry order since the TTL is fixed.
        self._tombstones: OrderedDict[str, float] = OrderedDict()
        self._watchers: dict[str, asyncio.Event] = {}
        self._subscription: Subscription | None = None

    async def start(self) -> None:
        # Live first, then history: a cancel sent in between is seen twice, which is harmless.
        self._subscription = await self._nc.subscribe(self._names.cancel_subject, cb=self._on_message)
        await self._replay_history()

    async def stop(self) -> None:
        if self._subscription is not None:
            await self._subscription.unsubscribe()
            self._subscription = None

    def is_cancelled(self, request_id: str) -> bool:
        self._expire()
        return request_id in self._tombstones

    @contextmanager
    def watch(self, request_id: str) -> Iterator[asyncio.Event]:
        """An event set when `request_id` is cancelled; already set if it was cancelled before."""
        event = asyncio.Event()
        if self.is_cancelled(request_id):
            event.set()
        self._watchers[request_id] = event
        try:
            yield event
        finally:
            self._watchers.pop(request_id, None)

    def mark(self, request_id: str) -> None:
        """Record a cancel (also used for requests whose client went away)."""
        self._tombstones[request_id] = time.monotonic() + self._ttl_s
        self._tombstones.move_to_end(request_id)
        while len(self._tombstones) > _MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)
        watcher = self._watchers.get(request_id)
        if watcher is not None and not watcher.is_set():
            CANCELS.labels(where="running").inc()
            watcher.set()

    def _expire(self) -> None:
        now = time.monotonic()
        while self._tombstones:
            request_id, expires_at = next(iter(self._tombstones.items()))
            if expires_at > now:
                return
            self._tombstones.popitem(last=False)

    async def _on_message(self, msg: Msg) -> None:
        try:
            cancel = decode(msg.data, Cancel)
        except (ValueError, ValidationError) as error:
            log.warning("cancel.undecodable", error=str(error))
            return
        CANCELS.labels(where="received").inc()
        self.mark(cancel.request_id)

    async def _replay_history(self) -> None:
        since = datetime.now(UTC) - timedelta(seconds=self._ttl_s)
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_TIME,
            opt_start_time=since,
            ack_policy=AckPolicy.NONE,
            inactive_threshold=30.0,
        )
        try:
            subscription = await self._js.pull_subscribe(
                self._names.cancel_subject, stream=self._names.control_stream, config=config
            )
        except NotFoundError:
            log.warning("cancel.no_control_stream", stream=self._names.control_stream)
            return
        try:
            while True:
                try:
                    messages = await subscription.fetch(batch=256, timeout=0.2)
                except TimeoutError:
                    return
                for msg in messages:
                    await self._on_message(msg)
        finally:
            await subscription.unsubscribe()
