"""Prefill pacing: how much prompt an engine is handed before what it was handed has started decoding.

Why: SGLang runs a waiting prefill before its next decode step. A burst handed over at once (64 arrivals at a
benchmark round's start, taken from the queue eight at a time) is prefilled batch after batch, and every stream
already decoding waits through all of them: on the H100 that was a 37 ms inter-token gap at p99 against 13 ms for
SGLang's own HTTP server, whose tokenizer spreads the same burst over time (docs/performance.md, tenth stop). With a
budget, the engine gets at most a budget's worth of prompt; the next share goes in once the last one has started
decoding (the engine adapter releases a share at its requests' second token), so decode steps run between shares.
What it costs is the first token of a burst's later requests: docs/performance.md, eleventh stop, has both.

Rules: shares are granted in arrival order (a long prompt is not overtaken for ever by short ones); a prompt longer
than the budget goes alone; tokens the engine already holds in its prefix cache are the caller's to leave out of the
count (they cost no prefill). A waiting request can be withdrawn (its client cancelled) without ever reaching the
engine.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field


class Withdrawn(Exception):
    """The request was withdrawn while it waited for its share; the engine never saw it."""


@dataclass(slots=True)
class _Waiter:
    request_id: str
    num_tokens: int
    granted: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Admission:
    """A granted share: `release()` once the request has started decoding (or ended); releasing twice is a no-op."""

    __slots__ = ("_budget", "num_tokens", "_released")

    def __init__(self, budget: PrefillBudget, num_tokens: int) -> None:
        self._budget = budget
        self.num_tokens = num_tokens
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._budget._give_back(self.num_tokens)


class PrefillBudget:
    def __init__(self, budget_tokens: int) -> None:
        if budget_tokens < 1:
            raise ValueError("a prefill budget is at least one token")
        self.budget_tokens = budget_tokens
        # Granted and not yet released: tokens, and the requests holding them.
        self.pending_tokens = 0
        self.num_pending = 0
        self._waiters: deque[_Waiter] = deque()

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    @property
    def waiting_tokens(self) -> int:
        return sum(waiter.num_tokens for waiter in self._waiters)

    async def admit(self, request_id: str, num_tokens: int) -> Admission:
        """Wait for this request's share of the budget; raises `Withdrawn` if `withdraw(request_id)` came first."""
        num_tokens = max(0, num_tokens)
        if not self._waiters and self._fits(num_tokens):
            self._grant(num_tokens)
            return Admission(self, num_tokens)
        waiter = _Waiter(request_id, num_tokens)
        self._waiters.append(waiter)
        try:
            await waiter.granted
        except asyncio.CancelledError:
            if waiter.granted.done() and not waiter.granted.cancelled() and waiter.granted.exception() is None:
                self._give_back(num_tokens)  # granted, then cancelled before it could run
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
                self._wake()  # it may have been the head that held the others back
            raise
        return Admission(self, num_tokens)

    def withdraw(self, request_id: str) -> bool:
        """End a waiting request's wait with `Withdrawn`; False when it is not waiting (granted, or unknown)."""
        for waiter in self._waiters:
            if waiter.request_id == request_id and not waiter.granted.done():
                self._waiters.remove(waiter)
                waiter.granted.set_exception(Withdrawn(request_id))
                self._wake()
                return True
        return False

    def _fits(self, num_tokens: int) -> bool:
        return self.num_pending == 0 or self.pending_tokens + num_tokens <= self.budget_tokens

    def _grant(self, num_tokens: int) -> None:
        self.pending_tokens += num_tokens
        self.num_pending += 1

    def _give_back(self, num_tokens: int) -> None:
        self.pending_tokens -= num_tokens
        self.num_pending -= 1
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._fits(self._waiters[0].num_tokens):
            waiter = self._waiters.popleft()
            if waiter.granted.done():
                continue  # its task was cancelled, and has not yet run to leave the queue itself
            self._grant(waiter.num_tokens)
            waiter.granted.set_result(None)
