"""Which worker holds which KV blocks, kept from the workers' KV events (no I/O here).

Each worker publishes `stored` / `removed` / `cleared` events with ids 1, 2, 3, ... per
process start (`GET /kv/events?since=ID`) and a full list of its cached blocks
(`GET /kv/snapshot`). Applying the events in order reproduces the worker's prefix cache;
anything that breaks the order (a skipped id, the worker's own `gap` flag when its bounded log
dropped events, a new `worker_id` after a restart, ids going backwards) makes the worker's
entry unsynced until a snapshot replaces it. An unsynced worker is never credited with cached
blocks: a stale index would send requests to a worker for KV it no longer has.

The index maps block hash → workers as one hash set per worker: a resync or a departed worker
replaces or drops one set, and a lookup walks the prompt's chain per candidate worker and stops
at its first miss, so it costs O(matched blocks), not O(prompt).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class WorkerBlocks:
    """One worker's cached blocks as the router last learned them."""

    worker_id: str | None = None
    root_hash: int | None = None
    block_size: int | None = None
    last_id: int = 0
    synced: bool = False  # False until a snapshot (or a gapless feed from id 1) is applied
    blocks: set[int] = field(default_factory=set)
    resyncs: int = 0
    unsynced_by: str = "start"  # why the next snapshot is needed: start, restart, gap, error

    def describe(self) -> dict[str, Any]:
        return {
            "synced": self.synced,
            "cached_blocks": len(self.blocks) if self.synced else 0,
            "worker_id": self.worker_id,
            "last_event_id": self.last_id,
            "block_size": self.block_size,
            "resyncs": self.resyncs,
        }


class KvIndex:
    """Block hashes per worker URL, fed by `apply_events` and `apply_snapshot`."""

    def __init__(self) -> None:
        self._workers: dict[str, WorkerBlocks] = {}

    def state(self, url: str) -> WorkerBlocks:
        entry = self._workers.get(url)
        if entry is None:
            entry = self._workers[url] = WorkerBlocks()
        return entry

    def known(self, url: str) -> WorkerBlocks | None:
        return self._workers.get(url)

    def remove(self, url: str) -> None:
        self._workers.pop(url, None)

    def retain(self, urls: Iterable[str]) -> None:
        keep = set(urls)
        for url in [u for u in self._workers if u not in keep]:
            del self._workers[url]

    # --- feeding -----------------------------------------------------------------------
    def apply_snapshot(self, url: str, snapshot: Mapping[str, Any]) -> None:
        entry = self.state(url)
        entry.worker_id = str(snapshot["worker_id"])
        entry.root_hash = int(snapshot["root_hash"])
        entry.block_size = int(snapshot["block_size"])
        entry.last_id = int(snapshot["last_id"])
        entry.blocks = {int(h) for h in snapshot.get("block_hashes") or ()}
        entry.synced = True

    def apply_events(self, url: str, reply: Mapping[str, Any]) -> bool:
        """Apply one `/kv/events` reply; False when the worker needs a resync from a snapshot.

        Events already applied (an id at or below the last one) are skipped, so re-reading a
        page is harmless.
        """
        entry = self.state(url)
        worker_id = str(reply.get("worker_id"))
        if entry.worker_id is not None and worker_id != entry.worker_id:
            return self._unsync(url, entry, "restart", f"restarted (worker_id {worker_id})")
        if reply.get("gap"):
            return self._unsync(url, entry, "gap", "its event log dropped events")
        last_id = int(reply.get("last_id") or 0)
        if last_id < entry.last_id:
            return self._unsync(
                url, entry, "restart", f"event ids went back ({last_id} < {entry.last_id})"
            )
        if not entry.synced:
            if entry.last_id != 0 or entry.worker_id is not None:
                return False  # waiting for a snapshot
            # A worker we have never synced whose feed starts at id 1 needs no snapshot.
            entry.synced = True
        entry.worker_id = worker_id
        entry.root_hash = int(reply["root_hash"])
        entry.block_size = int(reply["block_size"])
        for event in reply.get("events") or ():
            event_id = int(event["id"])
            if event_id <= entry.last_id:
                continue
            if event_id != entry.last_id + 1:
                return self._unsync(url, entry, "gap", f"event {entry.last_id + 1} is missing")
            _apply(entry.blocks, event)
            entry.last_id = event_id
        return True

    def unsync(self, url: str, code: str, why: str) -> None:
        """Forget a worker's blocks until the next snapshot (`code` labels the metric)."""
        self._unsync(url, self.state(url), code, why)

    def _unsync(self, url: str, entry: WorkerBlocks, code: str, why: str) -> bool:
        logger.info("KV index: worker %s needs a resync: %s", url, why)
        entry.synced = False
        entry.blocks = set()
        entry.resyncs += 1
        entry.unsynced_by = code
        return False

    # --- lookups -----------------------------------------------------------------------
    def cached_prefix(self, url: str, chain: Callable[[int, int, int], int | None]) -> int:
        """How many leading blocks of a prompt the worker holds.

        `chain(root_hash, block_size, i)` is the prompt's i-th block hash under the worker's
        hashing parameters (None past the last full block); it is asked lazily, so a miss at
        block 3 hashes only 4 blocks.
        """
        entry = self._workers.get(url)
        if entry is None or not entry.synced or entry.root_hash is None or not entry.block_size:
            return 0
        count = 0
        while True:
            block_hash = chain(entry.root_hash, entry.block_size, count)
            if block_hash is None or block_hash not in entry.blocks:
                return count
            count += 1

    def cached_blocks(self, url: str) -> int:
        entry = self._workers.get(url)
        return len(entry.blocks) if entry is not None and entry.synced else 0

    def block_size(self, url: str) -> int | None:
        entry = self._workers.get(url)
        return entry.block_size if entry is not None else None

    def describe(self, url: str) -> dict[str, Any] | None:
        entry = self._workers.get(url)
        return entry.describe() if entry is not None else None


def _apply(blocks: set[int], event: Mapping[str, Any]) -> None:
    kind = event.get("type")
    hashes = (int(h) for h in event.get("block_hashes") or ())
    if kind == "stored":
        blocks.update(hashes)
    elif kind == "removed":
        blocks.difference_update(hashes)
    elif kind == "cleared":
        blocks.clear()
    else:
        logger.debug("KV index: ignoring an event of unknown type %r", kind)
