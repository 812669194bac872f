"""Retention through the scheduler and the KV cache manager, on the fake model: a system prompt
marked with a cache breakpoint survives a flood of unrelated prompts that evicts every unmarked
prefix, and gives a prefix hit afterwards."""

from __future__ import annotations

import random
import zlib

import pytest

from tandem.types import CacheRetention
from tests.support.fake_clock import FakeClock

BLOCK = 4
SYSTEM = 32  # tokens of the marked prefix: 8 blocks


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [10 + seed % 80] + [rng.randrange(10, 90) for _ in range(n - 1)]


MARKED = tokens(SYSTEM, 1)
UNMARKED = tokens(SYSTEM, 2)  # a prefix of the same size with no breakpoint


def flood(eng, count: int = 12, start: int = 100) -> None:
    """Unrelated prompts, one after another: together several times the pool."""
    for n in range(count):
        eng.add(f"flood-{start + n}", tokens(40, start + n), max_tokens=4)
        eng.run()


def hit(eng, request_id: str, prefix: list[int], retention: CacheRetention | None = None) -> int:
    """Prefix-cache hit of a new turn behind `prefix` (a different question after it)."""
    request = eng.add(request_id, prefix + tokens(5, zlib.crc32(request_id.encode()) % 1000), max_tokens=2, retention=retention)
    eng.run()
    return request.num_cached_tokens


@pytest.mark.parametrize("marked", [True, False])
def test_a_retained_prefix_survives_a_flood(make_engine, marked: bool) -> None:
    clock = FakeClock()
    eng = make_engine(num_blocks=48, clock=clock)
    retention = CacheRetention(SYSTEM, 300.0) if marked else None
    assert hit(eng, "first", MARKED, retention) == 0
    assert hit(eng, "other", UNMARKED) == 0
    assert eng.pool.num_retained_blocks == (SYSTEM // BLOCK if marked else 0)
    flood(eng)
    assert eng.pool.num_evictions > 40  # the flood went through the whole pool
    assert hit(eng, "unmarked-again", UNMARKED) == 0
    assert hit(eng, "again", MARKED, retention) == (SYSTEM if marked else 0)


def test_only_the_blocks_up_to_the_breakpoint_are_retained(make_engine) -> None:
    eng = make_engine(num_blocks=48, clock=FakeClock())
    # The breakpoint falls inside the 8th block: 7 whole blocks are retained.
    hit(eng, "first", MARKED, CacheRetention(SYSTEM - 2, 300.0))
    assert eng.pool.num_retained_blocks == 7
    flood(eng)
    assert hit(eng, "again", MARKED) == 7 * BLOCK


def test_retention_ends_with_its_ttl(make_engine) -> None:
    clock = FakeClock()
    eng = make_engine(num_blocks=48, clock=clock)
    hit(eng, "first", MARKED, CacheRetention(SYSTEM, 300.0))
    clock.advance(301)
    assert eng.pool.num_retained_blocks == 0
    flood(eng)
    assert hit(eng, "again", MARKED) == 0


def test_a_later_request_extends_the_ttl(make_engine) -> None:
    clock = FakeClock()
    eng = make_engine(num_blocks=48, clock=clock)
    retention = CacheRetention(SYSTEM, 300.0)
    hit(eng, "first", MARKED, retention)
    clock.advance(200)
    assert hit(eng, "second", MARKED, retention) == SYSTEM  # hits and extends to 500
    clock.advance(200)  # 400: past the first deadline
    flood(eng)
    assert hit(eng, "third", MARKED) == SYSTEM


def test_a_request_needing_the_whole_pool_still_runs(make_engine, reference) -> None:
    """Retention orders eviction, it never pins: a prompt that needs every block gets them."""
    eng = make_engine(num_blocks=16, max_model_len=64, clock=FakeClock())
    hit(eng, "first", MARKED, CacheRetention(SYSTEM, 3600.0))
    assert eng.pool.num_retained_blocks == 8
    big = tokens(60, 7)
    request = eng.add("big", big, max_tokens=4)
    eng.run()
    assert request.output_token_ids == reference(big, 4)
    assert eng.scheduler.num_preemptions == 0
    assert hit(eng, "again", MARKED) == 0  # its blocks were needed, so they went
