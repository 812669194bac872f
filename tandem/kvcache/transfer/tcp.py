"""Requests to a source's KV port (wire.py frames over TCP): works between any two hosts.

Every request is signed and stamped; every reply must be signed by the same secret and name
the request's nonce, so a decode worker only ever adopts blocks from a peer that proved it
is one of its cluster's workers. A reply's body is read straight into the tensor it becomes,
after its size was checked against the blocks asked for.
"""

from __future__ import annotations

import secrets
import socket
import time
from typing import Any

import torch

from tandem.kvcache.codec import RAW, CodecError, KVCodec
from tandem.kvcache.transfer.base import KVLayout, KVTransferError, KVTransferHandle
from tandem.kvcache.transfer.wire import (
    CHECK,
    ERR,
    FETCH,
    OK,
    RELEASE,
    BodyPlace,
    Frame,
    FrameError,
    FrameKey,
    digest,
    no_body,
    recv_frame,
    send_frame,
)


def request(handle: KVTransferHandle, key: FrameKey, kind: int, fields: dict[str, Any], timeout: float,
            place: BodyPlace = no_body) -> Frame:
    """One request to the handle's source and its OK reply (KVTransferError otherwise)."""
    nonce = secrets.token_hex(16)
    where = f"tcp://{handle.host}:{handle.port}"
    try:
        with socket.create_connection(handle.address, timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # Addressed to this source: a request that reached another (an address a forged
            # handle named) cannot be relayed to the real one, which refuses it.
            send_frame(sock, key, kind, {**fields, "to": f"{handle.host}:{handle.port}", "ts": time.time(),
                                         "nonce": nonce})
            reply = recv_frame(sock, key, place)
    except TimeoutError:
        raise KVTransferError(f"no answer from {where} in {timeout:.0f} s") from None
    except FrameError as exc:
        raise KVTransferError(f"bad reply from {where}: {exc}") from None
    except (OSError, EOFError) as exc:
        raise KVTransferError(f"cannot reach the KV source at {where}: {exc}") from None
    if reply.header.get("re") != nonce:
        raise KVTransferError(f"{where} answered another request")
    if reply.kind == ERR:
        raise KVTransferError(f"KV source refused: {reply.header.get('message', '?')}")
    if reply.kind != OK:
        raise KVTransferError(f"{where} sent a reply of unknown kind {reply.kind}")
    return reply


def release(handle: KVTransferHandle, key: FrameKey, timeout: float = 5.0) -> None:
    """Tell the source it may free the blocks (every transport releases this way)."""
    request(handle, key, RELEASE, {"transfer_id": handle.transfer_id}, timeout)


def check(handle: KVTransferHandle, key: FrameKey, timeout: float = 5.0) -> None:
    """Raise KVTransferError unless the handle's lease still lives at the source."""
    request(handle, key, CHECK, {"transfer_id": handle.transfer_id}, timeout)


def expect_blocks(handle: KVTransferHandle, reply: dict[str, Any], indices: list[int], layout: KVLayout,
                  same_dtype: bool = False) -> KVLayout:
    """The layout the reply's blocks have, once it describes the blocks asked for in this
    reader's geometry (rows of any cache dtype, unless `same_dtype`); KVTransferError if not."""
    writer = layout.writer(reply.get("layout"))
    if writer is None or (same_dtype and writer != layout):
        raise KVTransferError(f"layout mismatch: the source has {reply.get('layout')}, this worker {layout.__dict__}")
    if reply.get("block_hashes") != [handle.block_hashes[i] for i in indices]:
        raise KVTransferError("the source sent blocks for other hashes")
    return writer


class BlockReceiver:
    """Where a FETCH reply's body goes: a buffer exactly the size of the blocks asked for, in
    the codec asked for (the reply must name the same one) and the cache dtype the source
    declares (its rows become this reader's dtype in `blocks`)."""

    def __init__(self, layout: KVLayout, count: int, codec: KVCodec = RAW) -> None:
        self.layout = layout
        self.codec = codec
        self.count = count
        self.writer = layout  # until the reply says otherwise
        self.shape = layout.block_shape(count)
        self.nbytes = 0
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def __call__(self, kind: int, header: dict[str, Any], length: int) -> memoryview:
        writer = self.layout.writer(header.get("layout")) if kind == OK else None
        if writer is not None:
            self.writer, self.shape = writer, writer.block_shape(self.count)
            self.nbytes = self.codec.payload_bytes(self.shape, writer.torch_dtype)
        if (writer is None or length != self.nbytes or header.get("shape") != list(self.shape)
                or header.get("codec", RAW.name) != self.codec.name):
            raise FrameError(f"a {length}-byte {header.get('codec', RAW.name)} body of shape {header.get('shape')} "
                             f"and layout {header.get('layout')}, expected {self.codec.name} blocks of "
                             f"{self.layout.__dict__} (rows of any cache dtype)")
        self.buffer = torch.empty(self.nbytes, dtype=torch.uint8)
        return memoryview(self.buffer.numpy())

    def blocks(self, handle: KVTransferHandle, reply: Frame, indices: list[int]) -> torch.Tensor:
        """The received blocks in this reader's cache dtype, once the reply's hashes, layout and
        digest check out."""
        writer = expect_blocks(handle, reply.header, indices, self.layout)
        if writer != self.writer:
            raise KVTransferError("the reply's layout is not the one its body was read for")
        if reply.body is None and self.codec.payload_bytes(writer.block_shape(self.count), writer.torch_dtype):
            raise KVTransferError("the source sent no blocks")
        if reply.body is not None and digest(reply.body) != reply.header.get("digest"):
            raise KVTransferError(f"checksum mismatch on transfer {handle.transfer_id}")
        try:
            return self.codec.decode(self.buffer, self.shape, self.layout.torch_dtype, writer.torch_dtype,
                                     self.layout.scales(), writer.scales())
        except CodecError as exc:  # e.g. a NaN scale under a matching digest: a failed pull
            raise KVTransferError(f"unusable blocks on transfer {handle.transfer_id}: {exc}") from None


class TcpTransport:
    name = "tcp"

    def __init__(self, key: FrameKey, layout: KVLayout, codec: KVCodec = RAW) -> None:
        self.key = key  # the cluster secret's KV key (wire.py)
        self.layout = layout  # this worker's cache geometry: what fetched blocks must have
        self.codec = codec  # how the blocks travel (kvcache/codec.py)
        self.bytes_received = 0
        self.last_nbytes = 0  # the last fetch's payload: what crossed the wire

    def fetch(self, handle: KVTransferHandle, indices: list[int], timeout: float) -> torch.Tensor:
        receiver = BlockReceiver(self.layout, len(indices), self.codec)
        fields: dict[str, Any] = {"transfer_id": handle.transfer_id, "indices": indices}
        if self.codec != RAW:
            fields["codec"] = self.codec.name
        reply = request(handle, self.key, FETCH, fields, timeout, receiver)
        blocks = receiver.blocks(handle, reply, indices)
        self.bytes_received += receiver.nbytes
        self.last_nbytes = receiver.nbytes
        return blocks
