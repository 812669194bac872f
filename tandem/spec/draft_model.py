"""The draft model: a small model with the target's vocabulary proposes, greedily.

It runs in the target's worker, after the target's step, over a paged KV cache of its own
that uses the target's block tables: the same block ids and slots, a different tensor. So
the scheduler allocates once for both (plus `lookahead` slots past the verified tokens for
the draft's own guesses), and a preempted or finished request frees both at once.

Each step, for every request the target just ran:

1. **catch up**: the draft computes its KV for the tokens it has not seen, up to and
   including the token the target just sampled (the accepted drafts and the bonus token).
   A request new to this worker (a fresh prompt, a prefix-cache hit, a prompt whose KV came
   from a prefill worker) is caught up from position 0: the draft's KV is rebuilt from the
   prompt wherever the target's came from, so it never reads KV it did not write;
2. **guess**: the catch-up's last row gives the first guess; each further guess is one
   single-token forward of the draft over the requests still guessing.

The guesses' KV slots are written speculatively and rewritten by the next catch-up, which
starts after the last token the target kept. Guesses are greedy (the draft's argmax): for a
sampled request that is a point-mass q, which rejection sampling keeps lossless.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tandem.config import ModelConfig
from tandem.kernels.base import AttentionBackend, kv_cache_shape
from tandem.worker.model_runner import RequestState, ScheduledChunk, lazily_zeroed, prepare_batch


@dataclass
class DraftStepReport:
    seconds: float = 0.0  # draft time this step (catch-up and guesses)
    guess_forward_seconds: float = 0.0  # mean time of one single-token guessing forward


class DraftModelProposer:
    def __init__(self, model: torch.nn.Module, config: ModelConfig, backend: AttentionBackend, num_blocks: int,
                 block_size: int, dtype: torch.dtype, max_tokens: int) -> None:
        self.model = model
        self.config = config
        self.block_size = block_size
        self.max_tokens = max_tokens
        spec = config.kv_spec
        shape = kv_cache_shape(num_blocks, block_size, spec.num_heads, spec.head_dim, spec.num_planes)
        self.kv_cache = lazily_zeroed((config.num_hidden_layers, *shape), dtype)
        self.kv_caches = list(self.kv_cache.unbind(0))
        self._computed: dict[str, int] = {}  # request id -> tokens whose draft KV is valid
        self.report = DraftStepReport()

    def forget(self, request_id: str) -> None:
        """The request finished or was preempted: its blocks (and this KV) are gone."""
        self._computed.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, chunks: list[ScheduledChunk], kept: dict[str, list[int]],
                lookahead: dict[str, int]) -> dict[str, list[int]]:
        """Guesses per request that sampled this step; `kept`: the tokens the target kept for
        each, `lookahead`: how many guesses the scheduler wants from each."""
        started = time.perf_counter()
        catch_up: list[ScheduledChunk] = []
        ends: dict[str, int] = {}  # request id -> tokens known after this step (draft KV valid to there)
        for chunk in chunks:
            state = chunk.state
            assert state is not None
            if not state.sampling_params.speculate:
                continue
            new_tokens = kept.get(chunk.request_id, []) if chunk.samples else []
            real_end = chunk.start + chunk.num_tokens - len(chunk.draft_token_ids)
            end = min(real_end + len(new_tokens), len(chunk.block_ids) * self.block_size)
            done = min(self._computed.get(chunk.request_id, 0), end)
            if end <= done:
                continue
            tokens = self._tokens(state, new_tokens, done, end)
            wants = chunk.samples and lookahead.get(chunk.request_id, 0) > 0 and end == real_end + len(new_tokens)
            catch_up.append(ScheduledChunk(chunk.request_id, tokens, done, chunk.block_ids, wants, state))
            ends[chunk.request_id] = end
        guesses: dict[str, list[int]] = {}
        if catch_up:
            guesses = self._forward_and_pick(catch_up)
            for request_id, end in ends.items():
                self._computed[request_id] = end
        guesses = self._guess_further(guesses, catch_up, ends, lookahead)
        self.report.seconds = time.perf_counter() - started
        return guesses

    def _guess_further(self, guesses: dict[str, list[int]], catch_up: list[ScheduledChunk], ends: dict[str, int],
                       lookahead: dict[str, int]) -> dict[str, list[int]]:
        blocks = {chunk.request_id: chunk.block_ids for chunk in catch_up}
        states = {chunk.request_id: chunk.state for chunk in catch_up}
        forwards = 0
        started = time.perf_counter()
        while True:
            step = []
            for request_id, tokens in guesses.items():
                position = ends[request_id] + len(tokens) - 1  # where the last guess goes in
                room = position < len(blocks[request_id]) * self.block_size
                if len(tokens) < min(lookahead.get(request_id, 0), self.max_tokens) and room:
                    step.append(ScheduledChunk(request_id, [tokens[-1]], position, blocks[request_id], True,
                                               states[request_id]))
            if not step:
                break
            for request_id, token in self._forward_and_pick(step).items():
                guesses[request_id] += token
            forwards += 1
        if forwards:
            self.report.guess_forward_seconds = (time.perf_counter() - started) / forwards
        return guesses

    def _forward_and_pick(self, chunks: list[ScheduledChunk]) -> dict[str, list[int]]:
        batch = prepare_batch(chunks, self.block_size)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        if not batch.sample_chunks:
            return {}
        every_row = batch.sample_rows.shape[0] == hidden.shape[0]
        logits = self.model.compute_logits(hidden if every_row else hidden[batch.sample_rows])
        picked = logits.argmax(dim=-1).tolist()
        return {chunk.request_id: [token] for chunk, token in zip(batch.sample_chunks, picked, strict=True)}

    @staticmethod
    def _tokens(state: RequestState, new_tokens: list[int], start: int, end: int) -> list[int]:
        """Tokens [start, end) of what the request holds plus the tokens just kept."""
        known = state.num_tokens
        head = state.tokens(start, max(0, min(end, known) - start)) if start < known else []
        return head + new_tokens[max(0, start - known) : end - known]
