"""Checkpoint bytes into device memory through pinned staging buffers, overlapped.

A `copy_` from pageable CPU memory (a view of the mmap'd checkpoint) into CUDA memory is
slow: the driver stages it through a small pinned buffer of its own, synchronously, so the
thread reading the file waits for every transfer and the bus waits for every read.
`StagedDeviceCopies` does the staging itself: it converts the source chunk by chunk into one
of two pinned buffers of its own (to the destination's dtype, so no full-size temporary) and
copies each buffer to the device with `non_blocking=True` on a stream of its own, so reading
(and converting) the next chunk overlaps the previous chunk's transfer.

What is CUDA-only (pinned memory, the stream, events) sits in `_Link`; on the CPU, which the
tests use, those are no-ops and the same chunking, alternation and conversion run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_CHUNK_BYTES = 64 << 20


class _Link:
    """What a CUDA target adds: pinned staging memory, a stream to copy on, and an event per
    staging buffer that tells when its last transfer is done. No-ops for another device."""

    def __init__(self, device: torch.device, pin: bool) -> None:
        self.pin = pin
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.events = [torch.cuda.Event(blocking=True) for _ in range(2)] if self.cuda else []
        self.device = device

    def buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def on_stream(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def transferred(self, turn: int) -> None:
        if self.cuda:
            self.events[turn].record(self.stream)

    def wait_free(self, turn: int) -> None:
        if self.cuda:
            self.events[turn].synchronize()  # a fresh event's synchronize returns at once

    def after_current(self) -> None:
        """Our copies start after work queued so far on this thread's stream (e.g. the init)."""
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def before_current(self) -> None:
        """Work queued later on this thread's stream sees the copies done (a device-side wait)."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def finish(self) -> None:
        if self.cuda:
            self.stream.synchronize()


def _pieces(src: torch.Tensor, limit: int) -> Iterator[torch.Tensor]:
    """`src` in its logical (row-major) order as views of at most `limit` elements each:
    slices of the flattened tensor where it is contiguous, else whole rows (or recursively,
    pieces of one row too big for `limit`)."""
    if src.is_contiguous():
        flat = src.view(-1)
        for start in range(0, flat.numel(), limit):
            yield flat[start:start + limit]
        return
    row = src.numel() // src.shape[0]
    if row > limit:
        for index in range(src.shape[0]):
            yield from _pieces(src[index], limit)
        return
    rows = limit // row
    for start in range(0, src.shape[0], rows):
        yield src[start:start + rows]


class StagedDeviceCopies(TorchFunctionMode):
    """While active (in this thread), `dst.copy_(src)` with `dst` a contiguous tensor on
    `device` and `src` a CPU tensor of its shape (other storage) goes through two staging
    buffers of `chunk_bytes` (pinned with `pin`), alternately; other copies are left alone.
    `__exit__` waits for every transfer. `bytes_staged`, `chunks` and `tensors` count what
    went through it (bytes in the destination's dtype).

    Its own copies are not seen again by it: torch pops a mode off the thread's stack while
    its `__torch_function__` runs, so they reach only the modes entered before it (such as
    `PrefetchReads`, which then prefetches each chunk's pages)."""

    def __init__(self, device: torch.device, pin: bool = True, chunk_bytes: int = _CHUNK_BYTES) -> None:
        super().__init__()
        if chunk_bytes < 16:
            raise ValueError(f"chunk_bytes must hold an element of any dtype (16 bytes), not {chunk_bytes}")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device, self.chunk_bytes = device, chunk_bytes
        self.bytes_staged = self.chunks = self.tensors = 0
        self._link = _Link(device, pin)
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._turn = 0

    def __enter__(self) -> StagedDeviceCopies:
        super().__enter__()
        self._link.after_current()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._link.finish()
        finally:
            self._buffers = [None, None]
            super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and len(args) == 2 and not kwargs and self._takes(*args):
            self._stage(*args)
            return args[0]
        return func(*args, **kwargs)

    def _takes(self, dst: torch.Tensor, src: Any) -> bool:
        return (isinstance(src, torch.Tensor) and src.device.type == "cpu" and dst.device == self.device
                and src.layout == dst.layout == torch.strided and not dst.is_quantized and not src.is_quantized
                and dst.shape == src.shape and dst.numel() > 0 and dst.is_contiguous()
                and src.untyped_storage().data_ptr() != dst.untyped_storage().data_ptr())

    def _stage(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        size = dst.element_size()
        flat, offset = dst.view(-1), 0
        for piece in _pieces(src, self.chunk_bytes // size):
            count = piece.numel()
            turn = self._turn
            self._link.wait_free(turn)  # its last transfer has read it
            buffer = self._buffers[turn]
            if buffer is None:
                buffer = self._buffers[turn] = self._link.buffer(self.chunk_bytes)
            staged = buffer[:count * size].view(dst.dtype)
            staged.view(piece.shape).copy_(piece)  # reads the file, converts, packs
            with self._link.on_stream():
                flat[offset:offset + count].copy_(staged, non_blocking=True)
            self._link.transferred(turn)
            self._turn ^= 1
            offset += count
            self.chunks += 1
            self.bytes_staged += count * size
        self.tensors += 1
        self._link.before_current()
