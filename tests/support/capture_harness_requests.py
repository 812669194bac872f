"""Record what Claude Code and Codex send, for the protocol tests' fixtures
(`python -m tests.support.capture_harness_requests [OUT_DIR]`).

Each harness, as scripts/setup.sh installed it and in its default configuration (Claude Code
with all of its built-in tools, Codex with its sub-agent and goal tools), runs one task
offline through the recording proxy against a scripted upstream that speaks just enough of
each protocol: the first turn answers with a tool call (Claude Code's Read of calc.py, Codex's
`exec_command` of `cat calc.py`), the second with a line of text. So the second request
carries the harness's tool result. The requests are written to OUT_DIR
(tests/edge/protocols/fixtures/ by default), headers without credentials and without the
transport's host and content-length, scratch paths replaced by stable ones.

Not a test, and no model: the fixtures are what the harnesses send, for the adapters' tests.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests.support import agent_harnesses as harnesses
from tests.support.recording_proxy import Exchange, RecordingProxy

FIXTURES = Path(__file__).resolve().parents[1] / "edge/protocols/fixtures"
MODEL = "qwen2.5-coder-0.5b"
TASK = "Fix the bug in calc.py."
_DROPPED_HEADERS = {"host", "content-length"}


def _sse(name: str, payload: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(payload)}\n\n".encode()


def _messages_answer(body: dict[str, Any], number: int, calc: str) -> bytes | dict[str, Any]:
    """Turn 1: a Read of calc.py; later turns: text. Streamed or whole as asked."""
    answered = any(isinstance(m.get("content"), list) and any(p.get("type") == "tool_result" for p in m["content"])
                   for m in body.get("messages", []))
    block: dict[str, Any] = ({"type": "text", "text": "Fixed."} if answered else
                             {"type": "tool_use", "id": f"toolu_{number:04d}", "name": "Read",
                              "input": {"file_path": calc}})
    stop = "end_turn" if answered else "tool_use"
    usage = {"input_tokens": 100, "output_tokens": 10, "cache_read_input_tokens": 0,
             "cache_creation_input_tokens": 0}
    message = {"id": f"msg_{number:04d}", "type": "message", "role": "assistant", "model": body.get("model"),
               "content": [block], "stop_reason": stop, "stop_sequence": None, "usage": usage}
    if not body.get("stream"):
        return message
    events = _sse("message_start", {"type": "message_start",
                                    "message": {**message, "content": [], "stop_reason": None}})
    if block["type"] == "text":
        events += _sse("content_block_start", {"type": "content_block_start", "index": 0,
                                               "content_block": {"type": "text", "text": ""}})
        delta = {"type": "text_delta", "text": block["text"]}
    else:
        events += _sse("content_block_start", {"type": "content_block_start", "index": 0,
                                               "content_block": {**block, "input": {}}})
        delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
    events += _sse("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta})
    events += _sse("content_block_stop", {"type": "content_block_stop", "index": 0})
    events += _sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                                     "usage": {"output_tokens": 10}})
    return events + _sse("message_stop", {"type": "message_stop"})


def _responses_answer(body: dict[str, Any], number: int) -> bytes:
    """Turn 1: `cat calc.py` through exec_command; later turns: a message."""
    answered = any(item.get("type") == "function_call_output" for item in body.get("input", []))
    item: dict[str, Any] = (
        {"type": "message", "id": f"msg_{number:04d}", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Fixed.", "annotations": []}]} if answered else
        {"type": "function_call", "id": f"fc_{number:04d}", "call_id": f"call_{number:04d}",
         "name": "exec_command", "arguments": json.dumps({"cmd": "cat calc.py"}), "status": "completed"})
    response = {"id": f"resp_{number:04d}", "object": "response", "created_at": 0, "status": "in_progress",
                "model": body.get("model"), "output": [], "usage": None}
    usage = {"input_tokens": 100, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 10,
             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 110}
    sequence = itertools.count()
    events = [
        ("response.created", {"response": response}),
        ("response.in_progress", {"response": response}),
        ("response.output_item.added", {"output_index": 0, "item": {**item, "status": "in_progress"}}),
        ("response.output_item.done", {"output_index": 0, "item": item}),
        ("response.completed", {"response": {**response, "status": "completed", "output": [item], "usage": usage}}),
    ]
    return b"".join(_sse(name, {"type": name, "sequence_number": next(sequence), **payload})
                    for name, payload in events)


@contextmanager
def scripted_upstream(calc: str) -> Iterator[str]:
    """An upstream that answers /v1/messages and /v1/responses as described above, 404 otherwise."""
    numbers = itertools.count(1)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            del format, args

        def _send(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802
            self._send(404, "application/json", b'{"error": {"message": "not scripted"}}')

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
            path = self.path.split("?")[0]
            if path == "/v1/messages":
                answer = _messages_answer(body, next(numbers), calc)
            elif path == "/v1/responses":
                answer = _responses_answer(body, next(numbers))
            else:
                self.do_GET()
                return
            if isinstance(answer, dict):
                self._send(200, "application/json", json.dumps(answer).encode())
            else:
                self._send(200, "text/event-stream", answer)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _version(binary: Path) -> str:
    return subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60).stdout.strip()


def _stable(text: str, scratch: Path) -> str:
    """Scratch paths replaced by one that is the same on every run (Claude Code also names
    its project folder by the path with dashes for slashes)."""
    for variable, fixed in ((str(scratch), "/tmp/scratch"), (str(scratch).replace("/", "-"), "-tmp-scratch")):
        text = text.replace(variable, fixed)
    return text


def _fixture(exchange: Exchange, harness: str, scratch: Path) -> dict[str, Any]:
    headers = exchange.redacted_headers()
    return {
        "harness": harness,
        "method": exchange.method,
        "path": exchange.path,
        "query": exchange.query,
        "headers": {k: _stable(v, scratch) for k, v in headers.items() if k not in _DROPPED_HEADERS},
        "body": json.loads(_stable(exchange.body.decode(), scratch)),
    }


def _record(harness: str, scratch: Path) -> list[Exchange]:
    repo = harnesses.scratch_repo(scratch)
    with scripted_upstream(str(repo / "calc.py")) as upstream, RecordingProxy(upstream) as proxy:
        if harness == "claude":
            env = harnesses.claude_code_env(scratch / "home", proxy.url)
            command = harnesses.claude_code_command(TASK, MODEL, "--max-turns", "3", tools=None)
        else:
            env = harnesses.codex_env(scratch / "home", proxy.url, MODEL, trimmed=False)
            command = harnesses.codex_command(TASK)
        result = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=300,
                                stdin=subprocess.DEVNULL)
        if result.returncode != 0:
            raise SystemExit(f"{harness} exited with {result.returncode}:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
        return proxy.snapshot()


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for harness, binary, path, stem in (("claude", harnesses.CLAUDE_CODE, "/v1/messages", "claude_code_messages"),
                                        ("codex", harnesses.CODEX, "/v1/responses", "codex_responses")):
        version = _version(binary)
        with tempfile.TemporaryDirectory(prefix="harness-capture-") as scratch:
            exchanges = _record(harness, Path(scratch))
            others = sorted({f"{e.method} {e.target}" for e in exchanges if e.path != path})
            turns = [e for e in exchanges if e.path == path]
            fixtures = [_fixture(e, version, Path(scratch)) for e in turns[:2]]
        for suffix, fixture in zip(("", "_turn2"), fixtures, strict=False):
            (out / f"{stem}{suffix}.json").write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
        print(f"{version}: {len(turns)} request(s) to {path}; other requests: {others or 'none'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else FIXTURES)
