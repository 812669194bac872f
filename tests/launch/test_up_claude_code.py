"""Claude Code, a real agent harness, unmodified against `tandem up`'s /v1/messages on
Qwen2.5-Coder-0.5B.

`claude -p` (npm @anthropic-ai/claude-code, installed by scripts/setup.sh into .claude-code/)
works on a scratch git repository with `ANTHROPIC_BASE_URL` pointing at the cluster, through
a recording proxy, in two invocations of one session: the task (up to three model turns:
read, edit, answer), then a follow-up resumed with `--resume`, so the session has at least two
model requests whatever the model does. Telemetry, error reporting, updates and all
non-essential traffic are off, and HOME is a scratch folder: nothing but loopback is reached.

What a harness-ready server must do, checked from the recorded traffic:

- every request is answered 2xx, and every stream is a well-formed Messages stream
  (message_start, whole content blocks, message_delta with a stop_reason, message_stop);
- Claude Code finishes each invocation without an API error, or, when the model wrote a
  whole 256-token answer, reports that cap, and the server's stream said max_tokens there;
- the session (Claude Code's `x-claude-code-session-id`, read by the Messages adapter) keeps
  every turn on one prefill worker, of two, and one decode worker: the router's log says the
  session rule placed them;
- the second turn reads at least 80% of its prompt from the cache
  (`cache_read_input_tokens` over input + cache read + cache write).

The model is tiny and samples at Claude Code's default temperature: whether it fixes the bug
is not checked, only that the harness ran its turns over the protocol without a fault.
Claude Code runs with three built-in tools (`--tools Read,Edit,Bash`: its default set is 14,
~9k tokens of schemas to prefill on a CPU) and `CLAUDE_CODE_MAX_OUTPUT_TOKENS=256` (it asks
for 32000 otherwise; tandem would cap that, but the fp32 0.5B model decodes 3-7 tokens a
second on two cores at these contexts). Claude Code sends temperature 1 whatever the server's
defaults, and the model then sometimes writes text until the cap; Claude Code asks again three
times before it gives up: at 512 tokens that one invocation took 821 s.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.support.agent_harnesses import (
    CLAUDE_CODE,
    claude_code_command,
    claude_code_env,
    scratch_repo,
)
from tests.support.protocol_streams import (
    AnthropicMessage,
    check_anthropic_message,
    check_anthropic_stream,
)
from tests.support.recording_proxy import Exchange, RecordingProxy
from tests.support.up_cluster import AGENT_MODEL, RouterLog, Up

TASK = "Read calc.py with the Read tool, then fix the bug in the add function with the Edit tool."
FOLLOW_UP = "In one sentence: what was wrong with add?"
MAX_OUTPUT_TOKENS = 256  # a rambling turn costs Claude Code four of these (it asks again three times)
RUN_TIMEOUT = 900  # seconds per invocation: 2-4 minutes on an AVX2-only 2-core box
SESSION_HEADER = "x-claude-code-session-id"
# How Claude Code words a turn that stopped at CLAUDE_CODE_MAX_OUTPUT_TOKENS.
OUTPUT_CAP_ERROR = f"response exceeded the {MAX_OUTPUT_TOKENS} output token maximum"


@pytest.fixture
def cluster(request: pytest.FixtureRequest) -> Up:
    """The session's shared `tandem up` (tests/launch/conftest.py): 2 prefill + 1 decode workers,
    started once the harness is known to be installed."""
    assert CLAUDE_CODE.exists(), f"{CLAUDE_CODE} is missing: run scripts/setup.sh (it installs @anthropic-ai/claude-code with npm)"
    return request.getfixturevalue("agent_cluster")


def _run(command: list[str], repo: Path, env: dict[str, str]) -> bool:
    """One `claude -p --output-format json` invocation. True when it stopped because the model
    wrote a whole MAX_OUTPUT_TOKENS answer: Claude Code sends temperature 1 whatever the
    server's defaults, the 0.5B model sometimes rambles, and Claude Code reports a turn that
    reached its output cap as an 'API Error' after asking again. The caller checks, in the
    recorded traffic, that the server said max_tokens for such a turn."""
    started = time.monotonic()
    result = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True,
                            timeout=RUN_TIMEOUT, stdin=subprocess.DEVNULL)
    print(f"{command[2]!r}: exit {result.returncode} after {time.monotonic() - started:.0f} s")
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no result from claude (exit {result.returncode}):\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    outcome = json.loads(lines[-1])
    print(f"  result: {outcome.get('subtype')} turns={outcome.get('num_turns')} {str(outcome.get('result'))[:300]!r}")
    cut_at_cap = (outcome.get("subtype") == "success" and outcome.get("is_error") is True
                  and OUTPUT_CAP_ERROR in str(outcome.get("result")))
    if cut_at_cap:
        assert result.returncode == 1, (result.returncode, outcome)
        return True
    # A run may stop at --max-turns (the model kept calling tools): not a protocol fault.
    ended_well = outcome.get("subtype") == "success" and not outcome.get("is_error")
    assert ended_well or outcome.get("subtype") == "error_max_turns", (outcome, result.stderr[-3000:])
    assert result.returncode == (0 if ended_well else 1), (result.returncode, outcome)
    assert "API Error" not in str(outcome.get("result")), outcome
    return False


def _answer(exchange: Exchange) -> AnthropicMessage:
    """The recorded answer to one /v1/messages request, checked to be well-formed."""
    assert 200 <= exchange.status < 300, (exchange.status, bytes(exchange.response[-2000:]))
    if exchange.json().get("stream"):
        assert exchange.is_stream, exchange.response_headers
        return check_anthropic_stream(exchange.sse_frames())
    return check_anthropic_message(exchange.response_json())


def test_claude_code_runs_a_code_fixing_session_unmodified(
    cluster: Up, router_log: RouterLog, tmp_path: Path
) -> None:
    repo = scratch_repo(tmp_path)
    session = str(uuid.uuid4())
    with RecordingProxy(cluster.url) as proxy:
        env = claude_code_env(tmp_path / "home", proxy.url, max_output_tokens=MAX_OUTPUT_TOKENS)
        cut = _run(claude_code_command(TASK, AGENT_MODEL, "--session-id", session, "--max-turns", "3"), repo, env)
        cut |= _run(claude_code_command(FOLLOW_UP, AGENT_MODEL, "--resume", session, "--max-turns", "1"), repo, env)
        exchanges = proxy.snapshot()

    for exchange in exchanges:  # shown if an assertion fails
        print(exchange.method, exchange.target, exchange.status)
    # Every request answered 2xx: the model's and any other Claude Code makes.
    failed = [(e.method, e.target, e.status, e.response[:1000].decode(errors="replace"))
              for e in exchanges if not 200 <= e.status < 300]
    assert not failed, failed
    turns = [e for e in exchanges if e.method == "POST" and e.path == "/v1/messages"]
    assert len(turns) >= 2, f"expected at least two model requests, got {len(turns)}"
    answers = [_answer(turn) for turn in turns]
    for number, (turn, answer) in enumerate(zip(turns, answers, strict=True), 1):
        print(f"turn {number}: stream={turn.json().get('stream')} stop={answer.stop_reason} "
              f"usage={answer.usage} blocks={[b['type'] for b in answer.blocks]}")
    assert all(turn.json()["model"] == AGENT_MODEL for turn in turns)
    if cut:  # Claude Code said a turn hit the cap: the server said so, at the cap it was asked for
        capped = [a for a in answers if a.stop_reason == "max_tokens"]
        assert capped, "Claude Code reported the output cap but no answer stopped at max_tokens"
        assert all(a.usage.get("output_tokens") == MAX_OUTPUT_TOKENS for a in capped), [a.usage for a in capped]
    assert {turn.header(SESSION_HEADER) for turn in turns} == {session}, "one Claude Code session"

    # The second turn continues the first: its prompt came mostly from the cache.
    second = answers[1]
    assert second.cached_fraction >= 0.8, (second.usage, second.prompt_tokens)

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
