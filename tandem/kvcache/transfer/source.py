"""The prefill side: prompt blocks held under a lease, served to decode workers.

Threads answer the KV port (a plain TCP listener speaking wire.py's signed frames), so the
engine loop never waits on the network. The scheduler owns the blocks: it keeps them
referenced while their lease lives and frees them only after this source reported the lease
finished (released or expired). Reads and expiry share one lock, so a lease never ends in the
middle of a read, and nothing is read after a lease ended: the blocks may belong to another
request by then.

Requests (each frame signed with the cluster secret, stamped, and addressed to this source as
`to: host:port`, so that one sent elsewhere cannot be relayed here; one reply each):
    FETCH   {transfer_id, indices[, codec]}   → OK {indices, block_hashes, layout, shape, codec,
                                                     nbytes, digest} + the blocks' bytes, as
                                                     the codec asked for writes them
                                                     (kvcache/codec.py; raw if none)
    FETCH   {transfer_id, indices, shm: true} → where this worker's KV cache file holds them
            (only if it has one):               OK {shm_path, shm_num_blocks, block_ids,
                                                     block_hashes, layout}, no body
    CHECK   {transfer_id}                     → OK {} while the lease lives
    RELEASE {transfer_id}                     → OK {}
    errors                                    → ERR {message}
The lease id is all a reader names: which blocks, and which file, are this source's own
record of the lease. A frame whose MAC does not verify is answered with ERR and the
connection closed before anything else is read; at most `MAX_CONNECTIONS` connections are
served at once, each idle at most `IDLE_S` seconds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from tandem.kvcache.codec import CODECS, RAW, KVCodec
from tandem.kvcache.transfer.base import KVLayout
from tandem.kvcache.transfer.wire import (
    CHECK,
    ERR,
    FETCH,
    OK,
    RELEASE,
    FrameAuthError,
    FrameError,
    FrameKey,
    digest,
    recv_frame,
    send_frame,
)
from tandem.trust.replay import ReplayGuard

logger = logging.getLogger(__name__)

FAULT_ENV = "TANDEM_KV_FAULT"  # "corrupt": flip payload bytes after digesting (tests only)
MAX_CONNECTIONS = 64
IDLE_S = 30.0
_MAX_INDICES = 1 << 20


@dataclass
class _Lease:
    block_ids: list[int]
    block_hashes: list[int]
    deadline: float


class KVSource:
    def __init__(self, read_blocks: Callable[[list[int]], torch.Tensor], layout: KVLayout, secret: str,
                 host: str = "127.0.0.1", port: int = 0, shm_path: str | None = None,
                 shm_num_blocks: int = 0) -> None:
        if not secret:
            raise ValueError("a KV source needs the cluster secret: it serves other requests' KV")
        self.read_blocks = read_blocks
        self.layout = layout
        self.host = host
        self.shm_path = shm_path
        self.shm_num_blocks = shm_num_blocks
        self.fault = os.environ.get(FAULT_ENV, "")
        self._key = FrameKey(secret)
        self._guard = ReplayGuard()
        self._leases: dict[str, _Lease] = {}
        self._lock = threading.Lock()
        self._ended: list[str] = []  # released or expired, not yet reported
        self._listener = socket.create_server((host, port), reuse_port=False)
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self.address = f"{host}:{self.port}"  # what a request must be addressed to (tcp.request's "to")
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="kv-source", daemon=True)
        self._thread.start()
        self.blocks_sent = 0
        self.bytes_sent = 0  # payload bytes served over tcp (after the codec)
        self.refused = 0  # frames without the cluster secret's MAC
        logger.info("KV transfer source listening on tcp://%s:%d%s; peers must sign with the cluster secret",
                    host, self.port, f" (shared memory {shm_path})" if shm_path else "")

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
        self._listener.close()

    # --- server threads -----------------------------------------------------------------
    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                connection.close()  # at the limit: the peer retries or computes the prompt itself
                continue
            threading.Thread(target=self._serve, args=(connection,), name="kv-source-conn", daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        try:
            connection.settimeout(IDLE_S)
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while not self._stop.is_set():
                try:
                    frame = recv_frame(connection, self._key)
                except (EOFError, TimeoutError, OSError):
                    return
                except FrameAuthError:
                    self.refused += 1
                    self._reply_error(connection, None, "wrong cluster secret")
                    return
                except FrameError as exc:
                    self._reply_error(connection, None, str(exc))
                    return
                nonce = frame.header.get("nonce")
                if frame.header.get("to") != self.address:
                    self._reply_error(connection, nonce, f"addressed to {frame.header.get('to')!r}, not this "
                                                         f"source ({self.address})")
                    return
                stale = self._guard.check(frame.header.get("ts"), nonce)
                if stale is not None:
                    self._reply_error(connection, nonce, stale)
                    return
                try:
                    kind, header, body = self._handle(frame.kind, frame.header)
                except Exception as exc:  # a bad request must not kill the thread
                    logger.exception("KV transfer request failed")
                    kind, header, body = ERR, {"message": f"{type(exc).__name__}: {exc}"}, None
                send_frame(connection, self._key, kind, {**header, "re": nonce}, body)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                connection.close()
            self._slots.release()

    def _reply_error(self, connection: socket.socket, nonce: object, message: str) -> None:
        with contextlib.suppress(OSError):
            send_frame(connection, self._key, ERR, {"message": message, "re": nonce if isinstance(nonce, str) else None})

    def _handle(self, kind: int, body: dict[str, Any]) -> tuple[int, dict[str, Any], memoryview | None]:
        lease_id = body.get("transfer_id")
        if not isinstance(lease_id, str):
            return ERR, {"message": "transfer_id must be a string"}, None
        if kind == RELEASE:
            self.release(lease_id)
            return OK, {}, None
        if kind not in (FETCH, CHECK):
            return ERR, {"message": f"unknown request kind {kind}"}, None
        indices = body.get("indices", [])
        if (not isinstance(indices, list) or len(indices) > _MAX_INDICES
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in indices)):
            return ERR, {"message": "indices must be a list of block indices"}, None
        codec_name = body.get("codec", RAW.name)
        if codec_name not in CODECS:
            return ERR, {"message": f"codec must be one of {', '.join(CODECS)}"}, None
        with self._lock:  # expiry waits for this read, so no block is recycled under it
            self._expire(time.monotonic())
            lease = self._leases.get(lease_id)
            if lease is None:
                return ERR, {"message": f"unknown or expired lease {lease_id}"}, None
            if kind == CHECK:
                return OK, {}, None
            if any(not 0 <= i < len(lease.block_ids) for i in indices):
                return ERR, {"message": "block index out of range"}, None
            block_ids = [lease.block_ids[i] for i in indices]
            hashes = [lease.block_hashes[i] for i in indices]
            if body.get("shm") is True and self.shm_path:
                return OK, {"shm_path": self.shm_path, "shm_num_blocks": self.shm_num_blocks,
                            "block_ids": block_ids, "block_hashes": hashes, "layout": asdict(self.layout)}, None
            data = self.read_blocks(block_ids).contiguous()
        encoded = KVCodec(codec_name).encode(data, self.layout.scales())
        payload = memoryview(encoded.numpy()).cast("B") if encoded.numel() else memoryview(b"")
        header = {"indices": indices, "block_hashes": hashes, "layout": asdict(self.layout),
                  "shape": list(data.shape), "codec": codec_name, "nbytes": payload.nbytes,
                  "digest": digest(payload)}
        if self.fault == "corrupt" and payload.nbytes:
            corrupted = bytearray(payload)
            corrupted[0] ^= 0xFF
            payload = memoryview(corrupted)
        self.blocks_sent += len(indices)
        self.bytes_sent += payload.nbytes
        return OK, header, payload
