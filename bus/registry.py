"""Worker cards in the registry bucket, refreshed on a heartbeat and expired by the bucket's TTL."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import structlog
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue
from pydantic import ValidationError

from bus.lifecycle import sleep_unless, stop_tasks
from schemas.codec import decode, encode
from schemas.registry import ServingMode, Stage, WorkerCard

log = structlog.get_logger(__name__)

# The stages a serving mode needs live before its model counts as ready.
REQUIRED_STAGES: dict[ServingMode, frozenset[Stage]] = {
    ServingMode.AGGREGATED: frozenset({Stage.PROCESSOR, Stage.DECODE}),
    ServingMode.DISAGGREGATED: frozenset({Stage.PROCESSOR, Stage.PREFILL, Stage.DECODE}),
    ServingMode.ENCODE_AGGREGATED: frozenset({Stage.PROCESSOR, Stage.ENCODE, Stage.DECODE}),
    ServingMode.ENCODE_DISAGGREGATED: frozenset({Stage.PROCESSOR, Stage.ENCODE, Stage.PREFILL, Stage.DECODE}),
    ServingMode.EMBEDDING: frozenset({Stage.PROCESSOR, Stage.EMBED}),
    ServingMode.IMAGE: frozenset({Stage.PROCESSOR, Stage.IMAGE}),
}


class Registration:
    """This worker's card in the bucket: written now, refreshed every third of the TTL, removed
    by `close()`. `update()` replaces the card (readiness, KV usage) without a gap.

    A put that fails (NATS away, or back without the bucket: a server restarted with a fresh store)
    declares the bucket again through `reopen` and puts once more, so the card comes back by itself.
    """

    def __init__(self, bucket: KeyValue, card: WorkerCard, ttl_s: float,
                 reopen: Callable[[], Awaitable[KeyValue]] | None = None) -> None:
        self._bucket = bucket
        self._reopen = reopen
        self.card = card
        self._refresh_s = ttl_s / 3
        self._task: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()

    async def open(self) -> None:
        await self._write()
        self._task = asyncio.create_task(self._refresh_loop(), name=f"registry-{self.card.worker_id}")

    async def update(self, card: WorkerCard) -> None:
        """Replace the card and write it now (readiness changes must not wait for the next beat)."""
        self.card = card
        await self._write()

    def refresh(self, card: WorkerCard) -> None:
        """Replace the card; the next heartbeat writes it (for slowly changing figures like KV use)."""
        self.card = card

    async def close(self) -> None:
        self._closing.set()
        if self._task is not None:
            await stop_tasks([self._task])
            self._task = None
        await self._bucket.delete(self.card.worker_id)

    async def write_now(self) -> None:
        """Write the card at once (after a NATS restart, once the caller has declared the bucket again)."""
        await self._write()

    async def _write(self) -> None:
        try:
            await self._bucket.put(self.card.worker_id, encode(self.card))
        except Exception:
            if self._reopen is None:
                raise
            # The bucket may be gone (a server back with a fresh store): declare it again and write once more.
            # Declared only after a failed put, never before one: while a cluster re-elects, declaring waits on
            # the meta leader for longer than a beat, and a card that waited for it every beat lapsed although
            # the bucket's own new leader took puts (a registry leader's node lost, on a loaded machine).
            self._bucket = await self._reopen()
            await self._bucket.put(self.card.worker_id, encode(self.card))

    async def _refresh_loop(self) -> None:
        while not await sleep_unless(self._closing, self._refresh_s):
            try:
                # One beat at most: a put to a stream that lost its leader waits the client's whole
                # timeout (5 s, more than the TTL), and the card must be back as soon as a leader is. (Not wait_for:
                # on Python 3.11 it drops a cancel that arrives as the write ends, and close() waited for the loop.)
                async with asyncio.timeout(self._refresh_s):
                    await self._write()
            except Exception as error:  # NATS briefly away: the next beat tries again
                log.warning("registry.refresh_failed", error=repr(error))


async def live_keys(bucket: KeyValue) -> list[str]:
    """The bucket's keys, from the stream leader's own list of subjects.

    Not `bucket.keys()`: nats-py builds that from an ordered consumer and stops at the first message
    with nothing pending, or at once when the consumer's info says nothing is pending. On a replicated
    stream that info can come before the deliveries (a cluster electing leaders), so `keys()` said
    "no keys" to one processor for seconds while every card was there, and the processor refused
    requests for lack of workers.
    """
    prefix = bucket._pre  # "$KV.<bucket>."; nats-py keeps it and the stream's name private
    info = await bucket._js.stream_info(bucket._stream, subjects_filter=f"{prefix}>")
    return [subject[len(prefix):] for subject in (info.state.subjects or {})]


async def live_workers(bucket: KeyValue) -> list[WorkerCard]:
    keys = await live_keys(bucket)
    # All at once: one by one, each card was a round trip of its own (0.3-0.5 ms each on an idle pipeline).
    entries = await asyncio.gather(*(bucket.get(key) for key in keys), return_exceptions=True)
    cards = []
    for key, entry in zip(keys, entries, strict=True):
        if isinstance(entry, KeyNotFoundError):
            continue  # expired between listing and reading
        if isinstance(entry, BaseException):
            raise entry
        if entry.value:
            try:
                cards.append(decode(entry.value, WorkerCard))
            except (ValueError, ValidationError) as error:
                log.warning("registry.bad_card", key=key, error=str(error))
    return sorted(cards, key=_card_order)


def _card_order(card: WorkerCard) -> tuple[str, str, str]:
    return card.model, card.stage.value, card.worker_id


@dataclass(frozen=True)
class CardPut:
    """A worker's card written to the registry (registered, or its heartbeat)."""

    card: WorkerCard


@dataclass(frozen=True)
class CardRemoved:
    """A worker's card deleted (the worker stopped) or expired (a server that marks expiry)."""

    worker_id: str


RegistryChange = CardPut | CardRemoved


async def registry_changes(bucket: KeyValue, quiet_limit_s: float) -> AsyncIterator[RegistryChange]:
    """The registry's cards as they are now, then each change as it happens, from a watch on the bucket.

    Ends with `TimeoutError` when nothing came for `quiet_limit_s`: every live worker writes its card every third of
    the TTL, so a watch that stays quiet longer has lost the server (nats-py's ordered consumer can go silent across a
    restart) and the caller should watch again.
    """
    watcher = await bucket.watchall()
    try:
        while True:
            # Not nats-py's `updates(timeout=...)`: its `asyncio.wait_for` (Python 3.11) can return an entry that came
            # with a cancel and drop the cancel, and a worker stopping then waited 5 s for this watch, in vain.
            try:
                async with asyncio.timeout(quiet_limit_s):
                    entry = await anext(watcher)
            except TimeoutError as error:
                raise TimeoutError(f"no registry change for {quiet_limit_s} s") from error
            except StopAsyncIteration:  # the watcher was stopped
                return
            if entry is None:  # the end of the cards as they were when the watch began
                continue
            if entry.operation in (KV_DEL, KV_PURGE) or not entry.value:
                yield CardRemoved(entry.key)
                continue
            try:
                yield CardPut(decode(entry.value, WorkerCard))
            except (ValueError, ValidationError) as error:
                log.warning("registry.bad_card", key=entry.key, error=str(error))
    finally:
        try:
            await watcher.stop()
        except Exception as error:  # the connection is gone with the watch: nothing left to stop
            log.debug("registry.watch_stop_failed", error=repr(error))


class RegistryView:
    """The registry's cards as a process that consults them for every request keeps them.

    A view older than `refresh_after_s` is read again in the background: the request that finds it so goes on with
    it, and the next one gets the new one (a worker that registered meanwhile is seen a request later). A request
    waits for a read only when the view was never read or is older than `stale_limit_s`, or when it asks for a
    fresher one itself (`max_age_s`: before refusing a request for want of a worker). Requests that find the view
    stale together share one read.

    Before, a request that found the view older than a second read the registry on its own path, one round trip per
    card: 2 ms of the first token after a quiet second (docs/performance.md, twenty-fifth stop). A holder whose requests
    need not see a worker that registered in the last few seconds (the gateway) also runs `keep_fresh`, so that a
    request after a quiet spell longer than `stale_limit_s` does not wait for a read either.

    A holder that routes on the cards (the processor) runs `follow` instead: a watch on the bucket keeps the cards as
    they change, a new worker's card within milliseconds of its registration, and a request uses them without a read
    whenever the watch is trusted (see `WatchedCards`). A card the watch has not seen written for a TTL is dropped, as
    the bucket expires it.
    """

    def __init__(self, read: Callable[[], Awaitable[list[WorkerCard]]], *, refresh_after_s: float,
                 stale_limit_s: float, on_read: Callable[[list[WorkerCard]], None] | None = None) -> None:
        self._read = read
        self._refresh_after_s = refresh_after_s
        self._stale_limit_s = stale_limit_s
        self._on_read = on_read
        self._cards: list[WorkerCard] = []
        self._read_at_s = float("-inf")
        self._reading: asyncio.Future[None] | None = None
        self._watched = WatchedCards()

    async def cards(self, max_age_s: float | None = None) -> list[WorkerCard]:
        """The cards; with `max_age_s`, as read at most that long ago (waiting for a read if need be)."""
        if max_age_s is None:
            followed = self._watched.cards(time.monotonic(), self._on_read)
            if followed is not None:
                return followed
        age_s = time.monotonic() - self._read_at_s
        if age_s <= (self._refresh_after_s if max_age_s is None else max_age_s):
            return self._cards
        reading = self._read_under_way()
        if max_age_s is not None or age_s > self._stale_limit_s:
            # Shielded: a request cancelled while it waits does not cancel the read the others wait for.
            await asyncio.shield(reading)
        return self._cards

    async def latest(self) -> list[WorkerCard]:
        """The cards as they are now: the watch's while it is trusted (no read), else a read now (`refresh`). For a
        holder's periodic look that acts on workers gone (the processor's router forgets them), where a view up to
        `stale_limit_s` old would miss a worker that registered since."""
        followed = self._watched.cards(time.monotonic(), self._on_read)
        if followed is not None:
            return followed
        return await self.refresh()

    async def refresh(self) -> list[WorkerCard]:
        """Read the registry now, or join the read under way; the cards it read."""
        # Shielded: a holder's timer task stopped mid-read does not cancel a read that requests wait for.
        await asyncio.shield(self._read_under_way())
        return self._cards

    async def keep_fresh(self, interval_s: float) -> None:
        """Read the registry every `interval_s` until cancelled (a holder's background task). A failed read is logged
        and tried again at the next tick."""
        while True:
            try:
                await self.refresh()
            except Exception as error:  # the registry is recovering; the next tick will do
                log.debug("registry.refresh_failed", error=repr(error))
            await asyncio.sleep(interval_s)

    async def follow(self, changes: Callable[[], AsyncIterator[RegistryChange]], ttl_s: float,
                     retry_s: float = 1.0) -> None:
        """Keep the cards from `changes` (a watch: `registry_changes`) until cancelled; a watch that fails or falls
        quiet is begun again after `retry_s`, and requests read the registry meanwhile."""
        while True:
            self._watched.begin(time.monotonic(), ttl_s)
            try:
                async for change in changes():
                    self._watched.apply(change, time.monotonic())
            except Exception as error:  # the server restarting, or the watch gone quiet: watch again
                log.debug("registry.watch_ended", error=repr(error))
            finally:
                self._watched.end()
            await asyncio.sleep(retry_s)

    def invalidate(self) -> None:
        """The next request reads the registry first (a change it must see: an adapter just loaded)."""
        self._read_at_s = float("-inf")
        self._watched.distrust_until_read()

    def _read_under_way(self) -> asyncio.Future[None]:
        """The read under way, or a new one: requests that find the view stale together share one read."""
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._read_now())
            self._reading.add_done_callback(_note_failed_read)
        return self._reading

    async def _read_now(self) -> None:
        try:
            cards = await self._read()
            self._cards, self._read_at_s = cards, time.monotonic()
            self._watched.read_done()
            if self._on_read is not None:
                self._on_read(cards)
        finally:
            self._reading = None


class WatchedCards:
    """The cards a watch on the registry has seen, with when each was last written.

    Trusted only while the watch is live, has run for half a TTL (by then every live worker has written its card at
    least once, whatever the watch's first snapshot missed) and has heard something in the last half TTL (each worker
    writes every third of it, the holder's own card included); otherwise `cards` is None and the view reads.
    """

    def __init__(self) -> None:
        self._seen: dict[str, tuple[WorkerCard, float]] = {}
        self._ttl_s = 0.0
        self._since_s: float | None = None
        self._heard_at_s = float("-inf")
        self._sorted: list[WorkerCard] | None = None
        self._expires_at_s = float("inf")
        self._distrusted = False

    def begin(self, now_s: float, ttl_s: float) -> None:
        self._seen.clear()
        self._sorted, self._ttl_s, self._since_s, self._heard_at_s = None, ttl_s, now_s, float("-inf")

    def end(self) -> None:
        self._since_s = None

    def apply(self, change: RegistryChange, now_s: float) -> None:
        if isinstance(change, CardPut):
            self._seen[change.card.worker_id] = (change.card, now_s)
        else:
            self._seen.pop(change.worker_id, None)
        self._heard_at_s, self._sorted = now_s, None

    def distrust_until_read(self) -> None:
        self._distrusted = True

    def read_done(self) -> None:
        self._distrusted = False

    def cards(self, now_s: float, on_change: Callable[[list[WorkerCard]], None] | None) -> list[WorkerCard] | None:
        """The live cards, sorted as `live_workers` sorts them; None when the watch is not to be trusted now."""
        half_ttl_s = self._ttl_s / 2
        if (self._since_s is None or self._distrusted or now_s - self._since_s < half_ttl_s
                or now_s - self._heard_at_s > half_ttl_s):
            return None
        if self._sorted is None or now_s >= self._expires_at_s:
            # A card not written for a TTL is gone from the bucket too (its worker stopped without deleting it).
            self._seen = {key: seen for key, seen in self._seen.items() if now_s - seen[1] < self._ttl_s}
            self._expires_at_s = min((seen_s + self._ttl_s for _, seen_s in self._seen.values()), default=float("inf"))
            self._sorted = sorted((card for card, _ in self._seen.values()), key=_card_order)
            if on_change is not None:
                on_change(self._sorted)
        return self._sorted


def _note_failed_read(reading: asyncio.Future[None]) -> None:
    # A read nobody waited for: its failure is logged here (the next stale request tries again); a waiting
    # request gets the error itself.
    if not reading.cancelled() and reading.exception() is not None:
        log.debug("registry.read_failed", error=repr(reading.exception()))


def served_adapters(cards: list[WorkerCard]) -> dict[str, str]:
    """LoRA adapter -> its base model, for each adapter a ready worker has loaded."""
    return {name: card.model for card in cards if card.ready for name in card.lora_adapters}


def ready_models(cards: list[WorkerCard]) -> dict[str, ServingMode]:
    """Models for which every stage of their mode has at least one ready worker, and the LoRA adapters loaded on
    a ready worker of such a model (with the model's mode: a request may name an adapter as its model).

    A processor routes every mode, so its card counts for all of them whatever mode it was started in;
    image requests need no model in the processor, so any processor counts for an image model.
    """
    models = _ready_base_models(cards)
    adapters = {name: models[base] for name, base in served_adapters(cards).items() if base in models}
    return {**adapters, **models}


def _ready_base_models(cards: list[WorkerCard]) -> dict[str, ServingMode]:
    ready = [card for card in cards if card.ready]
    processors = {model for card in ready if card.stage == Stage.PROCESSOR for model in [card.model, *card.also_serves]}
    ready_stages: dict[tuple[str, ServingMode], set[Stage]] = {}
    for card in ready:
        if card.stage != Stage.PROCESSOR:
            stages = ready_stages.setdefault((card.model, card.mode), set())
            stages.add(card.stage)
            if card.model in processors or (card.mode == ServingMode.IMAGE and processors):
                stages.add(Stage.PROCESSOR)
    return {
        model: mode for (model, mode), stages in ready_stages.items() if REQUIRED_STAGES[mode] <= stages
    }
