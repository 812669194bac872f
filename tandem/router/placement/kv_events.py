"""Background reading of every worker's KV events into the router's `KvIndex`.

One task per worker, as for health polling, so a slow worker delays only its own entry. A
task starts from `GET /kv/snapshot`, then polls `GET /kv/events?since=<last id>` every
`interval_s` (at once while a worker's backlog comes in pages); whenever the index says the
feed broke (a gap, a restart), it takes a snapshot again. A worker without KV event
endpoints (404: an older worker) is asked again only every `_ABSENT_RETRY_S`, and is never
credited with cached blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import httpx

from tandem.router.placement.kv_index import KvIndex
from tandem.router.workers.registry import WorkerEndpoint, WorkerRegistry

logger = logging.getLogger(__name__)

_ABSENT_RETRY_S = 30.0
# A resync or the next page of a backlog follows at once, yet without spinning on a bad worker.
_AT_ONCE_S = 0.01


class KvEventPoller:
    def __init__(
        self,
        registry: WorkerRegistry,
        client: httpx.AsyncClient,
        index: KvIndex,
        interval_s: float,
        timeout_s: float,
        on_resync: Callable[[WorkerEndpoint, str], None] = lambda worker, reason: None,
    ) -> None:
        self.registry = registry
        self.client = client
        self.index = index
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._on_resync = on_resync
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._absent: set[str] = set()  # URLs whose /kv/snapshot answered 404

    def sync(self) -> None:
        """One task per worker URL: start new ones, stop and forget removed ones."""
        urls = {w.url for w in self.registry.workers}
        for url in list(self._tasks):
            if url not in urls:
                self._tasks.pop(url).cancel()
        self.index.retain(urls)
        for worker in self.registry.workers:
            if worker.url not in self._tasks:
                self._tasks[worker.url] = asyncio.create_task(
                    self._poll(worker), name=f"kv events {worker.url}"
                )

    async def poll_once(self, worker: WorkerEndpoint) -> float:
        """One step for one worker; returns how long to wait before the next."""
        entry = self.index.state(worker.url)
        try:
            if not entry.synced:
                reason = entry.unsynced_by
                reply = await self._get(worker, "/kv/snapshot")
                if reply is None:
                    return _ABSENT_RETRY_S if worker.url in self._absent else self.interval_s
                self.index.apply_snapshot(worker.url, reply)
                self._on_resync(worker, reason)
                logger.debug(
                    "KV index: %s synced at event %d with %d blocks (%s)",
                    worker.url,
                    entry.last_id,
                    len(entry.blocks),
                    reason,
                )
            reply = await self._get(worker, f"/kv/events?since={entry.last_id}")
            if reply is not None and not self.index.apply_events(worker.url, reply):
                return _AT_ONCE_S  # resync
            if reply is not None and reply.get("events") and reply["last_id"] > entry.last_id:
                return _AT_ONCE_S  # a page of a longer backlog: read on
        except (KeyError, TypeError, ValueError) as exc:
            self.index.unsync(worker.url, "error", f"malformed reply: {exc!r}")
        return self.interval_s

    async def _get(self, worker: WorkerEndpoint, path: str) -> dict[str, Any] | None:
        try:
            response = await self.client.get(
                worker.url + path, timeout=httpx.Timeout(self.timeout_s)
            )
        except httpx.HTTPError as exc:
            logger.debug("GET %s%s failed: %s", worker.url, path, exc)
            return None
        if response.status_code == 404:
            if worker.url not in self._absent:
                self._absent.add(worker.url)
                logger.info(
                    "worker %s publishes no KV events (GET %s is 404): it is routed by load only",
                    worker.url,
                    path.split("?")[0],
                )
            return None
        self._absent.discard(worker.url)
        if response.status_code != 200:
            logger.debug("GET %s%s answered %d", worker.url, path, response.status_code)
            return None
        reply = response.json()
        if not isinstance(reply, dict):
            raise ValueError(f"GET {path} did not answer a JSON object")
        return reply

    async def _poll(self, worker: WorkerEndpoint) -> None:
        while True:
            delay = self.interval_s
            if worker.healthy:
                try:
                    delay = await self.poll_once(worker)
                except Exception:  # a bug here must not stop polling for good
                    logger.exception("reading KV events from %s failed", worker.url)
            await asyncio.sleep(delay)

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
