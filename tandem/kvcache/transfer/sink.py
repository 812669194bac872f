"""The decode side: fetch a prompt's missing blocks in a background thread.

The scheduler allocated destination blocks and the request waits in WAITING_FOR_REMOTE_KV.
This thread fetches the data (shared memory when the source's file is on this host, else TCP)
and writes it into those blocks, which nothing else reads or writes until the load is
reported. A load cancelled meanwhile (the request was aborted, or the scheduler gave up on
it) never writes after `cancel` returned: the write and the cancel take the same lock, so
blocks handed to another request are never touched. Releases of the source's lease run on a
second thread, so a dead source (its release times out) does not delay the next load.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.kvcache.codec import KVCodec
from tandem.kvcache.transfer import tcp
from tandem.kvcache.transfer.base import KVLayout, KVTransferError, KVTransferHandle
from tandem.kvcache.transfer.shm import ShmTransport
from tandem.kvcache.transfer.tcp import TcpTransport
from tandem.kvcache.transfer.wire import FrameKey

logger = logging.getLogger(__name__)


@dataclass
class PullJob:
    request_id: str
    handle: KVTransferHandle
    indices: list[int]  # handle block indices to fetch
    dest_block_ids: list[int]


@dataclass
class PullResult:
    job: PullJob
    error: str | None = None
    transport: str = ""
    seconds: float = 0.0
    nbytes: int = 0  # moved: the codec's payload over tcp, the raw blocks from shared memory

    @property
    def ok(self) -> bool:
        return self.error is None


class KVSink:
    def __init__(self, write_blocks: Callable[[list[int], torch.Tensor], None], layout: KVLayout, secret: str,
                 fetch_timeout: float = 10.0, use_shm: bool = True, codec: str = "raw") -> None:
        if not secret:
            raise ValueError("a KV sink needs the cluster secret: it adopts only blocks its peers sign")
        self.write_blocks = write_blocks
        self.fetch_timeout = fetch_timeout
        self.key = FrameKey(secret)
        self.shm = ShmTransport(self.key, layout, KVCodec(codec)) if use_shm else None
        self.tcp = TcpTransport(self.key, layout, KVCodec(codec))
        self._jobs: queue.Queue[PullJob | None] = queue.Queue()
        self._releases: queue.Queue[KVTransferHandle | None] = queue.Queue()
        self._results: queue.Queue[PullResult] = queue.Queue()
        self._write_lock = threading.Lock()
        self._cancelled: set[str] = set()
        self._threads = [threading.Thread(target=self._run, name="kv-sink", daemon=True),
                         threading.Thread(target=self._run_releases, name="kv-sink-release", daemon=True)]
        for thread in self._threads:
            thread.start()

    def submit(self, job: PullJob) -> None:
        with self._write_lock:
            self._cancelled.discard(job.request_id)
        self._jobs.put(job)

    def cancel(self, request_id: str) -> None:
        """After this returns, the request's load writes nothing more and reports nothing."""
        with self._write_lock:
            self._cancelled.add(request_id)

    def release_remote(self, handle: KVTransferHandle) -> None:
        """Tell the source its lease may end (in the background)."""
        self._releases.put(handle)

    def results(self) -> list[PullResult]:
        done = []
        while True:
            try:
                done.append(self._results.get_nowait())
            except queue.Empty:
                return done

    def close(self) -> None:
        self._jobs.put(None)
        self._releases.put(None)
        for thread in self._threads:
            thread.join(2)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            started = time.monotonic()
            result = PullResult(job)
            try:
                data = self._fetch(job, result)
                with self._write_lock:
                    if job.request_id in self._cancelled:
                        self._cancelled.discard(job.request_id)
                        continue
                    if data is not None:
                        self.write_blocks(job.dest_block_ids, data)
            except Exception as exc:  # every failure means: compute the prompt here instead
                result.error = f"{type(exc).__name__}: {exc}"
            with self._write_lock:
                if job.request_id in self._cancelled:
                    self._cancelled.discard(job.request_id)
                    continue
            result.seconds = time.monotonic() - started
            self._results.put(result)

    def _fetch(self, job: PullJob, result: PullResult) -> torch.Tensor | None:
        if not job.indices:
            return None
        if self.shm is not None:
            data = self.shm.fetch(job.handle, job.indices, self.fetch_timeout)
            result.transport, result.nbytes = self.shm.last_transport, self.shm.last_nbytes
        else:
            data = self.tcp.fetch(job.handle, job.indices, self.fetch_timeout)
            result.transport, result.nbytes = self.tcp.name, self.tcp.last_nbytes
        expected = self.tcp.layout.block_shape(len(job.indices))
        if tuple(data.shape) != expected or data.dtype != self.tcp.layout.torch_dtype:
            raise KVTransferError(f"fetched {data.dtype} blocks of shape {tuple(data.shape)}, expected "
                                  f"{self.tcp.layout.torch_dtype} of {expected}")
        return data

    def _run_releases(self) -> None:
        while True:
            handle = self._releases.get()
            if handle is None:
                return
            try:
                tcp.release(handle, self.key, timeout=min(5.0, self.fetch_timeout))
            except Exception as exc:
                logger.debug("release of %s failed (it will expire): %s", handle.transfer_id, exc)
