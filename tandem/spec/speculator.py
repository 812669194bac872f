"""The scheduler's side of speculative decoding: whose drafts go into this step, and how many.

After the scheduler has placed every running request's own tokens, it hands the requests
whose chunk reaches the end of their known tokens (decodes, and a prompt's last chunk) to
`plan`: the proposer guesses up to k_max tokens for each, the adaptive rule keeps only the
tokens expected to pay (tandem/spec/adaptive.py), and the kept drafts become extra tokens of
those requests in the same step. After the step, `record` learns from what the target
accepted. Torch-free: it runs in the engine core beside the scheduler.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tandem.config import SpeculativeConfig
from tandem.spec.adaptive import AcceptanceTracker, StepCostModel, choose_lookahead
from tandem.spec.proposer import TokenProposer
from tandem.spec.stats import SpecDecodeStats
from tandem.types import Request

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Candidate:
    request: Request
    cap: int  # the most drafts it may take: k_max, tokens left before max_tokens / the context end


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: TokenProposer | None) -> None:
        """`proposer` None: the workers propose (a draft model runs beside the target after
        each step); their guesses arrive on the requests (`Request.spec_token_ids`)."""
        self.config = config
        self.proposer = proposer
        self.max_tokens = config.num_speculative_tokens
        # KV slots a worker-side proposer writes past the verified tokens: its own guesses.
        self.lookahead = self.max_tokens if proposer is None else 0
        self.cost = StepCostModel()
        self.acceptance = AcceptanceTracker()
        self.stats = SpecDecodeStats()
        self.draft_forward_seconds = 0.0  # a worker-side draft's single-token forward, smoothed

    def plan(self, candidates: list[Candidate], base_tokens: int, num_sampling: int,
             budget: int) -> dict[str, list[int]]:
        """Draft tokens per request for this step; requests with none are absent."""
        proposals: dict[str, list[int]] = {}
        for candidate in candidates:
            request = candidate.request
            cap = min(candidate.cap, self.max_tokens)
            if cap <= 0:
                continue
            if self.proposer is None:
                drafts = request.spec_token_ids
            else:
                drafts = self.proposer.propose(request.request_id, request.all_token_ids, request.num_prompt_tokens,
                                               cap)
            if drafts:
                proposals[request.request_id] = drafts[:cap]
        if not proposals:
            return {}
        if not self.config.adaptive:
            kept: dict[str, list[int]] = {}
            for request_id, drafts in proposals.items():
                if budget <= 0:
                    break
                kept[request_id] = drafts[:budget]
                budget -= len(kept[request_id])
            return kept
        rates = {request_id: self.acceptance.rate(request_id) for request_id in proposals}
        caps = {request_id: len(drafts) for request_id, drafts in proposals.items()}
        chosen = choose_lookahead(rates, caps, base_tokens, num_sampling, self.cost, budget)
        for request_id in proposals.keys() - chosen.keys():
            self.acceptance.passed_over(request_id)
        if not chosen:
            self.acceptance.nobody_tried()
        return {request_id: proposals[request_id][:k] for request_id, k in chosen.items()}

    def guesses_wanted(self, candidates: list[Candidate], base_tokens: int, num_sampling: int) -> dict[str, int]:
        """How many guesses a worker-side proposer should make for each request after this
        step: what the adaptive rule would verify next step, a draft forward's cost included
        (shared by the requests guessing), or k_max (capped) when k is fixed."""
        caps = {c.request.request_id: min(c.cap, self.max_tokens) for c in candidates}
        if not self.config.adaptive:
            return {request_id: cap for request_id, cap in caps.items() if cap > 0}
        rates = {request_id: self.acceptance.rate(request_id) for request_id in caps}
        extra = self.draft_forward_seconds / max(len(caps), 1)
        return choose_lookahead(rates, caps, base_tokens, num_sampling, self.cost, 1 << 30, extra)

    def observe_draft(self, forward_seconds: float) -> None:
        if forward_seconds > 0:
            previous = self.draft_forward_seconds
            self.draft_forward_seconds = forward_seconds if not previous else 0.8 * previous + 0.2 * forward_seconds

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        self.stats.record(num_proposed, num_accepted)
        self.acceptance.observe(request_id, num_proposed, num_accepted)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.cost.observe(num_tokens, seconds)

    def request_finished(self, request: Request) -> None:
        self.acceptance.forget(request.request_id)
        if self.proposer is not None:
            self.proposer.request_finished(request.request_id, request.all_token_ids, request.num_prompt_tokens)
