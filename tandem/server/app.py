"""The FastAPI app of `tandem serve`: OpenAI endpoints plus the worker endpoints (docs/serving.md).

The engine core starts in the app's lifespan, before uvicorn binds the port: a server that
accepts connections can serve them, which is what a health-gated launcher (`tandem up`,
the bench) relies on. Every failure is answered in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.config import EngineConfig, ServerConfig
from tandem.edge.disconnect import ClientGone
from tandem.edge.drain import Drain, DrainingServer
from tandem.edge.errors import (
    APIError,
    api_error_handler,
    bad_request,
    error_body,
    http_error_handler,
    validation_error_handler,
)
from tandem.edge.limits import RequestLimitMiddleware
from tandem.edge.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tandem.edge.protocols.anthropic_messages import MessagesAdapter
from tandem.edge.protocols.error_shape import ProtocolErrorShape, agent_protocol_shapes
from tandem.edge.protocols.openai_responses import OpenAIResponsesAdapter
from tandem.edge.protocols.response_store import is_redis_url, open_response_store
from tandem.kvcache.connector.factory import connector_sections
from tandem.loader.tokenizer import load_tokenizer
from tandem.server.chat_prompt import render_chat_prompt
from tandem.server.engine_client import AsyncEngineClient, EngineDeadError, EngineRequestError
from tandem.server.metrics import ServerMetrics, tier_blocks
from tandem.server.reasoning import get_reasoning_parser
from tandem.server.serving import ServingState
from tandem.server.serving_chat import create_chat_completion
from tandem.server.serving_completion import create_completion
from tandem.server.serving_count_tokens import count_tokens
from tandem.server.serving_protocol import serve_protocol
from tandem.server.tool_parsers import detect_tool_parser, get_tool_parser
from tandem.trust.access import AccessMiddleware, AccessPolicy, Level
from tandem.trust.peer import PeerVerifier

logger = logging.getLogger(__name__)


def build_app(engine_config: EngineConfig, config: ServerConfig, drain: Drain | None = None) -> FastAPI:
    drain = drain or Drain(config.shutdown_timeout_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = await AsyncEngineClient.start(engine_config, config.engine_start_timeout)
        try:
            tokenizer = load_tokenizer(Path(client.info.hf_dir))
            parser_name = config.tool_call_parser or detect_tool_parser(tokenizer.chat_template)
            names = config.served_model_names or (engine_config.model,)
            metrics = ServerMetrics(names[0], lambda: client.load, lambda: client.num_in_flight)
            app.state.serving = ServingState(
                config, client, tokenizer, tuple(names), metrics, get_tool_parser(parser_name), drain,
                reasoning_parser=get_reasoning_parser(config.reasoning_parser) if config.reasoning_parser else None)
            # Responses are kept where the cluster keeps KV (a Redis --kv-store), so that any
            # worker continues a conversation; else in this process.
            store_url = engine_config.kv_tiers.store_url
            app.state.responses = OpenAIResponsesAdapter(open_response_store(
                store_url if is_redis_url(store_url) else None, engine_config.kv_transfer.secret))
            logger.info("%s", app.state.responses.describe())
            # A drain waits for requests in flight and for handed-over prompt KV to be read.
            drain.busy = lambda: client.num_in_flight + client.load.kv_held
            reasoning = f", reasoning format: {config.reasoning_parser}" if config.reasoning_parser else ""
            logger.info("serving %s at http://%s:%d/v1 (tool-call format: %s%s)", ", ".join(names),
                        config.host, config.port, parser_name, reasoning)
            watcher = asyncio.create_task(_exit_when_engine_dies(client), name="engine watcher")
            try:
                yield
            finally:
                watcher.cancel()
                await app.state.responses.close()
        finally:
            logger.info("stopping the engine core")
            await client.shutdown()

    app = FastAPI(title="tandem", lifespan=lifespan, docs_url=None, redoc_url=None)
    # Outermost last: the body is bounded (limits), then the caller is known (access).
    app.add_middleware(AccessMiddleware, policy=worker_access_policy(config, engine_config.kv_transfer.secret))
    app.add_middleware(RequestLimitMiddleware, limits=config.limits)
    # Outside every refusal: on /v1/messages they reach the client in Anthropic's shape.
    app.add_middleware(ProtocolErrorShape, shapes=agent_protocol_shapes())
    app.add_exception_handler(APIError, _counted_api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(ClientGone, _disconnected_handler)
    app.add_exception_handler(EngineDeadError, _engine_dead_handler)
    app.add_exception_handler(EngineRequestError, _engine_refused_handler)
    app.add_exception_handler(Exception, _internal_error_handler)

    def state(request: Request) -> ServingState:
        return request.app.state.serving

    @app.get("/health")
    async def health(request: Request) -> Response:
        if drain.draining:
            return JSONResponse(drain.refusal("this worker").body(), status_code=503)
        if state(request).client.healthy:
            return Response(status_code=200)
        return JSONResponse(error_body(503, "the engine core is not running"), status_code=503)

    @app.get("/load")
    async def load(request: Request) -> dict[str, Any]:
        serving = state(request)
        current = serving.client.load
        return {
            "num_waiting_requests": current.num_waiting,
            "num_waiting_prefill_tokens": current.waiting_prefill_tokens,
            "num_running_requests": current.num_running,
            "num_requests_in_flight": serving.client.num_in_flight,
            "running_kv_tokens": current.running_kv_tokens,
            "kv_blocks_used": current.kv_blocks_used,
            "kv_blocks_total": current.kv_blocks_total,
            "kv_blocks_cached": current.kv_blocks_cached,
            "kv_blocks_retained": current.kv_blocks_retained,
            "kv_usage": current.kv_usage,
            "block_size": serving.client.info.block_size,
            "max_model_len": serving.max_model_len,
            "prefix_cache_queries": current.prefix_cache_queries,
            "prefix_cache_hits": current.prefix_cache_hits,
            "connector_loaded_tokens": current.connector_loaded_tokens,
            "tiers": tier_blocks(current),
            "role": serving.client.info.role,
            "kv_source": serving.client.info.kv_source,
            # Every registered connector's counters under its section ("kv_transfer", "kv_tiers"),
            # empty when it is off, so a router sees the same keys from every worker.
            **{section: current.connector(section) for section in connector_sections()},
            "spec_decode": current.spec_decode,
            "structured": current.structured,
        }

    @app.get("/kv/events")
    async def kv_events(request: Request, since: int = 0, limit: int = 1000) -> dict[str, Any]:
        """Stored / removed block hashes after event `since` (docs/prompt-caching.md); `gap` means resync."""
        return state(request).client.kv_events.since(since, max(1, min(limit, 10_000)))

    @app.get("/kv/snapshot")
    async def kv_snapshot(request: Request) -> dict[str, Any]:
        return state(request).client.kv_events.snapshot()

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        from importlib.metadata import version as package_version

        return {"version": package_version("tandem-serve")}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        serving = state(request)
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": serving.created, "owned_by": "tandem",
             "root": engine_config.model, "parent": None, "max_model_len": serving.max_model_len}
            for name in serving.model_names
        ]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(state(request), body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(state(request), body, request)

    messages_adapter = MessagesAdapter()

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        """Anthropic's Messages API (Claude Code), served as a chat request."""
        return await serve_protocol(state(request), messages_adapter, request)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(request: Request) -> Response:
        return await count_tokens(state(request), messages_adapter, request)
    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await serve_protocol(state(request), request.app.state.responses, request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> dict[str, Any]:
        return await request.app.state.responses.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
        return await request.app.state.responses.delete(response_id)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
        serving = state(request)
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of 'prompt' and 'messages'", "prompt", "invalid_value")
        if body.messages is not None:
            add_generation_prompt = body.add_generation_prompt and not body.continue_final_message
            prompt = render_chat_prompt(serving.tokenizer, body.messages, body.tools, body.tool_choice,
                                        serving.tool_parser, add_generation_prompt, body.continue_final_message,
                                        body.chat_template_kwargs)
            tokens = serving.encode(prompt.text, add_special_tokens=False)
        else:
            tokens = serving.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": serving.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
        serving = state(request)
        serving.check_model(body.model)
        vocab = serving.client.info.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise bad_request(f"token ids must be in [0, {vocab})", "tokens", "invalid_token_id")
        return {"prompt": serving.tokenizer.decode(body.tokens)}

    @app.post("/kv/release")
    async def kv_release(request: Request) -> dict[str, bool]:
        """Free a prefill handoff's held KV now, not at its lease's end: a router calls this
        when the decode half failed and nobody will read it (an unknown id is a no-op)."""
        try:
            body = await request.json()
        except ValueError:
            body = None
        transfer_id = body.get("transfer_id") if isinstance(body, dict) else None
        if not isinstance(transfer_id, str) or not transfer_id:
            raise bad_request("give {\"transfer_id\": \"...\"}", "transfer_id", "invalid_value")
        state(request).client.release_transfer(transfer_id)
        return {"released": True}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> dict[str, bool]:
        return {"reset": await state(request).client.reset_prefix_cache()}

    return app


_OBSERVE_PATHS = frozenset({"/metrics", "/load", "/version", "/openapi.json"})
_ADMIN_PATHS = frozenset({"/kv/events", "/kv/snapshot", "/kv/release", "/reset_prefix_cache"})


def worker_level(method: str, path: str) -> Level:
    """Each endpoint's access level (tandem/trust/access.py); the OpenAI ones are CLIENT."""
    if path == "/health":
        return Level.PUBLIC
    if path in _OBSERVE_PATHS:
        return Level.OBSERVE
    if path in _ADMIN_PATHS:
        return Level.ADMIN
    return Level.CLIENT


def worker_access_policy(config: ServerConfig, secret: str | None) -> AccessPolicy:
    """With a cluster secret, the router's signature opens everything; the admin key (else the
    secret, else the API key) opens the control plane; with nothing configured, all is open."""
    configured = bool(secret or config.api_key or config.admin_key)
    admin = config.admin_key or secret or config.api_key
    return AccessPolicy(
        level_of=worker_level,
        peers=PeerVerifier(secret) if secret else None,
        client_key=config.api_key,
        admin_tokens=(admin,) if admin else (),
        observe_open=config.public_metrics or not configured,
        admin_open=not configured,
    )


_ENGINE_DEATH_GRACE_S = 2.0


async def _exit_when_engine_dies(client: AsyncEngineClient) -> None:
    """A server whose engine core died can never serve again: after a moment (in-flight
    streams get their error event, the router sees /health fail) it stops itself, like vLLM's,
    so that whatever supervises it (`tandem up`, systemd, Kubernetes) starts a fresh one."""
    reason = await client.wait_dead()
    logger.error("%s; stopping this server in %.0f s so that its supervisor can start a new one",
                 reason, _ENGINE_DEATH_GRACE_S)
    await asyncio.sleep(_ENGINE_DEATH_GRACE_S)
    os.kill(os.getpid(), signal.SIGTERM)


async def _counted_api_error_handler(request: Request, exc: Exception) -> Response:
    """Every refusal is answered here, so here is where it is counted (tandem:request_errors)."""
    serving = getattr(request.app.state, "serving", None)
    if serving is not None and isinstance(exc, APIError):
        serving.metrics.observe_error(exc.status)
    return await api_error_handler(request, exc)


async def _engine_dead_handler(request: Request, exc: Exception) -> Response:
    """A request the engine died under: retryable elsewhere (a router moves it on)."""
    return await _counted_api_error_handler(request, APIError(503, str(exc), None, "engine_dead"))


async def _engine_refused_handler(request: Request, exc: Exception) -> Response:
    """A request the engine core refused or stopped (a grammar only the vocabulary rejects): a
    400 with the core's reason, as the streamed path's error event says."""
    return await _counted_api_error_handler(request, APIError(400, str(exc), None, "engine_refused"))


async def _disconnected_handler(_: Request, __: Exception) -> Response:
    # Nobody reads this: the client left. 499 is the conventional log status for it.
    return Response(status_code=499)


async def _internal_error_handler(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error", exc_info=exc)
    return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)


def run_server(engine_config: EngineConfig, config: ServerConfig, access_log: bool = True) -> None:
    """Serve until SIGINT / SIGTERM; the lifespan then stops the engine core."""
    drain = Drain(config.shutdown_timeout_s)
    app = build_app(engine_config, config, drain)
    server = DrainingServer(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                           access_log=access_log, timeout_graceful_shutdown=5), drain)
    server.serve_until_stopped()
