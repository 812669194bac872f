"""Maps requests to KV blocks: prefix matching on admission, slot allocation, caching, freeing.

Torch-free. The scheduler asks it two questions: how much of a new request's prompt is
already cached, and whether there is room for the next N tokens of a running request.

A request with a `retention` (a cache breakpoint) has the full blocks of its marked prefix
retained in the pool for its TTL as they are cached, and again whenever it hits them: they are
evicted after every unretained free block (block_pool.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.block_pool import BlockPool, KVBlock
from tandem.kvcache.block_hash import block_hashes, salted_root
from tandem.types import Request


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens of admitted requests, each request counted once
    hits: int = 0  # prompt tokens found cached


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, root_hash: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.root_hash = root_hash
        self.stats = PrefixCacheStats()
        self._blocks: dict[str, list[KVBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    def blocks_of(self, request_id: str) -> list[KVBlock]:
        return self._blocks.get(request_id, [])

    def block_ids_of(self, request_id: str, start: int = 0) -> list[int]:
        """Ids of the request's blocks from the `start`-th on."""
        return [b.block_id for b in self._blocks.get(request_id, ())[start:]]

    def num_blocks_of(self, request_id: str) -> int:
        return len(self._blocks.get(request_id, ()))

    def update_block_hashes(self, request: Request) -> list[int]:
        """Extend `request.block_hashes` over its full blocks; each block is hashed once.

        Called when a request arrives and whenever its tokens grow; cheap when nothing new
        filled a block (a length comparison).
        """
        hashes = request.block_hashes
        wanted = len(request.all_token_ids) // self.block_size
        if len(hashes) < wanted:
            parent = hashes[-1] if hashes else salted_root(self.root_hash, request.cache_salt)
            hashes.extend(block_hashes(request.all_token_ids[: wanted * self.block_size], self.block_size,
                                       self.root_hash, len(hashes), parent))
        return hashes

    def _cached_prefix(self, request: Request, max_blocks: int) -> list[KVBlock]:
        hashes = self.update_block_hashes(request)
        hits: list[KVBlock] = []
        for index, block_hash in enumerate(hashes[:max_blocks]):
            start = index * self.block_size
            block = self.pool.lookup(block_hash, request.all_token_ids[start : start + self.block_size])
            if block is None:
                break
            hits.append(block)
        return hits

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of a request that holds no blocks yet.

        At least one token is always left to compute, because the model must run on the
        last prompt token to produce the next token's logits.

        A pure lookup: the scheduler repeats it every step while the request waits for room,
        so the hit statistics are counted on admission instead (`record_prefix_lookup`).
        """
        if not self.enable_caching:
            return [], 0
        hits = self._cached_prefix(request, (request.num_tokens - 1) // self.block_size)
        return hits, len(hits) * self.block_size

    def cached_prefix_blocks(self, request: Request) -> int:
        """How many leading full blocks of the request's tokens this cache holds now."""
        if not self.enable_caching:
            return 0
        return len(self._cached_prefix(request, request.num_tokens // self.block_size))

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count an admitted request's prompt once in the prefix-cache hit rate."""
        if self.enable_caching:
            self.stats.queries += request.num_tokens
            self.stats.hits += num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock] = ()
    ) -> bool:
        """Make room for `num_new_tokens` more tokens; False (and nothing changed) if full."""
        held = self._blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        needed_total = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = max(0, needed_total - len(held) - len(computed_blocks))
        revived = sum(1 for b in computed_blocks if b.ref_count == 0)
        if num_new_blocks + revived > self.pool.num_free_blocks:
            if not held:
                del self._blocks[request.request_id]
            return False
        self.pool.touch(computed_blocks)
        if computed_blocks and request.retention is not None:
            self._retain(request, len(held), computed_blocks)  # a hit extends the prefix's retention
        held.extend(computed_blocks)
        held.extend(self.pool.allocate(num_new_blocks))
        if computed_blocks:
            self._num_cached_blocks[request.request_id] = len(held) - num_new_blocks
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Publish the request's newly completed full blocks to the prefix cache."""
        if not self.enable_caching:
            return
        held = self._blocks.get(request.request_id)
        if not held:
            return
        done = self._num_cached_blocks.get(request.request_id, 0)
        num_full = min(request.num_computed_tokens // self.block_size, len(held))
        if num_full <= done:
            return  # most steps: the decode's token did not fill a block
        hashes = self.update_block_hashes(request)
        for index in range(done, num_full):
            start = index * self.block_size
            self.pool.cache(held[index], hashes[index], request.all_token_ids[start : start + self.block_size])
        if request.retention is not None:
            self._retain(request, done, held[done:num_full])
        self._num_cached_blocks[request.request_id] = max(done, num_full)

    def _retain(self, request: Request, first: int, blocks: list[KVBlock]) -> None:
        """Retain those of `blocks` (the request's from index `first` on) that lie wholly within
        its retained prefix, for its TTL from now."""
        retention = request.retention
        assert retention is not None
        end = retention.tokens // self.block_size - first
        if end > 0:
            self.pool.retain(blocks[:end], retention.seconds)

    def free(self, request: Request, hold_blocks: int = 0) -> list[KVBlock]:
        """Release the blocks of a finished or preempted request (tail first, for LRU).

        The first `hold_blocks` blocks stay referenced and are returned: a KV connector keeps
        them under a lease (a prefill worker's prompt, until a decode worker has read it) and
        hands them back to `release` when the lease ends.
        """
        held = self._blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        kept, rest = held[:hold_blocks], held[hold_blocks:]
        self.pool.free(list(reversed(rest)))
        return kept

    def release(self, blocks: list[KVBlock]) -> None:
        """Drop blocks `free` kept for a connector, tail first."""
        self.pool.free(list(reversed(blocks)))
