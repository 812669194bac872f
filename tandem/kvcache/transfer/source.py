"""The prefill side: prompt blocks held under a lease, served to decode workers.

A thread answers fetches on a ZMQ ROUTER socket, so the engine loop never waits on the
network. The scheduler owns the blocks: it keeps them referenced while their lease lives and
frees them only after this source reported the lease finished (released or expired). Reads
and expiry share one lock, so a lease never ends in the middle of a read, and nothing is read
after a lease ended: the blocks may belong to another request by then.

Wire format (multipart ZMQ messages, one request → one reply; `transfer_id` is the lease id):
    FETCH   [b"FETCH", json {transfer_id, indices}]
        →   [b"OK", json {transfer_id, indices, block_hashes, layout, shape, nbytes, checksum}, payload]
    CHECK   [b"CHECK", json {transfer_id}]    →  [b"OK", b"{}"] while the lease lives
    RELEASE [b"RELEASE", json {transfer_id}]  →  [b"OK", b"{}"]
    errors  →   [b"ERR", json {message}]
`checksum` is xxh64 of the payload, checked by the receiver. A reader that copied blocks
through shared memory sends CHECK afterwards: if the lease still lives, what it copied was
the leased data.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import xxhash
import zmq

from tandem.kvcache.transfer.auth import refusal
from tandem.kvcache.transfer.base import KVLayout

logger = logging.getLogger(__name__)

FAULT_ENV = "TANDEM_KV_FAULT"  # "corrupt": flip payload bytes after checksumming (tests only)


@dataclass
class _Lease:
    block_ids: list[int]
    block_hashes: list[int]
    deadline: float


class KVSource:
    def __init__(self, read_blocks: Callable[[list[int]], torch.Tensor], layout: KVLayout,
                 host: str = "127.0.0.1", port: int = 0, shm_path: str | None = None,
                 shm_num_blocks: int = 0, secret: str | None = None) -> None:
        self.read_blocks = read_blocks
        self._secret = secret
        self.layout = layout
        self.host = host
        self.shm_path = shm_path
        self.shm_num_blocks = shm_num_blocks
        self.fault = os.environ.get(FAULT_ENV, "")
        self._leases: dict[str, _Lease] = {}
        self._lock = threading.Lock()
        self._ended: list[str] = []  # released or expired, not yet reported
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        if port:
            self._socket.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self._socket.bind_to_random_port(f"tcp://{host}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-source", daemon=True)
        self._thread.start()
        self.blocks_sent = 0
        self.refused = 0  # requests without the cluster secret
        logger.info("KV transfer source listening on tcp://%s:%d%s%s", host, self.port,
                    f" (shared memory {shm_path})" if shm_path else "",
                    "; peers must sign with the cluster secret" if secret else "")

    # --- worker thread ----------------------------------------------------------------
    def hold(self, lease_id: str, block_ids: list[int], block_hashes: list[int], timeout: float) -> None:
        """Serve these blocks under `lease_id` until released or `timeout` seconds pass."""
        with self._lock:
            self._leases[lease_id] = _Lease(list(block_ids), list(block_hashes), time.monotonic() + timeout)

    def release(self, lease_id: str) -> None:
        with self._lock:
            if self._leases.pop(lease_id, None) is not None:
                self._ended.append(lease_id)

    def finished(self) -> list[str]:
        """Leases that ended (released or expired) since the last call: their blocks may go."""
        with self._lock:
            self._expire(time.monotonic())
            ended, self._ended = self._ended, []
        return ended

    def _expire(self, now: float) -> None:
        """Under the lock: end every lease past its deadline."""
        for lease_id in [i for i, lease in self._leases.items() if lease.deadline < now]:
            del self._leases[lease_id]
            self._ended.append(lease_id)
            logger.warning("KV lease %s expired unread; its blocks are freed", lease_id)

    @property
    def num_held(self) -> int:
        with self._lock:
            return len(self._leases)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._socket.close(0)
        self._context.term()

    # --- server thread ----------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            identity, *frames = self._socket.recv_multipart()
            try:
                reply = self._handle(frames)
            except Exception as exc:  # a bad request must not kill the server thread
                logger.exception("KV transfer request failed")
                reply = [b"ERR", json.dumps({"message": f"{type(exc).__name__}: {exc}"}).encode()]
            self._socket.send_multipart([identity, *reply], copy=False)

    @staticmethod
    def _error(message: str) -> list[bytes | memoryview]:
        return [b"ERR", json.dumps({"message": message}).encode()]

    def _handle(self, frames: list[bytes]) -> list[bytes | memoryview]:
        if len(frames) < 2:
            return self._error("malformed request")
        refused = refusal(self._secret, frames)
        if refused is not None:
            self.refused += 1
            return self._error(refused)
        kind, body = frames[0], json.loads(frames[1])
        lease_id = str(body.get("transfer_id", ""))
        if kind == b"RELEASE":
            self.release(lease_id)
            return [b"OK", b"{}"]
        if kind not in (b"FETCH", b"CHECK"):
            return self._error(f"unknown request {kind[:20]!r}")
        indices = [int(i) for i in body.get("indices", [])]
        with self._lock:  # expiry waits for this read, so no block is recycled under it
            self._expire(time.monotonic())
            lease = self._leases.get(lease_id)
            if lease is None:
                return self._error(f"unknown or expired lease {lease_id}")
            if kind == b"CHECK":
                return [b"OK", b"{}"]
            if any(not 0 <= i < len(lease.block_ids) for i in indices):
                return self._error("block index out of range")
            data = self.read_blocks([lease.block_ids[i] for i in indices]).contiguous()
            hashes = [lease.block_hashes[i] for i in indices]
        payload = data.numpy().tobytes()
        header = {
            "transfer_id": lease_id, "indices": indices, "block_hashes": hashes,
            "layout": self.layout.__dict__, "shape": list(data.shape), "nbytes": len(payload),
            "checksum": xxhash.xxh64_hexdigest(payload),
        }
        if self.fault == "corrupt" and payload:
            payload = bytes([payload[0] ^ 0xFF]) + payload[1:]
        self.blocks_sent += len(indices)
        return [b"OK", json.dumps(header).encode(), payload]
