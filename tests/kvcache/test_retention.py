"""RetainingLRU: an LRU in which retained keys are handed out last, until their deadline."""

from __future__ import annotations

import random

import pytest

from tandem.kvcache.retention import RetainingLRU
from tests.support.fake_clock import FakeClock


def make(keys: range | list[int], clock: FakeClock) -> RetainingLRU:
    lru = RetainingLRU(clock)
    for key in keys:
        lru.push(key)
    return lru


def drain(lru: RetainingLRU) -> list[int]:
    out = []
    while lru:
        out.append(lru.pop())
    return out


def test_without_retention_it_is_a_plain_lru() -> None:
    lru = make(range(4), FakeClock())
    lru.push_first(9)
    lru.touch(0)
    assert list(lru) == [9, 1, 2, 3, 0]
    assert drain(lru) == [9, 1, 2, 3, 0]
    with pytest.raises(KeyError):
        lru.pop()


def test_retained_keys_go_after_every_ordinary_one() -> None:
    clock = FakeClock()
    lru = make(range(5), clock)
    lru.retain(0, clock() + 300)
    lru.retain(2, clock() + 60)
    assert list(lru) == [1, 3, 4, 0, 2]
    assert [lru.pop(), lru.pop()] == [1, 3]
    lru.push(7)  # a newer ordinary key still goes before the retained ones
    assert drain(lru) == [4, 7, 0, 2]


def test_a_retained_key_is_handed_out_when_nothing_else_is_left() -> None:
    clock = FakeClock()
    lru = make(range(3), clock)
    for key in range(3):
        lru.retain(key, clock() + 300)
    assert len(lru) == 3 and lru.num_retained() == 3
    assert lru.pop() == 0  # ordering, not pinning
    lru.forget(0)
    assert lru.num_retained() == 2


def test_retention_ends_at_the_deadline() -> None:
    clock = FakeClock()
    lru = make(range(4), clock)
    lru.retain(0, clock() + 300)
    lru.retain(1, clock() + 600)
    assert lru.pop() == 2  # 0 and 1 set aside
    lru.push(2)
    clock.advance(300)
    assert not lru.is_retained(0) and lru.is_retained(1)
    # 0 is ordinary again and the oldest ordinary key: it goes first.
    assert list(lru) == [0, 3, 2, 1]
    assert lru.num_retained() == 1
    clock.advance(300)
    assert lru.num_retained() == 0
    order = drain(lru)  # both were older than 3 and 2 when set aside
    assert sorted(order[:2]) == [0, 1] and order[2:] == [3, 2]
    lru2 = make(range(3), clock)
    lru2.retain(1, clock() + 1)
    clock.advance(2)
    assert drain(lru2) == [0, 1, 2]  # expired before it reached the head: plain LRU


def test_a_later_deadline_extends_and_an_earlier_one_does_not_shorten() -> None:
    clock = FakeClock()
    lru = make(range(3), clock)
    lru.retain(0, clock() + 300)
    clock.advance(200)
    lru.retain(0, clock() + 300)  # until 500 from the start
    lru.retain(0, clock() + 10)
    clock.advance(250)
    assert lru.is_retained(0)
    assert list(lru) == [1, 2, 0]
    clock.advance(51)
    assert not lru.is_retained(0)
    assert list(lru) == [0, 1, 2]


def test_forgetting_a_set_aside_key_makes_it_go_first() -> None:
    clock = FakeClock()
    lru = make(range(3), clock)
    lru.retain(0, clock() + 300)
    assert lru.pop() == 1
    lru.forget(0)
    assert drain(lru) == [0, 2]


def test_retention_of_a_key_outside_the_queue_applies_when_it_is_pushed() -> None:
    clock = FakeClock()
    lru = make(range(2), clock)
    lru.retain(5, clock() + 300)  # in use elsewhere
    assert lru.num_retained() == 1
    lru.push(5)
    lru.push(6)
    assert drain(lru) == [0, 1, 6, 5]


def test_a_touched_set_aside_key_stays_retained() -> None:
    clock = FakeClock()
    lru = make(range(3), clock)
    lru.retain(0, clock() + 300)
    assert lru.pop() == 1  # 0 set aside
    lru.touch(0)
    lru.remove(2)
    lru.push(2)
    assert drain(lru) == [2, 0]


def test_random_operations_keep_the_ordering_rule() -> None:
    """Against a plain model: a victim is retained only when every queued key is, the queue's
    size and retained count match, and the heap never holds more entries than keys seen."""
    rng = random.Random(7)
    clock = FakeClock()
    lru = RetainingLRU(clock)
    queued: set[int] = set()
    until: dict[int, float] = {}
    for _ in range(5000):
        op = rng.random()
        key = rng.randrange(40)
        if op < 0.3 and key not in queued:
            lru.push(key)
            queued.add(key)
        elif op < 0.45:
            deadline = clock() + rng.choice([5, 50, 300])
            lru.retain(key, deadline)
            until[key] = max(until.get(key, 0), deadline)
        elif op < 0.55 and key in queued:
            lru.remove(key)
            queued.discard(key)
        elif op < 0.6 and key in queued:
            lru.touch(key)
        elif op < 0.65:
            lru.forget(key)
            until.pop(key, None)
        elif op < 0.85 and queued:
            victim = lru.pop()
            assert victim in queued
            now = clock()
            retained = {k for k in queued if until.get(k, 0) > now}
            if victim in retained:
                assert retained == queued, "a retained key went while an ordinary one was queued"
            queued.discard(victim)
            if rng.random() < 0.7:
                lru.forget(victim)
                until.pop(victim, None)
        else:
            clock.advance(rng.choice([1, 10, 100]))
        assert len(lru) == len(queued)
        now = clock()
        assert lru.num_retained() == sum(1 for d in until.values() if d > now)
        assert len(lru._expiry) <= 2 * 40 + 64
