"""A worker's event stream relayed to the client, moved to another worker if its worker fails.

The relay rewrites each worker chunk for the client (pd/merge.py) and records the stream's
token ids when the call may move (migration.py). When the stream breaks, or the worker sends
an error event that is its own fault (a 5xx), the relay re-opens the request on another
worker with the tokens so far and goes on reading there; the client sees one stream. A call
that may not move (migration off, no cluster secret to sign the resumed request, several
output sequences, its moves used up) ends with an error event instead.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from tandem.edge.errors import APIError, error_body
from tandem.router.http.call import Answered, Call
from tandem.router.http.hops import WHOLE_ROLES, Hops
from tandem.router.http.metrics import RouterMetrics
from tandem.router.http.migration import can_migrate, resume_body
from tandem.router.http.sse import error_payload
from tandem.router.http.upstream import Hop, HopFailure, StreamBroken, Upstream
from tandem.router.pd.merge import (
    SSE_DONE,
    ChunkRewriter,
    has_output,
    sse,
    text_chunk,
)
from tandem.router.pd.split import requested_max_tokens

logger = logging.getLogger(__name__)


class Relay:
    def __init__(
        self,
        hops: Hops,
        upstream: Upstream,
        metrics: RouterMetrics,
        migration_limit: int,
        can_sign: bool,
    ) -> None:
        """`can_sign`: the router has the cluster secret that a resumed request's handoff
        fields are signed with (tandem/trust); without it no stream moves."""
        self.hops = hops
        self.upstream = upstream
        self.metrics = metrics
        self.migration_limit = migration_limit
        self.can_sign = can_sign

    def follows(self, call: Call) -> bool:
        """Whether the router records this stream's tokens so that it can move it."""
        return (
            call.stream
            and self.migration_limit > 0
            and self.can_sign  # the resumed request carries internal fields
            and can_migrate(call.body, call.kind)
        )

    def may_migrate(self, call: Call) -> bool:
        record = call.record
        return (
            record is not None
            and not record.finished
            and record.migrations < self.migration_limit
        )

    async def stream(
        self, call: Call, hop: Hop, rewriter: ChunkRewriter, decode_sent: float | None = None
    ) -> AsyncIterator[str]:
        """A worker's SSE stream, rewritten chunk by chunk, always ending with [DONE].

        If the worker fails mid-stream (the stream breaks, or it sends a 5xx error event) and
        the call may move, the stream continues on another worker (`migrate`); the caller
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
                            if _server_side(chunk) and self.may_migrate(call):
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
                if not self.may_migrate(call):
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
                moved = await self.migrate(call, hop, failure)
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

    async def migrate(
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
            self.migration_limit,
        )
        try:
            hop = await self.hops.open(
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
            return error_payload(bytes(answered.response.body), answered.response.status_code)
        if hop.status >= 400:
            try:
                return await self.hops.error_event(hop)
            finally:
                await hop.close()
        call.decode_worker = hop.worker
        return hop


def _is_output_event(data: str) -> bool:
    """A stream event past the preamble (a chat stream's role chunk): output, an error, the end."""
    try:
        chunk = json.loads(data)
    except ValueError:
        return True
    return not isinstance(chunk, dict) or "choices" not in chunk or has_output(chunk) or any(
        choice.get("finish_reason") for choice in chunk["choices"] or [])


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
