"""What every model-running proposer shares: a paged KV cache on the target's block tables,
knowing which of its blocks hold good KV, and the catch-up-then-guess loop.

A proposer that runs a model (a draft model, an EAGLE head) runs in the target's worker,
after the target's step, over a KV cache of its own that uses the target's block tables:
the same block ids and slots, another tensor. The scheduler allocates once for both (plus
`lookahead` slots past the verified tokens for the guesses), and a preempted or finished
request frees both at once.

Each step, for every request the target just ran:

1. **catch up**: the proposer computes its KV for the positions it has not seen, from what
   the target just kept (the accepted drafts and the sampled token). A request new to this
   worker starts after its longest run of leading blocks whose KV here is known good: a block
   is good once the proposer has computed all of it, and stops being good when anything else
   writes it (the target computing new tokens into a reused block without the proposer, a KV
   connector loading a prefill worker's or a tier's KV into it). So a prefix-cache hit costs
   nothing here, and the proposer never reads KV it did not write;
2. **guess**: the catch-up's last row gives the first guess; each further guess is one
   single-token forward over the requests still guessing, feeding back what the last one
   returned (a token; for EAGLE also a hidden state).

The guesses' KV slots are written speculatively. A proposer whose KV depends on tokens alone
(a draft model) keeps the KV of the guesses the target accepted, so a decode's next catch-up
is only what it never fed: the sampled token, and the last guess when all were kept; that
bounds its forwards to two tokens per request, where a 4-bit weight copy is fastest. EAGLE's
guess rows read its own hidden states, not the target's, so its catch-up rewrites them.
Guesses are greedy (argmax): for a sampled request that is a point-mass q, which rejection
sampling keeps lossless.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from tandem.batch.prepared import PreparedBatch, ScheduledChunk, TargetStep, prepare_batch
from tandem.config import KVCacheSpec
from tandem.kernels.base import kv_cache_shape
from tandem.platform.lazy_memory import lazily_zeroed

# The longest catch-up run as decode rows (one per position); longer ones (a prompt) as a
# prefill chunk.
DECODE_ROW_CATCH_UP = 16


@dataclass
class DraftStepReport:
    seconds: float = 0.0  # proposer time this step (catch-up and guesses)
    guess_forward_seconds: float = 0.0  # mean time of one single-token guessing forward
    catch_up_tokens: int = 0  # cumulative: positions computed to follow the target


@dataclass
class CatchUp:
    """One request's catch-up: `chunk` to run, the KV it leaves good up to `done`."""

    chunk: ScheduledChunk
    done: int
    hidden: torch.Tensor | None = None  # per token of `chunk` (EAGLE)
    good_from: int | None = None  # where the KV this leaves good begins (None: chunk.start)


@dataclass
class FedGuesses:
    """Guesses whose KV a guessing forward wrote: `tokens` at positions start, start + 1, …,
    into `block_ids` (the blocks of those positions then)."""

    start: int
    tokens: list[int]
    block_ids: list[int]


class PagedDraftProposer(ABC):
    def __init__(self, kv_spec: KVCacheSpec, num_layers: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, max_tokens: int) -> None:
        self.block_size = block_size
        self.max_tokens = max_tokens
        shape = kv_cache_shape(num_blocks, block_size, kv_spec.num_heads, kv_spec.head_dim, kv_spec.num_planes)
        self.kv_cache = lazily_zeroed((num_layers, *shape), dtype)
        self.kv_caches = list(self.kv_cache.unbind(0))
        self._computed: dict[str, int] = {}  # request id -> positions whose KV here is good
        self._good_blocks: set[int] = set()  # blocks whose whole KV here matches their tokens
        self._fed: dict[str, FedGuesses] = {}  # request id -> last step's guesses with KV here
        self.report = DraftStepReport()

    # --- what a proposer defines ----------------------------------------------------------
    @abstractmethod
    def _catch_up(self, chunk: ScheduledChunk, step: TargetStep, done: int) -> CatchUp | None:
        """The positions to compute after `done` for this chunk (None: nothing to do)."""

    @abstractmethod
    def _forward(self, batch: PreparedBatch, hidden: torch.Tensor | None) -> tuple[torch.Tensor, Any]:
        """Run the batch; the sampled rows' logits, and what the next guess of each sampled
        row needs besides its token (EAGLE: the output hidden state; else None)."""

    def _resume_from(self, chunk: ScheduledChunk, step: TargetStep, done: int, fed: FedGuesses | None) -> int:
        """Where this request's catch-up may start, given its KV is good up to `done` and
        the last step's guesses `fed` wrote KV after it. By default the guesses' KV is
        rewritten (it may depend on more than the tokens)."""
        return done

    # --- bookkeeping ------------------------------------------------------------------------
    def forget(self, request_id: str) -> None:
        """The request finished or was preempted: its blocks (and this KV) are gone."""
        self._computed.pop(request_id, None)
        self._fed.pop(request_id, None)

    def invalidate(self, block_ids: list[int]) -> None:
        """Something other than the proposer wrote these blocks (a KV connector's load)."""
        self._good_blocks.difference_update(block_ids)

    def _blocks_between(self, block_ids: list[int], start: int, end: int) -> list[int]:
        size = self.block_size
        return block_ids[start // size : -(-end // size)]

    def _first_unseen(self, chunk: ScheduledChunk) -> int:
        """Where the KV here for this request stops being good."""
        known = self._computed.get(chunk.request_id)
        if known is not None:
            return known
        good = 0
        for block_id in chunk.block_ids[: chunk.start // self.block_size]:
            if block_id not in self._good_blocks:
                break
            good += self.block_size
        return good

    # --- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, step: TargetStep) -> dict[str, list[int]]:
        """Guesses per request that sampled this step."""
        started = time.perf_counter()
        for chunk in step.chunks:  # the target wrote these slots; the proposer rewrites its own below
            self.invalidate(self._blocks_between(chunk.block_ids, chunk.start, chunk.start + chunk.num_tokens))
        catch_ups = []
        for chunk in step.chunks:
            assert chunk.state is not None
            fed = self._fed.pop(chunk.request_id, None)
            if chunk.state.sampling_params.speculate:
                done = self._first_unseen(chunk)
                resume = self._resume_from(chunk, step, done, fed)
                catch_up = self._catch_up(chunk, step, resume)
                if catch_up is not None:
                    if resume > done:
                        catch_up.good_from = done
                    # A decode's few positions go through the decode kernel, as a verification's
                    # do, instead of a gather and SDPA per request per layer.
                    catch_up.chunk.rows_as_decodes = catch_up.chunk.num_tokens <= DECODE_ROW_CATCH_UP
                    catch_ups.append(catch_up)
        guesses: dict[str, list[int]] = {}
        carry: dict[str, Any] = {}
        if catch_ups:
            hidden = None
            if catch_ups[0].hidden is not None:
                hidden = torch.cat([c.hidden for c in catch_ups])
            chunks = [c.chunk for c in catch_ups]
            batch = prepare_batch(chunks, self.block_size)
            if hidden is not None:  # rows of the batch, which orders decode rows its own way
                hidden = hidden[self._source_rows(chunks, batch)]
            guesses, carry = self._pick(batch, hidden)
            size = self.block_size
            for catch_up in catch_ups:
                chunk = catch_up.chunk
                self._computed[chunk.request_id] = catch_up.done
                self.report.catch_up_tokens += chunk.num_tokens
                # Blocks now computed whole hold good KV.
                good_from = chunk.start if catch_up.good_from is None else catch_up.good_from
                self._good_blocks.update(chunk.block_ids[good_from // size : catch_up.done // size])
        self._guess_further(guesses, carry, {c.chunk.request_id: c for c in catch_ups}, step.lookahead)
        self.report.seconds = time.perf_counter() - started
        return guesses

    @staticmethod
    def _source_rows(chunks: list[ScheduledChunk], batch: PreparedBatch) -> torch.Tensor:
        """For each row of `batch`, its row in the chunks' tokens laid end to end."""
        offsets, total = {}, 0
        for chunk in chunks:
            offsets[chunk.request_id] = total
            total += chunk.num_tokens
        order = [0] * total
        for request_id, rows in batch.rows_of.items():
            for j, row in enumerate(rows):
                order[row] = offsets[request_id] + j
        return torch.tensor(order, dtype=torch.long)

    def _pick(self, batch: PreparedBatch, hidden: torch.Tensor | None) -> tuple[dict[str, list[int]], dict[str, Any]]:
        logits, carry = self._forward(batch, hidden)
        if not batch.sample_chunks:
            return {}, {}
        picked = logits.argmax(dim=-1).tolist()
        guesses = {chunk.request_id: [token] for chunk, token in zip(batch.sample_chunks, picked, strict=True)}
        carried = {chunk.request_id: None if carry is None else carry[i] for i, chunk in enumerate(batch.sample_chunks)}
        return guesses, carried

    def _guess_further(self, guesses: dict[str, list[int]], carry: dict[str, Any], catch_ups: dict[str, CatchUp],
                       lookahead: dict[str, int]) -> None:
        forwards = 0
        started = time.perf_counter()
        while True:
            step, step_carry = [], []
            for request_id, tokens in guesses.items():
                catch_up = catch_ups[request_id]
                chunk = catch_up.chunk
                # The last guess goes in right after the catch-up's last position, and on.
                position = chunk.start + chunk.num_tokens + len(tokens) - 1
                room = position < len(chunk.block_ids) * self.block_size
                if len(tokens) < min(lookahead.get(request_id, 0), self.max_tokens) and room:
                    step.append(ScheduledChunk(request_id, [tokens[-1]], position, chunk.block_ids, True, chunk.state))
                    step_carry.append(carry.get(request_id))
            if not step:
                break
            for chunk in step:  # a guess's KV is only as good as the guess
                self.invalidate(self._blocks_between(chunk.block_ids, chunk.start, chunk.start + 1))
            batch = prepare_batch(step, self.block_size)
            hidden = None
            if step_carry[0] is not None:
                order = {chunk.request_id: i for i, chunk in enumerate(step)}
                hidden = torch.stack([step_carry[order[c.request_id]] for c in batch.sample_chunks])
            picked, carried = self._pick(batch, hidden)
            for request_id, token in picked.items():
                guesses[request_id] += token
                carry[request_id] = carried[request_id]
            forwards += 1
        if forwards:
            self.report.guess_forward_seconds = (time.perf_counter() - started) / forwards
        for request_id, tokens in guesses.items():
            if len(tokens) > 1:  # all but the last guess went in, right after the catch-up
                chunk = catch_ups[request_id].chunk
                start = chunk.start + chunk.num_tokens
                blocks = self._blocks_between(chunk.block_ids, start, start + len(tokens) - 1)
                self._fed[request_id] = FedGuesses(start, tokens[:-1], blocks)
