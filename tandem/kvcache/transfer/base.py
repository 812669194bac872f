"""The KV handoff from a prefill worker to a decode worker: the handle and the transport seam.

Design: **the decode worker pulls.** The prefill worker computes the prompt, keeps the
prompt's full KV blocks referenced under a lease (an id and an expiry), and returns a handle
(the source's KV port, the blocks' hashes, the lease id as `transfer_id`). The decode
worker fetches only the blocks it does not already hold (it checks each block hash against
its own prefix cache first), writes them into blocks of its own, then tells the prefill
worker to release. A fetch after the lease ended (released or expired) is refused, and a
shared-memory copy is confirmed against the lease after it was taken, so a decode worker
never adopts blocks that were freed and reused in the meantime.

Why pull rather than push: the decode side alone knows which blocks it already has and
when it has room for the rest, so nothing is pre-allocated on a guess; and every failure
ends the same safe way: the prefill worker frees its blocks when the decode worker
releases them *or* when the handle expires (a decode worker that died never strands
blocks), and a decode worker whose fetch fails, times out or fails its checksum computes
the prompt itself. Only full blocks travel; the partial last block (< block_size tokens)
and the first generated token are recomputed by the decode worker, a few tokens at most.

Transports (`KVTransport`), both over the source's KV port (wire.py: frames whose header is
signed with the cluster secret, both ways, and whose body size the header declares): `tcp`
(any two hosts: the blocks travel in the reply, with their hashes, layout, shape and an
xxh3-128 digest) and `shm` (same host: the source answers with where the lease's blocks lie
in its KV cache file under /dev/shm, and the decode worker copies them out directly, then
confirms the lease still lived). GPU transports (CUDA IPC, NCCL) would slot in as more.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

from tandem.config import KV_INT8_SCALE_BYTES

if TYPE_CHECKING:  # the scheduler side builds handles and layouts without torch
    import torch

# A KV cache's rows; uint8: int8 values and their scale; float8_e4m3fn: values over their layer's scales.
CACHE_DTYPES = ("float32", "bfloat16", "float16", "uint8", "float8_e4m3fn")
FP8_DTYPE = "float8_e4m3fn"
_SCALE_RANGE = (2.0**-64, 2.0**64)  # what an fp8 layer's scale may be (kv_scales.py makes powers of two near 1)


class KVTransferError(RuntimeError):
    """A fetch failed: unreachable source, unknown or expired transfer, checksum mismatch."""


@dataclass(frozen=True)
class KVLayout:
    """The cache geometry both sides must share for blocks to be meaningful."""

    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: str  # torch dtype name, e.g. "float32"
    num_planes: int = 2  # keys and values; 1 for a latent cache (MLA), see config.KVCacheSpec
    key_divisors: str = ""  # the digest of the divisors the cached keys hold k/s by ("": none; models/key_divisors.py)
    # An fp8 cache's per-layer scales, (key, value) per layer ((latent,) under MLA): a stored
    # value times its layer's and plane's scale is the value it stands for. Empty for the
    # other dtypes. Two fp8 workers may differ here (each measures its own); a reader
    # converts (kvcache/codec.py).
    kv_scales: tuple[float, ...] = ()

    def block_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of `num_blocks` blocks as the cache indexes them (blocks on dimension 3); an
        int8 cache's rows (dtype uint8) end in their scale's bytes."""
        width = self.head_dim + KV_INT8_SCALE_BYTES if self.dtype == "uint8" else self.head_dim
        return (self.num_layers, self.num_planes, self.num_kv_heads, num_blocks, self.block_size, width)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    def scales(self) -> torch.Tensor | None:
        """kv_scales as an fp32 tensor [layers, planes], or None for a cache without scales."""
        if not self.kv_scales:
            return None
        import torch

        return torch.tensor(self.kv_scales, dtype=torch.float32).view(self.num_layers, self.num_planes)

    def writer(self, sent: Any) -> KVLayout | None:
        """The layout a source or a chunk declares (untrusted), when its blocks can become
        this cache's: the same geometry, rows of any cache dtype (a codec converts fp32,
        bf16, fp16 and int8 rows into this cache's dtype); None otherwise."""
        return writer_layout(self.__dict__, sent)


def writer_layout(expected: dict[str, Any], sent: Any) -> KVLayout | None:
    """`sent` as a KVLayout when it has `expected`'s fields and values but for the dtype, which
    may be any cache dtype, and an fp8 writer's scales, one finite positive number per layer
    and plane (none for another dtype); None otherwise (a chunk header written before a field
    existed lacks it in both)."""
    if not isinstance(sent, dict) or set(sent) != set(expected) or sent.get("dtype") not in CACHE_DTYPES:
        return None
    if any(sent[name] != value for name, value in expected.items() if name not in ("dtype", "kv_scales")):
        return None
    scales = sent.get("kv_scales", ())  # (absent in both: a layout written before it existed)
    if not isinstance(scales, (list, tuple)):
        return None
    wanted = sent["num_layers"] * sent["num_planes"] if sent["dtype"] == FP8_DTYPE else 0
    if len(scales) != wanted or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
            and _SCALE_RANGE[0] <= x <= _SCALE_RANGE[1] for x in scales):
        return None
    return KVLayout(**{**sent, "kv_scales": tuple(float(x) for x in scales)})


_MAX_TRANSFER_ID = 128
_MAX_HANDLE_BLOCKS = 1 << 20


@dataclass
class KVTransferHandle:
    """What a prefill worker returns and a decode worker needs to fetch the prompt's KV.

    It names a lease and the source that holds it, never where the blocks live: the source
    maps the lease to its own block ids and shared-memory file when asked (source.py), so a
    handle, which travels through the router, cannot point a reader at anything else.
    """

    transfer_id: str  # the lease id
    host: str  # the source's KV port
    port: int
    block_hashes: list[int]  # of the prompt's full blocks, in order
    expires_in: float = 0.0

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KVTransferHandle:
        """A handle from JSON, every field type- and range-checked (KVTransferError if not)."""
        def bad(why: str) -> KVTransferError:
            return KVTransferError(f"malformed KV transfer handle: {why}")

        if not isinstance(data, dict):
            raise bad("not an object")
        transfer_id, host, port = data.get("transfer_id"), data.get("host"), data.get("port")
        hashes, expires = data.get("block_hashes"), data.get("expires_in", 0.0)
        if not isinstance(transfer_id, str) or not 0 < len(transfer_id) <= _MAX_TRANSFER_ID:
            raise bad("transfer_id must be a string of 1 to 128 characters")
        if not isinstance(host, str) or not 0 < len(host) <= 255:
            raise bad("host must be a host name or address")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise bad("port must be in [1, 65535]")
        if (not isinstance(hashes, list) or len(hashes) > _MAX_HANDLE_BLOCKS
                or not all(isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 1 << 64 for h in hashes)):
            raise bad("block_hashes must be a list of 64-bit block hashes")
        if isinstance(expires, bool) or not isinstance(expires, (int, float)) or not 0 <= expires < 1e9:
            raise bad("expires_in must be a number of seconds")
        return cls(transfer_id, host, port, list(hashes), float(expires))


class KVTransport(Protocol):
    """Moves block data from a source to this process; one instance per decode worker."""

    name: str

    def fetch(self, handle: KVTransferHandle, indices: list[int], timeout: float) -> torch.Tensor:
        """The blocks at `indices` of the handle, shaped `layout.block_shape(len(indices))`."""
        ...
