"""A pipeline stage: a contiguous run of decoder layers, fed by the stage before it.

Pipeline parallelism splits the model by depth: stage 0 embeds the tokens and runs its
layers, then sends the hidden states (one [tokens, hidden] tensor: these decoders keep the
residual stream in it) to the same tensor-parallel rank of the next stage; the last stage
runs the final norm and the LM head and samples. Every stage gets the same plain
`SchedulerOutput`, so each builds the same batch and knows the shape it will receive.

Sends are asynchronous (`isend`): a stage hands its micro-batch on and starts the next one
while the next stage computes, which is what keeps several micro-batches in flight. A send is
waited for before the next one (gloo keeps one buffer per pair in order), and at the end.
A group of one stage (the default) holds every layer and sends nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tandem.platform.profiling import profiled


@dataclass
class PipelineStage:
    index: int = 0
    size: int = 1
    start_layer: int = 0
    end_layer: int = 0  # exclusive; 0 with size 1: every layer (set by `whole`)
    prev_rank: int | None = None  # global rank this stage receives from
    next_rank: int | None = None  # global rank this stage sends to
    _pending: Any = field(default=None, repr=False)  # the last isend, and its buffer

    @classmethod
    def whole(cls, num_layers: int) -> PipelineStage:
        return cls(0, 1, 0, num_layers)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    @property
    def split(self) -> bool:
        return self.size > 1

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.start_layer

    def owns_layer(self, layer: int) -> bool:
        return self.start_layer <= layer < self.end_layer

    def send(self, hidden: torch.Tensor) -> None:
        """Hand `hidden` to the next stage without waiting for it to be received."""
        assert self.next_rank is not None, "the last stage sends nothing"
        with profiled("pp.send"):
            self.wait_sent()
            buffer = hidden.contiguous()
            self._pending = (dist.isend(buffer, self.next_rank), buffer)

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
        assert self.prev_rank is not None, "the first stage receives nothing"
        hidden = torch.empty(num_tokens, hidden_size, dtype=dtype)
        with profiled("pp.recv"):  # the wait for the stage before: this stage's idle time
            dist.recv(hidden, self.prev_rank)
        return hidden

    def wait_sent(self) -> None:
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None
