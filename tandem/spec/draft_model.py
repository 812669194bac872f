"""The draft model: a small model with the target's vocabulary proposes, greedily.

It runs in the target's worker, after the target's step, over a paged KV cache of its own
that uses the target's block tables: the same block ids and slots, a different tensor. So
the scheduler allocates once for both (plus `lookahead` slots past the verified tokens for
the draft's own guesses), and a preempted or finished request frees both at once.

Each step, for every request the target just ran:

1. **catch up**: the draft computes its KV for the tokens it has not seen, up to and
   including the token the target just sampled (the accepted drafts and the bonus token).
   A request new to this worker starts after its longest run of leading blocks whose draft
   KV is known good: a block is good once the draft has computed all of it, and stops being
   good when anything else writes it (the target computing new tokens into a reused block
   without the draft, a KV connector loading a prefill worker's or a tier's KV into it). So
   a prefix-cache hit costs the draft nothing, and a prompt whose KV came from elsewhere is
   rebuilt from the prompt: the draft never reads KV it did not write;
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
    catch_up_tokens: int = 0  # cumulative: tokens the draft computed to follow the target


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
        self._good_blocks: set[int] = set()  # blocks whose whole draft KV matches their tokens
        self.report = DraftStepReport()

    def forget(self, request_id: str) -> None:
        """The request finished or was preempted: its blocks (and this KV) are gone."""
        self._computed.pop(request_id, None)

    def invalidate(self, block_ids: list[int]) -> None:
        """Something other than the draft wrote these blocks (a KV connector's load)."""
        self._good_blocks.difference_update(block_ids)

    def _blocks_between(self, block_ids: list[int], start: int, end: int) -> list[int]:
        size = self.block_size
        return block_ids[start // size : -(-end // size)]

    def _first_unseen(self, chunk: ScheduledChunk) -> int:
        """Where the draft's KV for this request stops being good."""
        known = self._computed.get(chunk.request_id)
        if known is not None:
            return known
        good = 0
        for block_id in chunk.block_ids[: chunk.start // self.block_size]:
            if block_id not in self._good_blocks:
                break
            good += self.block_size
        return good

    @torch.inference_mode()
    def propose(self, chunks: list[ScheduledChunk], kept: dict[str, list[int]],
                lookahead: dict[str, int]) -> dict[str, list[int]]:
        """Guesses per request that sampled this step; `kept`: the tokens the target kept for
        each, `lookahead`: how many guesses the scheduler wants from each."""
        started = time.perf_counter()
        catch_up: list[ScheduledChunk] = []
        ends: dict[str, int] = {}  # request id -> tokens known after this step (draft KV valid to there)
        for chunk in chunks:  # the target wrote these slots this step; the draft rewrites its own below
            self.invalidate(self._blocks_between(chunk.block_ids, chunk.start, chunk.start + chunk.num_tokens))
        for chunk in chunks:
            state = chunk.state
            assert state is not None
            if not state.sampling_params.speculate:
                continue
            new_tokens = kept.get(chunk.request_id, []) if chunk.samples else []
            real_end = chunk.start + chunk.num_tokens - len(chunk.draft_token_ids)
            end = min(real_end + len(new_tokens), len(chunk.block_ids) * self.block_size)
            done = min(self._first_unseen(chunk), end)
            if end <= done:
                continue
            tokens = self._tokens(state, new_tokens, done, end)
            wants = chunk.samples and lookahead.get(chunk.request_id, 0) > 0 and end == real_end + len(new_tokens)
            catch_up.append(ScheduledChunk(chunk.request_id, tokens, done, chunk.block_ids, wants, state))
            ends[chunk.request_id] = end
            self.report.catch_up_tokens += end - done
        guesses: dict[str, list[int]] = {}
        if catch_up:
            guesses = self._forward_and_pick(catch_up)
            size = self.block_size
            for chunk in catch_up:
                end = ends[chunk.request_id]
                self._computed[chunk.request_id] = end
                # Blocks the draft has now computed whole hold good draft KV.
                self._good_blocks.update(chunk.block_ids[chunk.start // size : end // size])
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
            for chunk in step:  # a guess's KV is only as good as the guess
                self.invalidate(self._blocks_between(chunk.block_ids, chunk.start, chunk.start + 1))
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
        logits = self.model.compute_logits(hidden if batch.sample_rows_in_order else hidden[batch.sample_rows])
        picked = logits.argmax(dim=-1).tolist()
        return {chunk.request_id: [token] for chunk, token in zip(batch.sample_chunks, picked, strict=True)}

    @staticmethod
    def _tokens(state: RequestState, new_tokens: list[int], start: int, end: int) -> list[int]:
        """Tokens [start, end) of what the request holds plus the tokens just kept."""
        known = state.num_tokens
        head = state.tokens(start, max(0, min(end, known) - start)) if start < known else []
        return head + new_tokens[max(0, start - known) : end - known]
