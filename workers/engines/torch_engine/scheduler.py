"""Which sequences run this step, and how many tokens each computes.

Continuous batching: every step, running sequences get their next token (decode) or their next
prompt chunk first, then waiting sequences are admitted while the step's token budget, the
running-sequence limit and free KV blocks allow. A long prompt is split into chunks of at most the
remaining budget (chunked prefill), so it never stalls the decodes of others. When blocks run out,
the most recently admitted sequence is preempted: its blocks are released and it waits again,
recomputing later (its prefix is usually still cached).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from workers.engines.torch_engine.block_manager import BlockManager
from workers.engines.torch_engine.sequence import Sequence, SeqStatus


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    seq: Sequence
    num_tokens: int

    @property
    def completes_prompt(self) -> bool:
        """After this chunk every token has K/V, so the step samples the next token."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_running: int, max_step_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_running = max_running
        self.max_step_tokens = max_step_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def waiting_prompt_tokens(self) -> int:
        """Prompt tokens not yet computed: waiting sequences', and the rest of prompts mid-prefill (chunked)."""
        waiting = sum(seq.num_uncomputed_tokens for seq in self.waiting)
        return waiting + sum(max(0, seq.num_prompt_tokens - seq.num_computed_tokens) for seq in self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, request_id: str) -> Sequence | None:
        """Take a sequence out wherever it is, releasing its blocks."""
        for seq in self.running:
            if seq.request_id == request_id:
                self.running.remove(seq)
                self.block_manager.free(seq)
                return seq
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                self.block_manager.free(seq)
                return seq
        return None

    def detach(self, seq: Sequence) -> None:
        """Stop scheduling a running sequence but keep its blocks (a prefill awaiting handoff)."""
        self.running.remove(seq)

    def add_running(self, seq: Sequence) -> None:
        """Run a sequence whose prompt KV arrived from elsewhere (decode role)."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        seq.status = SeqStatus.FINISHED
        self.running.remove(seq)
        self.block_manager.free(seq)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_step_tokens
        scheduled: list[ScheduledChunk] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:
                continue  # preempted earlier in this loop
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            if not self._make_room(seq, num_tokens, scheduled):
                continue
            self.block_manager.allocate(seq, num_tokens)
            scheduled.append(ScheduledChunk(seq, num_tokens))
            budget -= num_tokens
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            if not seq.block_table:
                self.block_manager.match_prefix(seq)
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            if not self.block_manager.can_allocate(seq, num_tokens):
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self.block_manager.allocate(seq, num_tokens)
            scheduled.append(ScheduledChunk(seq, num_tokens))
            budget -= num_tokens
        return scheduled

    def _make_room(self, seq: Sequence, num_tokens: int, scheduled: list[ScheduledChunk]) -> bool:
        """Preempt later-admitted sequences until `seq` fits; False if `seq` itself had to go."""
        already = {chunk.seq for chunk in scheduled}
        while not self.block_manager.can_allocate(seq, num_tokens):
            victims = [other for other in reversed(self.running) if other is not seq and other not in already]
            victim = victims[0] if victims else seq
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
