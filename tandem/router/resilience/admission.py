"""Admission control: at most `max_in_flight` requests through the router, a bounded queue.

A request beyond `max_in_flight` waits, first come first served, for one to finish; when
`max_queue` are waiting already it gets a 429 at once (with Retry-After), and one that waited
`queue_timeout_s` gets a 408. Both are OpenAI-shaped and retryable. Without a bound, an
overload shows up as every request slowing down until clients time out and retry, which
makes it worse; with it, the excess is told at once.

A slot is held from admission until the request's response has ended (a stream's last byte),
which is when the proxy calls `leave`.
"""

from __future__ import annotations

import asyncio
import collections
import math

from tandem.edge.errors import APIError
from tandem.router.config import AdmissionPolicy


class AdmissionQueue:
    def __init__(self, policy: AdmissionPolicy) -> None:
        self.policy = policy
        self.in_flight = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def waiting(self) -> int:
        return sum(not w.done() for w in self._waiters)

    async def enter(self) -> None:
        """A slot, or an APIError: 429 (the queue is full) or 408 (waited too long)."""
        limit = self.policy.max_in_flight
        if not limit or (self.in_flight < limit and not self.waiting):
            self.in_flight += 1
            return
        if self.waiting >= self.policy.max_queue:
            raise APIError(
                429,
                f"the router is at capacity ({self.in_flight} requests in flight, "
                f"{self.waiting} waiting); retry shortly",
                None,
                "router_queue_full",
                headers={"Retry-After": str(max(1, math.ceil(self.policy.queue_timeout_s / 10)))},
            )
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.policy.queue_timeout_s)
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():
                return  # the slot arrived just as the wait ran out: take it
            waiter.cancel()
            raise APIError(
                408,
                f"the request waited {self.policy.queue_timeout_s:g} s in the router's queue "
                "without a free slot; retry later",
                None,
                "router_queue_timeout",
            ) from None
        except asyncio.CancelledError:  # the client left while waiting
            if waiter.done() and not waiter.cancelled():
                self.leave()  # it was handed a slot nobody will use
            else:
                waiter.cancel()
            raise

    def leave(self) -> None:
        """A request ended: its slot goes to the longest waiter, or back to the pool."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes on: in_flight is unchanged
                return
        self.in_flight = max(0, self.in_flight - 1)
