"""One client request as it goes through the router, and the two ways it ends before a reply.

Every step of the request path (the proxy's admission, the direct and prefill/decode flows,
the relay, the closing bookkeeping) reads and fills the same `Call`, so each step needs no
reference to the others: what the log line, the metrics and the usage ledger report at the
end is what the steps wrote into it. `Answered` (a worker's own error reply) and
`tandem.edge.disconnect.ClientGone` end a call early, from any step, and the proxy turns them
into the client's response.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import Response

from tandem.router.accounting.auth import Caller
from tandem.router.http.migration import StreamRecord
from tandem.router.pd.merge import Identity, Kind
from tandem.router.placement.policies import PromptRoute
from tandem.router.workers.registry import WorkerEndpoint


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
    prefill_worker: WorkerEndpoint | None = None
    decode_worker: WorkerEndpoint | None = None
    first_hop_at: float | None = None
    ttft: float | None = None
    first_output_worker: WorkerEndpoint | None = None
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
    # The client's protocol ("chat", "completion", "messages", "responses"): the metrics'
    # endpoint label. Below the proxy a Messages or Responses call is a chat call.
    protocol: str = "chat"
    # The id the client sees (a Messages `msg_…`, a Responses `resp_…`); the chat id if None.
    reply_id: str | None = None

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

    def mark_first_output(self, worker: WorkerEndpoint | None) -> None:
        if self.ttft is None:
            self.ttft = time.monotonic() - self.received
            self.first_output_worker = worker


