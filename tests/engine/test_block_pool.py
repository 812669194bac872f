"""BlockPool: reference counts, the prefix-cache index and the LRU free queue."""

from __future__ import annotations

import pytest

from tandem.engine.block_pool import BlockPool, KVBlock, NoFreeBlocksError


def tokens(i: int) -> tuple[int, ...]:
    return (i, i + 1, i + 2, i + 3)


def cache_all(pool: BlockPool, blocks: list[KVBlock], base: int = 1000) -> None:
    for block in blocks:
        assert pool.cache(block, base + block.block_id, tokens(block.block_id))


def drain(pool: BlockPool) -> list[int]:
    """Allocate every free block one at a time: the eviction order, head first."""
    order = [pool.allocate(1)[0] for _ in range(pool.num_free_blocks)]
    ids = [b.block_id for b in order]
    pool.free(order)
    return ids


def test_needs_a_block() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)


def test_starts_all_free(make_pool) -> None:
    pool = make_pool(4)
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.num_cached_blocks) == (4, 0, 0)
    assert pool.usage == 0.0
    assert [b.block_id for b in pool.blocks] == [0, 1, 2, 3]


def test_allocate_and_free_count_references(make_pool) -> None:
    pool = make_pool(4)
    blocks = pool.allocate(3)
    assert len({b.block_id for b in blocks}) == 3
    assert all(b.ref_count == 1 for b in blocks)
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.usage) == (1, 3, 0.75)
    pool.free(blocks[:1])
    assert blocks[0].ref_count == 0
    assert pool.num_free_blocks == 2
    pool.free(blocks[1:])
    assert pool.num_free_blocks == 4


def test_allocate_zero(make_pool) -> None:
    pool = make_pool(2)
    assert pool.allocate(0) == []
    assert pool.num_free_blocks == 2


def test_allocate_too_many_takes_nothing(make_pool, check_pool) -> None:
    pool = make_pool(3)
    held = pool.allocate(2)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    check_pool(pool)
    pool.free(held)


def test_shared_block_needs_every_reference_dropped(make_pool) -> None:
    pool = make_pool(2)
    (block,) = pool.allocate(1)
    pool.touch([block])
    assert block.ref_count == 2
    assert pool.num_free_blocks == 1  # touching an in-use block takes nothing from the queue
    pool.free([block])
    assert block.ref_count == 1
    assert pool.num_free_blocks == 1
    pool.free([block])
    assert pool.num_free_blocks == 2


def test_double_free_raises(make_pool, check_pool) -> None:
    pool = make_pool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([block])
    assert block.ref_count == 0
    check_pool(pool)


def test_free_of_never_allocated_block_raises(make_pool) -> None:
    pool = make_pool(2)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([pool.blocks[1]])
    assert pool.num_free_blocks == 2


def test_fresh_pool_hands_out_blocks_in_order(make_pool) -> None:
    pool = make_pool(5)
    assert drain(pool) == [0, 1, 2, 3, 4]


def test_cached_blocks_freed_later_are_evicted_later(make_pool) -> None:
    pool = make_pool(4)
    blocks = pool.allocate(4)
    cache_all(pool, blocks)
    for index in (2, 0, 3, 1):
        pool.free([blocks[index]])
    assert drain(pool) == [2, 0, 3, 1]


def test_free_order_within_one_call_is_eviction_order(make_pool) -> None:
    pool = make_pool(3)
    blocks = pool.allocate(3)
    cache_all(pool, blocks)
    pool.free([blocks[2], blocks[1], blocks[0]])  # a sequence's tail first
    assert drain(pool) == [2, 1, 0]


def test_unhashed_blocks_are_reused_before_cached_ones(make_pool) -> None:
    pool = make_pool(6)
    blocks = pool.allocate(4)
    cache_all(pool, blocks[:2])
    # Cached blocks are freed first, yet every block without reusable content goes first,
    # including the never-used ones (4, 5).
    pool.free([blocks[0]])
    pool.free([blocks[2]])
    pool.free([blocks[1]])
    pool.free([blocks[3]])
    order = drain(pool)
    assert set(order[:4]) == {2, 3, 4, 5}
    assert order[4:] == [0, 1]


def test_eviction_forgets_the_prefix(make_pool) -> None:
    pool = make_pool(1)
    (block,) = pool.allocate(1)
    assert pool.cache(block, 42, tokens(0))
    pool.free([block])
    assert pool.lookup(42, tokens(0)) is block  # idle but still reusable
    assert pool.num_cached_blocks == 1
    (again,) = pool.allocate(1)
    assert again is block
    assert pool.lookup(42, tokens(0)) is None
    assert (block.block_hash, block.token_ids) == (None, None)
    assert (pool.num_cached_blocks, pool.num_evictions) == (0, 1)
    pool.free([again])


def test_touch_revives_a_freed_cached_block(make_pool) -> None:
    pool = make_pool(3)
    blocks = pool.allocate(3)
    cache_all(pool, blocks)
    pool.free(blocks)
    revived = pool.lookup(1001, tokens(1))
    assert revived is blocks[1]
    pool.touch([revived])
    assert revived.ref_count == 1
    assert pool.num_free_blocks == 2
    others = pool.allocate(2)
    assert revived not in others
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    assert pool.lookup(1001, tokens(1)) is revived  # never evicted while held
    assert pool.num_evictions == 2
    pool.free(others + [revived])


def test_revived_block_goes_to_the_back_when_freed_again(make_pool) -> None:
    pool = make_pool(2)
    a, b = pool.allocate(2)
    cache_all(pool, [a, b])
    pool.free([a])
    pool.free([b])
    pool.touch([a])
    pool.free([a])
    assert drain(pool) == [b.block_id, a.block_id]


def test_lookup_confirms_tokens(make_pool) -> None:
    pool = make_pool(2)
    (block,) = pool.allocate(1)
    assert pool.cache(block, 7, [1, 2, 3, 4])
    assert block.token_ids == (1, 2, 3, 4)
    assert pool.lookup(7, [1, 2, 3, 4]) is block
    assert pool.lookup(7, (1, 2, 3, 4)) is block
    # A forced collision: same hash, different tokens. A hash is not proof.
    assert pool.lookup(7, [1, 2, 3, 5]) is None
    assert pool.lookup(7, [1, 2, 3]) is None
    assert pool.lookup(8, [1, 2, 3, 4]) is None
    pool.free([block])


def test_cache_refuses_a_second_owner_or_a_second_hash(make_pool) -> None:
    pool = make_pool(2)
    a, b = pool.allocate(2)
    assert pool.cache(a, 7, tokens(0))
    assert not pool.cache(b, 7, tokens(0))  # the hash already has a block
    assert b.block_hash is None
    assert not pool.cache(a, 8, tokens(1))  # a block has one identity
    assert (a.block_hash, a.token_ids) == (7, tokens(0))
    assert pool.lookup(7, tokens(0)) is a
    assert pool.num_cached_blocks == 1
    pool.free([a, b])


def test_caching_disabled(make_pool) -> None:
    pool = make_pool(2, enable_caching=False)
    (block,) = pool.allocate(1)
    assert not pool.cache(block, 7, tokens(0))
    assert pool.lookup(7, tokens(0)) is None
    assert pool.num_cached_blocks == 0
    pool.free([block])


def test_reset_prefix_cache(make_pool) -> None:
    pool = make_pool(3)
    blocks = pool.allocate(3)
    cache_all(pool, blocks)
    pool.free(blocks[:2])
    assert not pool.reset_prefix_cache()  # a block is still in use: nothing forgotten
    assert pool.num_cached_blocks == 3
    assert pool.lookup(1000, tokens(0)) is blocks[0]
    pool.free(blocks[2:])
    assert pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0
    assert all(b.block_hash is None and b.token_ids is None for b in pool.blocks)
    assert pool.lookup(1000, tokens(0)) is None
    assert pool.num_free_blocks == 3
    # The forgotten blocks are ordinary free blocks again and can be cached anew.
    (block,) = pool.allocate(1)
    assert pool.cache(block, 1000, tokens(0))
    pool.free([block])
