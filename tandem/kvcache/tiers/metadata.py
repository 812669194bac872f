"""What the KV tiers' scheduler side tells its worker side each step (plain, picklable).

A chunk is `chunk_blocks` blocks from a chunk boundary, or, for the tail a finished request
leaves after its last whole chunk, fewer (its key names its length, so both kinds coexist).
Loads name, per chunk, the tier to read, the tokens it must hold and the device blocks to fill;
saves name the blocks to copy out after the step's forward pass (or the CPU tier's copy to
write down) and the tiers to put them in; evictions name CPU-tier chunks to drop, and the slow
tiers to write them to first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SLOW_MEDIA = ("disk", "cluster")


@dataclass
class ChunkLoad:
    chunk_hash: int  # of the chunk's last block; with num_blocks, its key
    medium: str  # cpu | disk | cluster
    token_ids: tuple[int, ...]  # the whole chunk's, checked against the stored header
    skip: int  # leading blocks of the chunk the device already holds
    dest_block_ids: list[int]  # where blocks skip .. skip + len(dest) go
    num_blocks: int  # the chunk's: chunk_blocks, or fewer for a request's tail


@dataclass
class LoadSpec:
    request_id: str
    chunks: list[ChunkLoad]


@dataclass
class SaveSpec:
    chunk_hash: int
    block_ids: list[int]  # device blocks to copy; empty: take the CPU tier's copy
    token_ids: tuple[int, ...]
    to_cpu: bool
    to_slow: tuple[str, ...]  # media the writer puts it in
    num_blocks: int
    hold_id: str | None = None  # a finished request's tail: its blocks are held until copied


@dataclass
class EvictSpec:
    chunk_hash: int
    demote_to: tuple[str, ...]  # write it there before dropping the CPU copy


@dataclass
class TiersMetadata:
    loads: list[LoadSpec] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    evictions: list[EvictSpec] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.loads or self.cancels or self.saves or self.evictions)
