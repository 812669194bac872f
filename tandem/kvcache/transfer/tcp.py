"""Fetching blocks over TCP (ZMQ DEALER → the source's ROUTER): works between any two hosts."""

from __future__ import annotations

import json

import numpy as np
import torch
import xxhash
import zmq

from tandem.kvcache.transfer.auth import sign
from tandem.kvcache.transfer.base import KVTransferError, KVTransferHandle


def _request(handle: KVTransferHandle, frames: list[bytes], timeout: float,
             secret: str | None = None) -> list[bytes]:
    frames = sign(secret, frames)
    context = zmq.Context.instance()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(f"tcp://{handle.host}:{handle.port}")
        socket.send_multipart(frames)
        if not socket.poll(int(timeout * 1000)):
            raise KVTransferError(f"no answer from tcp://{handle.host}:{handle.port} in {timeout:.0f} s")
        reply = socket.recv_multipart()
    finally:
        socket.close(0)
    if not reply or reply[0] != b"OK":
        message = json.loads(reply[1]).get("message", "?") if len(reply) > 1 else "empty reply"
        raise KVTransferError(f"KV source refused: {message}")
    return reply


def release(handle: KVTransferHandle, timeout: float = 5.0, secret: str | None = None) -> None:
    """Tell the source it may free the blocks (every transport releases this way)."""
    _request(handle, [b"RELEASE", json.dumps({"transfer_id": handle.transfer_id}).encode()], timeout,
             secret)


def check(handle: KVTransferHandle, timeout: float = 5.0, secret: str | None = None) -> None:
    """Raise KVTransferError unless the handle's lease still lives at the source."""
    _request(handle, [b"CHECK", json.dumps({"transfer_id": handle.transfer_id}).encode()], timeout,
             secret)


class TcpTransport:
    name = "tcp"

    def __init__(self, secret: str | None = None) -> None:
        self.secret = secret  # the cluster secret the sources want (auth.py)

    def fetch(self, handle: KVTransferHandle, indices: list[int], timeout: float) -> torch.Tensor:
        body = json.dumps({"transfer_id": handle.transfer_id, "indices": indices}).encode()
        reply = _request(handle, [b"FETCH", body], timeout, self.secret)
        if len(reply) != 3:
            raise KVTransferError("malformed FETCH reply")
        header, payload = json.loads(reply[1]), reply[2]
        if xxhash.xxh64_hexdigest(payload) != header.get("checksum"):
            raise KVTransferError(f"checksum mismatch on transfer {handle.transfer_id}")
        layout = handle.layout
        expected = list(layout.block_shape(len(indices)))
        if header.get("shape") != expected or header.get("layout") != layout.__dict__:
            raise KVTransferError(f"layout mismatch: got {header.get('shape')}, expected {expected}")
        if header.get("block_hashes") != [handle.block_hashes[i] for i in indices]:
            raise KVTransferError("the source sent blocks for other hashes")
        dtype = torch.empty((), dtype=layout.torch_dtype).numpy().dtype
        array = np.frombuffer(payload, dtype=dtype).reshape(expected)
        return torch.from_numpy(array.copy())
