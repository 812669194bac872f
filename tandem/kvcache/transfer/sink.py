"""The decode side: fetch a prompt's missing blocks in a background thread, then hand back.

The engine thread reserves destination blocks and submits a job; this thread fetches the
data (shared memory when the source's file is reachable, else TCP), writes it into the
reserved blocks (nothing else reads or writes them yet), releases the source, and reports.
The engine thread then publishes the blocks to its prefix cache and queues the request,
which finds them as cache hits. A failed job reports why; the engine then computes the
prompt itself. The source is released whatever happened, so its blocks never wait for
an expiry they need not.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.kvcache.transfer import tcp
from tandem.kvcache.transfer.base import KVTransferError, KVTransferHandle
from tandem.kvcache.transfer.shm import ShmTransport
from tandem.kvcache.transfer.tcp import TcpTransport

logger = logging.getLogger(__name__)


@dataclass
class PullJob:
    request_id: str
    handle: KVTransferHandle
    indices: list[int]  # handle block indices to fetch
    dest_block_ids: list[int]
    context: Any = None  # the engine's own bookkeeping, returned untouched


@dataclass
class PullResult:
    job: PullJob
    error: str | None = None
    transport: str = ""
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None


class KVSink:
    def __init__(self, write_blocks: Callable[[list[int], torch.Tensor], None], fetch_timeout: float = 10.0,
                 use_shm: bool = True) -> None:
        self.write_blocks = write_blocks
        self.fetch_timeout = fetch_timeout
        self.shm = ShmTransport() if use_shm else None
        self.tcp = TcpTransport()
        self._jobs: queue.Queue[PullJob | None] = queue.Queue()
        self._results: queue.Queue[PullResult] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kv-sink", daemon=True)
        self._thread.start()
        self.pending = 0

    def submit(self, job: PullJob) -> None:
        self.pending += 1
        self._jobs.put(job)

    def results(self) -> list[PullResult]:
        done = []
        while True:
            try:
                done.append(self._results.get_nowait())
            except queue.Empty:
                break
        self.pending -= len(done)
        return done

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(2)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            started = time.monotonic()
            result = PullResult(job)
            try:
                if job.indices:
                    transport = self.shm if self.shm is not None and self.shm.available(job.handle) else self.tcp
                    result.transport = transport.name
                    data = transport.fetch(job.handle, job.indices, self.fetch_timeout)
                    expected = job.handle.layout.block_shape(len(job.indices))
                    if tuple(data.shape) != expected:
                        raise KVTransferError(f"fetched shape {tuple(data.shape)}, expected {expected}")
                    self.write_blocks(job.dest_block_ids, data)
            except Exception as exc:  # every failure means: compute the prompt here instead
                result.error = f"{type(exc).__name__}: {exc}"
            try:
                tcp.release(job.handle, timeout=min(5.0, self.fetch_timeout))
            except Exception as exc:
                logger.debug("release of %s failed (it will expire): %s", job.handle.transfer_id, exc)
            result.seconds = time.monotonic() - started
            self._results.put(result)
