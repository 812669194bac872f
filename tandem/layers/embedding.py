"""Token embedding and LM head; the head may share the embedding matrix (tied weights).

Under tensor parallelism both are split by vocabulary (`VocabShard`): each rank holds a
contiguous range of rows, padded so every rank holds the same count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.distributed.tensor_parallel import SINGLE_RANK, TensorParallel
from tandem.kernels.layer_ops import LayerOpsKernel
from tandem.layers.bounded_greedy import BoundedGreedyHead
from tandem.layers.linear import LinearWeights


@dataclass(frozen=True)
class VocabShard:
    vocab_size: int
    tp: TensorParallel

    @property
    def rows(self) -> int:
        """Rows per rank: the vocabulary divided up, rounded up (the last rank is padded)."""
        return -(-self.vocab_size // self.tp.size)

    @property
    def start(self) -> int:
        return self.tp.rank * self.rows

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full [vocab, hidden] checkpoint tensor, zero-padded."""
        if not self.tp.split:
            return tensor
        mine = tensor[self.start : self.start + self.rows]
        if mine.shape[0] < self.rows:
            mine = torch.cat((mine, mine.new_zeros(self.rows - mine.shape[0], *mine.shape[1:])))
        return mine


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE_RANK) -> None:
        super().__init__()
        self.shard = VocabShard(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(self.shard.rows, hidden_size), requires_grad=False)

    def load(self, param_name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        mine = self.shard.take(tensor)
        if mine.shape != self.weight.shape:
            raise ValueError(f"shape mismatch: checkpoint {tuple(tensor.shape)} vs embedding {tuple(self.weight.shape)}")
        self.weight.data.copy_(mine)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        shard = self.shard
        if not shard.tp.split:
            return F.embedding(token_ids, self.weight)
        local = token_ids - shard.start
        outside = (local < 0) | (local >= shard.rows)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        hidden.masked_fill_(outside.unsqueeze(-1), 0.0)
        return shard.tp.all_reduce(hidden)  # each token's row came from exactly one rank


class LMHead(LinearWeights, nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE_RANK) -> None:
        super().__init__()
        self.shard = VocabShard(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(self.shard.rows, hidden_size), requires_grad=False)
        self.bias = None
        self.tied = False  # the weight is the embedding's: never drop it
        # --decode-weights float32: greedy tokens from a bf16 copy, proven equal to the fp32
        # argmax (layers/bounded_greedy.py); set by the worker.
        self.bounded_greedy: BoundedGreedyHead | None = None

    def tie_to(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight
        self.tied = True

    def load(self, param_name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        mine = self.shard.take(tensor)
        if mine.shape != self.weight.shape:
            raise ValueError(f"shape mismatch: checkpoint {tuple(tensor.shape)} vs LM head {tuple(self.weight.shape)}")
        self.weight.data.copy_(mine)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in fp32 whatever the run dtype, so sampling and logprobs are stable (an 8-bit
        head writes them in fp32 straight from its integer products)."""
        logits = self._products(hidden).float()
        if not self.shard.tp.split:
            return logits
        return self.shard.tp.all_gather_last(logits)[..., : self.shard.vocab_size]

    def greedy_ids(self, hidden: torch.Tensor, ops: LayerOpsKernel | None) -> torch.Tensor:
        """Each row's argmax of the logits as the head computes them, before forward's fp32
        copy: a bf16 value widens to fp32 exactly, so the index is the fp32 logits' (the first
        of equal maxima, or the first NaN). In bf16 that copy of 64 rows of SmolLM2's 49,152
        logits took 2.9 ms of a 40 ms decode step on the 2-core AMX Xeon. One rank's head. Where
        the packed GEMM finds each row's argmax itself (bf16 on AMX), no logits are written."""
        ids = self.dense_argmax(hidden)
        if ids is not None:
            return ids
        logits = self._products(hidden)
        return ops.argmax(logits) if ops is not None and ops.takes_argmax(logits) else logits.argmax(dim=-1)

    def _products(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden @ weight.T in the dtype the head's GEMM writes (fp32 from the 8-bit one)."""
        if self.int8 is not None and hidden.dim() == 2 and not self.uses_small_step(hidden):
            return self.int8.matmul(hidden, dtype=torch.float32)
        return self.linear(hidden)
