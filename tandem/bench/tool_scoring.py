"""Scoring one chat completion against its tool case, and the rates of a mode's run.

A returned call is *valid* when it names a function the request declared and its `arguments`
is a JSON string that parses and validates against that function's parameters schema (JSON
Schema Draft 2020-12, the `jsonschema` package). `format` keywords are not asserted (the
schemas here use `pattern` where a shape matters), as a strict-mode grammar does not enforce
them either. A response is *schema-valid* when it has at least one call and every call is
valid: a reply that calls nothing is not a valid call, it is counted apart (`no call`), and
one whose text looks like a call the server could not parse (`<tool_call>`, a `"name"` with
`"arguments"`) is counted once more as `call-like text`: that is a malformed call that reached
the user as prose. *Exact names* compares the returned names with the expected ones as a
multiset, so a parallel case needs both calls and no third.

Pure logic: the runner hands in the decoded response body (or the error it got), so the tests
feed it made-up responses.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any

from tandem.bench.tool_prompts import KINDS, ToolCase

VERDICTS = ("valid", "unknown_tool", "malformed_json", "schema_invalid")
_TEXT_CHARS = 300


@lru_cache(maxsize=256)
def _validator(schema_json: str) -> Any:
    try:
        from jsonschema import Draft202012Validator
    except ImportError as exc:  # a test extra (schemathesis pulls it in), not a serving dependency
        raise ValueError("tandem bench tools needs the jsonschema package: pip install jsonschema") from exc
    return Draft202012Validator(json.loads(schema_json))


def validation_error(schema: Mapping[str, Any], instance: Any) -> str | None:
    """The first way `instance` breaks `schema` (None: it validates)."""
    validator = _validator(json.dumps(schema, sort_keys=True))
    error = next(iter(validator.iter_errors(instance)), None)
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"{where or '(root)'}: {error.message}"[:_TEXT_CHARS]


@dataclass
class CallCheck:
    """One returned tool call and what is wrong with it, if anything."""

    name: str | None
    verdict: str  # one of VERDICTS
    detail: str = ""


def check_call(call: Any, schemas: Mapping[str, Mapping[str, Any]]) -> CallCheck:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return CallCheck(None, "malformed_json", "the call has no function object")
    name = function.get("name")
    if not isinstance(name, str) or name not in schemas:
        return CallCheck(name if isinstance(name, str) else None, "unknown_tool",
                         f"{name!r} is not a declared tool ({', '.join(schemas)})")
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        return CallCheck(name, "malformed_json", f"arguments is a {type(arguments).__name__}, not a JSON string")
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError as exc:
        return CallCheck(name, "malformed_json", f"{exc.msg} at {exc.pos}: {arguments[:120]!r}")
    problem = validation_error(schemas[name], parsed)
    if problem is not None:
        return CallCheck(name, "schema_invalid", problem)
    return CallCheck(name, "valid")


def looks_like_call(text: str) -> bool:
    """Text that carries a tool call the server did not turn into one."""
    return "<tool_call>" in text or ('"name"' in text and '"arguments"' in text)


@dataclass
class CaseScore:
    """What one case's response scored."""

    case_id: str
    kind: str
    expected: list[str]
    error: str | None = None  # HTTP status or transport failure: no response to score
    calls: list[CallCheck] = field(default_factory=list)
    text: str = ""  # the reply's content (cut), for reading the no-call answers
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    latency_s: float | None = None

    @property
    def names(self) -> list[str]:
        return [c.name or "" for c in self.calls]

    @property
    def valid(self) -> bool:
        return self.error is None and bool(self.calls) and all(c.verdict == "valid" for c in self.calls)

    @property
    def exact_names(self) -> bool:
        return self.error is None and Counter(self.names) == Counter(self.expected)

    @property
    def no_call(self) -> bool:
        return self.error is None and not self.calls

    @property
    def call_like_text(self) -> bool:
        return self.no_call and looks_like_call(self.text)

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"valid": self.valid, "exact_names": self.exact_names, "no_call": self.no_call}


def score_response(case: ToolCase, response: Mapping[str, Any] | None, error: str | None = None,
                   latency_s: float | None = None) -> CaseScore:
    """Score a decoded /v1/chat/completions body (or the error that came instead of one)."""
    score = CaseScore(case.case_id, case.kind, list(case.expected), latency_s=latency_s)
    if error is not None or response is None:
        score.error = error or "no response"
        return score
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        score.error = f"no choices in the response: {json.dumps(response)[:200]}"
        return score
    choice = choices[0]
    message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    score.finish_reason = choice.get("finish_reason")
    score.text = str(message.get("content") or "")[:_TEXT_CHARS]
    usage = response.get("usage")
    if isinstance(usage, dict):
        score.prompt_tokens = _int(usage.get("prompt_tokens"))
        score.completion_tokens = _int(usage.get("completion_tokens"))
    schemas = case.schemas()
    score.calls = [check_call(call, schemas) for call in message.get("tool_calls") or ()]
    return score


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _pct(part: int, whole: int) -> float | None:
    return 100.0 * part / whole if whole else None


def summarize(scores: Sequence[CaseScore]) -> dict[str, Any]:
    """A mode's rates (percent of all cases unless named per call) and failure counts."""
    cases = len(scores)
    calls = [c for s in scores for c in s.calls]
    verdicts = Counter(c.verdict for c in calls)
    errors = [s.error for s in scores if s.error is not None]
    summary: dict[str, Any] = {
        "cases": cases,
        "valid_pct": _pct(sum(s.valid for s in scores), cases),
        "exact_names_pct": _pct(sum(s.exact_names for s in scores), cases),
        "no_call_pct": _pct(sum(s.no_call for s in scores), cases),
        "call_like_text_pct": _pct(sum(s.call_like_text for s in scores), cases),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "calls": len(calls),
        "calls_valid_pct": _pct(verdicts["valid"], len(calls)),
        **{verdict: verdicts[verdict] for verdict in VERDICTS if verdict != "valid"},
    }
    for kind in KINDS:
        of_kind = [s for s in scores if s.kind == kind]
        summary[f"exact_names_{kind}_pct"] = _pct(sum(s.exact_names for s in of_kind), len(of_kind))
        summary[f"valid_{kind}_pct"] = _pct(sum(s.valid for s in of_kind), len(of_kind))
    latencies = [s.latency_s for s in scores if s.latency_s is not None and s.error is None]
    summary["latency_mean_s"] = sum(latencies) / len(latencies) if latencies else None
    prompts = [s.prompt_tokens for s in scores if s.prompt_tokens is not None]
    outputs = [s.completion_tokens for s in scores if s.completion_tokens is not None]
    summary["prompt_tokens_mean"] = sum(prompts) / len(prompts) if prompts else None
    summary["completion_tokens_mean"] = sum(outputs) / len(outputs) if outputs else None
    return summary


def failure_examples(scores: Sequence[CaseScore], limit: int = 5) -> list[str]:
    """A few lines showing what went wrong, one per failure kind, for the printed report."""
    seen: dict[str, str] = {}
    for score in scores:
        if score.error is not None:
            seen.setdefault("error", f"{score.case_id}: {score.error}")
        for call in score.calls:
            if call.verdict != "valid":
                seen.setdefault(call.verdict, f"{score.case_id}: {call.verdict}: {call.detail}")
        if score.call_like_text:
            seen.setdefault("call_like_text", f"{score.case_id}: call-like text: {score.text[:150]!r}")
    return list(seen.values())[:limit]
