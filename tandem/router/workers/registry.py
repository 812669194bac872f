"""What the router knows about each worker: health, last polled load, and its own dispatches.

A worker's /load lags reality by a poll interval (and by an engine step), so the router also
remembers the tokens it has routed to each worker since: a burst of requests arriving between
two polls must not all land on the worker that looked idle at the last poll.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tandem.router.config import BreakerPolicy, HealthPolicy, Role, WorkerSpec
from tandem.router.resilience.breaker import CircuitBreaker

logger = logging.getLogger(__name__)

DispatchKind = Literal["prefill", "decode"]


@dataclass
class HealthState:
    """Down after N consecutive failures, up after M consecutive successes.

    A worker never probed yet comes up on its first success: a router (or a reload) should not
    wait M poll intervals before using workers that are already there.
    """

    failures_to_down: int = 3
    successes_to_up: int = 2
    healthy: bool = False
    probed: bool = False
    consecutive_failures: int = 0
    consecutive_successes: int = 0

    def record(self, ok: bool) -> bool:
        """Count one probe or request outcome; True when `healthy` flipped."""
        first = not self.probed
        self.probed = True
        if ok:
            self.consecutive_successes += 1
            self.consecutive_failures = 0
            if not self.healthy and (first or self.consecutive_successes >= self.successes_to_up):
                self.healthy = True
                return True
            return False
        self.consecutive_failures += 1
        self.consecutive_successes = 0
        if self.healthy and self.consecutive_failures >= self.failures_to_down:
            self.healthy = False
            return True
        return False


@dataclass(frozen=True)
class LoadSnapshot:
    """The fields of a worker's `GET /load` the scores use (the whole reply is kept in `raw`)."""

    waiting_prefill_tokens: int = 0
    waiting_requests: int = 0
    running_requests: int = 0
    running_kv_tokens: int = 0
    kv_blocks_total: int = 0
    block_size: int = 16
    raw: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LoadSnapshot:
        def num(key: str, default: int = 0) -> int:
            value = data.get(key, default)
            return int(value) if isinstance(value, int | float) else default

        return cls(
            waiting_prefill_tokens=num("num_waiting_prefill_tokens"),
            waiting_requests=num("num_waiting_requests"),
            running_requests=num("num_running_requests"),
            running_kv_tokens=num("running_kv_tokens"),
            kv_blocks_total=num("kv_blocks_total"),
            block_size=num("block_size", 16) or 16,
            raw=data,
        )

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv_blocks_total * self.block_size


@dataclass
class _Dispatch:
    kind: DispatchKind
    tokens: int
    at: float


class WorkerEndpoint:
    """One worker endpoint in one role; the router's only mutable view of it."""

    def __init__(
        self, spec: WorkerSpec, policy: HealthPolicy, breaker: BreakerPolicy | None = None
    ) -> None:
        self.spec = spec
        self.health = HealthState(policy.failures_to_down, policy.successes_to_up)
        self.breaker = CircuitBreaker(f"{spec.role} worker {spec.url}", breaker or BreakerPolicy())
        self.draining = False  # POST /workers/{id}/drain: no new requests
        self.load: LoadSnapshot | None = None
        self.load_at: float | None = None
        self.in_flight = 0
        self.last_picked = 0  # the registry's pick counter when last chosen (ties → least recent)
        self._dispatches: dict[int, _Dispatch] = {}
        self._ids = itertools.count()
        # Waits on this worker (a stream's next chunk, a reply's headers) that end at once
        # when its health checks mark it down: a cut link sends no reset, only silence.
        self._on_lost: set[Callable[[], None]] = set()

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def id(self) -> str:
        """host:port, the name POST /workers/{id}/drain takes."""
        return self.url.split("://", 1)[-1].rstrip("/")

    @property
    def role(self) -> Role:
        return self.spec.role

    @property
    def block_size(self) -> int | None:
        """Tokens per KV block, as the worker's last /load said; None before it has answered
        (or if it did not say). A prefill/decode handoff needs both sides' to be equal."""
        value = self.load.raw.get("block_size") if self.load is not None else None
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    @property
    def healthy(self) -> bool:
        return self.health.healthy

    def available(self, now: float) -> bool:
        """Whether a new request may go here: up, its breaker lets it, not draining."""
        return self.health.healthy and not self.draining and self.breaker.allows(now)

    def watch_lost(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` if this worker goes down; returns the function that unregisters."""
        self._on_lost.add(callback)
        return lambda: self._on_lost.discard(callback)

    def lost(self) -> None:
        """Its health checks failed: every wait on it gives up now."""
        for callback in list(self._on_lost):
            callback()

    # --- the router's own record of what it sent -----------------------------------
    def dispatch(self, kind: DispatchKind, tokens: int, now: float) -> int:
        self.breaker.on_dispatch()
        handle = next(self._ids)
        self._dispatches[handle] = _Dispatch(kind, tokens, now)
        return handle

    def settle(self, handle: int) -> None:
        """The dispatch adds no load the poll cannot see (its prefill is over, or it ended)."""
        self._dispatches.pop(handle, None)

    def unreflected_tokens(self, kind: DispatchKind | None = None) -> int:
        return sum(d.tokens for d in self._dispatches.values() if kind is None or d.kind == kind)

    def unreflected_requests(self) -> int:
        return len(self._dispatches)

    def on_load(
        self, snapshot: LoadSnapshot, poll_started_at: float, reflect_delay_s: float
    ) -> None:
        """A fresh /load: dispatches sent well before the poll started are in its figures now."""
        if self.load_at is not None and poll_started_at < self.load_at:
            return  # an older poll answering late (a refresh overtook it)
        self.load = snapshot
        self.load_at = poll_started_at
        stale = [
            h for h, d in self._dispatches.items() if d.at + reflect_delay_s <= poll_started_at
        ]
        for handle in stale:
            del self._dispatches[handle]

    def describe(self, now: float) -> dict[str, Any]:
        return {
            "id": self.id,
            "url": self.url,
            "role": self.role,
            "healthy": self.healthy,
            "breaker": self.breaker.state,
            "breaker_trips": self.breaker.trips,
            "draining": self.draining,
            "consecutive_failures": self.health.consecutive_failures,
            "consecutive_successes": self.health.consecutive_successes,
            "in_flight": self.in_flight,
            "unreflected_tokens": self.unreflected_tokens(),
            "load_age_s": None if self.load_at is None else round(now - self.load_at, 3),
            "load": None if self.load is None else self.load.raw,
        }


def other_block_sizes(pool: Sequence[WorkerEndpoint], worker: WorkerEndpoint) -> frozenset[str]:
    """The URLs in `pool` whose KV blocks are of another size than `worker`'s, by their last
    /load; a size not yet reported counts as equal."""
    if worker.block_size is None:
        return frozenset()
    return frozenset(w.url for w in pool if w.block_size is not None and w.block_size != worker.block_size)


class WorkerRegistry:
    """The current worker list; a reload keeps the state of workers that stay."""

    def __init__(
        self,
        specs: tuple[WorkerSpec, ...],
        policy: HealthPolicy,
        breaker: BreakerPolicy | None = None,
    ) -> None:
        self._policy = policy
        self._breaker = breaker or BreakerPolicy()
        self._workers: dict[WorkerSpec, WorkerEndpoint] = {}
        self._picks = itertools.count(1)
        self.replace(specs)

    @property
    def workers(self) -> tuple[WorkerEndpoint, ...]:
        return tuple(self._workers.values())

    def replace(
        self, specs: tuple[WorkerSpec, ...]
    ) -> tuple[list[WorkerEndpoint], list[WorkerEndpoint]]:
        """Adopt a new list; returns (added, removed). In-flight requests keep their
        WorkerEndpoint."""
        removed = [w for spec, w in self._workers.items() if spec not in specs]
        added = []
        workers = {}
        for spec in specs:
            worker = self._workers.get(spec)
            if worker is None:
                worker = WorkerEndpoint(spec, self._policy, self._breaker)
                added.append(worker)
            workers[spec] = worker
        self._workers = workers
        return added, removed

    def pool(self, roles: tuple[Role, ...], healthy_only: bool = True) -> list[WorkerEndpoint]:
        """The workers of these roles that may take a new request now (or all of them)."""
        now = time.monotonic()
        return [
            w
            for w in self._workers.values()
            if w.role in roles and (not healthy_only or w.available(now))
        ]

    def mark_picked(self, worker: WorkerEndpoint) -> None:
        worker.last_picked = next(self._picks)
