"""Zero-copy tensors over an mmap'd .safetensors file, and reads of exactly the bytes used.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape,
data_offsets relative to the end of the header; plus an optional `__metadata__`), then the
raw little-endian bytes. `SafetensorsFile` maps the whole file once and hands out each tensor
as a torch view over the mapping: nothing is read until someone reads the view. A layer that
narrows or slices such a view gets another view, so the `copy_` into its parameter faults in
only the pages of the slice it keeps, which is how a tensor-parallel rank reads only its
shard of a checkpoint.

Only if the kernel's readahead lets it: a page fault that misses the page cache reads
read_ahead_kb around the page (128 KiB by default, 8 MiB on some virtual disks), reaching into
the neighbouring ranks' rows. `PrefetchReads` closes that gap: it asks the kernel
(POSIX_FADV_WILLNEED) for exactly the pages each copy will read, just before it reads them,
in large requests; a fault that then finds its page in the cache reads nothing more.

The mapping is private (MAP_PRIVATE) and writable, with no swap reserved (MAP_NORESERVE):
torch wants a writable buffer, a stray in-place write would copy the page and never reach the
file, and a file larger than RAM still maps. Read faults share the page cache's pages, so two
ranks on one machine read each page from disk once. Each view holds a reference to the
mapping (`torch.frombuffer` keeps its buffer alive), so the mapping lives as long as any view.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux's value; Python < 3.13 lacks it
_HEADER_LIMIT = 100 << 20  # the format's own bound on the JSON header

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _code, _name in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("F8_E4M3", "float8_e4m3fn"),
                     ("F8_E5M2", "float8_e5m2"), ("F8_E8M0", "float8_e8m0fnu")):
    if hasattr(torch, _name):  # newer torch only
        DTYPES[_code] = getattr(torch, _name)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the first byte in the file
    end: int  # one past the last byte

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class SafetensorsFile:
    """One .safetensors file, its header parsed and its bytes mapped (nothing read yet)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with self.path.open("rb", buffering=0) as handle:
            size = os.fstat(handle.fileno()).st_size
            if hasattr(os, "posix_fadvise"):  # read the header without readahead: left behind, its
                # marker page would start an async read of up to read_ahead_kb of tensors on first touch
                os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
            head = handle.read(8)
            if len(head) < 8:
                raise ValueError(f"{self.path}: not a safetensors file (shorter than its 8-byte header length)")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > min(_HEADER_LIMIT, size - 8):
                raise ValueError(f"{self.path}: header length {header_len} does not fit a {size}-byte file")
            raw = handle.read(header_len)
            if len(raw) != header_len:
                raise ValueError(f"{self.path}: header cut short ({len(raw)} of {header_len} bytes)")
            header = json.loads(raw)
        self.size = size
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.tensors = _parse_header(self.path, header, 8 + header_len, size)
        self._open()

    def _open(self) -> None:
        fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            if os.fstat(fd).st_size != self.size:
                raise ValueError(f"{self.path} changed size while it was being loaded")
            self._map = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE | _MAP_NORESERVE,
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd  # kept for posix_fadvise; the mapping needs no descriptor
        self._closer = weakref.finalize(self, os.close, fd)
        self.address = torch.frombuffer(self._map, dtype=torch.uint8, count=1).data_ptr()
        self._chunk = _readahead_limit(fd)

    def remap(self) -> SafetensorsFile:
        """The same file mapped again through its own open file, so with its own readahead
        state: threads reading different parts of one file do not disturb each other's."""
        twin = object.__new__(SafetensorsFile)
        twin.path, twin.size, twin.metadata, twin.tensors = self.path, self.size, self.metadata, self.tensors
        twin._open()
        return twin

    def names(self) -> list[str]:
        """Tensor names in file order (by offset): reading them in turn reads the file forward."""
        return list(self.tensors)

    def tensor(self, name: str) -> torch.Tensor:
        """A zero-copy view of `name` over the mapping (nothing is read until it is)."""
        info = self.tensors[name]
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        count = info.nbytes // info.dtype.itemsize
        flat = torch.frombuffer(self._map, dtype=info.dtype, count=count, offset=info.start)
        return flat.view(info.shape)

    def items(self, names: list[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, view) for `names` (default: all), in the order given."""
        for name in self.names() if names is None else names:
            yield name, self.tensor(name)

    def maps(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is a view of this file's mapping."""
        return tensor.device.type == "cpu" and self.address <= tensor.data_ptr() < self.address + self.size

    def prefetch(self, tensor: torch.Tensor) -> int:
        """Start reading exactly the pages `tensor` (a view of the mapping, any strides) will
        read, in large requests; returns the bytes asked for (cached pages are skipped)."""
        asked = 0
        for start, end in page_runs(tensor, self.address):
            asked += end - start
            self.read_ahead(start, end)
        return asked

    def read_ahead(self, start: int, end: int) -> None:
        """Ask the kernel to read file bytes [start, end) into the page cache and return at
        once (POSIX_FADV_WILLNEED, one request per the most the device reads at a time)."""
        for offset in range(start, end, self._chunk):
            os.posix_fadvise(self._fd, offset, min(self._chunk, end - offset), os.POSIX_FADV_WILLNEED)

    def __repr__(self) -> str:
        return f"SafetensorsFile({str(self.path)!r}, {len(self.tensors)} tensors, {self.size} bytes)"


_MAX_RUNS = 1 << 16


def page_runs(tensor: torch.Tensor, base: int = 0) -> list[tuple[int, int]]:
    """The page-aligned byte ranges, relative to address `base`, that reading `tensor` touches,
    merged where they touch. A strided view (a column slice) gives a run per row; past
    65536 runs, the one range from its first byte to its last."""
    if tensor.numel() == 0:
        return []
    item = tensor.element_size()
    dims = [(size, stride) for size, stride in zip(tensor.shape, tensor.stride(), strict=True) if size != 1]
    merged: list[tuple[int, int]] = []
    for size, stride in reversed(dims):  # fold dims that continue the one inside them
        if merged and stride == merged[-1][0] * merged[-1][1]:
            inner = merged.pop()
            merged.append((size * inner[0], inner[1]))
        else:
            merged.append((size, stride))
    merged.reverse()
    first = tensor.data_ptr() - base
    low = first + sum((size - 1) * stride for size, stride in merged if stride < 0) * item
    high = first + sum((size - 1) * stride for size, stride in merged if stride > 0) * item + item
    run = item
    if merged and merged[-1][1] == 1:
        run = merged.pop()[0] * item
    count = 1
    for size, _ in merged:
        count *= size
    page = mmap.PAGESIZE
    if count > _MAX_RUNS or any(stride < 0 for _, stride in merged):
        return [(low // page * page, -(-high // page) * page)]
    starts = torch.zeros(1, dtype=torch.int64)
    for size, stride in merged:
        starts = (starts.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride * item).flatten()
    runs: list[tuple[int, int]] = []
    for start in sorted((starts + first).tolist()):
        begin, end = start // page * page, -(-(start + run) // page) * page
        if runs and begin <= runs[-1][1]:
            runs[-1] = (runs[-1][0], max(runs[-1][1], end))
        else:
            runs.append((begin, end))
    return runs


class PrefetchReads(TorchFunctionMode):
    """While active (in this thread), every torch call that reads a view of `file`'s mapping
    (a copy, a cat, a conversion: `_READERS`) first asks the kernel for exactly the pages it
    reads (`SafetensorsFile.prefetch`). A layer's `copy_` of its slice thus reads that slice
    in large requests, and only it: a page fault that finds its page already in the cache
    starts no readahead of its own, so the other ranks' bytes stay on disk (mmap read-around
    would otherwise fetch up to the device's read_ahead_kb around every fault). A read by a
    call not listed is still correct, only left to the kernel's read-around.

    A function mode rather than a dispatch mode: entering a dispatch mode imports
    torch._dynamo, most of a second that a cold start would pay.
    """

    def __init__(self, file: SafetensorsFile) -> None:
        super().__init__()
        self.file = file
        self.prefetched = 0  # bytes asked for

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _READERS:
            for arg in (*args, *kwargs.values()):
                for tensor in arg if isinstance(arg, (list, tuple)) else (arg,):
                    if isinstance(tensor, torch.Tensor) and self.file.maps(tensor):
                        self.prefetched += self.file.prefetch(tensor)
        return func(*args, **kwargs)


_READERS = frozenset({
    torch.Tensor.copy_, torch.cat, torch.concat, torch.stack, torch.clone, torch.Tensor.clone,
    torch.Tensor.contiguous, torch.Tensor.to, torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16,
    torch.Tensor.double, torch.index_select, torch.Tensor.index_select,
})


def _readahead_limit(fd: int) -> int:
    """Bytes one POSIX_FADV_WILLNEED reads at most: the kernel caps it at the larger of the
    device's readahead window and its largest request (sysfs; 128 KiB when unknown)."""
    limit = 128 << 10
    try:
        dev = os.fstat(fd).st_dev
        queue = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
        queue = queue / "queue" if (queue / "queue").is_dir() else queue.resolve().parent / "queue"
        for name in ("read_ahead_kb", "max_sectors_kb"):
            limit = max(limit, int((queue / name).read_text()) << 10)
    except (OSError, ValueError):
        pass
    return limit


def _parse_header(path: Path, header: dict, data_start: int, size: int) -> dict[str, TensorInfo]:
    infos = []
    for name, entry in header.items():
        try:
            code, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: malformed header entry for {name!r}: {entry!r}") from exc
        if code not in DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {code}, which this torch cannot hold")
        dtype = DTYPES[code]
        numel = 1
        for dim in shape:
            numel *= dim
        if not 0 <= begin <= end or data_start + end > size or end - begin != numel * dtype.itemsize:
            raise ValueError(f"{path}: tensor {name!r} ({code} {list(shape)}) has bad data offsets [{begin}, {end})")
        infos.append(TensorInfo(name, dtype, shape, data_start + begin, data_start + end))
    infos.sort(key=lambda info: (info.start, info.name))
    return {info.name: info for info in infos}
