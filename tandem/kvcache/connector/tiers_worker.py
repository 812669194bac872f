"""The KV tiers' worker side: copies chunks out of the KV cache, writes and reads the tiers.

Runs in each rank's worker (tandem/kvcache/connector/tiers.py has the design). Three paths:

* saves, after a step's forward pass, on the engine thread: the chunk's blocks are gathered
  into a new tensor (the blocks may be reused once the step returns) and encoded in the tiers'
  codec (--kv-tier-dtype: the cache's bytes, or 8 / 4 bits with scales, kvcache/codec.py);
  that payload is the CPU tier's copy and, for admitted chunks, goes to the writer's queue;
* one writer thread encodes chunks (header, payload, xxh3-128; tiers/chunk.py) and puts them
  in the disk tier and the cluster store; a full queue drops the write, never the step;
* loader threads (at most `max_concurrent_loads`) read a request's chunks, verify them against
  the request's tokens and the model, and write the blocks into the cache under the job's
  lock, so a cancelled load never writes after its cancel was handled.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from tandem.config import EngineConfig
from tandem.kvcache.codec import CodecError, KVCodec
from tandem.kvcache.connector.base import KVCacheAccess, KVConnectorOutput, KVConnectorWorker
from tandem.kvcache.tiers.chunk import (
    ChunkError,
    ChunkHeader,
    chunk_key,
    encode_chunk,
    parse_chunk_key,
    read_chunk,
)
from tandem.kvcache.tiers.metadata import ChunkLoad, LoadSpec, TiersMetadata
from tandem.kvcache.tiers.open import open_stores
from tandem.kvcache.tiers.store import ChunkStore, ChunkStoreError
from tandem.kvcache.transfer.base import writer_layout

logger = logging.getLogger(__name__)


@dataclass
class _LoadJob:
    spec: LoadSpec
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False


@dataclass
class _LoadResult:
    request_id: str
    ok: bool
    error: str = ""
    stats: list[tuple[str, int, float, int]] = field(default_factory=list)
    gone: list[tuple[int, str]] = field(default_factory=list)


class TiersConnectorWorker(KVConnectorWorker):
    name = "tiers"

    def __init__(self, config: EngineConfig, rank: int) -> None:
        self.engine_config = config
        self.config = config.kv_tiers
        self.rank = rank
        self.kv: KVCacheAccess | None = None
        self._codec = KVCodec(self.config.codec)
        self.cpu: dict[int, Any] = {}  # chunk hash -> (its encoded blocks: uint8 payload, token ids)
        self.stores: dict[str, ChunkStore] = {}
        self._jobs: dict[str, _LoadJob] = {}
        self._holds_done: set[str] = set()  # tails copied since the last report
        self._results: queue.SimpleQueue[_LoadResult] = queue.SimpleQueue()
        self._reports: queue.SimpleQueue[tuple[str, int, str]] = queue.SimpleQueue()
        self._writes: queue.Queue[tuple[int, Any, tuple[int, ...], tuple[str, ...]] | None] = queue.Queue(
            maxsize=max(1, self.config.writer_queue_chunks))
        self._pool: ThreadPoolExecutor | None = None
        self._writer: threading.Thread | None = None
        self._counters: dict[str, dict[str, float]] = {}
        self._lock = threading.Lock()  # counters, from the writer and loader threads

    # --- set-up -------------------------------------------------------------------------
    def register_kv_cache(self, kv: KVCacheAccess) -> dict[str, Any]:
        import torch

        self.kv = kv
        layout = kv.layout
        self._dtype = getattr(torch, layout.dtype)
        self._scales = layout.scales()  # an fp8 cache's, which its chunks' values are over
        self._block_size = layout.block_size
        # a whole chunk's bytes, and per block its share (int4 keys share a step over 64 tokens,
        # so a block's bytes depend on the blocks beside it)
        chunk_bytes = self._codec.payload_bytes(layout.block_shape(self.config.chunk_blocks), self._dtype)
        self._block_bytes = -(-chunk_bytes // self.config.chunk_blocks)
        self._layout = asdict(layout)
        self.stores = open_stores(self.engine_config, role="worker", rank=kv.rank)
        self._pool = ThreadPoolExecutor(max(1, self.config.max_concurrent_loads), thread_name_prefix="kv-tier-load")
        if self.stores:
            self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
            self._writer.start()
        return {"chunk_bytes": chunk_bytes}

    def _blocks(self, token_ids: tuple[int, ...]) -> int:
        """A chunk's length in blocks: chunk_blocks, or fewer for a request's tail."""
        return len(token_ids) // self._block_size

    def _key(self, chunk_hash: int, token_ids: tuple[int, ...]) -> str:
        assert self.kv is not None
        return chunk_key(chunk_hash, self._blocks(token_ids), self.kv.rank, self.kv.world_size)

    def _header(self, token_ids: tuple[int, ...]) -> ChunkHeader:
        assert self.kv is not None
        num_blocks = self._blocks(token_ids)
        return ChunkHeader(self.kv.fingerprint, self._layout, tuple(self.kv.layout.block_shape(num_blocks)),
                           num_blocks, tuple(token_ids), self.kv.rank, self.kv.world_size, self._codec.name)

    def _count(self, group: str, name: str, amount: float = 1) -> None:
        """Bump a cumulative counter of a tier ("cpu", "disk", "cluster") or of the "writer"."""
        with self._lock:
            counters = self._counters.setdefault(group, {})
            counters[name] = counters.get(name, 0) + amount

    # --- each step ----------------------------------------------------------------------
    def start_load_kv(self, metadata: Any) -> None:
        if not isinstance(metadata, TiersMetadata):
            return
        for request_id in metadata.cancels:
            job = self._jobs.pop(request_id, None)
            if job is not None:
                with job.lock:  # once this returns, the job never writes again
                    job.cancelled = True
        for eviction in metadata.evictions:
            entry = self.cpu.pop(eviction.chunk_hash, None)
            self._count("cpu", "evictions")
            if entry is not None and eviction.demote_to:
                self._enqueue_write(eviction.chunk_hash, entry[0], entry[1], eviction.demote_to)
            elif eviction.demote_to:
                for medium in eviction.demote_to:
                    self._reports.put(("not_stored", eviction.chunk_hash, medium))
        for spec in metadata.loads:
            job = _LoadJob(spec)
            self._jobs[spec.request_id] = job
            assert self._pool is not None
            self._pool.submit(self._run_load, job)

    def save_kv(self, metadata: Any) -> None:
        if not isinstance(metadata, TiersMetadata) or self.kv is None:
            return
        for save in metadata.saves:
            if save.block_ids:
                # a copy (the blocks may be reused), in the tiers' codec
                data = self._codec.encode(self.kv.read_blocks(save.block_ids), self._scales)
            else:
                entry = self.cpu.get(save.chunk_hash)
                if entry is None:
                    for medium in save.to_slow:
                        self._reports.put(("not_stored", save.chunk_hash, medium))
                    continue
                data = entry[0]
            if save.to_cpu:
                self.cpu[save.chunk_hash] = (data, save.token_ids)
                self._count("cpu", "bytes_in", self._block_bytes * save.num_blocks)
            if save.to_slow:
                self._enqueue_write(save.chunk_hash, data, save.token_ids, save.to_slow)
        # A finished request's tail is copied: its blocks may go back to the pool.
        self._holds_done.update(save.hold_id for save in metadata.saves if save.hold_id)

    def _enqueue_write(self, chunk_hash: int, data: Any, token_ids: tuple[int, ...], media: tuple[str, ...]) -> None:
        try:
            self._writes.put_nowait((chunk_hash, data, token_ids, media))
        except queue.Full:
            self._count("writer", "dropped")
            for medium in media:
                self._reports.put(("not_stored", chunk_hash, medium))

    def get_finished(self) -> KVConnectorOutput:
        out = KVConnectorOutput(finished_holds=self._holds_done)
        self._holds_done = set()
        stats: list[tuple[str, int, float, int]] = []
        gone: list[tuple[int, str]] = []
        while True:
            try:
                result = self._results.get_nowait()
            except queue.Empty:
                break
            if self._jobs.pop(result.request_id, None) is None:
                continue  # cancelled: the scheduler side has moved on
            (out.finished_loads if result.ok else out.failed_loads).add(result.request_id)
            stats += result.stats
            gone += result.gone
            if not result.ok and self.rank == 0:
                logger.warning("request %s: KV tier load failed (%s); computing its prompt",
                               result.request_id, result.error)
        stored: list[tuple[int, str]] = []
        not_stored: list[tuple[int, str]] = []
        while True:
            try:
                kind, chunk_hash, medium = self._reports.get_nowait()
            except queue.Empty:
                break
            (stored if kind == "stored" else not_stored).append((chunk_hash, medium))
        with self._lock:
            counters = {group: dict(values) for group, values in self._counters.items()}
        counters.setdefault("writer", {})["queue_depth"] = self._writes.qsize()
        counters.setdefault("cpu", {})["chunks"] = len(self.cpu)
        for medium, store in self.stores.items():
            counters.setdefault(medium, {}).update(store.stats())
            drain = getattr(store, "drain_evicted", None)
            if drain is not None:  # the disk tier's own budget evicted these
                for key in drain():
                    parsed = parse_chunk_key(key)
                    if parsed is None:  # not a key this side wrote: nothing to announce
                        logger.debug("KV %s tier evicted %r, not a chunk key; ignored", medium, key)
                        continue
                    gone.append((parsed[0], medium))
        report: dict[str, Any] = {"counters": counters}
        if stored:
            report["stored"] = stored
        if not_stored:
            report["not_stored"] = not_stored
        if stats:
            report["load_stats"] = stats
        if gone:
            report["gone"] = gone
        out.reports[self.name] = report
        return out

    # --- threads ------------------------------------------------------------------------
    def _run_load(self, job: _LoadJob) -> None:
        spec = job.spec
        result = _LoadResult(spec.request_id, ok=False)
        per_medium: dict[str, list[float]] = {}
        try:
            for chunk in spec.chunks:
                if job.cancelled:
                    return
                started = time.perf_counter()
                data = self._read_chunk(chunk, result)
                if data is None:
                    return
                part = data[:, :, :, chunk.skip : chunk.skip + len(chunk.dest_block_ids)]  # decoded
                with job.lock:
                    if job.cancelled:
                        return
                    assert self.kv is not None
                    self.kv.write_blocks(chunk.dest_block_ids, part)
                seconds = time.perf_counter() - started
                num_bytes = self._block_bytes * (
                    chunk.num_blocks if chunk.medium != "cpu" else len(chunk.dest_block_ids))
                totals = per_medium.setdefault(chunk.medium, [0.0, 0.0, 0.0])
                totals[0] += num_bytes
                totals[1] += seconds
                totals[2] += 1
                self._count(chunk.medium, "bytes_out", num_bytes)
                self._count(chunk.medium, "chunks_loaded")
            result.ok = True
            result.stats = [(m, int(t[0]), t[1], int(t[2])) for m, t in per_medium.items()]
        except Exception as exc:  # noqa: BLE001 - any failure is a recompute, never a dead worker
            result.error = f"{type(exc).__name__}: {exc}"
        finally:
            self._results.put(result)

    def _read_chunk(self, chunk: ChunkLoad, result: _LoadResult) -> Any:
        """The chunk's blocks as a tensor, or None (result.error says why) if unusable."""
        import torch

        if chunk.medium == "cpu":
            entry = self.cpu.get(chunk.chunk_hash)
            if entry is None or entry[1] != chunk.token_ids:
                result.error = "not in the CPU tier any more"
                self._count("cpu", "misses")
                return None
            shape = tuple(self.kv.layout.block_shape(self._blocks(chunk.token_ids))) if self.kv else ()
            return self._codec.decode(entry[0], shape, self._dtype, self._dtype, self._scales, self._scales)
        store = self.stores[chunk.medium]
        key = self._key(chunk.chunk_hash, chunk.token_ids)
        value = store.get(key)  # ChunkStoreError propagates: a failed load
        if value is None:
            result.error = f"chunk {key} not in the {chunk.medium} tier any more"
            result.gone.append((chunk.chunk_hash, chunk.medium))
            self._count(chunk.medium, "misses")
            return None
        try:
            expected_header = self._header(chunk.token_ids)
            header, payload = read_chunk(value, expected_header)
            try:
                codec = KVCodec(header.codec)  # the writer's: any a reader knows
            except ValueError as exc:
                raise ChunkError("header", str(exc)) from exc
            writer = writer_layout(self._layout, header.layout)  # read_chunk checked it too
            if writer is None:
                raise ChunkError("layout", f"layout {header.layout}")
            writer_dtype = writer.torch_dtype
            expected = codec.payload_bytes(header.shape, writer_dtype)
            if len(payload) != expected:
                raise ChunkError("truncated", f"payload of {len(payload)} bytes, expected {expected}")
            with warnings.catch_warnings():  # a bytes value is read-only; it is only read from
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.frombuffer(payload, dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
            try:
                blocks = codec.decode(raw, header.shape, self._dtype, writer_dtype, self._scales, writer.scales())
            except CodecError as exc:  # e.g. a NaN scale: the checksum matched, the numbers are wrong
                raise ChunkError("values", str(exc)) from exc
        except ChunkError as exc:
            result.error = f"chunk {key} in the {chunk.medium} tier is unusable ({exc})"
            result.gone.append((chunk.chunk_hash, chunk.medium))
            self._count(chunk.medium, "corrupt")
            self._count(chunk.medium, f"corrupt_{exc.reason}")
            with contextlib.suppress(ChunkStoreError):
                store.delete(key)
            return None
        self._count(chunk.medium, "bytes_read", len(value))
        return blocks

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            if item is None:
                return
            chunk_hash, data, token_ids, media = item
            try:
                value = encode_chunk(self._header(token_ids), _tensor_bytes(data))  # data: the payload
            except Exception as exc:  # noqa: BLE001 - a failed encode is a dropped write, reported
                logger.warning("KV tier: cannot encode chunk %x: %s", chunk_hash, exc)
                for medium in media:
                    self._reports.put(("not_stored", chunk_hash, medium))
                continue
            for medium in media:
                try:
                    self.stores[medium].put(self._key(chunk_hash, token_ids), value)
                except ChunkStoreError as exc:
                    self._count(medium, "write_errors")
                    logger.debug("KV %s tier write failed: %s", medium, exc)
                    self._reports.put(("not_stored", chunk_hash, medium))
                    continue
                self._count(medium, "bytes_in", len(value))
                self._reports.put(("stored", chunk_hash, medium))

    def shutdown(self) -> None:
        if self._writer is not None:
            self._writes.put(None)
            self._writer.join(timeout=5)
            self._writer = None
        if self._pool is not None:
            for job in self._jobs.values():
                with job.lock:
                    job.cancelled = True
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        for store in self.stores.values():
            store.close()
        self.cpu.clear()


def _tensor_bytes(data: Any) -> memoryview:
    """A tensor's bytes without a copy when it is contiguous (chunk reads always are)."""
    import torch

    return memoryview(data.contiguous().view(-1).view(torch.uint8).numpy())
