"""One client request through the router: admitted, then served direct or prefill + decode.

The proxy is the coordinator. It reads and checks the body, counts the prompt, admits the
call (the caller's rate limits and quota, then a slot in the bounded queue), lets placement
prepare the route, and decides between the direct path (direct.py: one worker serves it
whole) and the prefill/decode path (pd_flow.py); a stream's relay and its migration to
another worker are relay.py's, and the call's closing metrics and ledger row are
bookkeeping.py's. Errors raised on the way (`APIError`, a worker's own `Answered` reply, a
client that left) become the client's response here.

The response status the client sees is decided before any byte is sent: the first hop is
opened (with retries) before the response starts. Client disconnects propagate: a stream's
generator is cancelled by Starlette and closes its upstream stream; a whole (non-streamed)
request is watched and cancelled the same way. A worker aborts a request whose connection
closes.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tandem.edge.disconnect import ClientGone, unless_disconnected
from tandem.edge.drain import Drain
from tandem.edge.errors import APIError
from tandem.edge.limits import check_shape
from tandem.edge.protocols.base import ProtocolAdapter, Translated
from tandem.router.accounting.accounting import Accounting
from tandem.router.accounting.auth import caller_key_of, caller_of
from tandem.router.config import RouterConfig
from tandem.router.http.bookkeeping import Bookkeeping
from tandem.router.http.call import Answered, Call
from tandem.router.http.direct import Direct
from tandem.router.http.hops import PREFILL_ROLES, Hops
from tandem.router.http.metrics import RouterMetrics
from tandem.router.http.pd_flow import KvRelease, PdFlow
from tandem.router.http.protocol import in_protocol, protocol_error
from tandem.router.http.relay import Relay
from tandem.router.http.upstream import Upstream
from tandem.router.pd.merge import Identity, Kind
from tandem.router.pd.split import decide_route
from tandem.router.placement.placement import Placement
from tandem.router.placement.prompt_tokens import PromptCounter
from tandem.router.resilience.admission import AdmissionQueue
from tandem.router.workers.registry import WorkerRegistry
from tandem.trust.fields import TenantSalts, strip_internal

logger = logging.getLogger(__name__)


class Proxy:
    def __init__(
        self,
        config: RouterConfig,
        registry: WorkerRegistry,
        upstream: Upstream,
        counter: PromptCounter,
        metrics: RouterMetrics,
        placement: Placement,
        accounting: Accounting | None = None,
    ) -> None:
        self.config = config
        self.registry = registry
        self.upstream = upstream
        self.counter = counter
        self.metrics = metrics
        self.placement = placement
        self.accounting = accounting or Accounting()
        self._warned_no_secret = False
        self.admission = AdmissionQueue(config.admission)
        self.drain = Drain(config.shutdown_timeout_s)
        # Without the cluster secret the salts are this process's own: unguessable still, but
        # a restart or a second router starts every tenant's cache cold.
        self.tenant_salts = TenantSalts(config.cluster_secret or secrets.token_hex(32))
        if config.cluster_secret is None:
            if config.migration_limit:
                logger.info("mid-stream migration is off: it hands a stream's tokens to the next worker "
                            "in a signed request, and this router has no --cluster-secret")
            if config.accounting.api_keys_file is not None and not config.shared_prefix_cache:
                logger.warning("tenant cache salts come from a key of this process (no --cluster-secret): "
                               "after a restart, or on another router, tenants start with a cold cache")
        self.books = Bookkeeping(metrics, self.accounting, self.admission, placement)
        hops = Hops(registry, placement, upstream, metrics)
        relay = Relay(
            hops, upstream, metrics, config.migration_limit, config.cluster_secret is not None
        )
        self.direct = Direct(hops, relay, self.accounting, self.books)
        self.pd = PdFlow(
            hops,
            relay,
            self.direct,
            KvRelease(upstream.client, config.health.timeout_s),
            self.accounting,
            self.books,
            metrics,
        )

    # --- entry -----------------------------------------------------------------------
    async def serve(
        self, kind: Kind, path: str, request: Request, adapter: ProtocolAdapter | None = None
    ) -> Response:
        """Serve a chat or completion request; with `adapter`, a request in another protocol
        (Messages, Responses) that travels as a chat request and is answered in its own."""
        if adapter is None:
            return await self._serve(kind, path, request, None)
        try:
            translated = await adapter.to_chat(await _json_body(request), request.headers, caller_of(request))
        except APIError as exc:
            self.metrics.requests.labels("none", adapter.name, str(exc.status)).inc()
            return protocol_error(adapter, exc)
        response = await self._serve(kind, path, request, translated, adapter)
        return await in_protocol(response, adapter, translated)

    async def _serve(
        self, kind: Kind, path: str, request: Request, translated: Translated | None,
        adapter: ProtocolAdapter | None = None,
    ) -> Response:
        if self.drain.draining:
            return self.drain.refusal("this router").response()
        received = time.monotonic()
        raw = translated.chat if translated is not None else await _json_body(request)
        body = strip_internal(raw)  # internal fields are set here, never by a client
        check_shape(body, self.config.limits)
        if self.config.accounting.api_keys_file is not None and not self.config.shared_prefix_cache:
            body = self.tenant_salts.salted(body, caller_of(request))
        model = body.get("model")
        call = Call(
            kind,
            path,
            body,
            self.accounting.worker_headers(request.headers),
            Identity.new(kind, model if isinstance(model, str) else ""),
            received,
            caller=caller_of(request),
            protocol=adapter.name if adapter is not None else kind,
        )
        if adapter is not None and translated is not None:
            call.reply_id = adapter.reply_id(translated, call.identity.id)
        try:
            call.prompt_tokens = await self.counter.count(body, kind)
            await self._admit(call, request)
            call.prompt_route = await self.placement.prepare(
                body, kind, request.headers, call.headers, call.prompt_tokens,
                translated.session if translated is not None else None,
            )
            call.prompt_tokens = call.prompt_route.prompt_tokens  # exact after a tokenize hop
            decision = decide_route(
                body,
                kind,
                call.prompt_tokens,
                self.config.pd_min_prompt_tokens,
                have_prefill=self._can_split(),
            )
            call.reason = decision.reason
            if decision.pd:
                response = await self.pd.serve(call, request)
            else:
                response = await self.direct.serve(call, request)
        except ClientGone:
            call.status = 499
            self.books.finish(call)
            return Response(status_code=499)
        except APIError as exc:
            call.status = exc.status
            self.books.finish(call)
            return exc.response()
        except Answered as answered:
            call.status = answered.response.status_code
            self.books.finish(call)
            return answered.response
        if not isinstance(response, StreamingResponse):
            self.books.finish(call)
        return response

    def _can_split(self) -> bool:
        """A prefill/decode split needs a prefill worker, and the cluster secret to sign the
        decode hop's handoff fields (tandem/trust): without it, requests are served whole."""
        if not self.registry.pool(PREFILL_ROLES):
            return False
        if self.config.cluster_secret is None:
            if not self._warned_no_secret:
                self._warned_no_secret = True
                logger.warning("prefill workers are configured but this router has no --cluster-secret: "
                               "requests are served whole on decode workers")
            return False
        return True

    async def _admit(self, call: Call, request: Request) -> None:
        """The caller's rate limits and quota, then a slot in the router's bounded queue."""
        key = caller_key_of(request)
        await self.accounting.admit(key, call.prompt_tokens)
        call.key, call.admitted_tokens = key, call.prompt_tokens
        started = time.monotonic()
        await unless_disconnected(request, self.admission.enter())
        call.admitted = True
        waited = time.monotonic() - started
        if waited > 0.001:
            self.metrics.queue_wait.observe(waited)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        # NaN and Infinity are not JSON (Python's json reads them; a worker then would not).
        body = json.loads(await request.body(), parse_constant=_no_constant)
    except ValueError as exc:
        raise APIError(
            400, f"the request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_value")
    return body
