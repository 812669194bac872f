"""Decode steps replayed as CUDA graphs: one launch for the whole forward instead of hundreds.

A decode-only step of an 8B model on a GPU is a few milliseconds of kernels and, eagerly,
about as long again of Python and launches. So, as vLLM and SGLang do, the forward of a
decode-only batch is captured once per batch size in `capture_sizes` (1, 2, 4, 8, then every
8 up to the largest) and replayed: a batch of n rows runs the graph of the smallest captured
size >= n, its inputs copied into static buffers and the rest padded. Prefill and mixed steps,
and batches above the largest size, run eagerly.

Padding has to leave the cache and the real rows alone: a padded row writes its KV to slot
-1 (the backend skips negative slots), attends over a context of 0 (no reads; its output is
zeros) and reads position 0 and token 0. Attention in a graph cannot size its launch from the
step's longest context, so the captured metadata says `max_context_len` (the engine's
longest) and the kernel's splits past a row's context return at once. Only backends that
declare `pads_decode_rows` honour all that; the others never get a graph.

`StaticDecodeStep` is the padding and the buffers; it is the same on every device, so CI
tests it on the CPU (the Triton kernels interpreted, `graphs=False`: each "replay" runs the
forward eagerly on the static buffers). `capture` is the CUDA part: a warm-up run (Triton
compiles, cuBLAS picks its kernels), then the capture, largest size first so the smaller
graphs reuse its memory pool.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.kernels.base import AttentionMetadata

logger = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def capture_sizes(largest: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to `largest` (which is always included)."""
    if largest < 1:
        return []
    sizes = [s for s in (1, 2, 4) if s < largest] + list(range(8, largest, 8))
    return [*sizes, largest]


@dataclass
class _Graph:
    size: int
    meta: AttentionMetadata
    output: torch.Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None


class StaticDecodeStep:
    """Static input buffers for decode batches of up to `sizes[-1]` rows, and one graph (or,
    without CUDA, one eager forward) per size in `sizes`."""

    def __init__(self, forward: Forward, sizes: list[int], max_context_len: int, block_size: int,
                 device: torch.device, graphs: bool) -> None:
        if not sizes:
            raise ValueError("no batch sizes to capture")
        self.forward = forward
        self.sizes = sorted(sizes)
        self.max_context_len = max_context_len
        self.use_graphs = graphs
        rows = self.sizes[-1]
        max_blocks = -(-max_context_len // block_size)
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(rows, **long)
        self.positions = torch.zeros(rows, **long)
        self.slots = torch.full((rows,), -1, **long)
        self.context_lens = torch.zeros(rows, **long)
        self.block_tables = torch.zeros(rows, max_blocks, **long)
        self._graphs = {size: _Graph(size, AttentionMetadata(
            slot_mapping=self.slots[:size], num_decode_tokens=size, decode_block_tables=self.block_tables[:size],
            decode_context_lens=self.context_lens[:size], decode_max_context_len=max_context_len, prefills=[],
            block_size=block_size)) for size in self.sizes}
        self._pool = None

    def takes(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """A decode-only step (every token a decode row) this set has a size for."""
        return (not meta.prefills and meta.num_decode_tokens == num_tokens and 0 < num_tokens <= self.sizes[-1]
                and meta.decode_max_context_len <= self.max_context_len
                and meta.decode_block_tables.shape[1] <= self.block_tables.shape[1])

    def size_for(self, rows: int) -> int:
        return next(size for size in self.sizes if size >= rows)

    def capture(self) -> float:
        """Capture every size's graph (largest first, sharing one memory pool); seconds taken."""
        started = time.perf_counter()
        if self.use_graphs:
            self._pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            entry = self._graphs[size]
            self._reset(0, size)
            if not self.use_graphs:
                continue
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._run_eager(entry)  # warm-up: compiles kernels, sets up cuBLAS, outside the graph
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                entry.output = self._run_eager(entry)
            entry.graph = graph
        if self.use_graphs:
            torch.cuda.synchronize()
        return time.perf_counter() - started

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The step's hidden states [rows, hidden], computed by the graph of its padded size."""
        rows = input_ids.shape[0]
        entry = self._graphs[self.size_for(rows)]
        width = meta.decode_block_tables.shape[1]
        self.input_ids[:rows].copy_(input_ids, non_blocking=True)
        self.positions[:rows].copy_(positions, non_blocking=True)
        self.slots[:rows].copy_(meta.slot_mapping, non_blocking=True)
        self.context_lens[:rows].copy_(meta.decode_context_lens, non_blocking=True)
        self.block_tables[:rows, :width].copy_(meta.decode_block_tables, non_blocking=True)
        self._reset(rows, entry.size)
        if entry.graph is None:
            return self._run_eager(entry)[:rows]
        entry.graph.replay()
        assert entry.output is not None
        return entry.output[:rows]

    def replay(self, size: int) -> None:
        """Replay the graph of `size` on whatever the buffers hold: for timing the forward alone
        (`tandem bench gpu`), apart from the step's host work."""
        graph = self._graphs[size].graph
        if graph is None:
            raise ValueError(f"no graph of {size} rows captured")
        graph.replay()

    def _reset(self, start: int, end: int) -> None:
        """Rows [start, end) become padding: token 0 at position 0, no KV write, no context."""
        if end > start:
            self.input_ids[start:end] = 0
            self.positions[start:end] = 0
            self.slots[start:end] = -1
            self.context_lens[start:end] = 0

    def _run_eager(self, entry: _Graph) -> torch.Tensor:
        size = entry.size
        entry.meta.scratch.clear()
        return self.forward(self.input_ids[:size], self.positions[:size], entry.meta)
