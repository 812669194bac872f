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

**Tiers.** Events name the medium a block entered or left (kvcache/events.py): "device" (the
worker's block pool; also what an event without a medium means, as older workers send),
"cpu" and "disk" (that worker's own lower tiers) and "cluster" (the store every worker reads).
A block may be in several media at once, so each worker has one set per local medium. Cluster
residency is not a worker's: a block any worker wrote there can be loaded by every worker that
reads the store, so the index keeps one pool-wide cluster set, the union of every worker's
`stored` reports (events and snapshots' `tiers.cluster`) minus any worker's `removed`. Nobody
sees the store's own evictions, so the set may be stale and only ever errs towards crediting a
block that is gone; that is acceptable, since such a miss costs a recompute, never a wrong
token. It is bounded (`cluster_capacity` hashes, the least recently reported dropped first)
and, unlike a worker's sets, it survives that worker's resync, restart or departure: the store
still holds what the worker wrote. `tiered_prefix` walks the prompt's chain through all of it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.kvcache.events import DEVICE, MEDIA

logger = logging.getLogger(__name__)

CLUSTER = "cluster"
# The media a worker holds blocks in itself; CLUSTER is the pool's.
LOCAL_MEDIA: tuple[str, ...] = tuple(m for m in MEDIA if m != CLUSTER)
# Hashes of the pool-wide cluster set: at 16 tokens a block, 16M tokens of prefixes.
DEFAULT_CLUSTER_CAPACITY = 1_000_000


def _local_sets() -> dict[str, set[int]]:
    return {medium: set() for medium in LOCAL_MEDIA}


@dataclass
class WorkerBlocks:
    """One worker's cached blocks as the router last learned them."""

    worker_id: str | None = None
    root_hash: int | None = None
    block_size: int | None = None
    last_id: int = 0
    synced: bool = False  # False until a snapshot (or a gapless feed from id 1) is applied
    media: dict[str, set[int]] = field(default_factory=_local_sets)  # device, cpu, disk
    # It has reported cluster blocks, so it has a cluster tier (and can read the store).
    writes_cluster: bool = False
    resyncs: int = 0
    unsynced_by: str = "start"  # why the next snapshot is needed: start, restart, gap, error

    @property
    def blocks(self) -> set[int]:
        """The device pool's blocks (what the index held before it knew of tiers)."""
        return self.media[DEVICE]

    def describe(self) -> dict[str, Any]:
        return {
            "synced": self.synced,
            "cached_blocks": len(self.blocks) if self.synced else 0,
            "tier_blocks": {
                m: len(self.media[m]) if self.synced else 0 for m in LOCAL_MEDIA if m != DEVICE
            },
            "writes_cluster": self.writes_cluster,
            "worker_id": self.worker_id,
            "last_event_id": self.last_id,
            "block_size": self.block_size,
            "resyncs": self.resyncs,
        }


class KvIndex:
    """Block hashes per worker URL and medium, plus the pool's cluster set; fed by
    `apply_events` and `apply_snapshot`."""

    def __init__(self, cluster_capacity: int = DEFAULT_CLUSTER_CAPACITY) -> None:
        self._workers: dict[str, WorkerBlocks] = {}
        # The pool-wide cluster set; insertion order is report order (a re-report moves a
        # hash to the end), so the first key is the one to drop when full.
        self._cluster: dict[int, None] = {}
        self.cluster_capacity = cluster_capacity

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
        tiers = snapshot.get("tiers") or {}  # absent from workers that predate tiers
        entry.media = {DEVICE: {int(h) for h in snapshot.get("block_hashes") or ()}}
        for medium in LOCAL_MEDIA[1:]:
            entry.media[medium] = {int(h) for h in tiers.get(medium) or ()}
        cluster = [int(h) for h in tiers.get(CLUSTER) or ()]
        self._cluster_stored(cluster)
        entry.writes_cluster = entry.writes_cluster or bool(cluster)
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
            self._apply(entry, event)
            entry.last_id = event_id
        return True

    def unsync(self, url: str, code: str, why: str) -> None:
        """Forget a worker's blocks until the next snapshot (`code` labels the metric)."""
        self._unsync(url, self.state(url), code, why)

    def _unsync(self, url: str, entry: WorkerBlocks, code: str, why: str) -> bool:
        logger.info("KV index: worker %s needs a resync: %s", url, why)
        entry.synced = False
        entry.media = _local_sets()
        if code == "restart":  # a new process may have another tier configuration
            entry.writes_cluster = False
        entry.resyncs += 1
        entry.unsynced_by = code
        return False

    def _apply(self, entry: WorkerBlocks, event: Mapping[str, Any]) -> None:
        kind = event.get("type")
        medium = event.get("medium") or DEVICE  # older workers: the device pool's events
        hashes = [int(h) for h in event.get("block_hashes") or ()]
        if medium == CLUSTER:
            entry.writes_cluster = True
            if kind == "stored":
                self._cluster_stored(hashes)
            elif kind == "removed":
                for block_hash in hashes:
                    self._cluster.pop(block_hash, None)
            elif kind == "cleared":  # the store is shared: flushed for one is flushed for all
                self._cluster.clear()
            return
        blocks = entry.media.get(medium)
        if blocks is None:
            logger.debug("KV index: ignoring an event of unknown medium %r", medium)
        elif kind == "stored":
            blocks.update(hashes)
        elif kind == "removed":
            blocks.difference_update(hashes)
        elif kind == "cleared":
            blocks.clear()
        else:
            logger.debug("KV index: ignoring an event of unknown type %r", kind)

    def _cluster_stored(self, hashes: Iterable[int]) -> None:
        cluster = self._cluster
        for block_hash in hashes:
            cluster.pop(block_hash, None)
            cluster[block_hash] = None
        while len(cluster) > self.cluster_capacity:
            del cluster[next(iter(cluster))]

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

    def tiered_prefix(
        self,
        url: str,
        chain: Callable[[int, int, int], int | None],
        ranked: Sequence[str] = MEDIA,
        reads_cluster: bool = True,
    ) -> list[str]:
        """The longest run of leading prompt blocks the worker can have without computing
        them, as the medium to take each from.

        A block counts while the worker holds it in any medium of `ranked`, or it is in the
        pool's cluster set and `reads_cluster`; each block's medium is the first of `ranked`
        that has it, so `ranked` is best first (the policy orders it by credit, and leaves
        out media it gives no credit). `chain` is as for `cached_prefix`. An unsynced worker
        gets an empty run, cluster included: its hashing parameters may be stale too.
        """
        entry = self._workers.get(url)
        if entry is None or not entry.synced or entry.root_hash is None or not entry.block_size:
            return []
        sources = [
            (medium, self._cluster if medium == CLUSTER else entry.media[medium])
            for medium in ranked
            if (medium == CLUSTER and reads_cluster) or medium in entry.media
        ]
        run: list[str] = []
        while True:
            block_hash = chain(entry.root_hash, entry.block_size, len(run))
            if block_hash is None:
                return run
            medium = next((m for m, held in sources if block_hash in held), None)
            if medium is None:
                return run
            run.append(medium)

    def cached_blocks(self, url: str) -> int:
        """Blocks on the worker's device (0 while unsynced)."""
        entry = self._workers.get(url)
        return len(entry.blocks) if entry is not None and entry.synced else 0

    def tier_blocks(self, url: str) -> dict[str, int]:
        """Blocks per local medium, device included (all 0 while unsynced)."""
        entry = self._workers.get(url)
        if entry is None or not entry.synced:
            return dict.fromkeys(LOCAL_MEDIA, 0)
        return {m: len(entry.media[m]) for m in LOCAL_MEDIA}

    def cluster_blocks(self) -> int:
        """Hashes in the pool-wide cluster set."""
        return len(self._cluster)

    def writes_cluster(self, url: str) -> bool:
        """Whether the worker has reported cluster blocks (so it has a cluster tier)."""
        entry = self._workers.get(url)
        return entry is not None and entry.writes_cluster

    def block_size(self, url: str) -> int | None:
        entry = self._workers.get(url)
        return entry.block_size if entry is not None else None

    def describe(self, url: str) -> dict[str, Any] | None:
        entry = self._workers.get(url)
        return entry.describe() if entry is not None else None
