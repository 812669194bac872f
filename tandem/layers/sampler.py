"""Turn a step's logits into tokens, one row per sequence, each with its own parameters.

Order, as in vLLM: penalties on the raw logits, then greedy argmax, or temperature ->
top-k -> top-p -> min-p -> a draw. Draws use the exponential race (argmax p / E with
E ~ Exp(1)), which lets a seeded request draw its noise from its own generator so its output
does not depend on what else shares the batch. Logprobs are of the raw model distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.kernels.layer_ops import LayerOpsKernel
from tandem.types import _GREEDY_EPS, SampledToken, SamplingParams, TokenLogprob

# Where penalised logits are clamped (a second line of defence behind the request checks):
# far beyond any model's logits, yet divided by the smallest temperature that samples
# (_GREEDY_EPS) still finite in float32, so a repetition_penalty of 1e-300 cannot make an
# inf, and then a NaN, of a probability.
_LOGIT_LIMIT = torch.finfo(torch.float32).max * _GREEDY_EPS / 4


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None
    banned_token_ids: list[int] = field(default_factory=list)  # e.g. EOS before min_tokens


class Sampler:
    def __init__(self, seed: int = 0, ops: LayerOpsKernel | None = None) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        # The C argmax (kernels/layer_ops.py) where it built: torch's is ~2 cycles a value,
        # 1.3 ms of a 64-sequence decode step over SmolLM2's vocabulary.
        self.ops = ops

    @staticmethod
    def plain_greedy(params: SamplingParams, banning: bool) -> bool:
        """Greedy with nothing to adjust or report: the token is the raw logits' argmax."""
        return params.greedy and params.logprobs is None and not banning and not params.has_penalties

    def argmax_ids(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's argmax, the first of equal maxima, as torch.argmax gives it."""
        if self.ops is not None and self.ops.takes_argmax(logits):
            return self.ops.argmax(logits)
        return logits.argmax(dim=-1)

    def argmax(self, logits: torch.Tensor) -> list[SampledToken]:
        """The common agent case, and every decode step of it: one argmax, no copies."""
        return [SampledToken(t) for t in self.argmax_ids(logits).tolist()]

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
        if all(self.plain_greedy(r.params, bool(r.banned_token_ids)) for r in rows):
            return self.argmax(logits)
        want_logprobs = any(r.params.logprobs is not None for r in rows)
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if want_logprobs else None
        logits = self.adjusted_logits(logits, rows)

        token_ids = torch.empty(len(rows), dtype=torch.long)
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        random = [i for i, r in enumerate(rows) if not r.params.greedy]
        if greedy:
            token_ids[greedy] = self.argmax_ids(logits[greedy])
        if random:
            token_ids[random] = self._draw(logits[random], [rows[i] for i in random])

        chosen = token_ids.tolist()
        results = []
        for i, (row, token) in enumerate(zip(rows, chosen, strict=True)):
            row_logprobs = None if raw_logprobs is None else raw_logprobs[i]
            results.append(self.sampled_token(token, row.params, row_logprobs))
        return results

    @staticmethod
    def sampled_token(token: int, params: SamplingParams, row_logprobs: torch.Tensor | None) -> SampledToken:
        """The token with the logprobs its request asked for, from the raw model distribution."""
        if row_logprobs is None or params.logprobs is None:
            return SampledToken(token)
        token_logprob = float(row_logprobs[token])
        top = None
        if params.logprobs > 0:
            values, indices = row_logprobs.topk(params.logprobs)
            top = [
                TokenLogprob(int(t), float(v), rank + 1)
                for rank, (v, t) in enumerate(zip(values.tolist(), indices.tolist(), strict=True))
            ]
        rank = int((row_logprobs > token_logprob).sum()) + 1
        return SampledToken(token, token_logprob, [TokenLogprob(token, token_logprob, rank)] + (top or []))

    def adjusted_logits(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """float32 logits with each row's penalties and bans applied (a copy when any apply)."""
        logits = logits.float()
        if any(r.params.has_penalties or r.banned_token_ids for r in rows):
            logits = logits.clone()
            for i, row in enumerate(rows):
                self._apply_penalties(logits[i], row)
        return logits

    def target_probs(self, adjusted: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The distribution each (random) row's token is drawn from, in vocabulary order:
        temperature, then top-k, top-p and min-p, as `__call__` draws."""
        logits = adjusted / self._temperatures(rows, adjusted.dtype)
        if any(r.params.top_k or r.params.top_p < 1.0 or r.params.min_p > 0 for r in rows):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            self._filter_sorted(sorted_logits, rows)
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        return torch.softmax(logits, dim=-1)

    def draw(self, probs: torch.Tensor, generator: torch.Generator | None) -> int:
        """One draw from a distribution (one row), by the exponential race."""
        noise = torch.empty_like(probs).exponential_(generator=generator or self.generator)
        return int((probs / noise).argmax())

    @staticmethod
    def _temperatures(rows: list[SamplingRow], dtype: torch.dtype) -> torch.Tensor:
        """Each row's temperature as a column; one past float32's range (1e300) is capped
        there, so that a banned token's -inf divided by it stays -inf, not NaN."""
        temperatures = torch.tensor([r.params.temperature for r in rows], dtype=dtype).unsqueeze(1)
        return temperatures.clamp_(max=torch.finfo(dtype).max)

    @staticmethod
    def _apply_penalties(row_logits: torch.Tensor, row: SamplingRow) -> None:
        params = row.params
        vocab = row_logits.shape[0]
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)), dtype=torch.long)
            seen = seen[seen < vocab]
            if seen.numel():
                values = row_logits[seen]
                row_logits[seen] = torch.where(
                    values > 0, values / params.repetition_penalty, values * params.repetition_penalty
                )
        if (params.frequency_penalty or params.presence_penalty) and row.output_token_ids:
            counts = torch.bincount(torch.tensor(row.output_token_ids, dtype=torch.long), minlength=vocab)[:vocab]
            row_logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
        if params.has_penalties:
            # Finite whatever the penalty: a tiny repetition_penalty overflows to inf, a huge
            # one sends every seen token to -inf (all of them: a row of NaN after softmax).
            row_logits.nan_to_num_(nan=-_LOGIT_LIMIT, posinf=_LOGIT_LIMIT, neginf=-_LOGIT_LIMIT)
            row_logits.clamp_(-_LOGIT_LIMIT, _LOGIT_LIMIT)
        if row.banned_token_ids:
            banned = torch.tensor([t for t in row.banned_token_ids if 0 <= t < vocab], dtype=torch.long)
            row_logits[banned] = float("-inf")

    def _draw(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        logits = logits / self._temperatures(rows, logits.dtype)
        needs_filter = any(r.params.top_k or r.params.top_p < 1.0 or r.params.min_p > 0 for r in rows)
        if needs_filter:
            logits, order = logits.sort(dim=-1, descending=True)
            self._filter_sorted(logits, rows)
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs)
        for i, row in enumerate(rows):
            noise[i].exponential_(generator=row.generator or self.generator)
        picked = (probs / noise).argmax(dim=-1)
        if needs_filter:
            picked = order.gather(1, picked.unsqueeze(1)).squeeze(1)
        return picked

    @staticmethod
    def _filter_sorted(sorted_logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        """Mask (in place) what top-k, top-p and min-p exclude, on logits sorted descending."""
        vocab = sorted_logits.shape[1]
        ranks = torch.arange(vocab).unsqueeze(0)
        # Clamped to the vocabulary before it becomes a tensor: a top_k of 2**63 overflowed
        # int64 here and killed the engine. Past the vocabulary, or 0 (or < 0), it is off.
        top_k = torch.tensor([r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]).unsqueeze(1)
        sorted_logits.masked_fill_(ranks >= top_k, float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        top_p = torch.tensor([r.params.top_p for r in rows], dtype=probs.dtype).unsqueeze(1)
        mass_before = probs.cumsum(dim=-1) - probs
        exclude = mass_before >= top_p
        min_p = torch.tensor([r.params.min_p for r in rows], dtype=probs.dtype).unsqueeze(1)
        exclude |= probs < min_p * probs[:, :1]
        exclude[:, 0] = False  # the most likely token always survives
        sorted_logits.masked_fill_(exclude, float("-inf"))
