"""How many tokens to speculate per request per step: only as many as pay for themselves.

A draft token costs a slot in the step whether or not it is accepted, and it pays only if
the target accepts it and every draft before it. With a request's per-position acceptance
rate α, its j-th draft token yields α^j expected tokens (Leviathan et al.: k drafts yield
(1 − α^(k+1)) / (1 − α) tokens per step, the 1 being the target's own token). A step over T
tokens takes about `fixed + per_token × T` seconds (fitted online from the engine's own
steps, `StepCostModel`), so the step's output rate is N / D with N the tokens it yields and
D its time. Adding a draft token with gain g raises that rate exactly when

    (N + g) / (D + per_token) > N / D   ⟺   g > per_token × N / D.

`choose_lookahead` adds draft tokens greedily, the largest gains first (every request's
first draft before anyone's second), while that holds. The rule needs no tuning table:

- batch 1, memory-bound step (fixed ≫ per_token): the bar is low, speculate deep;
- a large batch of decodes (N/D near 1/per_token, the step compute-bound): only
  near-certain tokens pass, down to k = 0;
- a step carrying a long prefill chunk yields few tokens for its time, so a draft costs
  little beside it and even a middling guess passes;
- a request whose drafts keep failing (prose) sees α, and so its gains, fall to nothing.

α is an exponentially weighted count per request (accepted / tested), started from the
proposer's running average over recent requests, so a new request's first guess is neither
blind trust nor a cold start. It never falls below `floor` (0.1): a request whose drafts
failed keeps trying one token where a token is cheap (batch 1: about 2% of a step here),
so it notices when its output turns predictable again (prose, then a quoted code block),
and stops trying where tokens are dear (a large batch, where the bar is far above 0.1).
Where the bar is above the floor, a request that has stopped guessing would never learn
again, so evidence fades without trials: each step a request's guesses are passed over, its
counts shrink (x0.9), and each step nobody guesses, the proposer-wide counts do too (x0.95),
so the estimates drift back to the prior and a guess is tried again now and then: a probe
of one token per request every few dozen steps, against locking out for good on a bad
start (the bench caught that: eight first guesses failed together at batch 8).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

_PRIOR_WEIGHT = 2.0  # positions' worth of the proposer-wide rate in a request's estimate
_GLOBAL_PRIOR_WEIGHT = 8.0  # positions' worth of `prior` in the proposer-wide rate


@dataclass
class StepCostModel:
    """step seconds ≈ fixed + per_token × tokens, by exponentially weighted least squares.

    Until the steps seen vary enough in size to separate the two terms, the ratio
    `prior_per_token_ratio` (per_token / fixed) stands in for the slope."""

    decay: float = 0.98
    prior_per_token_ratio: float = 0.02
    _w: float = 0.0
    _x: float = 0.0
    _xx: float = 0.0
    _y: float = 0.0
    _xy: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        d = self.decay
        self._w = d * self._w + 1.0
        self._x = d * self._x + tokens
        self._xx = d * self._xx + tokens * tokens
        self._y = d * self._y + seconds
        self._xy = d * self._xy + tokens * seconds

    @property
    def observed(self) -> bool:
        return self._w > 0

    def coefficients(self) -> tuple[float, float]:
        """(fixed, per_token) in seconds; (1, prior ratio) before any step was seen."""
        if not self._w:
            return 1.0, self.prior_per_token_ratio
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var_x = self._xx / self._w - mean_x * mean_x
        if var_x > 0.25:  # sizes differ enough to see a slope
            slope = (self._xy / self._w - mean_x * mean_y) / var_x
            fixed = mean_y - slope * mean_x
            if slope > 0 and fixed > 0:
                return fixed, slope
        # One size only (or a fit that makes no physical sense): split by the prior ratio.
        fixed = mean_y / (1.0 + self.prior_per_token_ratio * mean_x)
        return fixed, fixed * self.prior_per_token_ratio


@dataclass
class AcceptanceTracker:
    """Per-position acceptance rate α, per request and over the proposer's recent requests."""

    decay: float = 0.9
    prior: float = 0.5
    floor: float = 0.1
    _global_accepted: float = 0.0
    _global_tested: float = 0.0
    _requests: dict[str, list[float]] = field(default_factory=dict)  # id -> [accepted, tested]

    def global_rate(self) -> float:
        return ((self._global_accepted + _GLOBAL_PRIOR_WEIGHT * self.prior)
                / (self._global_tested + _GLOBAL_PRIOR_WEIGHT))

    def rate(self, request_id: str) -> float:
        counts = self._requests.get(request_id)
        base = self.global_rate()
        if counts is None:
            return max(base, self.floor)
        return max((counts[0] + _PRIOR_WEIGHT * base) / (counts[1] + _PRIOR_WEIGHT), self.floor)

    def observe(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """A verification: `num_accepted` of `num_proposed` drafts held. Positions tested are
        the accepted ones and, unless all held, the one that failed."""
        if num_proposed <= 0:
            return
        tested = num_accepted + (num_accepted < num_proposed)
        counts = self._requests.setdefault(request_id, [0.0, 0.0])
        counts[0] = self.decay * counts[0] + num_accepted
        counts[1] = self.decay * counts[1] + tested
        slow = self.decay ** 0.1  # the proposer-wide rate moves ten times slower
        self._global_accepted = slow * self._global_accepted + num_accepted
        self._global_tested = slow * self._global_tested + tested

    def passed_over(self, request_id: str) -> None:
        """The request had guesses this step and none was tried: its evidence fades."""
        counts = self._requests.get(request_id)
        if counts is not None:
            counts[0] *= self.decay
            counts[1] *= self.decay

    def nobody_tried(self) -> None:
        """A step with guesses on offer and none tried: the proposer-wide evidence fades."""
        self._global_accepted *= 0.95
        self._global_tested *= 0.95

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)


def choose_lookahead(rates: dict[str, float], caps: dict[str, int], base_tokens: int, num_sampling: int,
                     cost: StepCostModel, budget: int, extra_per_token: float = 0.0) -> dict[str, int]:
    """Draft tokens per request for this step (absent: 0), by the rule in the module docstring.

    `rates`: α per candidate request; `caps`: the most drafts each may take (k_max, room
    left before max_tokens or the context end); `base_tokens`: tokens the step computes
    anyway; `num_sampling`: tokens it yields anyway (one per request that samples);
    `budget`: token budget left in the step; `extra_per_token`: what proposing a token costs
    besides verifying it (a draft model's forward, shared by the requests guessing)."""
    fixed, per_token = cost.coefficients()
    per_token += extra_per_token
    produced = float(max(num_sampling, 1))
    seconds = fixed + per_token * base_tokens
    chosen: dict[str, int] = {}
    # Max-heap of each request's next gain: α^(k+1) for its (k+1)-th draft.
    heap = [(-rate, request_id) for request_id, rate in rates.items() if caps.get(request_id, 0) > 0 and rate > 0]
    heapq.heapify(heap)
    while heap and budget > 0:
        negative_gain, request_id = heapq.heappop(heap)
        gain = -negative_gain
        if gain * seconds <= per_token * produced:
            break  # the best remaining token would slow the step's output rate
        k = chosen.get(request_id, 0) + 1
        chosen[request_id] = k
        produced += gain
        seconds += per_token
        budget -= 1
        if k < caps[request_id]:
            heapq.heappush(heap, (negative_gain * rates[request_id], request_id))
    return chosen


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Leviathan et al.: (1 − α^(k+1)) / (1 − α) tokens per target step with k drafts."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
