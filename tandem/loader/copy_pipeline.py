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
0.17 s (each alone: 0.21 s). `ReadAhead` reads every byte of its span, so it serves only
ranks that keep every tensor whole; a tensor-parallel rank's exact reads come from
`safetensors_mmap.PrefetchReads`.
"""

from __future__ import annotations

import mmap
import threading
from concurrent.futures import Executor
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from tandem.platform.pages import MADV_POPULATE_READ, madvise, populate_for_write

_SPLIT_BYTES = 1 << 20  # smaller copies are not worth a hand-off to another thread


class ReadAhead:
    """A thread that maps a file's bytes [start, end) in order, keeping at most `lead` bytes
    ahead of `advance(offset)`, the copy's position. Stops at the end, on `stop()`, or at the
    first failure (an old kernel without MADV_POPULATE_READ: the copy's own faults read)."""

    def __init__(self, address: int, start: int, end: int, lead: int = 128 << 20, chunk: int = 8 << 20) -> None:
        self._address, self._end, self._lead, self._chunk = address, end, lead, chunk
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

    def _run(self) -> None:
        while self._next < self._end:
            with self._cond:
                while not self._stopped and self._next > self._position + self._lead:
                    self._cond.wait()
                if self._stopped:
                    return
            length = min(self._chunk, self._end - self._next)
            if madvise(self._address + self._next, length, MADV_POPULATE_READ):
                return
            self._next += length


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
