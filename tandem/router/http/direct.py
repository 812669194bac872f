"""The direct path: one worker of the decode/both pool serves the request whole.

The hop is opened (with retries) before the response starts, so a worker's 4xx reaches the
client with its own status and an unreachable pool is a 503. A whole reply is read while the
client is watched; a stream is relayed, and may move to another worker mid-stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tandem.router.accounting.accounting import Accounting
from tandem.router.http.bookkeeping import Bookkeeping
from tandem.router.http.call import Call
from tandem.router.http.hops import WHOLE_ROLES, Hops, worker_notes
from tandem.router.http.migration import StreamRecord
from tandem.router.http.relay import Relay
from tandem.router.http.sse import EventStream
from tandem.router.http.upstream import Hop
from tandem.router.pd.merge import ChunkRewriter, rewrite_reply
from tandem.router.pd.split import with_upstream_usage


class Direct:
    def __init__(
        self, hops: Hops, relay: Relay, accounting: Accounting, books: Bookkeeping
    ) -> None:
        self.hops = hops
        self.relay = relay
        self.accounting = accounting
        self.books = books

    async def serve(self, call: Call, request: Request) -> Response:
        call.route = "direct"
        body = with_upstream_usage(call.body)
        if self.relay.follows(call):
            call.record = StreamRecord()
            body = {**body, "return_token_ids": True}
        hop = await self.hops.open(
            call,
            request,
            "direct",
            WHOLE_ROLES,
            body,
            "prefill",
            call.prompt_tokens,
        )
        call.decode_worker = hop.worker
        await self.hops.raise_client_error(hop)
        if call.stream:
            return EventStream(
                self._stream(call, hop), self.books.cleanup(call, hop), worker_notes(hop)
            )
        reply = await self.hops.read_reply(hop, request)
        out = self.accounting.priced_reply(rewrite_reply(reply, call.identity), call.identity.model)
        call.usage = out.get("usage")
        return JSONResponse(out, headers=worker_notes(hop))

    async def _stream(self, call: Call, hop: Hop) -> AsyncIterator[str]:
        try:
            rewriter = ChunkRewriter(
                call.identity,
                call.include_usage,
                drop_role=False,
                on_usage=self.accounting.pricer(call.identity.model),
                keep_token_ids=call.wants_token_ids,
            )
            async for piece in self.relay.stream(call, hop, rewriter):
                yield piece
        except (GeneratorExit, asyncio.CancelledError):
            call.status = 499  # the client left; closing the hop aborts the worker's request
            raise
        finally:
            await hop.close()
            self.books.finish(call)
