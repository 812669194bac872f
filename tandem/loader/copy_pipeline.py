"""The copy of a checkpoint into parameters as a pipeline over cores.

A cold load does three things per byte: read it from disk into the page cache, fault in the
parameter page it goes to (a fresh page: allocated and zeroed by the kernel), and copy it.
dd only does the first. Done by one thread they add up; measured on this project's 2-core VM
for the default model's 0.54 GB: dd 0.16 s, one thread 0.21 s, and the warm load alone
(faults + copy, no disk) 0.19 s. So the work is spread out:

- `ReadAhead`, a thread per stream that keeps the file's pages mapped up to `lead` bytes ahead
  of the tensor being copied (MADV_POPULATE_READ: one sequential reader, the access dd makes,
  and the copy then takes no page fault on the file);
- `SplitCopies`, a torch function mode that splits each large `copy_` into a parameter in two:
  a helper thread faults in the second half of the destination (MADV_POPULATE_WRITE, which
  leaves its contents alone) while this thread copies the first, then copies the second.

Both only touch pages: what the model computes is the same. Together they bring the load to
0.17 s (each alone: 0.21 s). Mapping every byte ahead serves only ranks that keep every tensor
whole; a tensor-parallel rank's exact reads come from `safetensors_mmap.PrefetchReads`, and
ranks that together keep every byte on one machine split a forward read of the files between
them (`ReadShare`).
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from tandem.platform.pages import MADV_POPULATE_READ, madvise, populate_for_write

_SPLIT_BYTES = 1 << 20  # smaller copies are not worth a hand-off to another thread


@dataclass(frozen=True)
class ReadShare:
    """This process is `index` of `count` processes on one machine that, together, read every
    byte of the checkpoint: the ranks of a model whose ranks all live on this host. Cut the
    files into `unit`-sized pieces by absolute offset; this process asks the kernel to read
    the pieces whose number is `index` modulo `count`, in order, ahead of its copies, and
    finds the others in the page cache its peers fill. The disk sees the whole file read
    forward once, as dd reads it, instead of every rank's scattered slices asked for only as
    each copy starts; a rank whose copy gets ahead of the peer that reads its page still reads
    it itself (`PrefetchReads`). Ranks on separate hosts must not share: each host's ranks
    would together read every byte, where they need only their own."""

    index: int
    count: int
    unit: int = 8 << 20

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count or self.unit < mmap.PAGESIZE or self.unit % mmap.PAGESIZE:
            raise ValueError(f"bad read share: {self}")

    def owns(self, offset: int) -> bool:
        """Whether this process reads the piece holding file offset `offset`."""
        return offset // self.unit % self.count == self.index


class ReadAhead:
    """A thread that hands a file's bytes [start, end), in order and `chunk` bytes at a time,
    to `fetch(offset, length)`, keeping at most `lead` bytes ahead of `advance(offset)`, the
    copy's position. Chunks end at multiples of `chunk` (the first starts at `start`'s page).
    Stops at the end, on `stop()`, or when `fetch` returns False (an old kernel without
    MADV_POPULATE_READ: the copy's own faults read); `finish()` lets it run to the end first."""

    def __init__(self, fetch: Callable[[int, int], bool], start: int, end: int, lead: int = 128 << 20,
                 chunk: int = 8 << 20) -> None:
        self._fetch, self._end, self._lead, self._chunk = fetch, end, lead, chunk
        self._next = start - start % mmap.PAGESIZE
        self._position = start
        self._stopped = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="read-ahead", daemon=True)
        self._thread.start()

    def advance(self, offset: int) -> None:
        with self._cond:
            if offset > self._position:
                self._position = offset
                self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join()

    def finish(self) -> None:
        """Hand out every chunk left, whatever the copy's position, and wait until it has."""
        self.advance(self._end)
        self._thread.join()

    def _run(self) -> None:
        while self._next < self._end:
            with self._cond:
                while not self._stopped and self._next > self._position + self._lead:
                    self._cond.wait()
                if self._stopped:
                    return
            length = min(self._chunk - self._next % self._chunk, self._end - self._next)
            if not self._fetch(self._next, length):
                return
            self._next += length


def map_ahead(address: int) -> Callable[[int, int], bool]:
    """A `ReadAhead` fetch that maps [offset, offset + length) of the mapping at `address`
    (MADV_POPULATE_READ): one reader through the whole file, which the copy then finds mapped."""
    return lambda offset, length: madvise(address + offset, length, MADV_POPULATE_READ) == 0


def read_share_ahead(share: ReadShare, read: Callable[[int, int], object]) -> Callable[[int, int], bool]:
    """A `ReadAhead` fetch that asks `read(start, end)` (the kernel's asynchronous readahead)
    for the pieces `share` gives this process and skips the rest. Give it chunks of
    `share.unit`."""
    def fetch(offset: int, length: int) -> bool:
        if share.owns(offset):
            read(offset, offset + length)
        return True
    return fetch


class SplitCopies(TorchFunctionMode):
    """While active (in this thread), a `copy_` into a contiguous tensor of at least 1 MiB, of
    a source of its shape, is done in two halves by rows, the second half's pages faulted in
    on `helpers` while the first half is copied."""

    def __init__(self, helpers: Executor) -> None:
        super().__init__()
        self.helpers = helpers

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and len(args) == 2 and not kwargs:
            dst, src = args
            if (isinstance(src, torch.Tensor) and dst.shape == src.shape and dst.dim() >= 1 and dst.shape[0] >= 2
                    and dst.device.type == "cpu" and dst.is_contiguous()
                    and dst.numel() * dst.element_size() >= _SPLIT_BYTES):
                half = dst.shape[0] // 2
                faulted = self.helpers.submit(populate_for_write, dst[half:])
                dst[:half].copy_(src[:half])
                faulted.result()
                dst[half:].copy_(src[half:])
                return dst
        return func(*args, **kwargs)
