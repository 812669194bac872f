"""Verify draft tokens against the target model: keep the longest prefix it agrees with.

A request that brought k drafts d1..dk has k + 1 logits rows: row i is the target's
distribution for the token after d_i (row 0: after the request's last real token). Walking
the rows in order:

- **greedy**: the target's token at row i is its argmax; d_{i+1} holds if it equals that
  argmax. The tokens kept are the argmaxes up to and including the first mismatch, so the
  output is exactly what decoding without drafts would give.
- **random** (Leviathan et al., arXiv 2211.17192): with p the target distribution the
  normal sampler would draw from (temperature, top-k, top-p, min-p applied) and q the
  draft's, d holds with probability min(1, p(d) / q(d)); on the first rejection the token is
  drawn from normalise(max(0, p − q)), and if every draft held a bonus token is drawn from
  p of the last row, as the normal sampler would. Every kept token is then distributed as p.
  A proposer that only returns tokens (n-gram, suffix) is a point mass: q(d) = 1, so d holds
  with probability p(d) and the residual is p with d removed.

Penalties and min_tokens bans depend on the output so far, so row i sees the output with
d1..d_i appended. Draws use the request's own generator when it is seeded, so a seeded
request repeats itself run after run. Logprobs are of the raw model distribution, as the
normal sampler reports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.layers.sampler import Sampler, SamplingRow
from tandem.types import SampledToken, SamplingParams


@dataclass
class DraftedRequest:
    """One request's rows to verify: len(draft_token_ids) + 1 of them."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    draft_token_ids: list[int]
    generator: torch.Generator | None = None
    # Tokens banned while the output is shorter than min_tokens (stop tokens, EOS).
    min_tokens_banned: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None  # [k, vocab] the draft's q; None: point masses

    def rows(self) -> list[SamplingRow]:
        rows = []
        for i in range(len(self.draft_token_ids) + 1):
            output = self.output_token_ids + self.draft_token_ids[:i]
            banned = self.min_tokens_banned if len(output) < self.params.min_tokens else []
            rows.append(SamplingRow(self.params, self.prompt_token_ids, output, self.generator, banned))
        return rows


class RejectionSampler:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(self, logits: torch.Tensor, requests: list[DraftedRequest]) -> list[list[SampledToken]]:
        """`logits`: the requests' rows stacked in order; the kept tokens per request."""
        num_rows = sum(len(r.draft_token_ids) + 1 for r in requests)
        if num_rows != logits.shape[0]:
            raise ValueError(f"{logits.shape[0]} logits rows for {num_rows} rows to verify")
        results: list[list[SampledToken]] = []
        start = 0
        for request in requests:
            count = len(request.draft_token_ids) + 1
            results.append(self._verify(logits[start : start + count], request))
            start += count
        return results

    def _verify(self, logits: torch.Tensor, request: DraftedRequest) -> list[SampledToken]:
        params = request.params
        drafts = request.draft_token_ids
        rows = request.rows()
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if params.logprobs is not None else None
        if Sampler.plain_greedy(params, False) and not request.min_tokens_banned:
            chosen = logits.argmax(dim=-1).tolist()
        else:
            adjusted = self.sampler.adjusted_logits(logits, rows)
            if params.greedy:
                chosen = adjusted.argmax(dim=-1).tolist()
            else:
                chosen = self._accept_random(self.sampler.target_probs(adjusted, rows), request)
        kept: list[SampledToken] = []
        for i, token in enumerate(chosen):
            kept.append(self.sampler.sampled_token(token, params, None if raw_logprobs is None else raw_logprobs[i]))
            if i == len(drafts) or token != drafts[i]:
                break
        return kept

    def _accept_random(self, probs: torch.Tensor, request: DraftedRequest) -> list[int]:
        """Tokens by rejection sampling: the accepted drafts, then one drawn token."""
        generator = request.generator or self.sampler.generator
        drafts = request.draft_token_ids
        chosen: list[int] = []
        for i, draft in enumerate(drafts):
            p = probs[i]
            q_draft = 1.0 if request.draft_probs is None else float(request.draft_probs[i, draft])
            u = float(torch.rand((), generator=generator))
            if q_draft > 0 and u < min(1.0, float(p[draft]) / q_draft):
                chosen.append(draft)
                continue
            if request.draft_probs is None:
                residual = p.clone()
                residual[draft] = 0.0
            else:
                residual = (p - request.draft_probs[i].to(p.dtype)).clamp_min_(0.0)
            if float(residual.sum()) <= 0.0:
                residual = p  # p and q agree entirely: any draw from p is right
            chosen.append(self.sampler.draw(residual / residual.sum(), generator))
            return chosen
        chosen.append(self.sampler.draw(probs[len(drafts)], generator))
        return chosen
