"""Physical KV blocks: reference counts, the prefix-cache index and the LRU free queue.

A block whose reference count drops to zero is not forgotten: it joins the free queue with
its hash intact and can be revived by a later request with the same prefix, until the queue
hands it out again (least recently freed first). Torch-free by design.

A cached block may be *retained* until a deadline (a prompt-caching breakpoint's TTL,
`retain`): the free queue then hands it out only when no ordinary free block is left
(kvcache/retention.py). Retention orders eviction, it never pins: every free block, retained
or not, counts as free, so no allocation fails because of it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tandem.kvcache.retention import Clock, RetainingLRU


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, record_events: bool = False,
                 clock: Clock = time.monotonic) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Eviction order: the head is reused first, retained blocks after every other one.
        self._free = RetainingLRU(clock)
        for i in range(num_blocks):
            self._free.push(i)
        self._num_free = num_blocks  # len(self._free), kept here: asked every step per request
        self._cached: dict[int, KVBlock] = {}
        self.num_evictions = 0
        # KV events for routers (docs/prompt-caching.md): ("stored" | "removed", hash) or ("cleared", 0), in
        # order, until drained. Off unless someone drains them (an engine core behind a server).
        self.record_events = record_events
        self.events: list[tuple[str, int]] = []

    # --- accounting -----------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self._num_free

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_retained_blocks(self) -> int:
        """Cached blocks retained now (in use or free)."""
        return self._free.num_retained()

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    # --- allocation -----------------------------------------------------------------
    def allocate(self, count: int) -> list[KVBlock]:
        """Take `count` blocks from the head of the free queue, evicting their old contents
        (retained blocks last)."""
        if count > self._num_free:
            raise NoFreeBlocksError(f"asked for {count} blocks, {self._num_free} free")
        if not count:
            return []
        self._num_free -= count
        free = self._free
        # Nothing retained (the common case): the plain LRU alone, inline. Nothing is retained
        # while this runs, so the choice holds for the whole loop.
        retained = bool(free.until)
        popitem = free.plain.popitem
        taken = []
        for _ in range(count):
            block = self.blocks[free.pop() if retained else popitem(last=False)[0]]
            self._evict(block)
            block.ref_count = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache-hit blocks, reviving them from the free queue if idle."""
        for block in blocks:
            if block.ref_count == 0:
                self._free.remove(block.block_id)
                self._num_free -= 1
            block.ref_count += 1

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference from each block; idle blocks go to the free queue.

        Pass blocks in the order they should be evicted (a sequence's tail first). Blocks
        holding a cached prefix go to the back of the queue, so they survive longest; blocks
        with nothing reusable go to the front.
        """
        plain = self._free.plain  # pushing is `plain[key] = None` (kvcache/retention.py)
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of KV block {block.block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._num_free += 1
                plain[block.block_id] = None
                if block.block_hash is None:
                    plain.move_to_end(block.block_id, last=False)

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

    def retain(self, blocks: Iterable[KVBlock], seconds: float) -> None:
        """Keep these cached blocks behind unretained free ones for `seconds` from now (a later
        call extends, never shortens). Blocks holding no cached prefix are skipped."""
        free = self._free
        until = free.clock() + seconds
        for block in blocks:
            if block.block_hash is not None:
                free.retain(block.block_id, until)

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
            if self._free.until:
                self._free.forget(block.block_id)
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
                self.num_evictions += 1
                if self.record_events:
                    self.events.append(("removed", block.block_hash))
            block.block_hash = None
            block.token_ids = None
