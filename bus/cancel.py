"""Cancellation: a client publishes `Cancel` on `{ns}.control.cancel` or `{ns}.control.cancel.{scope}`;
every worker hears it.

Who may cancel what: a cancel on the bare subject stops any request (trusted publishers: the stages, the
gateway, an unsecured deployment's clients). A cancel on `{ns}.control.cancel.{scope}` stops only requests
whose reply inbox is `<prefix>.{scope}.…`, i.e. the client's own: a secured server lets each client
publish only to its own scope and read only its own inboxes (docs/security/nats-server.conf), so no
client can stop another's request.

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
from nats.js.errors import NotFoundError, ServiceUnavailableError
from pydantic import ValidationError
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from bus.metrics import CANCELS
from bus.subjects import Names
from schemas.codec import WIRE_VERSION, WIRE_VERSION_HEADER, decode, encode
from schemas.control import Cancel

log = structlog.get_logger(__name__)

# Far above any real rate of cancels within a TTL; bounds memory if a client floods the subject.
_MAX_TOMBSTONES = 1_000_000


async def send_cancel(js: JetStreamContext, names: Names, request_id: str, reason: str = "cancelled by client",
                      scope: str | None = None) -> None:
    """Cancel a request wherever it is (within `scope`: see the module docstring). Stored in the control
    stream, so it outlives the publish."""
    cancel = Cancel(request_id=request_id, reason=reason, sent_at_s=time.time())
    await js.publish(names.cancel_subject_for(scope), encode(cancel), headers={WIRE_VERSION_HEADER: str(WIRE_VERSION)})


def scope_of(inbox: str) -> str | None:
    """The owner token of an inbox (`_INBOX.alice.x` → alice); None for a bare `_INBOX.x`."""
    tokens = inbox.split(".")
    return tokens[1] if len(tokens) > 2 else None


def _applies(scope: str | None, reply_to: str) -> bool:
    return scope is None or scope_of(reply_to) == scope


class CancelRegistry:
    def __init__(self, nc: Client, js: JetStreamContext, names: Names, ttl_s: float) -> None:
        self._nc = nc
        self._js = js
        self._names = names
        self._ttl_s = ttl_s
        # request id -> (expiry in monotonic s, scopes it was cancelled in; None: any); insertion order is
        # expiry order since the TTL is fixed.
        self._tombstones: OrderedDict[str, tuple[float, set[str | None]]] = OrderedDict()
        # request id -> (event, the request's reply inbox)
        self._watchers: dict[str, tuple[asyncio.Event, str]] = {}
        self._subscriptions: list[Subscription] = []

    async def start(self) -> None:
        # Live first, then history: a cancel sent in between is seen twice, which is harmless.
        for subject in self._names.cancel_subjects:
            self._subscriptions.append(await self._nc.subscribe(subject, cb=self._on_message))
        # A cluster still electing the control stream's leader answers 503 for a while: retry (a cancel replayed
        # twice is harmless), then go on without the history rather than not start.
        try:
            async for attempt in AsyncRetrying(wait=wait_exponential(multiplier=0.2, max=2.0), stop=stop_after_delay(20),
                                               retry=retry_if_exception_type(ServiceUnavailableError), reraise=True):
                with attempt:
                    await self._replay_history()
        except ServiceUnavailableError:
            log.warning("cancel.history_unavailable", stream=self._names.control_stream)

    async def stop(self) -> None:
        for subscription in self._subscriptions:
            await subscription.unsubscribe()
        self._subscriptions.clear()

    def is_cancelled(self, request_id: str, reply_to: str) -> bool:
        self._expire()
        entry = self._tombstones.get(request_id)
        return entry is not None and any(_applies(scope, reply_to) for scope in entry[1])

    @contextmanager
    def watch(self, request_id: str, reply_to: str) -> Iterator[asyncio.Event]:
        """An event set when `request_id` is cancelled; already set if it was cancelled before."""
        event = asyncio.Event()
        if self.is_cancelled(request_id, reply_to):
            event.set()
        self._watchers[request_id] = (event, reply_to)
        try:
            yield event
        finally:
            self._watchers.pop(request_id, None)

    def mark(self, request_id: str, scope: str | None = None) -> None:
        """Record a cancel (also used, unscoped, for requests whose client went away)."""
        _, scopes = self._tombstones.get(request_id, (0.0, set()))
        self._tombstones[request_id] = (time.monotonic() + self._ttl_s, scopes | {scope})
        self._tombstones.move_to_end(request_id)
        while len(self._tombstones) > _MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)
        watcher = self._watchers.get(request_id)
        if watcher is None or watcher[0].is_set():
            return
        event, reply_to = watcher
        if _applies(scope, reply_to):
            CANCELS.labels(where="running").inc()
            event.set()
        else:
            log.warning("cancel.out_of_scope", request_id=request_id, scope=scope)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._tombstones:
            _, (expires_at, _) = next(iter(self._tombstones.items()))
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
        self.mark(cancel.request_id, self._names.cancel_scope(msg.subject))

    async def _replay_history(self) -> None:
        since = datetime.now(UTC) - timedelta(seconds=self._ttl_s)
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_TIME,
            opt_start_time=since,
            ack_policy=AckPolicy.NONE,
            inactive_threshold=30.0,
        )
        for subject in self._names.cancel_subjects:
            try:
                subscription = await self._js.pull_subscribe(subject, stream=self._names.control_stream, config=config)
            except NotFoundError:
                log.warning("cancel.no_control_stream", stream=self._names.control_stream)
                return
            try:
                await self._drain(subscription)
            finally:
                await subscription.unsubscribe()

    async def _drain(self, subscription: JetStreamContext.PullSubscription) -> None:
        while True:
            try:
                messages = await subscription.fetch(batch=256, timeout=0.2)
            except TimeoutError:
                return
            for msg in messages:
                await self._on_message(msg)
