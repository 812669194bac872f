"""A retry budget: retries may add at most a fixed share to the requests sent.

Retrying a failed hop on another worker is what keeps one bad worker from failing requests,
but in an overload every worker fails and every failure retried multiplies the load that
caused it. Linkerd's and Envoy's answer, used here: over a sliding window, retries are allowed
while they number fewer than `budget_ratio` × requests + `budget_min_per_s` × window (the floor lets a quiet
router retry at all). Past that, a hop's failure goes to the client at once.
"""

from __future__ import annotations

from collections import deque

from tandem.router.config import RetryPolicy


class RetryBudget:
    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self._requests: deque[float] = deque()
        self._retries: deque[float] = deque()

    def on_request(self, now: float) -> None:
        self._requests.append(now)
        self._prune(now)

    def try_retry(self, now: float) -> bool:
        """Whether one more retry fits the budget now; if so it is counted."""
        self._prune(now)
        allowed = self.policy.budget_ratio * len(self._requests) + self.policy.budget_min_per_s * self.policy.budget_window_s
        if len(self._retries) + 1 > allowed:
            return False
        self._retries.append(now)
        return True

    def _prune(self, now: float) -> None:
        for times in (self._requests, self._retries):
            while times and now - times[0] > self.policy.budget_window_s:
                times.popleft()
