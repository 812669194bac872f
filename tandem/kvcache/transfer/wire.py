"""The KV port's framing: a small signed header first, then a body whose size it declares.

Every message, either way, is one frame:

    preamble (20 bytes): magic b"TKV1" | kind (u8) | 3 zero bytes | header length (u32) |
                         body length (u64)
    MAC (32 bytes):      HMAC-SHA256 of preamble ‖ header, under the cluster secret's KV key
    header:              JSON object, at most MAX_HEADER_BYTES
    body:                raw bytes (block data), body length of them

A reader takes the preamble, refuses an impossible header length at once, reads the header
(64 KiB at most), checks the MAC in constant time and only then looks at the body: an
unauthenticated peer costs a reader at most one header's worth of memory, never a body it
declares. The body's size must also be what the reader expects (none for a request; exactly
the blocks asked for in a reply), so even a peer cannot make it allocate more. Requests are
stamped (`ts`, `nonce`: tandem/trust/replay.py, so a captured request does not verify again);
a reply names the nonce it answers (`re`), so a recorded reply cannot answer a new request.
The body is bound to its header by an xxh3-128 digest the header carries; that catches
corruption, and the MAC over the header keeps anyone without the secret from sending blocks
at all (an attacker able to rewrite traffic in flight on the cluster network is out of scope:
keep the KV ports on a private network).

Torch-free: bodies are memoryviews the caller provides, so block data lands where it belongs
without a copy.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import xxhash

from tandem.trust.keys import KV_PORT, derive_key

MAGIC = b"TKV1"
_PREAMBLE = struct.Struct("<4sB3xIQ")
_MAC_BYTES = 32
MAX_HEADER_BYTES = 64 << 10

# Frame kinds: requests, then replies.
FETCH = 1  # the blocks at some indices of a lease (or, with "shm": where to copy them from)
CHECK = 2  # does the lease still live? (after a shared-memory copy)
RELEASE = 3  # the reader is done: the lease may end
OK = 0x80
ERR = 0x81
REQUESTS = (FETCH, CHECK, RELEASE)


class FrameError(Exception):
    """A frame that must not be acted on; the connection is closed after it."""


class FrameAuthError(FrameError):
    """A frame whose MAC does not verify: its sender does not know the cluster secret."""


class FrameKey:
    """The KV port's key, derived from the cluster secret (one per process)."""

    def __init__(self, secret: str) -> None:
        self._key = derive_key(secret, KV_PORT)

    def mac(self, preamble: bytes, header: bytes) -> bytes:
        return hmac.new(self._key, preamble + header, hashlib.sha256).digest()


@dataclass
class Frame:
    kind: int
    header: dict[str, Any]
    body: memoryview | None = None


def send_frame(sock: socket.socket, key: FrameKey, kind: int, header: dict[str, Any],
               body: memoryview | None = None) -> None:
    head = json.dumps(header, separators=(",", ":")).encode()
    if len(head) > MAX_HEADER_BYTES:
        raise FrameError(f"header of {len(head)} bytes is over the {MAX_HEADER_BYTES}-byte limit")
    body_len = body.nbytes if body is not None else 0
    preamble = _PREAMBLE.pack(MAGIC, kind, len(head), body_len)
    sock.sendall(preamble + key.mac(preamble, head) + head)
    if body_len:
        sock.sendall(body.cast("B") if body.format != "B" or body.ndim != 1 else body)  # type: ignore[union-attr]


BodyPlace = Callable[[int, dict[str, Any], int], memoryview]
"""(kind, header, body length) -> a writable memoryview of exactly that many bytes to read the
body into; raises FrameError when the body is not one the reader expects."""


def no_body(kind: int, header: dict[str, Any], length: int) -> memoryview:
    raise FrameError(f"a {length}-byte body where none is expected")


def recv_frame(sock: socket.socket, key: FrameKey, place: BodyPlace = no_body) -> Frame:
    """One frame, its MAC checked before its body is read (module docstring)."""
    raw = recv_exact(sock, _PREAMBLE.size + _MAC_BYTES, eof_ok=True)
    if raw is None:
        raise EOFError("the peer closed the connection")
    preamble, mac = raw[:_PREAMBLE.size], raw[_PREAMBLE.size:]
    magic, kind, head_len, body_len = _PREAMBLE.unpack(preamble)
    if magic != MAGIC:
        raise FrameError("not a tandem KV frame")
    if head_len > MAX_HEADER_BYTES:
        raise FrameError(f"a header of {head_len} bytes is over the {MAX_HEADER_BYTES}-byte limit")
    head = recv_exact(sock, head_len)
    assert head is not None
    if not hmac.compare_digest(key.mac(preamble, head), mac):
        raise FrameAuthError("wrong cluster secret")
    try:
        header = json.loads(head)
    except ValueError as exc:
        raise FrameError(f"malformed header: {exc}") from None
    if not isinstance(header, dict):
        raise FrameError("the header is not a JSON object")
    body = None
    if body_len:
        body = place(kind, header, body_len)
        if body.nbytes != body_len:
            raise FrameError(f"a body of {body_len} bytes where {body.nbytes} are expected")
        recv_into_exact(sock, body)
    elif kind == OK and header.get("nbytes"):
        raise FrameError("a reply without the body its header announces")
    return Frame(kind, header, body)


def recv_exact(sock: socket.socket, count: int, eof_ok: bool = False) -> bytes | None:
    buffer = bytearray(count)
    view = memoryview(buffer)
    got = 0
    while got < count:
        n = sock.recv_into(view[got:])
        if n == 0:
            if eof_ok and got == 0:
                return None
            raise FrameError("the connection closed in the middle of a frame")
        got += n
    return bytes(buffer)


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise FrameError("the connection closed in the middle of a body")
        got += n


def digest(body: memoryview | bytes) -> str:
    """What a reply's header says of its body (xxh3-128, hex)."""
    return xxhash.xxh3_128_hexdigest(body)
