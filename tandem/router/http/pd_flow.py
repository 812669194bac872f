"""The prefill/decode path: prefill on one worker, its KV handed to a decode worker.

The prefill hop runs first, before the response starts: if it fails the request is served
whole instead (a fallback, counted), and a prefill worker's 4xx is the client's answer. Its
reply carries the KV handle (`kv_transfer_params`) and the first token, or the whole answer
when the request ended at prefill. For a stream, the router then sends the role chunk and
the first token itself and opens the decode hop inside the stream, so a decode failure can
only be reported as an error event. When the decode half fails or moves to another worker,
the prefill worker's held KV is released at once rather than when its lease runs out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tandem.edge.errors import APIError
from tandem.router.accounting.accounting import Accounting
from tandem.router.http.bookkeeping import Bookkeeping
from tandem.router.http.call import Answered, Call
from tandem.router.http.direct import Direct
from tandem.router.http.hops import PREFILL_ROLES, WHOLE_ROLES, Hops, no_worker, worker_notes
from tandem.router.http.metrics import RouterMetrics
from tandem.router.http.migration import StreamRecord
from tandem.router.http.relay import Relay
from tandem.router.http.sse import EventStream, error_payload
from tandem.router.http.upstream import Hop
from tandem.router.pd.merge import (
    SSE_DONE,
    ChunkRewriter,
    has_output,
    reply_to_chunks,
    rewrite_reply,
    role_chunk,
    sse,
    text_chunk,
)
from tandem.router.pd.split import (
    PrefillOutcome,
    decode_body,
    emit_first_token,
    prefill_body,
    prefill_outcome,
)
from tandem.router.workers.registry import WorkerEndpoint, other_block_sizes

logger = logging.getLogger(__name__)


class KvRelease:
    """Frees a prefill worker's held KV for a transfer now (POST /kv/release), in the
    background: the lease still ends on its own if the release fails."""

    def __init__(self, client: httpx.AsyncClient, timeout_s: float) -> None:
        self.client = client
        self.timeout_s = timeout_s
        self._background: set[asyncio.Task[None]] = set()

    def __call__(self, call: Call, outcome: PrefillOutcome) -> None:
        """The decode half failed or moved: the prefill worker's held KV for it is freed now
        (POST /kv/release), not when its lease runs out. A no-op if it was read already."""
        transfer_id = (outcome.kv or {}).get("transfer_id")
        worker = call.prefill_worker
        if not isinstance(transfer_id, str) or worker is None:
            return

        async def release() -> None:
            try:
                await self.client.post(
                    f"{worker.url}/kv/release",
                    json={"transfer_id": transfer_id},
                    headers=call.headers,
                    timeout=self.timeout_s,
                )
            except Exception as exc:  # the lease still ends on its own
                logger.debug("releasing %s on %s failed: %s", transfer_id, worker.url, exc)

        task = asyncio.create_task(release(), name=f"release {transfer_id}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)


class PdFlow:
    def __init__(
        self,
        hops: Hops,
        relay: Relay,
        direct: Direct,
        release: KvRelease,
        accounting: Accounting,
        books: Bookkeeping,
        metrics: RouterMetrics,
    ) -> None:
        self.hops = hops
        self.relay = relay
        self.direct = direct
        self.release = release
        self.accounting = accounting
        self.books = books
        self.metrics = metrics
        self._warned_no_pd: set[str] = set()
        self._warned_blocks: set[str] = set()  # decode workers no prefill worker can hand KV to

    async def serve(self, call: Call, request: Request) -> Response:
        decode = self.hops.choose(call, WHOLE_ROLES, "decode")
        if decode is None:
            raise no_worker("decode")
        other_blocks = self._other_block_sizes(decode)
        if other_blocks is None:  # no prefill worker could hand this decode worker its KV
            call.reason = "block sizes differ"
            return await self.direct.serve(call, request)
        call.route = "pd"
        sent = time.monotonic()
        try:
            hop = await self.hops.open(
                call,
                request,
                "prefill",
                PREFILL_ROLES,
                prefill_body(call.body, decode.url),
                "prefill",
                call.prompt_tokens,
                avoid=other_blocks,
            )
        except (APIError, Answered) as exc:
            reason = (
                exc.message if isinstance(exc, APIError) else f"HTTP {exc.response.status_code}"
            )
            logger.warning("prefill hop failed (%s); serving the request whole instead", reason)
            self.metrics.fallbacks.inc()
            call.reason = "prefill failed"
            return await self.direct.serve(call, request)
        call.prefill_worker = hop.worker
        await self.hops.raise_client_error(hop)
        reply = await self.hops.read_reply(hop, request)
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
                return EventStream(self._stream_reply(call, out), self.books.cleanup(call))
            return JSONResponse(out)
        emit = emit_first_token(call.body, outcome.first_text) or not outcome.takes_part or outcome.reasoning
        body = decode_body(call.body, outcome.kv if outcome.takes_part else None, emit)
        if call.stream:
            if self.relay.follows(call):
                first = (outcome.kv or {}).get("first_token_ids") if outcome.takes_part else None
                call.record = StreamRecord.after_prefill(
                    [t for t in first or [] if isinstance(t, int)], shown_by_router=not emit
                )
                body = {**body, "return_token_ids": True}
            return EventStream(
                self._stream(call, outcome, decode, body, emit), self.books.cleanup(call)
            )
        try:
            hop = await self.hops.open(
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
            await self.hops.raise_client_error(hop)
            reply = await self.hops.read_reply(hop, request)
        except BaseException:
            self.release(call, outcome)
            raise
        out = self._priced(call, rewrite_reply(reply, call.identity, _prefill_usage(outcome)))
        call.usage = out.get("usage")
        return JSONResponse(out, headers=worker_notes(hop))

    async def _stream(
        self,
        call: Call,
        outcome: PrefillOutcome,
        decode: WorkerEndpoint,
        body: dict[str, Any],
        emit: bool,
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
                hop = await self.hops.open(
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
                yield sse(error_payload(bytes(answered.response.body), call.status))
                yield SSE_DONE
                return
            call.decode_worker = hop.worker
            if hop.status >= 400:
                call.status = hop.status
                yield sse(await self.hops.error_event(hop))
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
            async for piece in self.relay.stream(call, hop, rewriter, decode_sent=sent):
                yield piece
        except (GeneratorExit, asyncio.CancelledError):
            call.status = 499
            raise
        finally:
            if hop is not None:
                await hop.close()
            if call.status != 200 or (call.record is not None and call.record.migrations):
                self.release(call, outcome)
            self.books.finish(call)

    async def _stream_reply(self, call: Call, reply: dict[str, Any]) -> AsyncIterator[str]:
        """An answer the prefill worker finished, as the stream the client asked for."""
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
            self.books.finish(call)

    def _priced(self, call: Call, reply: dict[str, Any]) -> dict[str, Any]:
        return self.accounting.priced_reply(reply, call.identity.model)

    def _other_block_sizes(self, decode: WorkerEndpoint) -> frozenset[str] | None:
        """The prefill workers whose KV blocks are of another size than `decode`'s (a GPU's 16
        tokens beside a CPU's 64, say): the decode worker would refuse their handoff and compute
        the prompt again, so they are the hop's last resort. None when every prefill worker is
        one of them: the request is served whole. Sizes not yet reported count as equal."""
        pool = self.hops.registry.pool(PREFILL_ROLES)
        other = other_block_sizes(pool, decode)
        if not other or len(other) < len(pool):
            return other
        if decode.url not in self._warned_blocks:
            self._warned_blocks.add(decode.url)
            logger.warning(
                "no prefill worker shares decode worker %s's KV block size (%s tokens; the prefill "
                "workers': %s): its requests are served whole; give every worker the same "
                "--block-size to split them", decode.url, decode.block_size,
                ", ".join(sorted({str(w.block_size) for w in pool})),
            )
        return None

    def _warn_no_pd(self, worker: WorkerEndpoint) -> None:
        if worker.url not in self._warned_no_pd:
            self._warned_no_pd.add(worker.url)
            logger.warning(
                "prefill worker %s does not hand over KV (no kv_transfer_params in its "
                "reply: started without --role prefill?); decode workers will compute "
                "whole requests",
                worker.url,
            )


def _prefill_usage(outcome: PrefillOutcome) -> dict[str, Any] | None:
    """Usage merges only when the decode hop continued the prefill hop's work."""
    return outcome.usage if outcome.takes_part else None
