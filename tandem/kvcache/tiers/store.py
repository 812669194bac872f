"""Placeholder for the chunk store interface (replaced by the kv-stores branch)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


class ChunkStoreError(RuntimeError):
    """The store could not be reached or failed an operation (not a plain miss)."""


class ChunkStore(ABC):
    medium: str = ""

    @abstractmethod
    def put(self, key: str, value: bytes | bytearray | memoryview) -> None: ...

    @abstractmethod
    def get(self, key: str) -> bytes | None: ...

    @abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]: ...

    @abstractmethod
    def delete(self, key: str) -> None: ...

    def close(self) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}
