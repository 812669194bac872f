"""OpenCode, a real agent harness, unmodified against `tandem up` on Qwen2.5-Coder-0.5B.

`opencode run` (npm `opencode-ai`, installed by scripts/setup.sh into .opencode-ai/: not
`.opencode`, which OpenCode reads as a config folder) works on a scratch git repo through a
provider that points at the cluster, as the README configures it. A recording proxy between the two keeps every request and streamed answer, and the
test checks what a harness-ready server must do:

- every request succeeds, OpenCode's `max_tokens: 32000` included (capped, not refused);
- the tool definitions reach the chat template (the prompt the model saw counts them);
- streamed tool calls parse, and OpenCode runs them (the next turn carries the result);
- a session's turns stay on one prefill worker (`x-session-affinity`), of two;
- from the second turn on, `cached_tokens` covers the prefix shared with the turn before.

The model runs greedily (temperature 0 in the test's provider entry) so a run is the same on
every machine of one CPU kind; the assertions hold for any model output that calls a tool.
No network beyond loopback: OpenCode's catalogue fetch, updates and sharing are switched off.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.support.agent_harnesses import scratch_repo
from tests.support.recording_proxy import Exchange, RecordingProxy
from tests.support.up_cluster import AGENT_MODEL, RouterLog, Up

REPO_ROOT = Path(__file__).resolve().parents[2]
OPENCODE = Path(os.environ.get("TANDEM_OPENCODE_DIR", REPO_ROOT / ".opencode-ai")) / "node_modules/.bin/opencode"
MODEL = AGENT_MODEL
RUN_TIMEOUT = 900  # the whole run: about 4 minutes on an AVX2-only 2-core box


def opencode_config(base_url: str, greedy: bool) -> dict:
    """The README's OpenCode provider entry for a tandem endpoint."""
    model: dict = {"name": "Qwen2.5-Coder 0.5B on tandem"}
    if greedy:
        model |= {"temperature": True, "options": {"temperature": 0}}
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "tandem": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "tandem",
                # OpenCode aborts a request after 5 minutes without response headers or
                # between stream chunks by default, and the router starts a stream once the
                # prompt is prefilled: a cold ~7k-token first turn took 395-500 s on an
                # AVX2-only 2-core box (README: the timeout options)
                "options": {"baseURL": f"{base_url}/v1", "timeout": 1_200_000,
                            "headerTimeout": 1_200_000, "chunkTimeout": 1_200_000},
                "models": {MODEL: model},
            }
        },
        "model": f"tandem/{MODEL}",
    }


@pytest.fixture
def cluster(request: pytest.FixtureRequest) -> Up:
    """The session's shared `tandem up` (tests/launch/conftest.py): 2 prefill + 1 decode workers,
    started once the harness is known to be installed."""
    assert OPENCODE.exists(), f"{OPENCODE} is missing: run scripts/setup.sh (it installs opencode-ai with npm)"
    return request.getfixturevalue("agent_cluster")


def _opencode_env(home: Path, cwd: Path) -> dict[str, str]:
    # PWD too: OpenCode looks for project config above $PWD, not above its working directory.
    env = dict(os.environ, PWD=str(cwd), HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"),
               XDG_DATA_HOME=str(home / ".local/share"), XDG_CACHE_HOME=str(home / ".cache"),
               XDG_STATE_HOME=str(home / ".local/state"))
    for flag in ("AUTOUPDATE", "MODELS_FETCH", "LSP_DOWNLOAD", "SHARE"):
        env[f"OPENCODE_DISABLE_{flag}"] = "1"
    return env


def _usage(exchange: Exchange) -> dict:
    usages = [e["usage"] for e in exchange.sse_events() if e.get("usage")]
    assert len(usages) == 1, "a stream with include_usage ends with exactly one usage chunk"
    return usages[0]


def _tool_calls(exchange: Exchange) -> list[dict]:
    """The streamed calls reassembled as a client does: by index, arguments concatenated."""
    calls: dict[int, dict] = {}
    for event in exchange.sse_events():
        for choice in event["choices"]:
            for piece in choice["delta"].get("tool_calls") or []:
                call = calls.setdefault(piece["index"], {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or piece.get("id")
                call["name"] = call["name"] or piece["function"].get("name")
                call["arguments"] += piece["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]


def _finish_reason(exchange: Exchange) -> str | None:
    reasons = [c["finish_reason"] for e in exchange.sse_events() for c in e["choices"] if c["finish_reason"]]
    return reasons[-1] if reasons else None


def _token_ids(cluster: Up, worker: str, body: dict, with_tools: bool = True) -> list[int]:
    """The prompt a worker renders for a request: its messages, and its tools unless told not to."""
    payload = {"model": MODEL, "messages": body["messages"]}
    if with_tools and body.get("tools"):
        payload |= {"tools": body["tools"], "tool_choice": body.get("tool_choice", "auto")}
    with cluster.worker(worker, timeout=60) as client:  # a worker answers its cluster's peers only
        reply = client.post("/tokenize", json=payload)
    assert reply.status_code == 200, reply.text
    return reply.json()["tokens"]


def test_opencode_runs_a_multi_step_task_unmodified(cluster: Up, router_log: RouterLog, tmp_path: Path) -> None:
    repo = scratch_repo(tmp_path)
    with RecordingProxy(cluster.url) as proxy:
        (repo / "opencode.json").write_text(json.dumps(opencode_config(proxy.url, greedy=True), indent=2))
        result = subprocess.run(
            [str(OPENCODE), "run", f"Read {repo}/calc.py and fix the bug in add."],
            cwd=repo, env=_opencode_env(tmp_path / "home", repo), capture_output=True, text=True,
            timeout=RUN_TIMEOUT,
        )
        exchanges = list(proxy.exchanges)
    assert result.returncode == 0, result.stderr[-3000:]
    chats = [e for e in exchanges if e.path.endswith("/chat/completions")]
    agent_turns = [e for e in chats if e.json().get("tools")]
    for number, turn in enumerate(agent_turns, 1):  # shown if an assertion fails
        print(f"turn {number}: usage {_usage(turn)}, calls {_tool_calls(turn)}")
    assert len(agent_turns) >= 2, f"expected a multi-step run, got {len(agent_turns)} turn(s):\n{result.stdout}"

    # Every request succeeded and every stream ended properly.
    for exchange in chats:
        assert exchange.status == 200, exchange.response[-2000:]
        assert exchange.response.rstrip().endswith(b"data: [DONE]")
        assert not any("error" in event for event in exchange.sse_events())
    # OpenCode's request shape, unmodified: no output limit set by hand anywhere.
    first = agent_turns[0].json()
    assert first["max_tokens"] == 32000 and first["stream"] and first["stream_options"]["include_usage"]
    assert first["tool_choice"] == "auto"
    declared = {tool["function"]["name"] for tool in first["tools"]}
    assert {"read", "edit", "bash"} <= declared

    workers = cluster.endpoints()
    prefill = [url for name, url in workers.items() if name.startswith("prefill-")]
    assert len(prefill) == 2

    # The tool definitions reached the template: the prompt the model saw counts them.
    block = cluster.load(prefill[0])["block_size"]  # prefix caching works in whole blocks
    with_tools = _token_ids(cluster, prefill[0], first)
    without = _token_ids(cluster, prefill[0], first, with_tools=False)
    assert _usage(agent_turns[0])["prompt_tokens"] == len(with_tools)
    assert len(with_tools) - len(without) > 2000, "the ~20k characters of tool definitions"
    with cluster.worker(prefill[0], timeout=60) as client:
        rendered = client.post("/detokenize", json={"model": MODEL, "tokens": with_tools}).json()["prompt"]
    assert all(f'"name": "{name}"' in rendered for name in declared)

    # Streamed tool calls parse, and OpenCode ran them: the next turn carries each result.
    called = [(i, call) for i, turn in enumerate(agent_turns) for call in _tool_calls(turn)]
    assert called, "no turn called a tool:\n" + result.stdout
    for index, call in called:
        assert call["name"] in declared and call["id"].startswith("call_")
        assert isinstance(json.loads(call["arguments"]), dict)
        assert _finish_reason(agent_turns[index]) == "tool_calls"
        if index + 1 < len(agent_turns):
            following = agent_turns[index + 1].json()["messages"]
            assert any(m["role"] == "tool" and m.get("tool_call_id") == call["id"] for m in following)

    # One session, one affinity key, one prefill worker for all of its turns.
    sessions = {e.headers.get("x-session-affinity") for e in agent_turns}
    assert len(sessions) == 1 and None not in sessions
    routed = re.findall(r"chat stream route=pd \(long prompt\) prefill=(\S+) .* status=200", router_log.text())
    assert len(routed) >= len(agent_turns) and len(set(routed)) == 1, routed

    # From the second turn on, the prefix shared with the turn before came from the cache.
    previous = with_tools
    for turn in agent_turns[1:]:
        tokens = _token_ids(cluster, prefill[0], turn.json())
        usage = _usage(turn)
        assert usage["prompt_tokens"] == len(tokens)
        shared = len(os.path.commonprefix([previous, tokens])) // block * block
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert cached >= shared - block, (cached, shared, usage)
        previous = tokens
