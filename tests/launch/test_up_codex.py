"""Codex, a real agent harness, unmodified against `tandem up`'s /v1/responses on
Qwen2.5-Coder-0.5B.

`codex exec` (npm @openai/codex, installed by scripts/setup.sh into .openai-codex/) works on a
scratch git repository through a provider entry in CODEX_HOME/config.toml
(`wire_api = "responses"`, `base_url` the cluster, through a recording proxy), in two
invocations of one session: the task, then a follow-up (`codex exec resume --last`), so the
session has at least two model requests whatever the model does. Updates, analytics,
feedback, OpenTelemetry, plugins and apps are off and CODEX_HOME is a scratch folder: nothing
but loopback is reached (with plugins on, Codex runs `git ls-remote` against GitHub at start).

What a harness-ready server must do, checked from the recorded traffic:

- every request is answered 2xx, and every stream is a well-formed Responses stream
  (response.created, each output item added then done, response.completed, sequence numbers
  in order);
- Codex finishes each invocation without an error or a failed turn, or, when the model
  wrote until the cluster's 1,024-token cut-off, reports that cut-off, and the server's
  stream said `response.incomplete` (reason `max_output_tokens`) at that many tokens;
- the session (Codex's `session-id` header and `prompt_cache_key`, read by the Responses
  adapter) keeps every turn on one prefill worker, of two, and one decode worker: the
  router's log says the session rule placed them;
- the second turn reads at least 80% of its prompt from the cache
  (`usage.input_tokens_details.cached_tokens` over `usage.input_tokens`).

The model is tiny and samples at the cluster's defaults (Codex sends no temperature and no
max_output_tokens; tests/launch/conftest.py): whether it fixes the bug is not
checked, only that the harness ran its turns over the protocol without a fault. At 0.7 the
0.5B model sometimes repeats a code block until the cut-off (a CI run on 2026-12-06), and
Codex then fails the turn: that is the model, not the protocol. Codex's
sub-agent and goal tools are off in the config (their schemas are ~12k characters a CPU would
prefill on every first turn); its shell, stdin, user-input, image and web-search tools stay.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.agent_harnesses import CODEX, codex_command, codex_env, scratch_repo
from tests.support.protocol_streams import ResponsesResult, check_responses_stream
from tests.support.recording_proxy import Exchange, RecordingProxy
from tests.support.up_cluster import AGENT_MODEL, AGENT_OUTPUT_CAP, RouterLog, Up

TASK = "Show calc.py with cat, then fix the bug in the add function."
FOLLOW_UP = "In one sentence: what was wrong with add?"
RUN_TIMEOUT = 900  # seconds per invocation: 2-4 minutes on an AVX2-only 2-core box
# How Codex words a turn whose response stopped at its output cap.
OUTPUT_CAP_ERROR = "Incomplete response returned, reason: max_output_tokens"


@pytest.fixture
def cluster(request: pytest.FixtureRequest) -> Up:
    """The session's shared `tandem up` (tests/launch/conftest.py): 2 prefill + 1 decode workers,
    started once the harness is known to be installed."""
    assert CODEX.exists(), f"{CODEX} is missing: run scripts/setup.sh (it installs @openai/codex with npm)"
    return request.getfixturevalue("agent_cluster")


def _fault_message(event: dict[str, Any]) -> str:
    """What a top-level `error` or `turn.failed` event says."""
    return str(event.get("message") or (event.get("error") or {}).get("message"))


def _run(command: list[str], repo: Path, env: dict[str, str]) -> bool:
    """One `codex exec --json` invocation, its JSONL events checked for errors and failed turns.
    True when the one fault was a response cut at the output cap (the model rambled): Codex
    fails that turn and exits 1; the caller checks, in the recorded traffic, that the server
    said so."""
    started = time.monotonic()
    result = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True,
                            timeout=RUN_TIMEOUT, stdin=subprocess.DEVNULL)
    print(f"{command[-1]!r}: exit {result.returncode} after {time.monotonic() - started:.0f} s")
    events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    for event in events:
        print("  ", json.dumps(event)[:300])
    faults = [e for e in events if e.get("type") in ("error", "turn.failed")]
    if faults and all(_fault_message(e) == OUTPUT_CAP_ERROR for e in faults):
        assert result.returncode == 1, (result.returncode, result.stderr[-3000:])
        return True
    assert result.returncode == 0, result.stderr[-3000:]
    assert not faults, faults
    assert any(e.get("type") == "turn.completed" for e in events), result.stderr[-3000:]
    return False


def _answer(exchange: Exchange) -> ResponsesResult:
    """The recorded answer to one /v1/responses request, checked to be a well-formed stream."""
    assert 200 <= exchange.status < 300, (exchange.status, bytes(exchange.response[-2000:]))
    assert exchange.json().get("stream") is True and exchange.is_stream, exchange.response_headers
    return check_responses_stream(exchange.sse_frames())


def test_codex_runs_a_code_fixing_session_unmodified(
    cluster: Up, router_log: RouterLog, tmp_path: Path
) -> None:
    repo = scratch_repo(tmp_path)
    with RecordingProxy(cluster.url) as proxy:
        env = codex_env(tmp_path / "home", proxy.url, AGENT_MODEL)
        cut = _run(codex_command(TASK), repo, env)
        cut |= _run(codex_command(FOLLOW_UP, resume_last=True), repo, env)
        exchanges = proxy.snapshot()

    for exchange in exchanges:  # shown if an assertion fails
        print(exchange.method, exchange.target, exchange.status)
    # Every request answered 2xx: the model's and any other Codex makes.
    failed = [(e.method, e.target, e.status, e.response[:1000].decode(errors="replace"))
              for e in exchanges if not 200 <= e.status < 300]
    assert not failed, failed
    turns = [e for e in exchanges if e.method == "POST" and e.path == "/v1/responses"]
    assert len(turns) >= 2, f"expected at least two model requests, got {len(turns)}"
    answers = [_answer(turn) for turn in turns]
    for number, answer in enumerate(answers, 1):
        print(f"turn {number}: status={answer.response['status']} usage={answer.usage} "
              f"items={[item['type'] for item in answer.items]}")
    assert all(turn.json()["model"] == AGENT_MODEL for turn in turns)
    if cut:  # Codex said a turn hit the cap: the server said so, at the cluster's cut-off
        capped = [a for a in answers if a.response["status"] == "incomplete"]
        assert capped, "Codex reported the output cap but no response was incomplete"
        assert all(a.response["incomplete_details"] == {"reason": "max_output_tokens"}
                   and a.usage.get("output_tokens") == AGENT_OUTPUT_CAP for a in capped), \
            [(a.response["incomplete_details"], a.usage) for a in capped]
    sessions = {(turn.header("session-id"), turn.json().get("prompt_cache_key")) for turn in turns}
    assert len(sessions) == 1 and None not in next(iter(sessions)), "one Codex session"

    # The second turn continues the first: its prompt came mostly from the cache.
    second = answers[1]
    assert second.cached_fraction >= 0.8, second.usage

    # One session, one prefill worker (of two) and one decode worker, placed by the session.
    routes = router_log.pd_routes()
    assert len(routes) >= len(turns), (len(turns), routes)
    assert all(route.status == 200 for route in routes), routes
    assert len({route.prefill for route in routes}) == 1, routes
    # (an answer whose first token ended it was done at the prefill worker: no decode hop)
    assert all(route.reason == "done at prefill" for route in routes if not route.decoded), routes
    assert len({route.decode for route in routes if route.decoded}) == 1, routes
    assert all("prefill:session" in route.placement and "decode:session" in route.placement
               for route in routes), routes
