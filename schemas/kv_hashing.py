"""Prefix-cache block keys, shared by every engine we implement (and what a KV-aware router computes).

The scheme of the reference notes (dynamo-sglang.md, J.58): a block's tokens hash is xxh3-64 with
seed 1337 over its token ids as little-endian u32; a block's key chains its parent's key:
key[0] = tokens_hash[0], key[i] = xxh3-64(LE u64 key[i-1] ‖ LE u64 tokens_hash[i]).
A prompt run with a LoRA adapter has other K/V than the same prompt on the base model: its chain starts from
the adapter's root (`lora_root`) as key[-1], so the two never share a block.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import xxhash

_HASH_SEED = 1337


def block_hash(parent: int | None, token_ids: list[int]) -> int:
    tokens_hash = xxhash.xxh3_64_intdigest(struct.pack(f"<{len(token_ids)}I", *token_ids), seed=_HASH_SEED)
    if parent is None:
        return tokens_hash
    return xxhash.xxh3_64_intdigest(struct.pack("<QQ", parent, tokens_hash))


def lora_root(lora_name: str | None) -> int | None:
    """The parent of a prompt's first block: None on the base model, a hash of the adapter's name with one."""
    if lora_name is None:
        return None
    return xxhash.xxh3_64_intdigest(b"lora:" + lora_name.encode(), seed=_HASH_SEED)


def iter_chain_hashes(token_ids: list[int], block_size: int, lora_name: str | None = None) -> Iterator[int]:
    """Keys of the full blocks of `token_ids` in order, computed as they are read: a prefix match that stops at the
    first unknown block hashes no further."""
    parent = lora_root(lora_name)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        yield parent


def chain_hashes(token_ids: list[int], block_size: int, lora_name: str | None = None) -> list[int]:
    """Keys of every full block of `token_ids` (run with the adapter `lora_name`, if any)."""
    return list(iter_chain_hashes(token_ids, block_size, lora_name))
