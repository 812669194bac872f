"""A worker's KV events, as routers read them (DESIGN.md: `GET /kv/events?since=ID`).

The engine's block pool reports, in order, each block hash it starts caching ("stored"),
each one it evicts ("removed"), and a reset of the whole cache ("cleared"). This log gives
every batch of same-type events an id, increasing by one from 1, and keeps the most recent
`capacity` of them: a router polls with the last id it has seen and gets what followed.
If what followed was already dropped, or the router's id belongs to another incarnation of
this worker (`worker_id` changes on every start), the reply says `gap` and the router
resyncs from `snapshot()`: every hash cached now, plus the id it is current to.

Torch-free: it lives in the API server process, fed from the engine core's outputs.
"""

from __future__ import annotations

import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass
class KVEvent:
    id: int
    type: str  # "stored" | "removed" | "cleared"
    block_hashes: list[int]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "type": self.type, "block_hashes": self.block_hashes}


@dataclass
class KVEventLog:
    root_hash: int
    block_size: int
    capacity: int = 100_000
    worker_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    last_id: int = 0
    _events: deque[KVEvent] = field(default_factory=deque)
    _cached: set[int] = field(default_factory=set)
    _sealed: bool = False  # the newest event was (possibly) read: it must not grow any more

    def append(self, events: list[tuple[str, int]]) -> None:
        """Record a batch from the block pool, grouping runs of the same type."""
        for event in events:
            kind, block_hash = event[0], event[1]
            if len(event) > 2 and event[2] != "device":
                continue  # lower tiers' events: not yet published
            if kind == "cleared":
                self._cached.clear()
                self._add(KVEvent(self.last_id + 1, "cleared", []))
                continue
            if kind == "stored":
                self._cached.add(block_hash)
            else:
                self._cached.discard(block_hash)
            tail = self._events[-1] if self._events else None
            if tail is not None and tail.type == kind and tail.id == self.last_id and not self._sealed:
                tail.block_hashes.append(block_hash)
            else:
                self._add(KVEvent(self.last_id + 1, kind, [block_hash]))
        self._sealed = True

    def _add(self, event: KVEvent) -> None:
        self._events.append(event)
        self.last_id = event.id
        self._sealed = False
        while len(self._events) > self.capacity:
            self._events.popleft()

    def since(self, since: int, limit: int = 1000) -> dict[str, Any]:
        first = self._events[0].id if self._events else self.last_id + 1
        gap = since > self.last_id or (since < first - 1 and since < self.last_id)
        events = [] if gap else [e.to_json() for e in self._events if e.id > since][:limit]
        return {
            "worker_id": self.worker_id, "root_hash": self.root_hash, "block_size": self.block_size,
            "last_id": self.last_id, "gap": gap, "events": events,
        }

    def snapshot(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id, "root_hash": self.root_hash, "block_size": self.block_size,
            "last_id": self.last_id, "block_hashes": sorted(self._cached),
        }
