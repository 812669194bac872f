"""The router's FastAPI app: OpenAI endpoints in front of the workers, plus its own views.

Endpoints: POST /v1/chat/completions and /v1/completions (proxy.py), GET /v1/models (from a
healthy worker), GET /health (200 while some worker can serve a whole request, "degraded" when the prefill
pool is gone; each pool's total / up / available workers), GET /workers,
POST /workers/reload (re-reads --config; SIGHUP does the same), POST /workers/{id}/drain and
/resume (rolling restarts; the id is the worker's host:port), GET /metrics, GET /v1/usage
(totals from the usage ledger, accounting/usage_api.py), GET /dashboard (a live page over
those, dashboard.html). With --api-keys, /v1/* needs a key (accounting/auth.py); the control
endpoints need the admin key, and the views do once keys are on (`router_access_policy`,
tandem/trust/access.py).

Everything stateful (the httpx client, the worker registry, the health monitor, metrics) is
built in the lifespan and hung on `app.state`: no module-level state, so tests can run
several routers in one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.edge.drain import Drain, DrainingServer
from tandem.edge.errors import (
    APIError,
    api_error_handler,
    error_body,
    http_error_handler,
    validation_error_handler,
)
from tandem.edge.limits import RequestLimitMiddleware
from tandem.edge.protocols.anthropic_messages import MessagesAdapter
from tandem.edge.protocols.error_shape import ProtocolErrorShape, agent_protocol_shapes
from tandem.edge.protocols.openai_responses import OpenAIResponsesAdapter
from tandem.edge.protocols.response_store import open_response_store
from tandem.router.accounting.accounting import load_keys, open_accounting
from tandem.router.accounting.auth import ApiKeyMiddleware, ApiKeys, KeyFile, caller_of
from tandem.router.accounting.usage_api import usage_report
from tandem.router.config import RouterConfig, all_worker_specs, dedupe
from tandem.router.http.count_tokens import count_tokens
from tandem.router.http.hops import WHOLE_ROLES
from tandem.router.http.metrics import RouterMetrics
from tandem.router.http.openapi import document_request_bodies
from tandem.router.http.proxy import Proxy
from tandem.router.http.upstream import HopFailure, Upstream, make_client
from tandem.router.placement.kv_events import KvEventPoller
from tandem.router.placement.kv_index import KvIndex
from tandem.router.placement.placement import Placement, PlacementMetrics
from tandem.router.placement.prompt_tokens import PromptCounter
from tandem.router.placement.tokenize import RemoteTokenizer
from tandem.router.workers.discovery import DnsDiscovery
from tandem.router.workers.health import HealthMonitor
from tandem.router.workers.registry import WorkerRegistry
from tandem.trust.access import AccessMiddleware, AccessPolicy, Level

logger = logging.getLogger(__name__)


@dataclass
class RouterState:
    config: RouterConfig
    client: httpx.AsyncClient
    registry: WorkerRegistry
    monitor: HealthMonitor
    metrics: RouterMetrics
    proxy: Proxy
    reload_lock: asyncio.Lock
    kv_index: KvIndex
    kv_events: KvEventPoller
    discovery: DnsDiscovery

    async def reload(self) -> dict[str, Any]:
        """Re-read the worker file and take the last discovered workers; workers that stay
        keep their health and load."""
        async with self.reload_lock:
            specs = dedupe([*all_worker_specs(self.config), *self.discovery.specs])
            added, removed = self.registry.replace(specs)
            self.monitor.sync()
            self.kv_events.sync()
            await asyncio.gather(*(self.monitor.probe(w) for w in added))
        logger.info(
            "worker list reloaded: %d workers (%d added, %d removed)",
            len(specs),
            len(added),
            len(removed),
        )
        return {"added": [w.url for w in added], "removed": [w.url for w in removed]}


def build_state(config: RouterConfig, keys: ApiKeys | KeyFile | None = None) -> RouterState:
    client = make_client(config.timeouts, config.cluster_secret)
    registry = WorkerRegistry(all_worker_specs(config), config.health, config.breaker)
    monitor = HealthMonitor(registry, client, config.health, config.scoring)
    metrics = RouterMetrics(lambda: registry.workers)

    def on_failure(hop: str, failure: HopFailure) -> None:
        outcome = (
            "timeout"
            if failure.timed_out
            else ("error" if failure.transport else str(failure.status))
        )
        metrics.hops.labels(failure.worker.url, hop, outcome).inc()
        if failure.transport:
            monitor.record(failure.worker, False, failure.reason)
        if not failure.busy:
            failure.worker.breaker.record_failure(time.monotonic(), failure.reason)

    upstream = Upstream(
        client,
        config.timeouts,
        config.retry,
        on_failure,
        lambda hop: metrics.retries.labels(hop).inc(),
        lambda hop: metrics.retries_denied.labels(hop).inc(),
    )
    kv_index = KvIndex()
    placement_metrics = PlacementMetrics(metrics.registry, kv_index, registry)
    kv_events = KvEventPoller(
        registry,
        client,
        kv_index,
        config.policy.kv_events_interval_s,
        config.health.timeout_s,
        lambda worker, reason: placement_metrics.resyncs.labels(worker.url, reason).inc(),
    )
    placement = Placement(
        config.policy,
        config.scoring,
        registry,
        kv_index,
        RemoteTokenizer(client, config.policy.tokenize_timeout_s),
        placement_metrics,
        monitor.refresh_load,
    )
    accounting = open_accounting(
        config.accounting,
        keys,
        lambda rows, ok: metrics.ledger_rows.labels("written" if ok else "failed").inc(rows),
    )
    proxy = Proxy(
        config,
        registry,
        upstream,
        PromptCounter(config.tokenizer),
        metrics,
        placement,
        accounting=accounting,
    )
    return RouterState(
        config, client, registry, monitor, metrics, proxy, asyncio.Lock(), kv_index, kv_events,
        DnsDiscovery(config.discover),
    )


def build_app(config: RouterConfig, drain: Drain | None = None) -> FastAPI:
    keys = load_keys(config.accounting)  # a bad key file fails here, before serving

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = build_state(config, keys)
        if drain is not None:
            state.proxy.drain = drain
        state.proxy.drain.busy = lambda: state.proxy.admission.in_flight + state.proxy.admission.waiting
        app.state.router = state
        # Shared by the replicas when it is Redis: any of them continues any conversation.
        app.state.responses = OpenAIResponsesAdapter(
            open_response_store(config.response_store, config.cluster_secret))
        background: set[asyncio.Task[Any]] = set()
        if config.discover:
            await state.discovery.refresh()
            await state.reload()
            background.add(asyncio.ensure_future(_discover_forever(state)))
        await state.monitor.probe_all()
        state.monitor.sync()
        state.kv_events.sync()
        if config.install_sighup:
            _install_sighup(state, background)
        healthy = sum(w.healthy for w in state.registry.workers)
        logger.info(
            "routing at http://%s:%d/v1 over %d workers (%d up): %s",
            config.host,
            config.port,
            len(state.registry.workers),
            healthy,
            ", ".join(f"{w.role} {w.url}" for w in state.registry.workers) or "none",
        )
        logger.info("%s", state.proxy.accounting.describe())
        logger.info("%s", app.state.responses.describe())
        try:
            yield
        finally:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            for task in list(background):
                task.cancel()
            await state.monitor.stop()
            await state.kv_events.stop()
            await state.client.aclose()
            await app.state.responses.close()
            # After the in-flight requests: every row they recorded is written before exit.
            await asyncio.to_thread(state.proxy.accounting.close)

    app = FastAPI(title="tandem router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(AccessMiddleware, policy=router_access_policy(config))
    app.add_middleware(ApiKeyMiddleware, keys=keys)
    app.add_middleware(RequestLimitMiddleware, limits=config.limits)  # outermost: before keys
    # Outside every refusal: on /v1/messages they reach the client in Anthropic's shape.
    app.add_middleware(ProtocolErrorShape, shapes=agent_protocol_shapes())
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(Exception, _internal_error_handler)

    def state_of(request: Request) -> RouterState:
        return request.app.state.router

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await state_of(request).proxy.serve("chat", "/v1/chat/completions", request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await state_of(request).proxy.serve("completion", "/v1/completions", request)

    messages_adapter = MessagesAdapter()

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        """Anthropic's Messages API (Claude Code), routed as a chat request."""
        proxy = state_of(request).proxy
        return await proxy.serve("chat", "/v1/chat/completions", request, messages_adapter)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(request: Request) -> Response:
        state = state_of(request)
        workers = state.registry.pool(WHOLE_ROLES) + state.registry.pool(("prefill",))
        headers = state.proxy.accounting.worker_headers(request.headers)
        return await count_tokens(messages_adapter, request, workers, state.client, headers,
                                  config.health.timeout_s * 5)
    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await state_of(request).proxy.serve("chat", "/v1/chat/completions", request,
                                                   request.app.state.responses)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> dict[str, Any]:
        return await request.app.state.responses.retrieve(response_id, caller_of(request))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
        return await request.app.state.responses.delete(response_id, caller_of(request))

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        state = state_of(request)
        workers = state.registry.pool(WHOLE_ROLES) + state.registry.pool(("prefill",))
        headers = state.proxy.accounting.worker_headers(request.headers)
        for worker in workers:
            try:
                reply = await state.client.get(
                    f"{worker.url}/v1/models",
                    headers=headers,
                    timeout=httpx.Timeout(config.health.timeout_s * 5),
                )
            except httpx.HTTPError as exc:
                logger.debug("GET %s/v1/models failed: %s", worker.url, exc)
                continue
            if reply.status_code < 500:
                return Response(
                    reply.content,
                    status_code=reply.status_code,
                    media_type=reply.headers.get("content-type", "application/json"),
                )
        raise APIError(503, "no healthy worker answered GET /v1/models", code="no_healthy_worker")

    @app.get("/v1/usage")
    async def usage(request: Request) -> dict[str, Any]:
        accounting = state_of(request).proxy.accounting
        return await usage_report(accounting, caller_of(request), request.query_params)

    @app.get("/health")
    async def health(request: Request) -> Response:
        state = state_of(request)
        if state.proxy.drain.draining:
            return JSONResponse(state.proxy.drain.refusal("this router").body(), status_code=503)
        pools = _pools(state)
        whole = pools["decode"]["available"] + pools["both"]["available"]
        if whole:
            # Without prefill workers requests are served whole on the others: slower, not down.
            split = pools["prefill"]["total"] == 0 or pools["prefill"]["available"] > 0
            return JSONResponse(
                {
                    "status": "ok" if split else "degraded",
                    "workers_up": sum(w.healthy for w in state.registry.workers),
                    "pools": pools,
                }
            )
        body = error_body(503, "no healthy worker can serve requests", None, "no_healthy_worker")
        return JSONResponse({**body, "pools": pools}, status_code=503)

    @app.get("/workers")
    async def workers(request: Request) -> dict[str, Any]:
        return {"workers": _describe_workers(state_of(request))}

    @app.post("/workers/reload")
    async def reload(request: Request) -> dict[str, Any]:
        state = state_of(request)
        try:
            change = await state.reload()
        except (ValueError, OSError) as exc:
            raise APIError(
                400, f"cannot reload the worker list: {exc}", code="invalid_config"
            ) from exc
        return {**change, "workers": _describe_workers(state)}

    @app.post("/workers/{worker_id}/drain")
    async def drain_worker(worker_id: str, request: Request) -> dict[str, Any]:
        """No new requests to this worker (rolling restarts); its running ones go on.
        Poll GET /workers until its in_flight is 0, restart it; it rejoins when its health
        comes back, or at POST /workers/{id}/resume."""
        return _set_draining(state_of(request), worker_id, True)

    @app.post("/workers/{worker_id}/resume")
    async def resume_worker(worker_id: str, request: Request) -> dict[str, Any]:
        return _set_draining(state_of(request), worker_id, False)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(state_of(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)

    dashboard = (Path(__file__).parent / "dashboard.html").read_text()

    @app.get("/dashboard")
    async def live_dashboard() -> HTMLResponse:
        """A live page of this router's traffic and workers, read from its own /metrics,
        /workers and /v1/usage by the browser every two seconds."""
        return HTMLResponse(dashboard)

    document_request_bodies(app)
    return app


_OBSERVE_PATHS = frozenset({"/metrics", "/workers", "/openapi.json"})


def router_level(method: str, path: str) -> Level:
    """Each endpoint's access level (tandem/trust/access.py). /v1/* is PUBLIC here because the
    API-key middleware (accounting/auth.py) guards it; so is /dashboard, a page that holds no
    data: a browser cannot send a key to open it, and what it shows comes from /metrics and
    /workers, for which the page asks the admin key when they are closed."""
    if method == "POST" and path.startswith("/workers/"):
        return Level.ADMIN  # reload, drain, resume
    if path in _OBSERVE_PATHS:
        return Level.OBSERVE
    return Level.PUBLIC


def router_access_policy(config: RouterConfig) -> AccessPolicy:
    """The control plane opens to the admin key (else the cluster secret); views close once
    API keys or an admin key are on, unless --public-metrics; with nothing configured (a dev
    router on a laptop), everything is open."""
    keys_on = config.accounting.api_keys_file is not None or config.admin_key is not None
    admin = config.admin_key or config.cluster_secret
    return AccessPolicy(
        level_of=router_level,
        admin_tokens=(admin,) if admin else (),
        observe_open=config.public_metrics or not keys_on,
        admin_open=not keys_on and config.cluster_secret is None,
    )


def _pools(state: RouterState) -> dict[str, dict[str, int]]:
    """Per role: workers configured, up (health polls), available (up, breaker closed or
    half-open, not draining): what each pool can serve now."""
    now = time.monotonic()
    pools = {}
    for role in ("prefill", "decode", "both"):
        members = [w for w in state.registry.workers if w.role == role]
        pools[role] = {
            "total": len(members),
            "up": sum(w.healthy for w in members),
            "available": sum(w.available(now) for w in members),
        }
    return pools


def _set_draining(state: RouterState, worker_id: str, draining: bool) -> dict[str, Any]:
    worker = next((w for w in state.registry.workers if w.id == worker_id), None)
    if worker is None:
        known = ", ".join(w.id for w in state.registry.workers) or "none"
        raise APIError(404, f"no worker {worker_id!r} (workers: {known})", None, "worker_not_found")
    if worker.draining != draining:
        worker.draining = draining
        logger.info("worker %s %s", worker.url,
                    "drains: no new requests" if draining else "takes requests again")
    return worker.describe(time.monotonic())


def _describe_workers(state: RouterState) -> list[dict[str, Any]]:
    """Each worker's state and load, plus what the KV index holds for it (`kv`)."""
    now = time.monotonic()
    return [
        {**w.describe(now), "kv": state.kv_index.describe(w.url)} for w in state.registry.workers
    ]


def _install_sighup(state: RouterState, background: set[asyncio.Task[Any]]) -> None:
    def on_sighup() -> None:
        task = asyncio.ensure_future(_reload_logged(state))
        background.add(task)
        task.add_done_callback(background.discard)

    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, on_sighup)
    except (
        NotImplementedError,
        RuntimeError,
        ValueError,
    ) as exc:  # not the main thread, or Windows
        logger.debug("SIGHUP reload not available: %s", exc)


async def _discover_forever(state: RouterState) -> None:
    """Re-resolve the --discover names every interval; adopt the workers when they change."""
    while True:
        await asyncio.sleep(state.config.discover_interval_s)
        try:
            if await state.discovery.refresh():
                await state.reload()
        except (ValueError, OSError) as exc:
            logger.error("discovery: cannot update the worker list: %s", exc)


async def _reload_logged(state: RouterState) -> None:
    try:
        await state.reload()
    except (ValueError, OSError) as exc:
        logger.error("SIGHUP: cannot reload the worker list: %s", exc)


async def _internal_error_handler(_: Request, exc: Exception) -> Response:
    logger.exception("unhandled error", exc_info=exc)
    return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)


def run_router(config: RouterConfig) -> None:
    """Serve until SIGINT, or a SIGTERM and its drain (tandem/edge/drain.py)."""
    drain = Drain(config.shutdown_timeout_s)
    server = DrainingServer(
        uvicorn.Config(
            build_app(config, drain),
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            access_log=config.access_log,
            timeout_graceful_shutdown=5,
        ),
        drain,
    )
    server.serve_until_stopped()
