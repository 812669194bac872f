"""Prefill/decode disaggregation as data: when to split, and the two hops' request bodies.

Protocol with the workers (`tandem serve --role prefill|decode|both`):

1. Prefill hop: the client's body with `stream: false`, `max_tokens: 1` and
   `kv_transfer_params: {do_remote_decode: true, remote_decode: <decode worker URL>}`. The
   reply is a one-token completion plus a top-level `kv_transfer_params` object holding
   `first_token_ids` and opaque transfer fields (or null: nothing to hand over).
2. The reply is the whole answer when it stopped at the first token, when the client asked
   for one token, or when `kv_transfer_params` is null.
3. Decode hop: the client's own body plus `kv_transfer_params: {<prefill's object>,
   do_remote_prefill: true, emit_first_token: <bool>}`. The decode worker counts the first
   token as generated. With `emit_first_token: false` its stream starts after the first
   token, which the router has already sent the client at prefill latency; requests with
   tools use `true` so the worker's tool-call parser sees the whole output.

A prefill reply with no `kv_transfer_params` key at all comes from a worker that does not
take part in the protocol (an older worker, or one started without --role): the decode hop
then runs the whole request as a plain one and its reply stands alone.

The split is skipped (one worker serves the whole request) when:
- the prompt is shorter than `--pd-min-prompt-tokens` (default 256): the extra HTTP round
  trip and KV transfer cost more than the short prefill they move off the decode worker;
- `n` > 1, `best_of` > 1, logprobs, `echo` or several prompts in one completion request: the
  one-token prefill hop cannot carry several sequences or per-token logprobs across to the
  decode worker, so merging them would be wrong, not just slower.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.router.pd.merge import Kind, finish_reason, first_text


@dataclass(frozen=True)
class RouteDecision:
    pd: bool
    reason: str


def requested_max_tokens(body: dict[str, Any], kind: Kind) -> int | None:
    if kind == "chat":
        value = body.get("max_completion_tokens")
        return body.get("max_tokens") if value is None else value
    return body.get("max_tokens", 16)  # OpenAI's completion default


def wants_tools(body: dict[str, Any]) -> bool:
    return bool(body.get("tools")) and body.get("tool_choice") != "none"


def _single_sequence_problem(body: dict[str, Any], kind: Kind) -> str | None:
    if body.get("n") not in (None, 1):
        return "n>1"
    if body.get("best_of") not in (None, 1):
        return "best_of>1"
    if kind == "chat" and (body.get("logprobs") or body.get("top_logprobs")):
        return "logprobs"
    if kind == "completion":
        if body.get("logprobs") is not None:
            return "logprobs"
        if body.get("echo"):
            return "echo"
        prompt = body.get("prompt")
        if (
            isinstance(prompt, list)
            and prompt
            and not all(isinstance(p, int) for p in prompt)
            and len(prompt) > 1
        ):
            return "several prompts"
    return None


def decide_route(
    body: dict[str, Any], kind: Kind, prompt_tokens: int, min_prompt_tokens: int, have_prefill: bool
) -> RouteDecision:
    if not have_prefill:
        return RouteDecision(False, "no prefill worker")
    problem = _single_sequence_problem(body, kind)
    if problem:
        return RouteDecision(False, problem)
    if requested_max_tokens(body, kind) == 1:
        return RouteDecision(False, "max_tokens=1")
    if prompt_tokens < min_prompt_tokens:
        return RouteDecision(False, "short prompt")
    return RouteDecision(True, "long prompt")


def prefill_body(body: dict[str, Any], decode_url: str) -> dict[str, Any]:
    out = dict(body)
    out["stream"] = False
    out["max_tokens"] = 1
    out.pop("max_completion_tokens", None)
    out.pop("stream_options", None)
    if (out.get("min_tokens") or 0) > 1:
        out["min_tokens"] = 1  # the first token keeps its min_tokens meaning (no EOS)
    out["kv_transfer_params"] = {"do_remote_decode": True, "remote_decode": decode_url}
    return out


def with_upstream_usage(body: dict[str, Any]) -> dict[str, Any]:
    """Streams always ask the worker for usage: the router counts tokens, then strips it."""
    if not body.get("stream"):
        return body
    out = dict(body)
    out["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    return out


def decode_body(
    body: dict[str, Any], kv: dict[str, Any] | None, emit_first_token: bool
) -> dict[str, Any]:
    out = with_upstream_usage(body)
    if kv is not None:
        out = dict(out)
        out["kv_transfer_params"] = {
            **kv,
            "do_remote_prefill": True,
            "emit_first_token": emit_first_token,
        }
    return out


@dataclass(frozen=True)
class PrefillOutcome:
    reply: dict[str, Any]
    kv: dict[str, Any] | None  # what to pass to the decode hop
    takes_part: bool  # the worker speaks the protocol (its reply has the key)
    complete: bool  # the reply is the whole answer
    first_text: str
    # The worker splits reasoning from the answer (its reply says `reasoning_content`): only
    # the decode worker, whose parser reads the whole output, can say where the first token
    # belongs, so it sends that token itself.
    reasoning: bool = False

    @property
    def usage(self) -> dict[str, Any] | None:
        usage = self.reply.get("usage")
        return usage if isinstance(usage, dict) else None


def prefill_outcome(reply: dict[str, Any], body: dict[str, Any], kind: Kind) -> PrefillOutcome:
    takes_part = "kv_transfer_params" in reply
    kv = reply.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        kv = None
    reason = finish_reason(reply)
    complete = (
        (reason is not None and reason != "length")
        or requested_max_tokens(body, kind) == 1
        or (takes_part and kv is None)
    )
    choices = reply.get("choices") or [{}]
    message = choices[0].get("message") if isinstance(choices[0], dict) else None
    reasoning = isinstance(message, dict) and "reasoning_content" in message
    return PrefillOutcome(reply, kv, takes_part, complete, first_text(reply), reasoning)


def emit_first_token(body: dict[str, Any], first_text: str = "") -> bool:
    """Whether the decode worker sends the first token itself (see the module docstring).

    Also when the first token is part of a multi-byte character: alone it decodes to U+FFFD,
    and the decode worker, which sees the next token too, sends the character whole.
    """
    return not body.get("stream") or wants_tools(body) or "\ufffd" in first_text
