"""The KV handoff from a prefill worker to a decode worker: the handle and the transport seam.

Design: **the decode worker pulls.** The prefill worker computes the prompt, keeps the
prompt's full KV blocks referenced under a lease (an id and an expiry), and returns a handle
(where to fetch, which blocks, their hashes, the lease id as `transfer_id`). The decode
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

Transports (`KVTransport`): `tcp` (any two hosts: framed ZMQ messages with a header —
transfer id, block hashes, layout, dtype, shape — and an xxh64 checksum per message) and
`shm` (same host: the decode worker maps the prefill worker's KV cache file in /dev/shm and
copies the blocks directly). GPU transports (CUDA IPC, NCCL) would slot in as more.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # the scheduler side builds handles and layouts without torch
    import torch


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

    def block_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of `num_blocks` blocks as the cache indexes them (blocks on dimension 3)."""
        return (self.num_layers, self.num_planes, self.num_kv_heads, num_blocks, self.block_size, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)


@dataclass
class KVTransferHandle:
    """What a prefill worker returns and a decode worker needs to fetch the prompt's KV."""

    transfer_id: str
    host: str
    port: int
    block_hashes: list[int]  # of the prompt's full blocks, in order
    layout: KVLayout
    shm_path: str | None = None  # set when the source's cache is a shared-memory file
    shm_num_blocks: int = 0  # blocks in that file (its shape)
    expires_in: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KVTransferHandle:
        try:
            values = dict(data)
            values["layout"] = KVLayout(**values["layout"])
            known = set(cls.__dataclass_fields__)
            return cls(**{k: v for k, v in values.items() if k in known})
        except (KeyError, TypeError, ValueError) as exc:
            raise KVTransferError(f"malformed KV transfer handle: {exc}") from exc


class KVTransport(Protocol):
    """Moves block data from a source to this process; one instance per decode worker."""

    name: str

    def fetch(self, handle: KVTransferHandle, indices: list[int], timeout: float) -> torch.Tensor:
        """The blocks at `indices` of the handle, shaped `layout.block_shape(len(indices))`."""
        ...
