"""EAGLE-3 as a proposer: the head guesses from the target's own hidden states.

The head's row at position i reads token i+1 and the target's aux hidden state at i (three
residual streams, concatenated; the target model keeps them when `aux_hidden_layers` is set),
and predicts token i+2. So after a target step the head can catch up on every position whose
target hidden state this step computed and whose next token is known: the chunk's real
tokens and accepted drafts (the sampled token is the "next token" of the last of them). The
first guess comes from that last row; each further guess feeds the head's own output hidden
state back instead of the target's.

Positions before the chunk have no target hidden state any more: a request new to this worker
whose leading blocks do not hold good head KV (a prompt whose KV a connector loaded) is caught
up only from the chunk on, and the head attends to whatever its cache holds before that. The
guesses are then worse, never wrong: the target verifies them.
"""

from __future__ import annotations

import torch

from tandem.batch.prepared import PreparedBatch, ScheduledChunk, TargetStep
from tandem.spec.draft_model import known_tokens
from tandem.spec.eagle3 import Eagle3Head
from tandem.spec.paged_draft import CatchUp, PagedDraftProposer


class Eagle3Proposer(PagedDraftProposer):
    needs_aux_hidden = True

    def __init__(self, head: Eagle3Head, num_blocks: int, block_size: int, dtype: torch.dtype,
                 max_tokens: int) -> None:
        super().__init__(head.config.kv_spec, 1, num_blocks, block_size, dtype, max_tokens)
        self.head = head

    def _catch_up(self, chunk: ScheduledChunk, step: TargetStep, done: int) -> CatchUp | None:
        state = chunk.state
        assert state is not None and step.aux_hidden is not None and step.rows_of is not None
        new_tokens = step.kept.get(chunk.request_id, []) if chunk.samples else []
        real_end = chunk.start + chunk.num_tokens - len(chunk.draft_token_ids)
        # Positions with a target hidden state from this step: the real tokens and the kept drafts.
        with_hidden = real_end + max(len(new_tokens) - 1, 0)
        known = real_end + len(new_tokens) if chunk.samples else state.num_tokens
        end = min(with_hidden, known - 1, len(chunk.block_ids) * self.block_size)
        done = max(min(done, end), chunk.start)
        if end <= done:
            return None
        rows = step.rows_of[chunk.request_id][done - chunk.start : end - chunk.start]
        hidden = step.aux_hidden[torch.tensor(rows, dtype=torch.long)]
        tokens = known_tokens(state, new_tokens, done + 1, end + 1)
        wants = chunk.samples and step.lookahead.get(chunk.request_id, 0) > 0 and end == known - 1
        return CatchUp(ScheduledChunk(chunk.request_id, tokens, done, chunk.block_ids, wants, state), end, hidden)

    def _forward(self, batch: PreparedBatch, hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        assert hidden is not None
        out = self.head(batch.input_ids, batch.positions, hidden, self.kv_caches[0], batch.meta)
        sampled = out if batch.sample_rows_in_order else out[batch.sample_rows]
        return self.head.compute_logits(sampled), sampled
