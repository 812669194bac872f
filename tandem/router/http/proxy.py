"""One client request through the workers: whole on one worker, or prefill hop + decode hop.

The response status the client sees is decided before any byte is sent: the first hop is
opened (with retries) before the response starts, so a worker's 4xx passes through with its
own status and an unreachable pool is a 503. For a disaggregated stream, the router sends
the role chunk and the first token right after the prefill hop, then opens the decode hop
inside the stream; a decode failure after that point can only be reported in the stream.

Client disconnects propagate: a stream's generator is cancelled by Starlette and closes its
upstream stream; a whole (non-streamed) request is watched and cancelled the same way. A
worker aborts a request whose connection closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from tandem.edge.drain import Drain
from tandem.edge.errors import APIError, error_body
from tandem.edge.limits import check_shape
from tandem.router.accounting.accounting import Accounting
from tandem.router.accounting.auth import Caller, caller_key_of, caller_of
from tandem.router.config import Role, RouterConfig
from tandem.router.http.metrics import RouterMetrics
from tandem.router.http.migration import StreamRecord, can_migrate, resume_body
from tandem.router.http.upstream import Hop, HopFailure, StreamBroken, Upstream
from tandem.router.pd.merge import (
    SSE_DONE,
    ChunkRewriter,
    Identity,
    Kind,
    has_output,
    reply_to_chunks,
    rewrite_reply,
    role_chunk,
    sse,
    text_chunk,
)
from tandem.router.pd.split import (
    PrefillOutcome,
    decide_route,
    decode_body,
    emit_first_token,
    prefill_body,
    prefill_outcome,
    requested_max_tokens,
    with_upstream_usage,
)
from tandem.router.placement.placement import Placement
from tandem.router.placement.policies import PromptRoute
from tandem.router.placement.prompt_tokens import PromptCounter
from tandem.router.resilience.admission import AdmissionQueue
from tandem.router.workers.registry import DispatchKind, Worker, WorkerRegistry
from tandem.trust.fields import TenantSalts, strip_internal

logger = logging.getLogger(__name__)

T = TypeVar("T")

PREFILL_ROLES: tuple[Role, ...] = ("prefill",)
WHOLE_ROLES: tuple[Role, ...] = ("decode", "both")  # serve whole requests and decode hops
_DISCONNECT_POLL_S = 0.25


class ClientGone(Exception):
    pass


class Answered(Exception):
    """A worker's own error reply, passed to the client as it is."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


@dataclass
class Call:
    """One client request and what the log line and metrics report about it."""

    kind: Kind
    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    identity: Identity
    received: float
    prompt_tokens: int = 0
    route: str = "direct"
    reason: str = ""
    prefill_worker: Worker | None = None
    decode_worker: Worker | None = None
    first_hop_at: float | None = None
    ttft: float | None = None
    first_output_worker: Worker | None = None
    status: int = 200
    usage: dict[str, Any] | None = None
    retries: int = 0
    finished: bool = False
    prompt_route: PromptRoute = field(default_factory=lambda: PromptRoute(0))
    # For the usage ledger (accounting/accounting.py): who called, and what is known if no
    # usage comes.
    caller: str = ""
    prefill_usage: dict[str, Any] | None = None
    output_chunks: int = 0
    # A stream the router can move to another worker if its worker fails (migration.py).
    record: StreamRecord | None = None
    failed_workers: set[str] = field(default_factory=set)
    # Admission: the key and limits it was admitted under, and whether it holds a slot.
    key: Caller | None = None
    admitted_tokens: int = 0  # the prompt tokens its rate limit took at admission
    admitted: bool = False

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def wants_token_ids(self) -> bool:
        return self.body.get("return_token_ids") is True

    @property
    def include_usage(self) -> bool:
        options = self.body.get("stream_options")
        return bool(isinstance(options, dict) and options.get("include_usage"))

    def mark_first_output(self, worker: Worker | None) -> None:
        if self.ttft is None:
            self.ttft = time.monotonic() - self.received
            self.first_output_worker = worker


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
        self._warned_no_pd: set[str] = set()
        self._background: set[asyncio.Task[None]] = set()
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

    # --- entry -----------------------------------------------------------------------
    async def serve(self, kind: Kind, path: str, request: Request) -> Response:
        if self.drain.draining:
            return self.drain.refusal("this router").response()
        received = time.monotonic()
        body = strip_internal(await _json_body(request))  # internal fields are set here, never by a client
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
        )
        try:
            call.prompt_tokens = await self.counter.count(body, kind)
            await self._admit(call, request)
            call.prompt_route = await self.placement.prepare(
                body, kind, request.headers, call.headers, call.prompt_tokens
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
                response = await self._pd(call, request)
            else:
                response = await self._whole(call, request)
        except ClientGone:
            call.status = 499
            self._finish(call)
            return Response(status_code=499)
        except APIError as exc:
            call.status = exc.status
            self._finish(call)
            return exc.response()
        except Answered as answered:
            call.status = answered.response.status_code
            self._finish(call)
            return answered.response
        if not isinstance(response, StreamingResponse):
            self._finish(call)
        return response

    def _can_split(self) -> bool:
        """A prefill/decode split needs a prefill worker, and the cluster secret to sign the
        decode hop's handoff fields (tandem/trust): without it, requests are served whole."""
        if not self.registry.pool(PREFILL_ROLES):
            return False
        if self.config.cluster_secret is None:
            if "secret" not in self._warned_no_pd:
                self._warned_no_pd.add("secret")
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
        await _unless_disconnected(request, self.admission.enter())
        call.admitted = True
        waited = time.monotonic() - started
        if waited > 0.001:
            self.metrics.queue_wait.observe(waited)

    # --- one worker --------------------------------------------------------------------
    async def _whole(self, call: Call, request: Request) -> Response:
        call.route = "direct"
        body = with_upstream_usage(call.body)
        if self._follows(call):
            call.record = StreamRecord()
            body = {**body, "return_token_ids": True}
        hop = await self._open(
            call,
            request,
            "direct",
            WHOLE_ROLES,
            body,
            "prefill",
            call.prompt_tokens,
        )
        call.decode_worker = hop.worker
        await self._raise_client_error(call, hop)
        if call.stream:
            return _SSE(self._stream_whole(call, hop), self._cleanup(call, hop), _worker_notes(hop))
        reply = await self._read_reply(hop, request)
        out = self._priced(call, rewrite_reply(reply, call.identity))
        call.usage = out.get("usage")
        return JSONResponse(out, headers=_worker_notes(hop))

    async def _stream_whole(self, call: Call, hop: Hop) -> AsyncIterator[str]:
        try:
            rewriter = ChunkRewriter(
                call.identity,
                call.include_usage,
                drop_role=False,
                on_usage=self.accounting.pricer(call.identity.model),
                keep_token_ids=call.wants_token_ids,
            )
            async for piece in self._relay(call, hop, rewriter):
                yield piece
        except (GeneratorExit, asyncio.CancelledError):
            call.status = 499  # the client left; closing the hop aborts the worker's request
            raise
        finally:
            await hop.close()
            self._finish(call)

    # --- prefill + decode --------------------------------------------------------------
    async def _pd(self, call: Call, request: Request) -> Response:
        decode = self.placement.choose(self.registry.pool(WHOLE_ROLES), call.prompt_route, "decode")
        if decode is None:
            raise no_worker("decode")
        call.route = "pd"
        sent = time.monotonic()
        try:
            hop = await self._open(
                call,
                request,
                "prefill",
                PREFILL_ROLES,
                prefill_body(call.body, decode.url),
                "prefill",
                call.prompt_tokens,
            )
        except (APIError, Answered) as exc:
            reason = (
                exc.message if isinstance(exc, APIError) else f"HTTP {exc.response.status_code}"
            )
            logger.warning("prefill hop failed (%s); serving the request whole instead", reason)
            self.metrics.fallbacks.inc()
            call.reason = "prefill failed"
            return await self._whole(call, request)
        call.prefill_worker = hop.worker
        await self._raise_client_error(call, hop)
        reply = await self._read_reply(hop, request)
        self.metrics.prefill_hop.observe(time.monotonic() - sent)
        outcome = prefill_outcome(reply, call.body, call.kind)
        call.prefill_usage = outcome.usage
        if not outcome.takes_part:
            self._warn_no_pd(hop.worker)
        if outcome.complete:
            call.reason = "done at prefill"
            out = self._priced(call, rewrite_reply(reply, call.identity))
            call.usage = out.get("usage")
            if call.stream:
                return _SSE(self._stream_reply(call, out), self._cleanup(call))
            return JSONResponse(out)
        emit = emit_first_token(call.body, outcome.first_text) or not outcome.takes_part
        body = decode_body(call.body, outcome.kv if outcome.takes_part else None, emit)
        if call.stream:
            if self._follows(call):
                first = (outcome.kv or {}).get("first_token_ids") if outcome.takes_part else None
                call.record = StreamRecord.after_prefill(
                    [t for t in first or [] if isinstance(t, int)], shown_by_router=not emit
                )
                body = {**body, "return_token_ids": True}
            return _SSE(self._stream_pd(call, outcome, decode, body, emit), self._cleanup(call))
        try:
            hop = await self._open(
                call,
                request,
                "decode",
                WHOLE_ROLES,
                body,
                "decode",
                call.prompt_tokens,
                preferred=decode,
            )
            call.decode_worker = hop.worker
            await self._raise_client_error(call, hop)
            reply = await self._read_reply(hop, request)
        except BaseException:
            self._release_prefill_kv(call, outcome)
            raise
        out = self._priced(call, rewrite_reply(reply, call.identity, _prefill_usage(outcome)))
        call.usage = out.get("usage")
        return JSONResponse(out, headers=_worker_notes(hop))

    async def _stream_pd(
        self, call: Call, outcome: PrefillOutcome, decode: Worker, body: dict[str, Any], emit: bool
    ) -> AsyncIterator[str]:
        hop: Hop | None = None
        try:
            if call.kind == "chat":
                yield sse(role_chunk(call.identity, call.include_usage))
            if not emit and outcome.first_text:
                call.mark_first_output(call.prefill_worker)
                call.output_chunks += 1
                yield sse(text_chunk(call.identity, outcome.first_text, call.include_usage))
            sent = time.monotonic()
            try:
                hop = await self._open(
                    call,
                    None,
                    "decode",
                    WHOLE_ROLES,
                    body,
                    "decode",
                    call.prompt_tokens,
                    preferred=decode,
                )
            except APIError as exc:
                call.status = exc.status
                yield sse(exc.body())
                yield SSE_DONE
                return
            except Answered as answered:
                call.status = answered.response.status_code
                yield sse(_error_payload(bytes(answered.response.body), call.status))
                yield SSE_DONE
                return
            call.decode_worker = hop.worker
            if hop.status >= 400:
                call.status = hop.status
                yield sse(_error_payload(await self.upstream.read(hop.response), hop.status))
                yield SSE_DONE
                return
            rewriter = ChunkRewriter(
                call.identity,
                call.include_usage,
                drop_role=True,
                prefill_usage=_prefill_usage(outcome),
                on_usage=self.accounting.pricer(call.identity.model),
                keep_token_ids=call.wants_token_ids,
            )
            async for piece in self._relay(call, hop, rewriter, decode_sent=sent):
                yield piece
        except (GeneratorExit, asyncio.CancelledError):
            call.status = 499
            raise
        finally:
            if hop is not None:
                await hop.close()
            if call.status != 200 or (call.record is not None and call.record.migrations):
                self._release_prefill_kv(call, outcome)
            self._finish(call)

    async def _stream_reply(self, call: Call, reply: dict[str, Any]) -> AsyncIterator[str]:
        try:
            for chunk in reply_to_chunks(reply, call.identity, call.include_usage):
                if has_output(chunk):
                    call.mark_first_output(call.prefill_worker)
                yield sse(chunk)
            yield SSE_DONE
        except (GeneratorExit, asyncio.CancelledError):
            call.status = 499
            raise
        finally:
            self._finish(call)

    # --- hops --------------------------------------------------------------------------
    async def _open(
        self,
        call: Call,
        request: Request | None,
        hop_name: str,
        roles: tuple[Role, ...],
        body: dict[str, Any],
        kind: DispatchKind,
        tokens: int,
        preferred: Worker | None = None,
        avoid: frozenset[str] = frozenset(),
    ) -> Hop:
        """Open a hop on the best worker of `roles`, retrying on others; errors as responses.

        Workers in `avoid` (a migrated stream's failed ones) are the last resort."""

        def pick(exclude: set[str]) -> Worker | None:
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
        def prefill_work(worker: Worker) -> int:
            return call.prompt_route.prefill_work(worker.url)

        load: int | Callable[[Worker], int] = prefill_work if kind == "prefill" else tokens
        work = self.upstream.open_with_retries(
            hop_name, pick, call.path, body, call.headers, kind, load
        )
        try:
            hop = await (work if request is None else _unless_disconnected(request, work))
        except LookupError:
            raise no_worker("prefill" if hop_name == "prefill" else "decode") from None
        except HopFailure as failure:
            raise _failure_response(failure) from None
        call.retries += hop.attempts - 1
        self.metrics.hops.labels(hop.worker.url, hop_name, str(hop.status)).inc()
        return hop

    async def _raise_client_error(self, call: Call, hop: Hop) -> None:
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

    async def _read_reply(self, hop: Hop, request: Request) -> dict[str, Any]:
        try:
            data = await _unless_disconnected(request, self.upstream.read(hop.response))
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

    async def _relay(
        self, call: Call, hop: Hop, rewriter: ChunkRewriter, decode_sent: float | None = None
    ) -> AsyncIterator[str]:
        """A worker's SSE stream, rewritten chunk by chunk, always ending with [DONE].

        If the worker fails mid-stream (the stream breaks, or it sends a 5xx error event) and
        the call may move, the stream continues on another worker (`_migrate`); the caller
        closes `hop`, this closes the hops it opened itself."""
        own: list[Hop] = []
        try:
            while True:
                failure: str | None = None
                try:
                    async for data in self.upstream.events(
                        hop.response, is_output=_is_output_event, worker=hop.worker
                    ):
                        if data == "[DONE]":
                            break
                        try:
                            chunk = json.loads(data)
                        except ValueError:
                            logger.warning(
                                "skipping a malformed event from %s: %.200s", hop.worker.url, data
                            )
                            continue
                        if not isinstance(chunk, dict):
                            continue
                        if "error" in chunk and "choices" not in chunk:
                            if _server_side(chunk) and self._may_migrate(call):
                                failure = f"error event: {_message_of(chunk)}"
                                break
                            call.status = _status_of(chunk)
                            yield sse(chunk)
                            continue
                        if call.record is not None:
                            call.record.take(chunk)
                        out = rewriter(chunk)
                        if out is None:
                            continue
                        if has_output(out):
                            call.output_chunks += 1
                            if decode_sent is not None:
                                self.metrics.decode_first.observe(time.monotonic() - decode_sent)
                                decode_sent = None
                            call.mark_first_output(hop.worker)
                        yield sse(out)
                except StreamBroken as exc:
                    failure = str(exc)
                    self.metrics.hops.labels(hop.worker.url, "stream", "broken").inc()
                    self.upstream.report("stream", HopFailure(hop.worker, failure))
                if failure is None:
                    break
                if not self._may_migrate(call):
                    call.status = 502
                    logger.warning("stream from %s broke: %s", hop.worker.url, failure)
                    yield sse(
                        error_body(
                            502,
                            f"worker {hop.worker.url} failed mid-stream: {failure}",
                            None,
                            "worker_stream_broken",
                        )
                    )
                    break
                moved = await self._migrate(call, hop, failure)
                if isinstance(moved, dict):
                    call.status = _status_of(moved)
                    yield sse(moved)
                    break
                if moved is None:  # every token was out: only the end was missing
                    yield sse(_length_chunk(call))
                    break
                own.append(moved)
                hop = moved
                rewriter.drop_role = True
        finally:
            for opened in own:
                await opened.close()
        call.usage = rewriter.usage
        yield SSE_DONE

    # --- migration (migration.py) ------------------------------------------------------
    def _follows(self, call: Call) -> bool:
        """Whether the router records this stream's tokens so that it can move it."""
        return (
            call.stream
            and self.config.migration_limit > 0
            and self.config.cluster_secret is not None  # the resumed request carries internal fields
            and can_migrate(call.body, call.kind)
        )

    def _may_migrate(self, call: Call) -> bool:
        record = call.record
        return (
            record is not None
            and not record.finished
            and record.migrations < self.config.migration_limit
        )

    async def _migrate(
        self, call: Call, broken: Hop, failure: str
    ) -> Hop | dict[str, Any] | None:
        """Continue `call` on another worker: the new hop, an error event, or None when the
        client has every token it asked for already (the stream only lacks its end)."""
        record = call.record
        assert record is not None
        record.migrations += 1
        call.failed_workers.add(broken.worker.url)
        await broken.close()
        if record.out_of_budget(requested_max_tokens(call.body, call.kind)):
            record.finished = True
            return None
        self.metrics.migrations.labels(call.route).inc()
        logger.warning(
            "stream from %s broke after %d tokens (%s); moving it to another worker (%d of %d)",
            broken.worker.url,
            len(record.token_ids),
            failure,
            record.migrations,
            self.config.migration_limit,
        )
        try:
            hop = await self._open(
                call,
                None,
                "direct",
                WHOLE_ROLES,
                resume_body(call.body, record),
                "prefill",
                call.prompt_tokens + len(record.token_ids),
                avoid=frozenset(call.failed_workers),
            )
        except APIError as exc:
            return exc.body()
        except Answered as answered:
            return _error_payload(bytes(answered.response.body), answered.response.status_code)
        if hop.status >= 400:
            try:
                return _error_payload(await self.upstream.read(hop.response), hop.status)
            finally:
                await hop.close()
        call.decode_worker = hop.worker
        return hop

    def _release_prefill_kv(self, call: Call, outcome: PrefillOutcome) -> None:
        """The decode half failed or moved: the prefill worker's held KV for it is freed now
        (POST /kv/release), not when its lease runs out. A no-op if it was read already."""
        transfer_id = (outcome.kv or {}).get("transfer_id")
        worker = call.prefill_worker
        if not isinstance(transfer_id, str) or worker is None:
            return

        async def release() -> None:
            try:
                await self.upstream.client.post(
                    f"{worker.url}/kv/release",
                    json={"transfer_id": transfer_id},
                    headers=call.headers,
                    timeout=self.config.health.timeout_s,
                )
            except Exception as exc:  # the lease still ends on its own
                logger.debug("releasing %s on %s failed: %s", transfer_id, worker.url, exc)

        task = asyncio.create_task(release(), name=f"release {transfer_id}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # --- bookkeeping -------------------------------------------------------------------
    def _warn_no_pd(self, worker: Worker) -> None:
        if worker.url not in self._warned_no_pd:
            self._warned_no_pd.add(worker.url)
            logger.warning(
                "prefill worker %s does not hand over KV (no kv_transfer_params in its "
                "reply: started without --role prefill?); decode workers will compute "
                "whole requests",
                worker.url,
            )

    def _priced(self, call: Call, reply: dict[str, Any]) -> dict[str, Any]:
        return self.accounting.priced_reply(reply, call.identity.model)

    def _cleanup(self, call: Call, hop: Hop | None = None) -> Callable[[], Awaitable[None]]:
        """What a stream must do even if its body never ran (the client left first)."""

        async def cleanup() -> None:
            if hop is not None:
                await hop.close()
            if not call.finished:
                call.status = 499
                self._finish(call)

        return cleanup

    def _finish(self, call: Call) -> None:
        if call.finished:
            return
        call.finished = True
        end = time.monotonic()
        route = call.route
        self.metrics.requests.labels(route, call.kind, str(call.status)).inc()
        self.metrics.e2e.labels(route).observe(end - call.received)
        if call.ttft is not None and call.first_output_worker is not None:
            self.metrics.ttft.labels(route, call.first_output_worker.url).observe(call.ttft)
        completion = (call.usage or {}).get("completion_tokens")
        if call.stream and call.ttft is not None and isinstance(completion, int) and completion > 1:
            self.metrics.tpot.labels(route).observe((end - call.received - call.ttft) / (completion - 1))
        self.metrics.observe_usage(
            call.prefill_worker or call.decode_worker,
            call.decode_worker or call.prefill_worker,
            call.usage,
        )
        self.accounting.record(call, end)
        if call.key is not None:
            self.accounting.settle(call.key, call.admitted_tokens, call.usage)
        if call.admitted:
            self.admission.leave()
        self.placement.ended(call.prefill_worker, call.decode_worker)
        prompt = call.usage.get("prompt_tokens") if call.usage else None
        counted = f"{prompt}" if prompt is not None else f"~{call.prompt_tokens}"
        logger.info(
            "%s %s route=%s (%s) prefill=%s decode=%s prompt_tokens=%s ttft=%s e2e=%.3fs "
            "retries=%d migrations=%d status=%d placement=%s",
            call.kind,
            "stream" if call.stream else "whole",
            route,
            call.reason,
            call.prefill_worker.url if call.prefill_worker else "-",
            call.decode_worker.url if call.decode_worker else "-",
            counted,
            f"{call.ttft:.3f}s" if call.ttft is not None else "-",
            end - call.received,
            call.retries,
            call.record.migrations if call.record is not None else 0,
            call.status,
            ",".join(call.prompt_route.notes) or "-",
        )


# --- helpers ---------------------------------------------------------------------------
_WORKER_NOTES = "x-tandem-max-tokens-"  # a capped max_tokens (tandem serve --max-tokens-policy)


def _worker_notes(hop: Hop) -> dict[str, str]:
    """The worker's notes to the client that the router passes on: what max_tokens it ran
    with. A prefill/decode stream starts before its decode hop answers, so it has none."""
    return {k: v for k, v in hop.response.headers.items() if k.lower().startswith(_WORKER_NOTES)}


class _SSE(StreamingResponse):
    """An event stream that releases its upstream hop however the response ends.

    A generator's `finally` runs only if the generator started and is closed; when the
    client leaves before the body starts (or while the generator waits at a `yield`),
    Starlette just drops it. Closing it here, shielded from the cancellation, makes the
    worker see its connection close (and abort) at once.
    """

    def __init__(self, body: AsyncIterator[str], cleanup: Callable[[], Awaitable[None]],
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                body = self.body_iterator
                if isinstance(body, AsyncGenerator):
                    await body.aclose()
                await self._cleanup()


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


def _is_output_event(data: str) -> bool:
    """A stream event past the preamble (a chat stream's role chunk): output, an error, the end."""
    try:
        chunk = json.loads(data)
    except ValueError:
        return True
    return not isinstance(chunk, dict) or "choices" not in chunk or has_output(chunk) or any(
        choice.get("finish_reason") for choice in chunk["choices"] or [])


def _prefill_usage(outcome: PrefillOutcome) -> dict[str, Any] | None:
    """Usage merges only when the decode hop continued the prefill hop's work."""
    return outcome.usage if outcome.takes_part else None


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


def _error_payload(data: bytes, status: int) -> dict[str, Any]:
    try:
        payload = json.loads(data)
        if isinstance(payload, dict) and "error" in payload:
            return payload
    except ValueError:
        pass
    return error_body(status, data.decode(errors="replace")[:500] or f"HTTP {status}")


def _server_side(chunk: dict[str, Any]) -> bool:
    """An error event that is the worker's fault (its engine died, say), not the request's."""
    error = chunk.get("error")
    if not isinstance(error, dict):
        return False
    code = error.get("code")
    return error.get("type") == "server_error" or (isinstance(code, int) and code >= 500)


def _message_of(chunk: dict[str, Any]) -> str:
    error = chunk.get("error")
    return str(error.get("message", "")) if isinstance(error, dict) else str(error)


def _length_chunk(call: Call) -> dict[str, Any]:
    """The end of a stream whose tokens were all out when its worker failed."""
    return text_chunk(call.identity, "", call.include_usage, "length")


def _status_of(chunk: dict[str, Any]) -> int:
    error = chunk.get("error")
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, int) else 500


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which closes its upstream connection) if the client leaves."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
