"""Token embedding and LM head; the head may share the embedding matrix (tied weights)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.layers.linear import LinearWeights


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)


class LMHead(LinearWeights, nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.bias = None

    def tie_to(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in fp32 whatever the run dtype, so sampling and logprobs are stable."""
        return self.linear(hidden).float()
