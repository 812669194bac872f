"""The block hash chain: the one definition of a KV block's identity.

The engine's prefix cache, the KV tiers, the KV events and the router's index all key blocks
by this chain, so it lives in one torch-free module that each of them imports.

    h0  = xxh3_64(JSON [model_id, kv_dtype, block_size, extra_keys])
    h_i = xxh3_64(h_{i-1} as 8 little-endian bytes ‖ block i's tokens as little-endian uint32)

Only full blocks are hashed: a partial block's content is still changing.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence

import xxhash


def root_hash(model_id: str, kv_dtype: str, block_size: int, extra_keys: Sequence[str] = ()) -> int:
    """Seed of the chain: blocks of different models, dtypes or sizes never collide."""
    payload = json.dumps([model_id, kv_dtype, int(block_size), list(extra_keys)]).encode()
    return xxhash.xxh3_64_intdigest(payload)


def chain_hash(parent_hash: int, block_tokens: Sequence[int]) -> int:
    payload = struct.pack("<Q", parent_hash) + struct.pack(f"<{len(block_tokens)}I", *block_tokens)
    return xxhash.xxh3_64_intdigest(payload)


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    root: int,
    start_block: int = 0,
    parent_hash: int | None = None,
) -> list[int]:
    """Hashes of the full blocks of `token_ids`, from `start_block` on.

    Pass the hash of block `start_block - 1` as `parent_hash` to extend an existing chain
    without rehashing it (the root when starting from block 0).
    """
    parent = root if parent_hash is None else parent_hash
    hashes = []
    num_full = len(token_ids) // block_size
    for index in range(start_block, num_full):
        parent = chain_hash(parent, token_ids[index * block_size : (index + 1) * block_size])
        hashes.append(parent)
    return hashes
