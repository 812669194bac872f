"""BlockPool retention: a cache breakpoint's blocks are evicted after every unmarked free block
until their deadline, and never make an allocation fail."""

from __future__ import annotations

from tandem.engine.block_pool import BlockPool, KVBlock
from tests.support.fake_clock import FakeClock

TTL = 300.0


def tokens(i: int) -> tuple[int, ...]:
    return (i, i + 1, i + 2, i + 3)


def cached_blocks(pool: BlockPool, count: int) -> list[KVBlock]:
    """Allocate `count` blocks and publish each to the prefix cache (hash 1000 + id)."""
    blocks = pool.allocate(count)
    for block in blocks:
        assert pool.cache(block, 1000 + block.block_id, tokens(block.block_id))
    return blocks


def drain(pool: BlockPool) -> list[int]:
    """Allocate every free block one at a time: the eviction order, head first."""
    order = [pool.allocate(1)[0] for _ in range(pool.num_free_blocks)]
    pool.free(order)
    return [b.block_id for b in order]


def still_cached(pool: BlockPool, block_ids: list[int]) -> list[int]:
    return [i for i in block_ids if pool.lookup(1000 + i, tokens(i)) is not None]


def test_unmarked_blocks_are_evicted_before_retained_ones(make_pool) -> None:
    clock = FakeClock()
    pool = make_pool(6, clock=clock)
    blocks = cached_blocks(pool, 6)
    pool.retain(blocks[:2], TTL)  # the oldest: LRU alone would evict them first
    pool.free(blocks)
    assert pool.num_retained_blocks == 2
    pool.free(pool.allocate(4))  # pressure: four blocks wanted
    assert still_cached(pool, list(range(6))) == [0, 1]
    order = drain(pool)
    assert sorted(order[:4]) == [2, 3, 4, 5] and order[4:] == [0, 1]


def test_retained_blocks_go_only_when_nothing_else_is_free(make_pool, check_pool) -> None:
    clock = FakeClock()
    pool = make_pool(4, clock=clock)
    blocks = cached_blocks(pool, 4)
    pool.retain(blocks[:3], TTL)
    pool.free(blocks)
    taken = pool.allocate(2)  # the unmarked block, then the least recent retained one
    assert [b.block_id for b in taken] == [3, 0]
    assert still_cached(pool, [0, 1, 2, 3]) == [1, 2]
    assert pool.num_retained_blocks == 2  # the evicted one no longer counts
    check_pool(pool)
    pool.free(taken)


def test_retention_never_makes_an_allocation_fail(make_pool) -> None:
    clock = FakeClock()
    pool = make_pool(5, clock=clock)
    blocks = cached_blocks(pool, 5)
    pool.retain(blocks, 3600)
    pool.free(blocks)
    assert pool.num_free_blocks == 5  # retained blocks are free blocks
    everything = pool.allocate(5)
    assert pool.num_cached_blocks == 0 and pool.num_retained_blocks == 0
    pool.free(everything)


def test_after_the_deadline_a_retained_block_is_ordinary(make_pool) -> None:
    clock = FakeClock()
    pool = make_pool(4, clock=clock)
    blocks = cached_blocks(pool, 4)
    pool.retain(blocks[:1], TTL)
    pool.free(blocks)
    pool.free(pool.allocate(1))  # block 1 goes; block 0 is set aside behind 2 and 3
    clock.advance(TTL)
    assert pool.num_retained_blocks == 0
    order = drain(pool)
    assert order.index(0) < order.index(2) < order.index(3)  # the least recently used again


def test_a_later_request_extends_retention(make_pool) -> None:
    clock = FakeClock()
    pool = make_pool(3, clock=clock)
    blocks = cached_blocks(pool, 3)
    pool.retain(blocks[:1], TTL)
    pool.free(blocks)
    clock.advance(TTL - 10)
    hit = pool.lookup(1000, tokens(0))
    assert hit is not None
    pool.touch([hit])  # a later request with the same breakpoint reuses the block ...
    pool.retain([hit], TTL)  # ... and marks it again
    pool.free([hit])
    clock.advance(TTL - 10)  # past the first deadline, within the second
    assert pool.num_retained_blocks == 1
    assert drain(pool) == [1, 2, 0]
    clock.advance(11)
    assert pool.num_retained_blocks == 0


def test_only_cached_blocks_are_retained(make_pool) -> None:
    pool = make_pool(2, clock=FakeClock())
    blocks = pool.allocate(2)
    pool.retain(blocks, TTL)  # nothing reusable in them
    assert pool.num_retained_blocks == 0
    pool.free(blocks)


def test_reset_forgets_retention(make_pool) -> None:
    pool = make_pool(3, clock=FakeClock())
    blocks = cached_blocks(pool, 3)
    pool.retain(blocks, TTL)
    pool.free(blocks)
    assert pool.reset_prefix_cache()
    assert pool.num_retained_blocks == 0 and pool.num_cached_blocks == 0
    assert pool.num_free_blocks == 3
