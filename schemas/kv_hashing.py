"""Prefix-cache block keys, shared by every engine we implement (and what a KV-aware router computes).

The scheme of the reference notes (dynamo-sglang.md, J.58): a block's tokens hash is xxh3-64 with
seed 1337 over its token ids as little-endian u32; a block's key chains its parent's key:
key[0] = tokens_hash[0], key[i] = xxh3-64(LE u64 key[i-1] ‖ LE u64 tokens_hash[i]).
"""

from __future__ import annotations

import struct

import xxhash

_HASH_SEED = 1337


def block_hash(parent: int | None, token_ids: list[int]) -> int:
    tokens_hash = xxhash.xxh3_64_intdigest(struct.pack(f"<{len(token_ids)}I", *token_ids), seed=_HASH_SEED)
    if parent is None:
        return tokens_hash
    return xxhash.xxh3_64_intdigest(struct.pack("<QQ", parent, tokens_hash))


def chain_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """Keys of every full block of `token_ids`."""
    keys: list[int] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys
