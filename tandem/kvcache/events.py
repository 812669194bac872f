"""A worker's KV events, as routers read them (docs/prompt-caching.md: `GET /kv/events?since=ID`).

The engine reports, in order, each block hash that becomes resident in a medium ("stored"),
each one that leaves it ("removed"), and a reset of a whole medium ("cleared"). The media are
the KV hierarchy's tiers: "device" (the block pool on the accelerator), "cpu" (the worker's
CPU-memory tier), "disk" (its local disk tier) and "cluster" (the store every worker can
read). The engine's tuples are `(kind, block_hash)` — the device pool, which predates the
tiers — or `(kind, block_hash, medium)`. A block can be resident in several media at once
(written through to cpu while still on the device, say), so residency is a set per medium.

This log gives every run of events of the same type and medium an id, increasing by one from
1, and keeps the most recent `capacity` of them: a router polls with the last id it has seen
and gets what followed. If what followed was already dropped, or the router's id belongs to
another incarnation of this worker (`worker_id` changes on every start), the reply says `gap`
and the router resyncs from `snapshot()`: every hash resident now, per medium, plus the id it
is current to.

Wire shapes (every event names its medium; routers that predate media read only the
device's, since the device keeps the old `block_hashes` key in snapshots):

    event:    {"id": 7, "type": "stored", "medium": "cpu", "block_hashes": [...]}
    snapshot: {"worker_id", "root_hash", "block_size", "last_id",
               "block_hashes": [...device, sorted...],
               "tiers": {"cpu": [...], "disk": [...], "cluster": [...]}}

`tiers` always holds all three lower media (an empty list when nothing is there), so a reader
need not tell "empty" from "absent". The `cluster` list is what *this* worker wrote to the
cluster store and has not seen removed: the store is shared and evicts on its own, so it may
be stale (a router treats it as a hint; a miss recomputes).

Torch-free: it lives in the API server process, fed from the engine core's outputs.
"""

from __future__ import annotations

import logging
import uuid
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

DEVICE = "device"
# Every medium a KV event may name, fastest first. The lower tiers' order is also the order
# of `snapshot()["tiers"]`.
MEDIA: tuple[str, ...] = (DEVICE, "cpu", "disk", "cluster")
LOWER_MEDIA: tuple[str, ...] = MEDIA[1:]


@dataclass
class KVEvent:
    id: int
    type: str  # "stored" | "removed" | "cleared"
    block_hashes: list[int]
    medium: str = DEVICE

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "type": self.type, "medium": self.medium,
                "block_hashes": self.block_hashes}


def _resident_sets() -> dict[str, set[int]]:
    return {medium: set() for medium in MEDIA}


@dataclass
class KVEventLog:
    root_hash: int
    block_size: int
    capacity: int = 100_000
    worker_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    last_id: int = 0
    _events: deque[KVEvent] = field(default_factory=deque)
    _resident: dict[str, set[int]] = field(default_factory=_resident_sets)
    _sealed: bool = False  # the newest event was (possibly) read: it must not grow any more
    _unknown_media: set[str] = field(default_factory=set)  # warned about once each

    def append(self, events: Iterable[Sequence[Any]]) -> None:
        """Record a batch from the engine, grouping runs of the same type and medium.

        A 2-tuple is the device pool's; a `cleared` without a medium resets the device only
        (the prefix-cache reset). An event naming a medium outside `MEDIA` is dropped with a
        warning rather than raised: this runs in the server's output reader, which must not
        die over one bad event, and a router could not credit an unknown medium anyway.
        """
        for event in events:
            kind, block_hash = event[0], event[1]
            medium = event[2] if len(event) > 2 else DEVICE
            resident = self._resident.get(medium)
            if resident is None:
                if medium not in self._unknown_media:
                    self._unknown_media.add(medium)
                    logger.warning("KV events: dropping events of unknown medium %r", medium)
                continue
            if kind == "cleared":
                resident.clear()
                self._add(KVEvent(self.last_id + 1, "cleared", [], medium))
                continue
            if kind == "stored":
                resident.add(block_hash)
            else:
                resident.discard(block_hash)
            tail = self._events[-1] if self._events else None
            if (tail is not None and tail.type == kind and tail.medium == medium
                    and tail.id == self.last_id and not self._sealed):
                tail.block_hashes.append(block_hash)
            else:
                self._add(KVEvent(self.last_id + 1, kind, [block_hash], medium))
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
            "last_id": self.last_id, "block_hashes": sorted(self._resident[DEVICE]),
            "tiers": {medium: sorted(self._resident[medium]) for medium in LOWER_MEDIA},
        }
