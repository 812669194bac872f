"""A circuit breaker per worker: closed, open, half-open.

Health polls say whether a worker answers `/health`; the breaker says whether its requests
succeed. It is fed only by that worker's own failures as the router saw them (no connection,
no headers in time, a 5xx that is not a "busy, retry" 503, a stream that broke), never by a
client's 4xx, a client that left, or the other half of a prefill/decode pair: SGLang's gateway
once marked prefill workers dead for good because decode-side aborts fed their breakers.

- closed: requests flow; `failures` failures within `window_s` seconds open it.
- open: no requests for `cooldown_s`, doubling (up to `max_cooldown_s`) each time a trial
  fails, so a worker that stays broken costs one request per cool-down, not a stream of them.
- half-open: one trial request at a time; its success closes the breaker, its failure opens it.

A worker the health polls saw go down and come back up starts closed again: it is most
likely a new process (`tandem up` restarts dead workers), and its cool-down, doubled by the
trials that failed while it was down, would keep it idle long after it is back.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Literal

from tandem.router.config import BreakerPolicy

logger = logging.getLogger(__name__)

BreakerState = Literal["closed", "open", "half_open"]
STATE_CODES: dict[BreakerState, int] = {"closed": 0, "open": 1, "half_open": 2}


class CircuitBreaker:
    def __init__(self, name: str, policy: BreakerPolicy) -> None:
        self.name = name
        self.policy = policy
        self.state: BreakerState = "closed"
        self.trips = 0  # times it opened
        self._failures: deque[float] = deque()
        self._opened_at = 0.0
        self._cooldown = policy.cooldown_s
        self._trial_in_flight = False

    def allows(self, now: float) -> bool:
        """Whether a new request may go to the worker now (an open breaker whose cool-down
        is over turns half-open here and lets one trial through)."""
        if self.state == "open" and now - self._opened_at >= self._cooldown:
            self._move("half_open", "cool-down over; one trial request")
            self._trial_in_flight = False
        if self.state == "half_open":
            return not self._trial_in_flight
        return self.state == "closed"

    def on_dispatch(self) -> None:
        if self.state == "half_open":
            self._trial_in_flight = True

    def record_success(self) -> None:
        if self.state == "half_open":
            self._cooldown = self.policy.cooldown_s
            self._failures.clear()
            self._move("closed", "the trial request succeeded")

    def record_failure(self, now: float, reason: str) -> None:
        if self.state == "half_open":
            self._cooldown = min(self.policy.max_cooldown_s, self._cooldown * 2)
            self._open(now, f"the trial request failed: {reason}")
            return
        if self.state == "open":
            return  # requests sent before it opened, failing now
        self._failures.append(now)
        while self._failures and now - self._failures[0] > self.policy.window_s:
            self._failures.popleft()
        if len(self._failures) >= self.policy.failures:
            self._open(now, f"{len(self._failures)} failures in {self.policy.window_s:g} s, "
                            f"the last: {reason}")

    def reset(self, why: str) -> None:
        """Back to closed: the worker came back up (a restarted process is a new worker)."""
        self._failures.clear()
        self._cooldown = self.policy.cooldown_s
        self._trial_in_flight = False
        if self.state != "closed":
            self._move("closed", why)

    def _open(self, now: float, why: str) -> None:
        self._opened_at = now
        self._trial_in_flight = False
        self.trips += 1
        self._move("open", f"{why}; no requests for {self._cooldown:g} s")

    def _move(self, state: BreakerState, why: str) -> None:
        log = logger.warning if state == "open" else logger.info
        log("circuit breaker of %s: %s -> %s (%s)", self.name, self.state, state, why)
        self.state = state
