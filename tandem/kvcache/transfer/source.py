"""The prefill side: prompt blocks kept under a transfer id, served to decode workers.

A thread answers fetches on a ZMQ ROUTER socket, so the engine loop never waits on the
network. The engine thread owns the block pool; the server thread only reads pinned block
data (under a lock shared with expiry, so a block is never recycled mid-read) and queues
release requests for the engine thread to apply.

Wire format (multipart ZMQ messages, one request → one reply):
    FETCH   [b"FETCH", json {transfer_id, indices}]
        →   [b"OK", json {transfer_id, indices, block_hashes, layout, shape, nbytes, checksum}, payload]
    RELEASE [b"RELEASE", json {transfer_id}]  →  [b"OK", b"{}"]
    errors  →   [b"ERR", json {message}]
`checksum` is xxh64 of the payload, checked by the receiver.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import xxhash
import zmq

from tandem.kvcache.transfer.base import KVLayout, KVTransferHandle

logger = logging.getLogger(__name__)

FAULT_ENV = "TANDEM_KV_FAULT"  # "corrupt": flip payload bytes after checksumming (tests only)


@dataclass
class _Held:
    block_ids: list[int]
    block_hashes: list[int]
    deadline: float
    blocks: list[Any]  # the engine's KVBlock objects, handed back on release


class KVSource:
    def __init__(self, read_blocks: Callable[[list[int]], torch.Tensor], layout: KVLayout,
                 host: str = "127.0.0.1", port: int = 0, timeout: float = 60.0,
                 shm_path: str | None = None, shm_num_blocks: int = 0) -> None:
        self.read_blocks = read_blocks
        self.layout = layout
        self.host = host
        self.timeout = timeout
        self.shm_path = shm_path
        self.shm_num_blocks = shm_num_blocks
        self.fault = os.environ.get(FAULT_ENV, "")
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()
        self._released: list[str] = []
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
        logger.info("KV transfer source listening on tcp://%s:%d%s", host, self.port,
                    f" (shared memory {shm_path})" if shm_path else "")

    # --- engine thread ----------------------------------------------------------------
    def hold(self, transfer_id: str, blocks: list[Any], block_hashes: list[int]) -> KVTransferHandle:
        """Keep `blocks` (the engine holds one reference on each) until released or expired."""
        held = _Held([b.block_id for b in blocks], list(block_hashes), time.monotonic() + self.timeout, blocks)
        with self._lock:
            self._held[transfer_id] = held
        return KVTransferHandle(transfer_id, self.host, self.port, list(block_hashes), self.layout,
                                self.shm_path, self.shm_num_blocks, self.timeout,
                                extra={"block_ids": held.block_ids} if self.shm_path else {})

    def collect_released(self) -> list[list[Any]]:
        """Blocks whose transfer was released or expired; the engine frees them."""
        now = time.monotonic()
        freed = []
        with self._lock:
            released, self._released = self._released, []
            for transfer_id in released:
                held = self._held.pop(transfer_id, None)
                if held is not None:
                    freed.append(held.blocks)
            for transfer_id in [t for t, h in self._held.items() if h.deadline < now]:
                logger.warning("KV transfer %s expired unread after %.0f s; freeing its blocks",
                               transfer_id, self.timeout)
                freed.append(self._held.pop(transfer_id).blocks)
        return freed

    def release(self, transfer_id: str) -> None:
        with self._lock:
            self._released.append(transfer_id)

    @property
    def num_held(self) -> int:
        with self._lock:
            return len(self._held)

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

    def _handle(self, frames: list[bytes]) -> list[bytes | memoryview]:
        if len(frames) < 2:
            return [b"ERR", b'{"message": "malformed request"}']
        kind, body = frames[0], json.loads(frames[1])
        transfer_id = str(body.get("transfer_id", ""))
        if kind == b"RELEASE":
            self.release(transfer_id)
            return [b"OK", b"{}"]
        if kind != b"FETCH":
            return [b"ERR", json.dumps({"message": f"unknown request {kind[:20]!r}"}).encode()]
        indices = [int(i) for i in body.get("indices", [])]
        with self._lock:  # expiry waits for this read, so no block is recycled under it
            held = self._held.get(transfer_id)
            if held is None:
                return [b"ERR", json.dumps({"message": f"unknown or expired transfer {transfer_id}"}).encode()]
            if any(not 0 <= i < len(held.block_ids) for i in indices):
                return [b"ERR", b'{"message": "block index out of range"}']
            data = self.read_blocks([held.block_ids[i] for i in indices]).contiguous()
            hashes = [held.block_hashes[i] for i in indices]
        payload = data.numpy().tobytes()
        header = {
            "transfer_id": transfer_id, "indices": indices, "block_hashes": hashes,
            "layout": self.layout.__dict__, "shape": list(data.shape), "nbytes": len(payload),
            "checksum": xxhash.xxh64_hexdigest(payload),
        }
        if self.fault == "corrupt" and payload:
            payload = bytes([payload[0] ^ 0xFF]) + payload[1:]
        self.blocks_sent += len(indices)
        return [b"OK", json.dumps(header).encode(), payload]
