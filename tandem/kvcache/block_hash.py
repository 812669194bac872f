"""The block hash chain: the one definition of a KV block's identity.

The engine's prefix cache, the KV connectors and tiers, the KV events and the router's index
all key blocks by this chain, so it lives in one torch-free module that each of them imports.

    root = xxh3_64(JSON [model_fingerprint, kv_dtype, block_size, extra_keys])
    h0   = root, or xxh3_64(b"salt" ‖ root as 8 little-endian bytes ‖ cache_salt as UTF-8)
    h_i  = xxh3_64(h_{i-1} as 8 little-endian bytes ‖ block i's tokens as little-endian uint32)

The model fingerprint (tandem/loader/fingerprint.py) names the architecture, dtype and a
digest of the weights' identity, so KV of another model or revision can never match. A
request's optional `cache_salt` (vLLM's field) salts the chain so tenants never share blocks;
a router that knows a worker's root (its `/kv/events` say it) salts it the same way.

Only full blocks are hashed: a partial block's content is still changing.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence

import xxhash


def root_hash(model_fingerprint: str, kv_dtype: str, block_size: int, extra_keys: Sequence[str] = ()) -> int:
    """Seed of the chain: blocks of different models, dtypes or sizes never collide."""
    payload = json.dumps([model_fingerprint, kv_dtype, int(block_size), list(extra_keys)]).encode()
    return xxhash.xxh3_64_intdigest(payload)


def salted_root(root: int, cache_salt: str | None) -> int:
    """The chain's first parent for a request: the root itself, or the root salted."""
    if not cache_salt:
        return root
    return xxhash.xxh3_64_intdigest(b"salt" + struct.pack("<Q", root) + cache_salt.encode())


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
