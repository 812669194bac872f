"""The byte-level store a slow KV tier writes chunks into and reads them from.

A store knows keys and values, nothing about KV: the chunk layer (chunk.py) puts a header and
a checksum in every value and checks them on the way out, so a store may lose, truncate or
corrupt a value and the worst outcome is a recompute. Two rules every store keeps:

* `put` commits atomically: a reader sees the whole value or none of it (disk: write a
  temporary file, then rename; Redis: one SET);
* a failure to reach the store raises `ChunkStoreError`, a plain absence returns None/False,
  so callers can count the two apart (a miss is normal, an error is an alert).

Methods are called from the writer thread, loader threads and the engine thread at once, so
every store is thread-safe.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


class ChunkStoreError(RuntimeError):
    """The store could not be reached or failed an operation (not a plain miss)."""


class ChunkStore(ABC):
    medium: str = ""  # "disk" | "cluster"

    @abstractmethod
    def put(self, key: str, value: bytes | bytearray | memoryview) -> None:
        """Store `value` under `key`, atomically."""

    @abstractmethod
    def get(self, key: str) -> bytes | bytearray | None:
        """The value under `key`, or None."""

    @abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Which of `keys` are present, in one round trip where the store allows."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Drop `key` (a no-op when absent)."""

    def count_sightings(self, keys: Sequence[str]) -> list[int] | None:
        """Count one more request containing each key, across every worker sharing the store,
        and return the totals; None where the store cannot count (then sightings are local)."""
        return None

    def close(self) -> None:  # noqa: B027 - optional
        """Release connections and files."""

    def stats(self) -> dict[str, float]:
        """Cumulative counters and current usage, for /load and /metrics."""
        return {}
