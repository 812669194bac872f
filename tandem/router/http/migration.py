"""Mid-stream migration: what a broken stream has sent, and the request that continues it.

When a worker dies or its stream breaks after the client has seen part of the answer, the
router re-sends the request to another worker together with the tokens generated so far, as
token ids (workers report them per chunk because the router asks with `return_token_ids`). The
new worker treats them as output it did not generate itself, the way a decode worker treats a
prefill worker's first token (tandem/server/serving.py `handoff`): they are context for its
prefill (mostly a prefix-cache or KV-tier hit), count toward `max_tokens` and the usage, and
their text is not sent again. `streamed_from` tells it which of them reached the client
through a stream, whose stop-string hold-back kept the last few characters back: those it sends
now, so the client's text has no gap and nothing twice.

Only a request with one output sequence moves (n == 1, one prompt, no echo): several
sequences would each need their own record. Dynamo keeps migration off by default
(`--migration-limit 0`); here it is on, with a limit of 3 moves per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.router.pd.merge import Kind

DEFAULT_MIGRATION_LIMIT = 3


def can_migrate(body: dict[str, Any], kind: Kind) -> bool:
    """One output sequence whose tokens the router can follow and hand on."""
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return False
    if kind == "completion":
        if body.get("echo"):
            return False
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt):
            return len(prompt) == 1
    return True


@dataclass
class StreamRecord:
    """The output token ids of a stream so far, in order, and how the client saw them."""

    token_ids: list[int] = field(default_factory=list)
    # token_ids[:streamed_from] were shown whole (a prefill worker's first token that the
    # router sent itself); the rest came through a worker's stream.
    streamed_from: int = 0
    migrations: int = 0
    finished: bool = False

    @classmethod
    def after_prefill(cls, first_token_ids: list[int], shown_by_router: bool) -> StreamRecord:
        return cls(list(first_token_ids), len(first_token_ids) if shown_by_router else 0)

    def take(self, chunk: dict[str, Any]) -> None:
        """Record a worker chunk's token ids and whether it ended the sequence."""
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            ids = choice.get("token_ids")
            if isinstance(ids, list):
                self.token_ids.extend(t for t in ids if isinstance(t, int))
            if choice.get("finish_reason") is not None:
                self.finished = True

    def out_of_budget(self, max_tokens: object) -> bool:
        """Every token the client asked for is out already: only the end is missing."""
        return isinstance(max_tokens, int) and len(self.token_ids) >= max_tokens


def resume_body(body: dict[str, Any], record: StreamRecord) -> dict[str, Any]:
    """The client's request again, continuing after the recorded tokens on a new worker.

    A prefill worker's KV handle is dropped (its lease may be gone with the failure): the new
    worker computes the prompt itself, from its prefix cache and KV tiers where it can.
    `max_tokens` stays the client's: the new worker counts the recorded tokens toward it.
    """
    out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    out["stream"] = True
    out["stream_options"] = {"include_usage": True}
    out["return_token_ids"] = True
    if record.token_ids:
        out["kv_transfer_params"] = {
            "do_remote_prefill": True,
            "first_token_ids": list(record.token_ids),
            "emit_first_token": False,
            "streamed_from": record.streamed_from,
        }
    return out
