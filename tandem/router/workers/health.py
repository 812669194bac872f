"""Background polling of every worker's /health and /load, one task per worker.

One task per worker (not one loop over all) so that a hung worker, whose polls each wait the
full timeout, does not make every other worker's load figures stale. Requests that fail to
reach a worker count as failed probes too, so a dead worker goes down within a few requests
even between polls.

When a request through this router ends on a worker, the last /load still counts it (as
running KV tokens, say) until the next poll: `refresh_load` polls that worker's /load at once,
so the next placement does not see the load of a request that is already gone. This matters
most for kv_aware routing, where a conversation's previous turn, still counted as load, would
otherwise cancel out exactly the cache hit its next turn should get there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import httpx

from tandem.router.config import HealthPolicy, ScoringConfig
from tandem.router.workers.registry import LoadSnapshot, WorkerEndpoint, WorkerRegistry

logger = logging.getLogger(__name__)


class HealthMonitor:
    def __init__(
        self,
        registry: WorkerRegistry,
        client: httpx.AsyncClient,
        policy: HealthPolicy,
        scoring: ScoringConfig,
    ) -> None:
        self.registry = registry
        self.client = client
        self.policy = policy
        self.scoring = scoring
        self._tasks: dict[WorkerEndpoint, asyncio.Task[None]] = {}
        self._refreshing: set[WorkerEndpoint] = set()
        self._refresh_again: set[WorkerEndpoint] = set()
        self._refreshes: set[asyncio.Task[None]] = set()

    def record(self, worker: WorkerEndpoint, ok: bool, reason: str = "") -> None:
        """Count one outcome and log the transitions (the only place that does)."""
        first = not worker.health.probed
        if worker.health.record(ok):
            if worker.healthy:
                logger.info("worker %s (%s) is up", worker.url, worker.role)
                worker.breaker.reset("its /health is back")
                worker.draining = False  # a drained worker that restarted takes requests again
            else:
                logger.warning(
                    "worker %s (%s) is down after %d failures: %s%s",
                    worker.url,
                    worker.role,
                    worker.health.consecutive_failures,
                    reason or "unreachable",
                    f"; giving up {worker.in_flight} request(s) on it" if worker.in_flight else "",
                )
                worker.lost()
        elif first and not ok:
            logger.warning(
                "worker %s (%s) is not reachable yet: %s", worker.url, worker.role, reason
            )

    async def probe(self, worker: WorkerEndpoint) -> None:
        started = time.monotonic()
        timeout = httpx.Timeout(self.policy.timeout_s)
        try:
            response = await self.client.get(f"{worker.url}/health", timeout=timeout)
            ok, reason = response.status_code == 200, f"/health answered {response.status_code}"
        except httpx.HTTPError as exc:
            ok, reason = False, f"{type(exc).__name__}: {exc}".rstrip(": ")
        self.record(worker, ok, reason)
        if ok:
            await self._poll_load(worker, started)

    async def _poll_load(self, worker: WorkerEndpoint, started: float) -> None:
        try:
            response = await self.client.get(
                f"{worker.url}/load", timeout=httpx.Timeout(self.policy.timeout_s)
            )
            if response.status_code == 200:
                worker.on_load(
                    LoadSnapshot.from_json(response.json()), started, self.scoring.reflect_delay_s
                )
        except (httpx.HTTPError, ValueError) as exc:
            logger.debug("GET %s/load failed: %s", worker.url, exc)

    def refresh_load(self, worker: WorkerEndpoint) -> None:
        """Poll the worker's /load now; one poll at a time, another after it if asked again."""
        if worker in self._refreshing:
            self._refresh_again.add(worker)
            return
        self._refreshing.add(worker)
        task = asyncio.create_task(self._refresh(worker), name=f"refresh {worker.url}")
        self._refreshes.add(task)
        task.add_done_callback(self._refreshes.discard)

    async def _refresh(self, worker: WorkerEndpoint) -> None:
        try:
            while True:
                self._refresh_again.discard(worker)
                await self._poll_load(worker, time.monotonic())
                if worker not in self._refresh_again:
                    return
        finally:
            self._refreshing.discard(worker)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(w) for w in self.registry.workers))

    def sync(self) -> None:
        """One polling task per current worker: start new ones, stop removed ones."""
        current = set(self.registry.workers)
        for worker in list(self._tasks):
            if worker not in current:
                self._tasks.pop(worker).cancel()
        for worker in current:
            if worker not in self._tasks:
                self._tasks[worker] = asyncio.create_task(
                    self._poll(worker), name=f"poll {worker.url}"
                )

    async def _poll(self, worker: WorkerEndpoint) -> None:
        while True:
            await asyncio.sleep(self.policy.interval_s)
            try:
                await self.probe(worker)
            except Exception:  # a bug here must not stop polling for good
                logger.exception("polling %s failed", worker.url)

    async def stop(self) -> None:
        tasks = [*self._tasks.values(), *self._refreshes]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
