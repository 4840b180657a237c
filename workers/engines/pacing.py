"""Prefill pacing: how much prompt an engine is handed before what it was handed has started decoding.

Why: SGLang runs a waiting prefill before its next decode step. A burst handed over at once (64 arrivals at a
benchmark round's start, taken from the queue eight at a time) is prefilled batch after batch, and every stream
already decoding waits through all of them: on the H100 that was a 37 ms inter-token gap at p99 against 13 ms for
SGLang's own HTTP server, whose tokenizer spreads the same burst over time (docs/performance.md, tenth stop). With a
budget, the engine gets at most a budget's worth of prompt; the next share goes in once the last one has started
decoding (the engine adapter releases a share at its requests' second token), so decode steps run between shares.
What it costs is the first token of a burst's later requests: docs/performance.md, eleventh stop, has both.

Or at a rate (`PrefillRate`, a token bucket): prompt tokens go in at so many per second whatever the requests do, after
a burst of up to `burst_tokens` at once. That spreads a burst in time the way SGLang's own server spreads it, by
tokenizing one prompt after another in its HTTP process (about 4 ms for a 576-token prompt on the H100 machine), and
it needs no round trip through the engine's output. With no burst, requests go in one at a time, each
`num_tokens / rate` after the last.

Rules: shares are granted in arrival order (a long prompt is not overtaken for ever by short ones); a prompt longer
than the budget goes alone; tokens the engine already holds in its prefix cache are the caller's to leave out of the
count (they cost no prefill). A waiting request can be withdrawn (its client cancelled) without ever reaching the
engine.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


class Withdrawn(Exception):
    """The request was withdrawn while it waited for its share; the engine never saw it."""


class Admission:
    """A granted share: `release()` once the request has started decoding (or ended); releasing twice is a no-op.
    A share granted at a rate has nothing to release (its tokens are spent), and `release()` does nothing."""

    __slots__ = ("num_tokens", "_on_release")

    def __init__(self, num_tokens: int, on_release: Callable[[int], None] | None = None) -> None:
        self.num_tokens = num_tokens
        self._on_release = on_release

    def release(self) -> None:
        if self._on_release is not None:
            on_release, self._on_release = self._on_release, None
            on_release(self.num_tokens)


@dataclass(slots=True)
class _Waiter:
    request_id: str
    num_tokens: int
    granted: asyncio.Future[Admission] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class _Pacer(ABC):
    """Requests waiting in arrival order for what `_fits` allows; `_grant` spends it, `_refund` gives back a share
    granted to a request that never reached the engine."""

    def __init__(self) -> None:
        self._waiters: deque[_Waiter] = deque()

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    @property
    def waiting_tokens(self) -> int:
        return sum(waiter.num_tokens for waiter in self._waiters)

    async def admit(self, request_id: str, num_tokens: int) -> Admission:
        """Wait for this request's share; raises `Withdrawn` if `withdraw(request_id)` came first."""
        num_tokens = max(0, num_tokens)
        if not self._waiters and self._fits(num_tokens):
            return self._grant(num_tokens)
        waiter = _Waiter(request_id, num_tokens)
        self._waiters.append(waiter)
        self._wake()
        try:
            return await waiter.granted
        except asyncio.CancelledError:
            if waiter.granted.done() and not waiter.granted.cancelled() and waiter.granted.exception() is None:
                self._refund(waiter.granted.result())  # granted, then cancelled before it could run
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
                self._wake()  # it may have been the head that held the others back
            raise

    def withdraw(self, request_id: str) -> bool:
        """End a waiting request's wait with `Withdrawn`; False when it is not waiting (granted, or unknown)."""
        for waiter in self._waiters:
            if waiter.request_id == request_id and not waiter.granted.done():
                self._waiters.remove(waiter)
                waiter.granted.set_exception(Withdrawn(request_id))
                self._wake()
                return True
        return False

    def _wake(self) -> None:
        while self._waiters and self._fits(self._waiters[0].num_tokens):
            waiter = self._waiters.popleft()
            if waiter.granted.done():
                continue  # its task was cancelled, and has not yet run to leave the queue itself
            waiter.granted.set_result(self._grant(waiter.num_tokens))

    @abstractmethod
    def _fits(self, num_tokens: int) -> bool: ...

    @abstractmethod
    def _grant(self, num_tokens: int) -> Admission: ...

    @abstractmethod
    def _refund(self, admission: Admission) -> None: ...


class PrefillBudget(_Pacer):
    """At most `budget_tokens` of prompt handed over and not yet decoding (a longer prompt alone)."""

    def __init__(self, budget_tokens: int) -> None:
        if budget_tokens < 1:
            raise ValueError("a prefill budget is at least one token")
        super().__init__()
        self.budget_tokens = budget_tokens
        # Granted and not yet released: tokens, and the requests holding them.
        self.pending_tokens = 0
        self.num_pending = 0

    def _fits(self, num_tokens: int) -> bool:
        return self.num_pending == 0 or self.pending_tokens + num_tokens <= self.budget_tokens

    def _grant(self, num_tokens: int) -> Admission:
        self.pending_tokens += num_tokens
        self.num_pending += 1
        return Admission(num_tokens, self._give_back)

    def _refund(self, admission: Admission) -> None:
        admission.release()

    def _give_back(self, num_tokens: int) -> None:
        self.pending_tokens -= num_tokens
        self.num_pending -= 1
        self._wake()


class PrefillRate(_Pacer):
    """A token bucket: `rate_tokens_per_s` of prompt, after up to `burst_tokens` at once. A request goes in once the
    bucket holds its tokens (or is full, for a prompt longer than the burst), and leaves it that much in debt."""

    def __init__(self, rate_tokens_per_s: float, burst_tokens: int = 0) -> None:
        if rate_tokens_per_s <= 0 or burst_tokens < 0:
            raise ValueError("a prefill rate is positive, and its burst at least 0 tokens")
        super().__init__()
        self.rate_tokens_per_s = rate_tokens_per_s
        self.burst_tokens = burst_tokens
        self._available_tokens = float(burst_tokens)
        self._counted_at_s: float | None = None
        self._timer: asyncio.TimerHandle | None = None

    def _fits(self, num_tokens: int) -> bool:
        return self._refill() >= min(num_tokens, self.burst_tokens)

    def _grant(self, num_tokens: int) -> Admission:
        self._available_tokens -= num_tokens
        return Admission(num_tokens)

    def _refund(self, admission: Admission) -> None:
        self._available_tokens = min(float(self.burst_tokens), self._available_tokens + admission.num_tokens)
        self._wake()

    def _refill(self) -> float:
        now_s = asyncio.get_running_loop().time()
        if self._counted_at_s is not None:
            earned = (now_s - self._counted_at_s) * self.rate_tokens_per_s
            self._available_tokens = min(float(self.burst_tokens), self._available_tokens + earned)
        self._counted_at_s = now_s
        return self._available_tokens

    def _wake(self) -> None:
        super()._wake()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._waiters:  # the head waits for the bucket: look again once it will hold enough
            needed = min(self._waiters[0].num_tokens, self.burst_tokens) - self._available_tokens
            self._timer = asyncio.get_running_loop().call_later(max(0.0, needed) / self.rate_tokens_per_s,
                                                                self._wake)
