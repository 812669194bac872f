"""The KV tiers as a connector: CPU memory, local disk and a cluster store below the device pool.

Unit: a **chunk** of `chunk_blocks` consecutive blocks of a request's tokens (by default 256
tokens' worth: 4 blocks of 64 on a CPU, 16 of 16 on a GPU), keyed by the fingerprinted chain
hash of its last block (tiers/chunk.py), so the key names the whole prefix, the model, its
revision and the cache salt.

**Store.** As a request's computation completes a chunk, the step's metadata names it and the
worker side, after the forward pass, copies the chunk's blocks out of the KV cache:

* into the **CPU tier** (write-through, every chunk; a dict of tensors in the worker's memory
  under a byte budget whose LRU the scheduler side keeps, so lookups never ask the worker).
  A chunk inside a request's retained prefix (a cache breakpoint, `Request.retention`) is
  evicted after every unretained one until its TTL ends, as in the device pool
  (kvcache/retention.py);
* to the **disk tier** and the **cluster store** through one writer thread with a bounded
  queue: a full queue drops the write (counted) and the step never waits. Only admitted chunks
  are written there, so one-shot prompts stay out: a chunk seen in at least `admit_after`
  requests (counted cluster-wide when the store can count), and every chunk of a request that
  *continues a known prefix* (its first chunk seen before): a conversation's next turn, whose
  new chunks the turn after re-sends. Without that rule a turn's new chunks would reach the
  cluster store only on their second sighting, which under round-robin routing happens on
  another worker that does not hold them: every turn would recompute the previous one's. A
  chunk that reaches its second sighting while it is on the device or in CPU memory is written
  then. A chunk the CPU tier evicts goes down to the slow tiers if it was admitted and is not
  there yet.

**Load.** On admission, beyond the device pool's prefix hit, the scheduler side finds the
longest run of chunks held by a tier (CPU index, then one batched existence probe per slow
tier), keeps the prefix of that run the cost model says loads faster than it computes
(tiers/cost.py), and the request waits in WAITING_FOR_REMOTE_KV while loader threads read,
verify and write the blocks; the rest of the engine keeps stepping. A request wanting a chunk
another request is loading waits for that load and then hits the device cache (one load per
chunk); at most `max_concurrent_loads` run at once; a load not done within `load_timeout` is
cancelled and the prompt computed. Any failure of a load (a miss, a corrupt or foreign value,
an unreachable store) is counted and the request computes its prompt: never wrong tokens.

**Events.** Chunks entering or leaving a tier become KV events with their medium ("cpu",
"disk", "cluster") for routers; disk and cluster ones once the writer confirms them.

With tensor parallelism each rank stores and loads its own shard under its own key; the
scheduler side probes rank 0's keys, and a load any rank fails is a recompute.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.config import EngineConfig
from tandem.kvcache.connector.base import (
    NO_HOLD,
    HoldDecision,
    KVConnectorOutput,
    KVConnectorScheduler,
)
from tandem.kvcache.retention import Clock, RetainingLRU
from tandem.kvcache.tiers.chunk import chunk_key
from tandem.kvcache.tiers.cost import CostModel
from tandem.kvcache.tiers.metadata import ChunkLoad, EvictSpec, LoadSpec, SaveSpec, TiersMetadata
from tandem.kvcache.tiers.open import open_stores
from tandem.kvcache.tiers.store import ChunkStore, ChunkStoreError
from tandem.types import Request

logger = logging.getLogger(__name__)

_LOAD_POLL_S = 0.003
_WRITE_POLL_S = 0.05
_MAX_SIGHTINGS = 200_000  # chunk hashes remembered by the admission filter
_MAX_KNOWN = 50_000  # chunks remembered as held by a slow tier (about 0.5 TB of KV at 10 MiB each)
LOAD_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class _Tracked:
    """A request the connector has seen: its blocks (as the runner knows them) and how many of
    its chunks were already considered for storing."""

    request: Request
    block_ids: list[int] = field(default_factory=list)
    chunks_done: int = 0
    counted: bool = False  # its lookup's outcome (miss, skipped by cost) is in the counters
    continues: bool = False  # its first chunk was seen before: all its chunks are admitted


@dataclass
class _Load:
    chunk_hashes: list[int]
    media: list[str]
    deadline: float
    started: float


@dataclass
class TierCounters:
    lookups: int = 0  # requests asked about
    chunk_hits: dict[str, int] = field(default_factory=lambda: {"cpu": 0, "disk": 0, "cluster": 0})
    chunk_misses: int = 0  # requests whose first chunk beyond the device hit was in no tier
    loads: int = 0
    loads_failed: int = 0
    loads_timed_out: int = 0
    loads_skipped_by_cost: int = 0  # requests a tier could serve, recomputing estimated faster
    probe_errors: int = 0


class TiersConnectorScheduler(KVConnectorScheduler):
    name = "tiers"
    section = "kv_tiers"

    def __init__(self, config: EngineConfig, clock: Clock = time.monotonic) -> None:
        self.config = config.kv_tiers
        self.block_size = config.cache.block_size
        self.chunk_blocks = self.config.chunk_blocks
        self.chunk_tokens = self.chunk_blocks * self.block_size
        self.cost = CostModel(enabled=self.config.cost_model)
        self.slow_media = tuple(m for m, on in (("disk", self.config.disk_path),
                                                ("cluster", self.config.store_url)) if on)
        self._probes: dict[str, ChunkStore] = open_stores(config, role="probe")
        self._chunk_bytes = 0
        self._block_bytes = 0
        self._cpu_blocks = 0  # blocks the CPU tier holds, for its budget
        self._holds: set[str] = set()  # finished requests' tails being copied out
        self._cpu_budget = self.config.cpu_bytes
        self._cpu: dict[int, list[int]] = {}  # chunk hash -> its block hashes
        self._cpu_lru = RetainingLRU(clock)  # the CPU tier's chunk hashes, in eviction order
        self._sightings: OrderedDict[int, int] = OrderedDict()
        # chunk hash -> the slow media known to hold it (from confirmed writes and probes)
        self._known: OrderedDict[int, set[str]] = OrderedDict()
        self._block_hashes: dict[int, list[int]] = {}  # of chunks written here, for removal events
        self._pending: dict[int, tuple[set[str], list[int]]] = {}  # writes awaiting confirmation
        self._tracked: dict[str, _Tracked] = {}
        self._plans: dict[str, list[tuple[int, int, str]]] = {}  # request -> (chunk index, hash, medium)
        self._loads: dict[str, _Load] = {}
        self._inflight: dict[int, str] = {}  # chunk hash being loaded -> request id
        self._meta = TiersMetadata()
        self._events: list[tuple[str, int, str]] = []
        self._counters = TierCounters()
        self._load_hist: dict[str, dict[str, Any]] = {}
        self._worker_counters: dict[str, dict[str, float]] = {}
        self._step: tuple[float, int] | None = None

    def set_worker_info(self, infos: Sequence[dict[str, Any]]) -> None:
        info = infos[0] if infos else {}
        self._chunk_bytes = int(info.get("chunk_bytes", 0))
        self._block_bytes = self._chunk_bytes // self.chunk_blocks
        if self._cpu_budget and self._chunk_bytes and self._cpu_budget < self._chunk_bytes:
            logger.warning("--kv-offload-cpu-bytes %d holds no chunk of %d bytes; the CPU tier is off",
                           self._cpu_budget, self._chunk_bytes)
            self._cpu_budget = 0
        if self._cpu_budget or self.slow_media:
            logger.info("KV tiers: %s; chunks of %d blocks (%.1f MiB); slow tiers admit after %d sightings",
                        ", ".join(self._describe_tiers()), self.chunk_blocks, self._chunk_bytes / (1 << 20),
                        self.config.admit_after)

    def _describe_tiers(self) -> list[str]:
        tiers = []
        if self._cpu_budget:
            tiers.append(f"cpu {self._cpu_budget / (1 << 30):.2f} GiB")
        if self.config.disk_path:
            tiers.append(f"disk {self.config.disk_path} ({self.config.disk_bytes / (1 << 30):.1f} GiB)")
        if self.config.store_url:
            tiers.append(f"cluster {self.config.store_url}")
        return tiers

    # --- lookups ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool] | None:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            tracked = self._tracked[request.request_id] = _Tracked(request)
            tracked.continues = self._count_sightings(request)
            self._counters.lookups += 1
        hashes = request.block_hashes
        local = num_computed_tokens // self.block_size
        limit = (request.num_tokens - 1) // self.block_size  # the last token is computed here
        K = self.chunk_blocks  # noqa: N806
        candidates: list[tuple[int, int, int]] = []  # (chunk index, blocks, chunk hash)
        index = local // K
        while (index + 1) * K <= len(hashes) and index * K < limit:
            candidates.append((index, K, hashes[(index + 1) * K - 1]))
            index += 1
        if any(h in self._inflight for _, _, h in candidates):
            return None  # another request is loading some: take them from the device cache after
        run = self._run(candidates)
        stop = candidates[len(run)][0] if len(run) < len(candidates) else index
        if stop * K < limit:
            run += self._tail(hashes, stop, limit)  # a finished request's partial chunk there
        # A request waiting for room is asked again every step: count its outcome once.
        first_answer, tracked.counted = not tracked.counted, True
        if not run:
            self._counters.chunk_misses += int(first_answer)
            return 0, False
        chosen = self._worth_loading(run, local, limit)
        if not chosen:
            self._counters.loads_skipped_by_cost += int(first_answer)
            return 0, False
        if len(self._loads) >= self.config.max_concurrent_loads or any(h in self._inflight for _, _, h, _ in chosen):
            return None
        last_index, last_blocks = chosen[-1][0], chosen[-1][1]
        num_blocks = min(last_index * K + last_blocks, limit) - local
        self._plans[request.request_id] = chosen
        return num_blocks * self.block_size, True

    def _run(self, candidates: list[tuple[int, int, int]]) -> list[tuple[int, int, int, str]]:
        """The leading candidates some tier holds, each with the tier to read it from."""
        media = self._locate([chunk_key(h, n) for _, n, h in candidates], [h for _, _, h in candidates])
        run = []
        for (index, n, chunk_hash), medium in zip(candidates, media, strict=True):
            if medium is None:
                break
            run.append((index, n, chunk_hash, medium))
        return run

    def _tail(self, hashes: list[int], index: int, limit: int) -> list[tuple[int, int, int, str]]:
        """The longest partial chunk at `index` a tier holds (a finished request's tail)."""
        start = index * self.chunk_blocks
        sizes = range(min(self.chunk_blocks - 1, len(hashes) - start), 0, -1)
        pieces = [(index, n, hashes[start + n - 1]) for n in sizes]
        if not pieces:
            return []
        media = self._locate([chunk_key(h, n) for _, n, h in pieces], [h for _, _, h in pieces])
        for (i, n, chunk_hash), medium in zip(pieces, media, strict=True):
            if medium is not None and chunk_hash not in self._inflight:
                return [(i, n, chunk_hash, medium)]
        return []

    def _count_sightings(self, request: Request) -> bool:
        """One more request seen with each of its chunks: here, and in the cluster store when it
        can count (so a sighting on any worker counts); the larger count stands. True when the
        request continues a known prefix (its first chunk now has `admit_after` sightings)."""
        hashes = request.block_hashes
        chunks = [hashes[end - 1] for end in range(self.chunk_blocks, len(hashes) + 1, self.chunk_blocks)]
        shared: list[int] | None = None
        store = self._probes.get("cluster")
        if store is not None and chunks and self.config.admit_after > 1:
            try:
                shared = store.count_sightings([chunk_key(h, self.chunk_blocks) for h in chunks])
            except ChunkStoreError:
                self._counters.probe_errors += 1
        for n, chunk_hash in enumerate(chunks):
            local = self._sightings.pop(chunk_hash, 0) + 1
            self._sightings[chunk_hash] = max(local, shared[n]) if shared else local
        continues = bool(chunks) and self._sightings[chunks[0]] >= self.config.admit_after
        if continues:  # its chunks count as admitted wherever they go (the CPU tier's demotions too)
            for chunk_hash in chunks:
                self._sightings[chunk_hash] = max(self._sightings[chunk_hash], self.config.admit_after)
        while len(self._sightings) > _MAX_SIGHTINGS:
            self._sightings.popitem(last=False)
        return continues

    def _locate(self, keys: list[str], chunk_hashes: list[int]) -> list[str | None]:
        """Where each chunk is: cpu, else the first slow medium holding it, else None; one
        batched probe per slow tier for the chunks still unplaced."""
        media: list[str | None] = ["cpu" if h in self._cpu else None for h in chunk_hashes]
        for medium in self.slow_media:
            open_at = [n for n, m in enumerate(media) if m is None]
            if not open_at:
                break
            store = self._probes[medium]
            try:
                found = store.exists([keys[n] for n in open_at])
            except ChunkStoreError as exc:
                self._counters.probe_errors += 1
                logger.debug("KV %s tier probe failed: %s", medium, exc)
                continue
            for n, hit in zip(open_at, found, strict=True):
                if hit:
                    media[n] = medium
                    self._remember(chunk_hashes[n], medium)
        return media

    def _worth_loading(self, run: list[tuple[int, int, int, str]], local: int,
                       limit: int) -> list[tuple[int, int, int, str]]:
        """The prefix of the run whose load saves the most time against computing it here."""
        saved, best, best_len = 0.0, 0.0, 0
        for n, (index, num_blocks, _, medium) in enumerate(run):
            first = max(index * self.chunk_blocks, local)
            last = min(index * self.chunk_blocks + num_blocks, limit)
            tokens = (last - first) * self.block_size
            # A slow tier reads the whole chunk; the CPU tier copies just the blocks it needs.
            num_bytes = self._block_bytes * (num_blocks if medium != "cpu" else last - first)
            if self.cost.enabled and self.cost.measured(medium):
                saved += self.cost.recompute_seconds(tokens) - self.cost.load_seconds(medium, num_bytes)
            else:
                saved += 1.0  # unmeasured (or cost model off): load, and so measure it
            if saved > best:
                best, best_len = saved, n + 1
        return run[:best_len]

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        plan = self._plans.pop(request.request_id, [])
        local = request.num_computed_tokens // self.block_size
        end = local + num_external_tokens // self.block_size
        chunks: list[ChunkLoad] = []
        for index, num_blocks, chunk_hash, medium in plan:
            start = index * self.chunk_blocks
            first, last = max(start, local), min(start + num_blocks, end)
            if first >= last:
                continue
            tokens = tuple(request.all_token_ids[start * self.block_size : (start + num_blocks) * self.block_size])
            chunks.append(ChunkLoad(chunk_hash, medium, tokens, first - start, block_ids[first:last], num_blocks))
            self._inflight[chunk_hash] = request.request_id
            self._counters.chunk_hits[medium] = self._counters.chunk_hits.get(medium, 0) + 1
        now = time.monotonic()
        self._loads[request.request_id] = _Load([c.chunk_hash for c in chunks], [c.medium for c in chunks],
                                                now + self.config.load_timeout, now)
        self._meta.loads.append(LoadSpec(request.request_id, chunks))
        self._counters.loads += 1

    def _end_load(self, request_id: str, cancel: bool) -> _Load | None:
        load = self._loads.pop(request_id, None)
        if load is None:
            return None
        for chunk_hash in load.chunk_hashes:
            if self._inflight.get(chunk_hash) == request_id:
                del self._inflight[chunk_hash]
        if cancel:
            self._meta.cancels.append(request_id)
        return load

    def timed_out_loads(self, now: float) -> list[str]:
        late = [request_id for request_id, load in self._loads.items() if load.deadline < now]
        for request_id in late:
            logger.warning("request %s: its KV tier load did not finish in %.1f s; computing its prompt",
                           request_id, self.config.load_timeout)
            self._counters.loads_timed_out += 1
            self._end_load(request_id, cancel=True)
        return late

    # --- stores -----------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> TiersMetadata | None:
        out = scheduler_output
        if out is not None:
            self._note_blocks(out)
            self._step = (time.monotonic(), sum(out.num_scheduled_tokens.values()))
            for request_id, num_new in out.num_scheduled_tokens.items():
                tracked = self._tracked.get(request_id)
                if tracked is not None:
                    self._plan_saves(tracked, tracked.request.num_computed_tokens + num_new)
        meta, self._meta = self._meta, TiersMetadata()
        return None if meta.empty else meta

    def _note_blocks(self, out: Any) -> None:
        for new in out.new_requests:
            tracked = self._tracked.get(new.request_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids)
        for cached in out.cached_requests:
            tracked = self._tracked.get(cached.request_id)
            if tracked is not None:
                tracked.block_ids.extend(cached.new_block_ids)
        for request_id in out.preempted_request_ids:
            tracked = self._tracked.get(request_id)
            if tracked is not None:
                tracked.block_ids = []

    def _plan_saves(self, tracked: _Tracked, computed_after_step: int) -> None:
        """Store the chunks this step completes (or that were complete on admission)."""
        hashes = tracked.request.block_hashes
        full = min(computed_after_step // self.chunk_tokens, len(hashes) // self.chunk_blocks,
                   len(tracked.block_ids) // self.chunk_blocks)
        admitted = True if tracked.continues else None  # else: by the chunk's own sightings
        for index in range(tracked.chunks_done, full):
            self._plan_save(tracked, index, self.chunk_blocks, admitted=admitted)
        tracked.chunks_done = max(tracked.chunks_done, full)

    def _plan_save(self, tracked: _Tracked, index: int, num_blocks: int, hold_id: str | None = None,
                   admitted: bool | None = None) -> bool:
        """Store chunk `index` (`num_blocks` of it); False if no tier wants it."""
        request = tracked.request
        start = index * self.chunk_blocks
        end = start + num_blocks
        chunk_hash = request.block_hashes[end - 1]
        in_cpu = chunk_hash in self._cpu
        if in_cpu:
            self._cpu_lru.touch(chunk_hash)
            self._retain_cpu(request, chunk_hash, end)
        to_cpu = bool(self._cpu_budget) and not in_cpu
        to_slow = self._slow_targets(chunk_hash, admitted)
        if not to_cpu and not to_slow:
            return False
        block_hashes = request.block_hashes[start:end]
        tokens = tuple(request.all_token_ids[start * self.block_size : end * self.block_size])
        source = [] if in_cpu else tracked.block_ids[start:end]
        self._meta.saves.append(SaveSpec(chunk_hash, source, tokens, to_cpu, to_slow, num_blocks, hold_id))
        if to_slow:
            self._pending[chunk_hash] = (set(to_slow), block_hashes)
        if to_cpu:
            self._cpu[chunk_hash] = block_hashes
            self._cpu_lru.push(chunk_hash)
            self._retain_cpu(request, chunk_hash, end)
            self._cpu_blocks += num_blocks
            self._events += [("stored", h, "cpu") for h in block_hashes]
            self._evict_cpu()
        return True

    def _retain_cpu(self, request: Request, chunk_hash: int, end_block: int) -> None:
        """Retain a CPU chunk ending at block `end_block` if it lies within the request's
        retained prefix, for its TTL from now (a later request extends it)."""
        retention = request.retention
        if retention is not None and end_block * self.block_size <= retention.tokens:
            lru = self._cpu_lru
            lru.retain(chunk_hash, lru.clock() + retention.seconds)

    def _slow_targets(self, chunk_hash: int, admitted: bool | None = None) -> tuple[str, ...]:
        if not self.slow_media or chunk_hash in self._pending:
            return ()
        if admitted is None:
            admitted = self._sightings.get(chunk_hash, 0) >= self.config.admit_after
        if not admitted:
            return ()
        known = self._known.get(chunk_hash, set())
        return tuple(m for m in self.slow_media if m not in known)

    def _evict_cpu(self) -> None:
        lru = self._cpu_lru
        while self._cpu_blocks * self._block_bytes > self._cpu_budget:
            loading: list[int] = []  # chunks being loaded: they stay, in their place
            victim = None
            while lru:
                candidate = lru.pop()
                if candidate not in self._inflight:
                    victim = candidate
                    break
                loading.append(candidate)
            for chunk_hash in reversed(loading):
                lru.push_first(chunk_hash)
            if victim is None:
                return  # every chunk is being loaded; over budget until a load ends
            lru.forget(victim)
            block_hashes = self._cpu.pop(victim)
            self._cpu_blocks -= len(block_hashes)
            demote = self._slow_targets(victim)
            if demote:
                self._pending[victim] = (set(demote), block_hashes)
            self._meta.evictions.append(EvictSpec(victim, demote))
            self._events += [("removed", h, "cpu") for h in block_hashes]

    # --- reports ----------------------------------------------------------------------
    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self._holds -= output.finished_holds
        if self._step is not None:
            started, tokens = self._step
            self.cost.observe_step(tokens, time.monotonic() - started)
            self._step = None
        report = output.reports.get(self.name) or {}
        for chunk_hash, medium in report.get("stored", ()):
            self._write_done(chunk_hash, medium, stored=True)
        for chunk_hash, medium in report.get("not_stored", ()):
            self._write_done(chunk_hash, medium, stored=False)
        for chunk_hash, medium in report.get("gone", ()):  # corrupt, evicted or missing there
            known = self._known.get(chunk_hash)
            if known is not None and medium in known:
                known.discard(medium)
                self._events += [("removed", h, medium) for h in self._block_hashes.get(chunk_hash, ())]
        for medium, num_bytes, seconds, num_chunks in report.get("load_stats", ()):
            self.cost.observe_load(medium, num_bytes, seconds, num_chunks)
        self._worker_counters = report.get("counters", self._worker_counters)
        for request_id in output.finished_loads | output.failed_loads:
            load = self._end_load(request_id, cancel=False)
            if load is None:
                continue
            self._observe_latency(load, time.monotonic() - load.started)
            if request_id in output.failed_loads:
                self._counters.loads_failed += 1

    def _write_done(self, chunk_hash: int, medium: str, stored: bool) -> None:
        pending = self._pending.get(chunk_hash)
        block_hashes: list[int] = pending[1] if pending else []
        if pending is not None:
            pending[0].discard(medium)
            if not pending[0]:
                del self._pending[chunk_hash]
        if not stored:
            return
        self._remember(chunk_hash, medium, block_hashes)
        self._events += [("stored", h, medium) for h in block_hashes]

    def _remember(self, chunk_hash: int, medium: str, block_hashes: list[int] | None = None) -> None:
        self._known.setdefault(chunk_hash, set()).add(medium)
        self._known.move_to_end(chunk_hash)
        if block_hashes:
            self._block_hashes[chunk_hash] = block_hashes
        while len(self._known) > _MAX_KNOWN:
            forgotten, _ = self._known.popitem(last=False)
            self._block_hashes.pop(forgotten, None)

    def _observe_latency(self, load: _Load, seconds: float) -> None:
        """Into the histogram of the slowest tier the load read from."""
        medium = max(load.media, key=("cpu", "disk", "cluster").index) if load.media else "cpu"
        hist = self._load_hist.setdefault(medium, {"buckets": [0] * (len(LOAD_SECONDS_BUCKETS) + 1),
                                                   "sum": 0.0, "count": 0})
        slot = next((n for n, bound in enumerate(LOAD_SECONDS_BUCKETS) if seconds <= bound),
                    len(LOAD_SECONDS_BUCKETS))
        hist["buckets"][slot] += 1
        hist["sum"] += seconds
        hist["count"] += 1

    def request_finished(self, request: Request, block_ids: list[int]) -> HoldDecision:
        """Store the tail: the computed blocks after the request's last whole chunk (an agent's
        next turn starts with them). The request's blocks are held until the worker side has
        copied them, since the step that copies comes after they would be freed."""
        request_id = request.request_id
        if request_id in self._loads:
            self._end_load(request_id, cancel=True)
        self._plans.pop(request_id, None)
        tracked = self._tracked.pop(request_id, None)
        if tracked is None or request.num_preemptions and not tracked.block_ids:
            return NO_HOLD
        K = self.chunk_blocks  # noqa: N806
        tracked.block_ids = list(block_ids)
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes),
                       len(block_ids))
        index = tracked.chunks_done
        tail = num_full - index * K
        if not 0 < tail < K:
            return NO_HOLD
        # Admitted to the slow tiers when the request continued a known prefix: a
        # conversation's tail is what its next turn re-sends.
        hold_id = f"tiers-{request_id}-{uuid.uuid4().hex[:8]}"
        if not self._plan_save(tracked, index, tail, hold_id, tracked.continues):
            return NO_HOLD
        self._holds.add(hold_id)
        return HoldDecision(num_full, hold_id)

    def pending_work(self) -> float | None:
        if not self._meta.empty:
            return 0.0
        if self._loads or self._holds:
            return _LOAD_POLL_S
        if self._pending:
            return _WRITE_POLL_S
        return None

    def drain_events(self) -> list[tuple[str, int, str]]:
        events, self._events = self._events, []
        return events

    def counters(self) -> dict[str, Any]:
        """What /load reports under `kv_tiers` and /metrics renders as `tandem:kv_tier_*`."""
        c = self._counters
        media: dict[str, dict[str, float]] = {m: dict(v) for m, v in self._worker_counters.items()
                                              if m in ("cpu", "disk", "cluster")}
        cpu = media.setdefault("cpu", {})
        cpu.update(blocks=self._cpu_blocks, bytes=self._cpu_blocks * self._block_bytes,
                   budget_bytes=self._cpu_budget, chunks_retained=self._cpu_lru.num_retained())
        for medium, hits in c.chunk_hits.items():
            if medium == "cpu" or medium in self.slow_media:
                media.setdefault(medium, {})["chunk_hits"] = hits
        disk = media.get("disk")
        if disk is not None:
            disk["blocks"] = disk.get("num_chunks", 0) * self.chunk_blocks
        writer = dict(self._worker_counters.get("writer", {}))
        writer["pending"] = len(self._pending)
        return {
            "chunk_blocks": self.chunk_blocks, "block_bytes": self._block_bytes,
            # what one token costs in every tier, after --kv-tier-dtype's codec
            "bytes_per_token": self._block_bytes / self.block_size, "codec": self.config.codec,
            "media": media, "writer": writer,
            "lookups": c.lookups, "chunk_misses": c.chunk_misses, "loads": c.loads,
            "loads_failed": c.loads_failed, "loads_timed_out": c.loads_timed_out,
            "loads_skipped_by_cost": c.loads_skipped_by_cost, "probe_errors": c.probe_errors,
            "load_seconds": {m: {"buckets": list(h["buckets"]), "sum": h["sum"], "count": h["count"]}
                             for m, h in self._load_hist.items()},
            "load_seconds_bounds": list(LOAD_SECONDS_BUCKETS),
            "cost_model": self.cost.describe(),
        }

    def shutdown(self) -> None:
        for store in self._probes.values():
            store.close()
