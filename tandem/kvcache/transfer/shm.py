"""Fetching blocks from a prefill worker on the same host through its shared KV cache file.

The source's KV cache lives in a file under /dev/shm. The reader asks the source (a signed
FETCH with `shm: true`) where the lease's blocks lie: the source answers with its file and
the block ids, from its own record of the lease, so nothing a request carried ever names a
file or a block. Mapping the file read-only and copying the blocks costs one memory copy,
no socket and no serialisation. The copy is then confirmed against the lease (a CHECK): the
source frees leased blocks only after the lease ended, so if it still lives after the copy,
the copy is the leased data; if it ended (expired), the blocks may have been reused and the
copy is thrown away. A source with no file (started without --kv-transfer-shm) answers with
the bytes instead, as TCP would; a file that is not on this host (the source is elsewhere)
makes this reader use TCP with that source from then on. A file whose rows are of another
cache dtype (an int8 prefill worker, an fp32 decode worker) is not copied: those blocks come
over the port, which rounds them into this reader's rows.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

import numpy as np
import torch

from tandem.kvcache.codec import RAW, KVCodec
from tandem.kvcache.transfer import tcp
from tandem.kvcache.transfer.base import KVLayout, KVTransferError, KVTransferHandle
from tandem.kvcache.transfer.wire import FETCH, FrameKey


class ShmTransport:
    name = "shm"

    def __init__(self, key: FrameKey, layout: KVLayout, codec: KVCodec = RAW) -> None:
        self.key = key
        self.layout = layout
        self.codec = codec  # for blocks that come over the port instead (a copy here stays raw)
        self.tcp = tcp.TcpTransport(key, layout, codec)
        self._maps: dict[tuple[str, int], np.ndarray] = {}
        self._remote: set[tuple[str, int]] = set()  # sources whose file is not on this host
        self.itemsize = torch.empty((), dtype=layout.torch_dtype).element_size()
        self.last_transport = ""  # of the last fetch: shm, or tcp when the bytes came over the port
        self.last_nbytes = 0  # and the bytes it copied or received

    def fetch(self, handle: KVTransferHandle, indices: list[int], timeout: float) -> torch.Tensor:
        """The blocks, copied from the source's file when it is on this host, else over TCP."""
        self.last_transport = "tcp"
        if handle.address in self._remote:
            return self._over_tcp(handle, indices, timeout)
        receiver = tcp.BlockReceiver(self.layout, len(indices), self.codec)
        fields: dict[str, Any] = {"transfer_id": handle.transfer_id, "indices": indices, "shm": True}
        if self.codec != RAW:
            fields["codec"] = self.codec.name
        reply = tcp.request(handle, self.key, FETCH, fields, timeout, receiver)
        if "shm_path" not in reply.header:  # no file at the source: it sent the bytes
            blocks = receiver.blocks(handle, reply, indices)
            self.last_nbytes = receiver.nbytes
            return blocks
        writer = tcp.expect_blocks(handle, reply.header, indices, self.layout)
        if writer != self.layout:  # its rows are of another cache dtype: a copy would not be ours
            return self._over_tcp(handle, indices, timeout)  # the port converts them
        source = self._mapping(reply.header)
        if source is None:
            self._remote.add(handle.address)
            return self._over_tcp(handle, indices, timeout)
        block_ids = reply.header.get("block_ids")
        if (not isinstance(block_ids, list) or len(block_ids) != len(indices)
                or not all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b < source.shape[3]
                           for b in block_ids)):
            raise KVTransferError("the source named blocks outside its cache file")
        raw = torch.from_numpy(np.ascontiguousarray(source[:, :, :, block_ids]))
        data = raw.view(self.layout.torch_dtype)
        tcp.check(handle, self.key, timeout=min(5.0, timeout))
        self.last_transport = "shm"
        self.last_nbytes = data.numel() * self.itemsize
        return data

    def _over_tcp(self, handle: KVTransferHandle, indices: list[int], timeout: float) -> torch.Tensor:
        blocks = self.tcp.fetch(handle, indices, timeout)
        self.last_nbytes = self.tcp.last_nbytes
        return blocks

    def _mapping(self, header: dict[str, Any]) -> np.ndarray | None:
        """The source's cache file mapped read-only, as bytes per element row, or None when the
        file is not on this host."""
        path, num_blocks = header.get("shm_path"), header.get("shm_num_blocks")
        if (not isinstance(path, str) or not path.startswith("/dev/shm/") or ".." in path
                or isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0):
            raise KVTransferError("the source described its cache file badly")
        key = (path, num_blocks)
        array = self._maps.get(key)
        if array is not None:
            return array
        *outer, head_dim = self.layout.block_shape(num_blocks)
        shape = (*outer, head_dim * self.itemsize)  # raw bytes: numpy has no bfloat16
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None  # another host's file
        except OSError as exc:
            raise KVTransferError(f"cannot open the source's KV file {path}: {exc}") from exc
        try:
            size = os.fstat(fd).st_size
            if size != int(np.prod(shape)):
                raise KVTransferError(f"{path} holds {size} bytes, not a cache of shape {tuple(outer + [head_dim])}")
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        array = np.frombuffer(mapping, dtype=np.uint8).reshape(shape)
        self._maps[key] = array
        return array
