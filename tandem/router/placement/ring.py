"""Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, 2018).

Session affinity wants two things at once: a session keeps its worker (its KV cache is
there), and no worker drowns because a few busy sessions hash to it. Plain consistent hashing
gives the first; the bound gives the second: a worker may take a request only while its load
stays within `c × average` (rounded up), and a full worker passes the request on to the next
worker clockwise on the ring. With c > 1 some worker always has room, the walk is
deterministic (a session that overflows keeps overflowing to the same place), and when a
worker joins or leaves only the keys whose owner changed move: about 1/n of them.

Each worker sits on the ring at `virtual_nodes` points (xxh3 of "url#i") so that its share of
the ring, and hence of sessions, is close to 1/n. No Python package implements the bounded
variant, hence these few lines.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence

import xxhash


def key_point(key: str) -> int:
    return xxhash.xxh3_64_intdigest(key.encode())


class HashRing:
    """An immutable ring over a fixed set of member names (worker URLs)."""

    def __init__(self, members: Sequence[str], virtual_nodes: int = 150) -> None:
        if virtual_nodes < 1:
            raise ValueError(f"virtual_nodes must be >= 1, got {virtual_nodes}")
        points = sorted(
            (key_point(f"{member}#{i}"), member)
            for member in set(members)
            for i in range(virtual_nodes)
        )
        self.members = frozenset(members)
        self._points = [p for p, _ in points]
        self._owners = [m for _, m in points]

    def walk(self, key: str) -> list[str]:
        """Every member once, in ring order from the key's point: owner first, then overflow."""
        if not self._points:
            return []
        start = bisect.bisect_left(self._points, key_point(key))
        seen: dict[str, None] = {}
        size = len(self._points)
        for offset in range(size):
            seen.setdefault(self._owners[(start + offset) % size])
            if len(seen) == len(self.members):
                break
        return list(seen)

    def owner(self, key: str) -> str | None:
        """The unbounded choice: who owns the key regardless of load."""
        order = self.walk(key)
        return order[0] if order else None


def load_bound(loads: Sequence[int], balance_factor: float) -> int:
    """Most requests one member may hold after taking this one: ⌈c × (total + 1) / n⌉."""
    if not loads:
        return 0
    return max(1, math.ceil(balance_factor * (sum(loads) + 1) / len(loads)))


def bounded_pick(
    ring: HashRing, key: str, load: Callable[[str], int], balance_factor: float
) -> tuple[str, int] | None:
    """(member, position on the walk) of the first member under the bound; 0 = the owner.

    With `balance_factor` >= 1 someone is always under the bound (not everyone can be above
    the average), so this returns None only for an empty ring.
    """
    order = ring.walk(key)
    if not order:
        return None
    bound = load_bound([load(m) for m in order], balance_factor)
    for position, member in enumerate(order):
        if load(member) + 1 <= bound:
            return member, position
    return order[0], 0  # balance_factor < 1 was refused by the config; stay correct anyway
