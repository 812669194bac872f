"""The draft model: a small model with the target's vocabulary proposes, greedily.

It runs as a `PagedDraftProposer` (paged_draft.py): after the target's step it catches up on
the tokens the target kept, then guesses one token per forward. Its KV at position i is the
draft's own over tokens 0..i, so a catch-up covers exactly the positions whose tokens became
known: the real tokens of the chunk, the accepted drafts and the token just sampled.
"""

from __future__ import annotations

import torch

from tandem.batch.prepared import PreparedBatch, RequestState, ScheduledChunk, TargetStep
from tandem.config import ModelConfig
from tandem.spec.paged_draft import CatchUp, FedGuesses, PagedDraftProposer


class DraftModelProposer(PagedDraftProposer):
    def __init__(self, model: torch.nn.Module, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, max_tokens: int) -> None:
        super().__init__(config.kv_spec, config.num_hidden_layers, num_blocks, block_size, dtype, max_tokens)
        self.model = model

    def _catch_up(self, chunk: ScheduledChunk, step: TargetStep, done: int) -> CatchUp | None:
        state = chunk.state
        assert state is not None
        new_tokens = step.kept.get(chunk.request_id, []) if chunk.samples else []
        real_end = chunk.start + chunk.num_tokens - len(chunk.draft_token_ids)
        known = real_end + len(new_tokens)
        end = min(known, len(chunk.block_ids) * self.block_size)
        done = min(done, end)
        if end <= done:
            return None
        wants = chunk.samples and step.lookahead.get(chunk.request_id, 0) > 0 and end == known
        tokens = known_tokens(state, new_tokens, done, end)
        return CatchUp(ScheduledChunk(chunk.request_id, tokens, done, chunk.block_ids, wants, state), end)

    def _resume_from(self, chunk: ScheduledChunk, step: TargetStep, done: int, fed: FedGuesses | None) -> int:
        """Past the guesses the target kept: their KV here is the draft's own over the same
        tokens at the same positions. The last known token always runs (its row guesses)."""
        if fed is None or fed.start != done or not chunk.samples:
            return done
        state = chunk.state
        assert state is not None
        new_tokens = step.kept.get(chunk.request_id, [])
        known = chunk.start + chunk.num_tokens - len(chunk.draft_token_ids) + len(new_tokens)
        end = min(done + len(fed.tokens), known - 1)
        if end <= done or self._blocks_between(chunk.block_ids, done, done + len(fed.tokens)) != fed.block_ids:
            return done  # nothing to keep, or the blocks the guesses wrote are not this request's now
        kept = 0
        for actual, guessed in zip(known_tokens(state, new_tokens, done, end), fed.tokens, strict=False):
            if actual != guessed:
                break
            kept += 1
        return done + kept

    def _forward(self, batch: PreparedBatch, hidden: torch.Tensor | None) -> tuple[torch.Tensor, None]:
        out = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        if not batch.sample_chunks:
            return out[:0], None
        return self.model.compute_logits(out if batch.sample_rows_in_order else out[batch.sample_rows]), None


def known_tokens(state: RequestState, new_tokens: list[int], start: int, end: int) -> list[int]:
    """Tokens [start, end) of what the request holds plus the tokens the target just kept."""
    held = state.num_tokens
    head = state.tokens(start, max(0, min(end, held) - start)) if start < held else []
    return head + new_tokens[max(0, start - held) : end - held]
