"""Physical KV blocks: reference counts, the prefix-cache index and the LRU free queue.

A block whose reference count drops to zero is not forgotten: it joins the free queue with
its hash intact and can be revived by a later request with the same prefix, until the queue
hands it out again (least recently freed first). Torch-free by design.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, record_events: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Insertion order is eviction order: the head is reused first.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, KVBlock] = {}
        self.num_evictions = 0
        # KV events for routers (docs/prompt-caching.md): ("stored" | "removed", hash) or ("cleared", 0), in
        # order, until drained. Off unless someone drains them (an engine core behind a server).
        self.record_events = record_events
        self.events: list[tuple[str, int]] = []

    # --- accounting -----------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    # --- allocation -----------------------------------------------------------------
    def allocate(self, count: int) -> list[KVBlock]:
        """Take `count` blocks from the head of the free queue, evicting their old contents."""
        if count > len(self._free):
            raise NoFreeBlocksError(f"asked for {count} blocks, {len(self._free)} free")
        taken = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_count = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache-hit blocks, reviving them from the free queue if idle."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference from each block; idle blocks go to the free queue.

        Pass blocks in the order they should be evicted (a sequence's tail first). Blocks
        holding a cached prefix go to the back of the queue, so they survive longest; blocks
        with nothing reusable go to the front.
        """
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of KV block {block.block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    # --- prefix cache ---------------------------------------------------------------
    def lookup(self, block_hash: int, token_ids: Sequence[int]) -> KVBlock | None:
        """The cached block for this hash, confirmed against its tokens (a hash is not proof)."""
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def cache(self, block: KVBlock, block_hash: int, token_ids: Sequence[int]) -> bool:
        """Register a full block under its chain hash; False if another block already holds it."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block
        if self.record_events:
            self.events.append(("stored", block_hash))
        return True

    def drain_events(self) -> list[tuple[str, int]]:
        events, self.events = self.events, []
        return events

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only possible when no block is in use."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            self._evict(block)
        if self.record_events:
            self.events = [("cleared", 0)]
        return True

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
                self.num_evictions += 1
                if self.record_events:
                    self.events.append(("removed", block.block_hash))
            block.block_hash = None
            block.token_ids = None
