"""The stored form of a KV chunk: a header, the payload, an xxh3-128 checksum.

A chunk is `n` consecutive KV blocks of one request's prefix (every layer, K and V), keyed by
the fingerprinted hash chain of its last block (tandem/kvcache/block_hash.py), so another
model, revision, dtype, block size or cache salt never produces the same key. The value on
disk or in a cluster store is, in order:

    magic b"TKVC" | format version (u16) | header length (u32) | header (JSON) | payload | digest

The JSON header names the model fingerprint, the cache layout (layers, KV heads, block size,
head dim, dtype), the payload's shape (of the blocks it encodes) and its codec (the cache's
own bytes, or 8 / 4 bits with scales: tandem/kvcache/codec.py), the chunk's token ids and the
rank that wrote it; the digest is xxh3-128 over everything before it. A reader takes any
codec a chunk names, and rows of any cache dtype (it decodes them into its own cache), so
workers with different --kv-tier-dtype or --kv-cache-dtype share one store. `decode_chunk` checks all of it against
what the reader expects and raises `ChunkError` (with a short reason used as a metric label)
on any mismatch, so a truncated, corrupt, foreign or stale value is a miss and a recompute,
never wrong KV. Token ids make a hit certain rather than probable: the reader compares them
with the request's own tokens, as the device prefix cache does.

Torch-free: the payload is bytes; the worker turns it into a tensor without copying.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import asdict, dataclass
from typing import Any

import xxhash

from tandem.kvcache.transfer.base import writer_layout

MAGIC = b"TKVC"
# 2: an int8 cache's rows hold their values rotated (kernels/kv_format.py); a version-1 chunk
# of int8 rows would read back as other values, so it is refused as any older format is.
# 3: an int4 chunk's keys are levels per channel group (kvcache/codec.py), not per token.
# 4: the layout names an fp8 writer's scales (kv_scales) and its rows are its e4m3 bytes.
FORMAT_VERSION = 4
_PREAMBLE = struct.Struct("<4sHI")  # magic, version, header length
_DIGEST_BYTES = 16


class ChunkError(ValueError):
    """A stored value that must not be used; `reason` is one of REASONS."""

    REASONS = ("truncated", "magic", "version", "checksum", "header", "foreign", "layout", "tokens", "values")

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class ChunkHeader:
    fingerprint: str  # the model fingerprint (tandem/loader/fingerprint.py)
    layout: dict[str, Any]  # KVLayout as a dict
    shape: tuple[int, ...]  # of the payload tensor
    num_blocks: int
    token_ids: tuple[int, ...]
    rank: int = 0
    world_size: int = 1
    codec: str = "raw"  # how the payload encodes the blocks (kvcache/codec.py); any is read

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()


def chunk_key(last_block_hash: int, num_blocks: int, rank: int = 0, world_size: int = 1) -> str:
    """The store key of the chunk whose last block has this chain hash (the chain covers every
    token before it, so the key names the whole prefix, the model and the cache salt)."""
    return f"{last_block_hash:016x}-{num_blocks}b-r{rank}of{world_size}"


# What chunk_key produces for a 64-bit chain hash (block_hash.py's are xxh3_64), a positive
# block count and a rank below the world size; no leading zeros, so one spelling per key.
_CHUNK_KEY = re.compile(r"([0-9a-f]{16})-([1-9][0-9]{0,8})b-r(0|[1-9][0-9]{0,5})of([1-9][0-9]{0,5})")


def parse_chunk_key(key: str) -> tuple[int, int, int, int] | None:
    """(last block hash, blocks, rank, world size) of a key `chunk_key` made, or None for any
    other string (a foreign file name, a key of another format)."""
    match = _CHUNK_KEY.fullmatch(key)
    if match is None:
        return None
    chunk_hash, num_blocks, rank, world_size = (int(match[1], 16), int(match[2]), int(match[3]),
                                                int(match[4]))
    return (chunk_hash, num_blocks, rank, world_size) if rank < world_size else None


_CODEC = re.compile(r"[a-z0-9]{1,16}")  # a codec's name; which ones exist, the reader knows


def is_chunk_key(key: str) -> bool:
    """Whether `key` is one `chunk_key` could have made."""
    return parse_chunk_key(key) is not None


def encode_chunk(header: ChunkHeader, payload: bytes | memoryview) -> bytes:
    """Header, payload and digest as one value (one copy of the payload)."""
    head = header.to_json()
    preamble = _PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(head))
    digest = xxhash.xxh3_128()
    digest.update(preamble)
    digest.update(head)
    digest.update(payload)
    return b"".join((preamble, head, payload, digest.digest()))


def decode_chunk(value: bytes | memoryview, expected: ChunkHeader) -> memoryview:
    """The payload of a stored value, after checking it against what the reader expects
    (fingerprint, layout, shape, token ids); raises ChunkError otherwise."""
    return read_chunk(value, expected)[1]


def read_chunk(value: bytes | memoryview, expected: ChunkHeader) -> tuple[ChunkHeader, memoryview]:
    """The stored header (its codec is the writer's, whatever `expected` says) and the payload,
    after the checks of `decode_chunk`."""
    view = memoryview(value)
    if len(view) < _PREAMBLE.size + _DIGEST_BYTES:
        raise ChunkError("truncated", f"{len(view)} bytes")
    magic, version, head_len = _PREAMBLE.unpack_from(view)
    if magic != MAGIC:
        raise ChunkError("magic", f"{bytes(magic)!r}")
    if version != FORMAT_VERSION:
        raise ChunkError("version", f"format {version}, this reader knows {FORMAT_VERSION}")
    body_end = len(view) - _DIGEST_BYTES
    head_end = _PREAMBLE.size + head_len
    if head_end > body_end:
        raise ChunkError("truncated", f"header of {head_len} bytes in a {len(view)}-byte value")
    if xxhash.xxh3_128_digest(view[:body_end]) != bytes(view[body_end:]):
        raise ChunkError("checksum", "xxh3-128 digest mismatch")
    try:
        fields = json.loads(bytes(view[_PREAMBLE.size:head_end]))
        header = ChunkHeader(fields["fingerprint"], fields["layout"], tuple(fields["shape"]),
                             int(fields["num_blocks"]), tuple(fields["token_ids"]),
                             int(fields.get("rank", 0)), int(fields.get("world_size", 1)),
                             str(fields.get("codec", "raw")))
    except (ValueError, KeyError, TypeError) as exc:
        raise ChunkError("header", str(exc)) from exc
    if _CODEC.fullmatch(header.codec) is None:
        raise ChunkError("header", f"codec {header.codec[:32]!r}")
    if header.fingerprint != expected.fingerprint:
        raise ChunkError("foreign", f"written by model {header.fingerprint}, not {expected.fingerprint}")
    # The reader's geometry, in rows of any cache dtype: the codec rounds them into its own.
    writer = writer_layout(expected.layout, header.layout)
    if (writer is None or header.num_blocks != expected.num_blocks
            or header.shape != writer.block_shape(expected.num_blocks)
            or (header.rank, header.world_size) != (expected.rank, expected.world_size)):
        raise ChunkError("layout", f"layout {header.layout} shape {header.shape}, expected "
                                   f"{expected.layout} shape {expected.shape}")
    if header.token_ids != expected.token_ids:
        raise ChunkError("tokens", "the chunk holds other tokens than the request's (hash collision?)")
    return header, view[head_end:body_end]
