"""Fetching blocks from a prefill worker on the same host through its shared KV cache file.

The source's KV cache lives in a file under /dev/shm; the handle names the file and the
source-side block ids. Mapping it read-only and copying the blocks costs one memory copy,
no socket and no serialisation. The copy is then confirmed against the lease (a CHECK over
TCP): the source frees leased blocks only after the lease ended, so if it still lives after
the copy, the copy is the leased data; if it ended (expired), the blocks may have been reused
and the copy is thrown away.
"""

from __future__ import annotations

import mmap
import os

import numpy as np
import torch

from tandem.kvcache.transfer import tcp
from tandem.kvcache.transfer.base import KVTransferError, KVTransferHandle


class ShmTransport:
    name = "shm"

    def __init__(self, secret: str | None = None) -> None:
        self._maps: dict[str, np.ndarray] = {}
        self.secret = secret  # for the lease check over the source's port (auth.py)

    def available(self, handle: KVTransferHandle) -> bool:
        return bool(handle.shm_path) and os.path.exists(handle.shm_path) and "block_ids" in handle.extra

    def _mapping(self, handle: KVTransferHandle) -> np.ndarray:
        path = handle.shm_path or ""
        array = self._maps.get(path)
        if array is None:
            layout = handle.layout
            dtype = torch.empty((), dtype=layout.torch_dtype).numpy().dtype
            shape = layout.block_shape(handle.shm_num_blocks)
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise KVTransferError(f"cannot open the source's KV file {path}: {exc}") from exc
            try:
                size = os.fstat(fd).st_size
                if size != int(np.prod(shape)) * dtype.itemsize:
                    raise KVTransferError(f"{path} holds {size} bytes, not a cache of shape {shape}")
                mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
            finally:
                os.close(fd)
            array = np.frombuffer(mapping, dtype=dtype).reshape(shape)
            self._maps[path] = array
        return array

    def fetch(self, handle: KVTransferHandle, indices: list[int], timeout: float) -> torch.Tensor:
        block_ids = handle.extra.get("block_ids", [])
        if any(not 0 <= i < len(block_ids) for i in indices):
            raise KVTransferError("block index out of range")
        source = self._mapping(handle)
        data = torch.from_numpy(np.ascontiguousarray(source[:, :, :, [block_ids[i] for i in indices]]))
        tcp.check(handle, timeout=min(5.0, timeout), secret=self.secret)
        return data
