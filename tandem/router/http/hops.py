"""Opening a call's hop on a worker, and turning what a worker answers into the client's error.

The direct flow, the prefill/decode flow and a migrating stream all open hops the same way:
the best worker of a pool (placement), retried on others before the first byte (upstream),
with a pool that has no healthy worker as a 503 and a worker's 4xx as the client's own
answer (`Answered`). Reading a whole reply watches the client, so a client that leaves
cancels the hop.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from tandem.edge.disconnect import ClientGone, unless_disconnected
from tandem.edge.errors import APIError, error_body
from tandem.router.config import Role
from tandem.router.http.call import Answered, Call
from tandem.router.http.metrics import RouterMetrics
from tandem.router.http.sse import error_payload
from tandem.router.http.upstream import Hop, HopFailure, Upstream
from tandem.router.placement.placement import Placement
from tandem.router.workers.registry import DispatchKind, WorkerEndpoint, WorkerRegistry

PREFILL_ROLES: tuple[Role, ...] = ("prefill",)
WHOLE_ROLES: tuple[Role, ...] = ("decode", "both")  # serve whole requests and decode hops

_WORKER_NOTES = "x-tandem-max-tokens-"  # a capped max_tokens (tandem serve --max-tokens-policy)


class Hops:
    def __init__(
        self,
        registry: WorkerRegistry,
        placement: Placement,
        upstream: Upstream,
        metrics: RouterMetrics,
    ) -> None:
        self.registry = registry
        self.placement = placement
        self.upstream = upstream
        self.metrics = metrics

    def choose(self, call: Call, roles: tuple[Role, ...], hop_name: str) -> WorkerEndpoint | None:
        """The worker of `roles` that placement would pick for `call` now."""
        return self.placement.choose(self.registry.pool(roles), call.prompt_route, hop_name)

    async def open(
        self,
        call: Call,
        request: Request | None,
        hop_name: str,
        roles: tuple[Role, ...],
        body: dict[str, Any],
        kind: DispatchKind,
        tokens: int,
        preferred: WorkerEndpoint | None = None,
        avoid: frozenset[str] = frozenset(),
    ) -> Hop:
        """Open a hop on the best worker of `roles`, retrying on others; errors as responses.

        Workers in `avoid` (a migrated stream's failed ones) are the last resort."""

        def pick(exclude: set[str]) -> WorkerEndpoint | None:
            if (
                preferred is not None
                and preferred.available(time.monotonic())
                and preferred.url not in exclude
            ):
                return preferred
            pool = [w for w in self.registry.pool(roles) if w.url not in exclude]
            fresh = [w for w in pool if w.url not in avoid]
            return self.placement.choose(fresh or pool, call.prompt_route, hop_name)

        if call.first_hop_at is None:
            call.first_hop_at = time.monotonic()
            self.metrics.overhead.observe(call.first_hop_at - call.received)
        def prefill_work(worker: WorkerEndpoint) -> int:
            return call.prompt_route.prefill_work(worker.url)

        load: int | Callable[[WorkerEndpoint], int] = prefill_work if kind == "prefill" else tokens
        work = self.upstream.open_with_retries(
            hop_name, pick, call.path, body, call.headers, kind, load
        )
        try:
            hop = await (work if request is None else unless_disconnected(request, work))
        except LookupError:
            raise no_worker("prefill" if hop_name == "prefill" else "decode") from None
        except HopFailure as failure:
            raise _failure_response(failure) from None
        call.retries += hop.attempts - 1
        self.metrics.hops.labels(hop.worker.url, hop_name, str(hop.status)).inc()
        return hop

    async def raise_client_error(self, hop: Hop) -> None:
        """A 4xx from a worker is the client's: the same status and body, no retry."""
        if hop.status < 400:
            return
        try:
            data = await self.upstream.read(hop.response)
        finally:
            await hop.close()
        headers = {k: v for k, v in hop.response.headers.items() if k.lower() == "retry-after"}
        raise Answered(
            Response(
                data,
                status_code=hop.status,
                headers=headers,
                media_type=hop.response.headers.get("content-type", "application/json"),
            )
        )

    async def error_event(self, hop: Hop) -> dict[str, Any]:
        """A hop's error reply (status >= 400) as an event for a stream that has started."""
        return error_payload(await self.upstream.read(hop.response), hop.status)

    async def read_reply(self, hop: Hop, request: Request) -> dict[str, Any]:
        try:
            data = await unless_disconnected(request, self.upstream.read(hop.response))
        except TimeoutError:
            raise APIError(
                504, f"worker {hop.worker.url} stopped sending its reply", code="worker_timeout"
            ) from None
        except Exception as exc:
            if isinstance(exc, ClientGone):
                raise
            raise APIError(
                502,
                f"worker {hop.worker.url} failed: {type(exc).__name__}: {exc}",
                code="worker_failed",
            ) from None
        finally:
            await hop.close()
        try:
            reply = json.loads(data)
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            raise APIError(
                502,
                f"worker {hop.worker.url} sent a reply that is not a JSON object",
                code="worker_failed",
            )
        return reply


def worker_notes(hop: Hop) -> dict[str, str]:
    """The worker's notes to the client that the router passes on: what max_tokens it ran
    with. A prefill/decode stream starts before its decode hop answers, so it has none."""
    return {k: v for k, v in hop.response.headers.items() if k.lower().startswith(_WORKER_NOTES)}


def no_worker(pool: str) -> APIError:
    """503 with Retry-After: the pool has no healthy worker now, but health polls may find one."""
    return APIError(
        503,
        f"no healthy {pool} worker is available; retry shortly",
        code="no_healthy_worker",
        headers={"Retry-After": "1"},
    )


def _failure_response(failure: HopFailure) -> Exception:
    if failure.status is not None:
        body = failure.body
        try:
            valid = isinstance(json.loads(body), dict)
        except ValueError:
            valid = False
        if not valid:
            body = json.dumps(
                error_body(
                    failure.status, f"worker {failure.worker.url} answered HTTP {failure.status}"
                )
            ).encode()
        return Answered(
            Response(
                body,
                status_code=failure.status,
                headers=failure.headers,
                media_type="application/json",
            )
        )
    if failure.timed_out:
        return APIError(
            504, f"worker {failure.worker.url}: {failure.reason}", code="worker_timeout"
        )
    return APIError(
        502,
        f"no worker could be reached (last: {failure.worker.url}: {failure.reason})",
        code="worker_unavailable",
    )
