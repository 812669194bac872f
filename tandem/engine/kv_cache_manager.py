"""Maps requests to KV blocks: prefix matching on admission, slot allocation, caching, freeing.

Torch-free. The scheduler asks it two questions: how much of a new request's prompt is
already cached, and whether there is room for the next N tokens of a running request.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.block_pool import BlockPool, KVBlock
from tandem.kvcache.block_hash import block_hashes
from tandem.types import Request, RequestStatus


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
        self._hashes: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        # Prefill/decode handoff: requests whose prompt blocks outlive them (see `free`).
        self._keep_on_free: set[str] = set()
        self.kept: dict[str, list[KVBlock]] = {}

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    def blocks_of(self, request_id: str) -> list[KVBlock]:
        return self._blocks.get(request_id, [])

    def block_ids_of(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, [])]

    def _full_block_hashes(self, request: Request, num_tokens: int) -> list[int]:
        """The request's chain hashes up to `num_tokens`, extended incrementally."""
        hashes = self._hashes.setdefault(request.request_id, [])
        wanted = num_tokens // self.block_size
        if len(hashes) < wanted:
            tokens = request.all_token_ids[: wanted * self.block_size]
            parent = hashes[-1] if hashes else None
            hashes.extend(block_hashes(tokens, self.block_size, self.root_hash, len(hashes), parent))
        return hashes[:wanted]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of a request that holds no blocks yet.

        At least one token is always left to compute, because the model must run on the
        last prompt token to produce the next token's logits.

        A pure lookup: the scheduler repeats it every step while the request waits for room,
        so the hit statistics are counted on admission instead (`record_prefix_lookup`).
        """
        if not self.enable_caching:
            return [], 0
        max_tokens = request.num_tokens - 1
        hits: list[KVBlock] = []
        for index, block_hash in enumerate(self._full_block_hashes(request, max_tokens)):
            start = index * self.block_size
            block = self.pool.lookup(block_hash, request.all_token_ids[start : start + self.block_size])
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

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
        hashes = self._full_block_hashes(request, request.num_computed_tokens)
        for index in range(done, len(hashes)):
            start = index * self.block_size
            self.pool.cache(held[index], hashes[index], request.all_token_ids[start : start + self.block_size])
        self._num_cached_blocks[request.request_id] = max(done, len(hashes))

    def keep_prompt_blocks(self, request_id: str) -> None:
        """When this request ends, keep its full prompt blocks referenced (for a KV handoff).

        A prefill worker's request ends after its first token, but a decode worker has yet
        to read the prompt's KV; the blocks must not return to the free queue, where the
        next allocation could overwrite them. They wait in `kept` until taken.
        """
        self._keep_on_free.add(request_id)

    def take_kept(self, request_id: str) -> list[KVBlock]:
        return self.kept.pop(request_id, [])

    def free(self, request: Request) -> None:
        """Release every block of a finished or preempted request (tail first, for LRU)."""
        held = self._blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self._hashes.pop(request.request_id, None)
        if request.status.finished and request.request_id in self._keep_on_free:
            self._keep_on_free.discard(request.request_id)
            if request.status != RequestStatus.FINISHED_ABORTED:
                num_full = min(len(held), request.num_prompt_tokens // self.block_size)
                self.kept[request.request_id] = held[:num_full]
                held = held[num_full:]
        self.pool.free(list(reversed(held)))

    # --- KV adopted from another worker ---------------------------------------------
    def cached_prefix_blocks(self, token_ids: list[int]) -> int:
        """How many leading full blocks of these tokens this cache already holds."""
        if not self.enable_caching:
            return 0
        hashes = block_hashes(token_ids[: len(token_ids) // self.block_size * self.block_size],
                              self.block_size, self.root_hash)
        for index, block_hash in enumerate(hashes):
            start = index * self.block_size
            if self.pool.lookup(block_hash, token_ids[start : start + self.block_size]) is None:
                return index
        return len(hashes)

    def prompt_block_hashes(self, token_ids: list[int]) -> list[int]:
        full = len(token_ids) // self.block_size * self.block_size
        return list(block_hashes(token_ids[:full], self.block_size, self.root_hash))

    def adopt(self, token_ids: list[int], first_index: int, blocks: list[KVBlock]) -> int:
        """Publish blocks filled from elsewhere as the cached blocks `first_index`... of these
        tokens; returns how many were published (a block already cached elsewhere is not)."""
        hashes = self.prompt_block_hashes(token_ids)
        published = 0
        for offset, block in enumerate(blocks):
            index = first_index + offset
            start = index * self.block_size
            if self.pool.cache(block, hashes[index], token_ids[start : start + self.block_size]):
                published += 1
        return published
