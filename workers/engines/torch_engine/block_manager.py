"""KV-cache blocks: allocation, reference counts, the prefix cache, and the KV events they cause.

A block holds `block_size` tokens' K/V. A full block is keyed by a chained hash of its tokens and
all tokens before it (`schemas.kv_hashing`), so equal prefixes find equal blocks. A block nobody references but whose content is hashed stays cached (evictable, least
recently used first) until its memory is needed: then it is evicted and a `BlockRemoved` event
says so. Registering a newly computed full block emits `BlockStored`.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import TYPE_CHECKING

from schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from schemas.kv_hashing import block_hash, lora_root

if TYPE_CHECKING:
    from workers.engines.torch_engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._block_of_hash: dict[int, int] = {}
        self._free: deque[int] = deque(range(num_blocks))
        # Unreferenced blocks with cached content, least recently used first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._events: list[KvEvent] = []
        self.prompt_tokens_seen = 0
        self.prompt_tokens_cached = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by a live sequence (cached-but-unreferenced blocks count as free)."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of_hash)

    def take_events(self) -> list[KvEvent]:
        events, self._events = self._events, []
        return events

    def match_prefix(self, seq: Sequence) -> None:
        """Give a new sequence the cached blocks of its longest cached prefix."""
        assert not seq.block_table
        self.prompt_tokens_seen += seq.num_prompt_tokens
        if not self.enable_prefix_caching:
            return
        # At least one token must be computed to produce logits, so a fully cached prompt
        # recomputes its last block.
        max_blocks = (seq.num_tokens - 1) // self.block_size
        parent = lora_root(seq.lora_name)
        for index in range(max_blocks):
            start = index * self.block_size
            key = block_hash(parent, seq.token_ids[start : start + self.block_size])
            block = self._block_of_hash.get(key)
            if block is None:
                break
            self._reference(block)
            seq.block_table.append(block)
            seq.block_hashes.append(key)
            parent = key
        seq.num_computed_tokens = seq.num_cached_tokens = len(seq.block_table) * self.block_size
        self.prompt_tokens_cached += seq.num_cached_tokens

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Extend the sequence's block table to hold `num_new_tokens` more tokens."""
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            seq.block_table.append(self._take_block())

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Hash and cache the blocks this step filled; emit one BlockStored for them."""
        full_blocks = seq.num_computed_tokens // self.block_size
        if not self.enable_prefix_caching or len(seq.block_hashes) >= full_blocks:
            return
        first_new = len(seq.block_hashes)
        parent = seq.block_hashes[-1] if seq.block_hashes else lora_root(seq.lora_name)
        stored_hashes: list[int] = []
        stored_tokens: list[int] = []
        for index in range(first_new, full_blocks):
            tokens = seq.token_ids[index * self.block_size : (index + 1) * self.block_size]
            key = block_hash(parent, tokens)
            seq.block_hashes.append(key)
            parent = key
            block = seq.block_table[index]
            if key in self._block_of_hash:
                continue  # another sequence cached the same content first; ours stays private
            self._hash_of[block] = key
            self._block_of_hash[key] = block
            stored_hashes.append(key)
            stored_tokens.extend(tokens)
        if stored_hashes:
            first_stored_index = len(seq.block_hashes) - len(stored_hashes)
            self._events.append(
                BlockStored(
                    block_hashes=stored_hashes,
                    parent_block_hash=seq.block_hashes[first_stored_index - 1] if first_stored_index > 0 else None,
                    token_ids=stored_tokens,
                    block_size=self.block_size,
                )
            )

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; cached blocks stay reusable until evicted."""
        for block in reversed(seq.block_table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                if self._hash_of[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.num_computed_tokens = 0

    def clear_cache(self) -> bool:
        """Forget every cached block nobody uses; False (and nothing done) while any is in use."""
        if self.num_used_blocks:
            return False
        for block in list(self._evictable):
            self._hash_of[block] = None
            self._free.append(block)
        self._evictable.clear()
        self._block_of_hash.clear()
        self._events.append(AllBlocksCleared())
        return True

    def _reference(self, block: int) -> None:
        if self._ref_counts[block] == 0:
            self._evictable.pop(block, None)
        self._ref_counts[block] += 1

    def _take_block(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            evicted = self._hash_of[block]
            assert evicted is not None
            del self._block_of_hash[evicted]
            self._hash_of[block] = None
            self._events.append(BlockRemoved(block_hashes=[evicted]))
        self._ref_counts[block] = 1
        return block
