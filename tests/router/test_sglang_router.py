"""SGLang's own router (`sglang-router`, PyPI; Rust) in front of real tandem workers.

Regular mode works unmodified: it registers both workers, proxies plain and streamed chat,
and its cache-aware policy keeps a session's turns on one worker, so later turns read the
shared prefix from that worker's cache. Its prefill/decode mode does not hand KV to tandem
(it speaks SGLang's bootstrap protocol, not tandem's `kv_transfer_params`): it sends each
request to both workers and returns the decode worker's answer, so the prompt is computed
twice. The test pins that down too. sglang-router lives in `.venv-sglang-router`
(scripts/setup.sh), or wherever TANDEM_SGLANG_ROUTER points.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tandem.platform.ports import free_port
from tests.support.live_server import LiveServer, start_server, stop_server

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m"
SYSTEM = "You are a coding agent with tools to read, edit and test files. " * 25


def _sglang_router() -> Path:
    override = os.environ.get("TANDEM_SGLANG_ROUTER")
    executable = Path(override) if override else REPO_ROOT / ".venv-sglang-router" / "bin" / "sglang-router"
    if not (executable.is_file() and os.access(executable, os.X_OK)):
        pytest.fail(f"sglang-router not found at {executable}; run `bash scripts/setup.sh`, or by hand: "
                    "python3.11 -m venv .venv-sglang-router && .venv-sglang-router/bin/pip install "
                    "sglang-router==0.3.2", pytrace=False)
    return executable


def _launch(log_path: Path, *args: str) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    with log_path.open("wb") as log:
        process = subprocess.Popen([str(_sglang_router()), "launch", "--host", "127.0.0.1", "--port", str(port),
                                    "--prometheus-port", str(free_port()), *args],
                                   stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            workers = httpx.get(f"{url}/workers", timeout=2).json()["workers"]
            if len(workers) == 2 and all(w["is_healthy"] for w in workers):
                return url, process
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"sglang-router did not register both workers:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.3)


@pytest.fixture(scope="module")
def workers(tandem_server_process: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LiveServer]]:
    second = start_server(tmp_path_factory.mktemp("sglang-router") / "second.log", "--kv-cache-memory", "128MiB")
    yield [tandem_server_process, second]
    assert not stop_server(second)


def _finished(server: LiveServer) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tandem:request_success_total{"))


def _chat(url: str, turn: int, **extra: object) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "max_tokens": 6, "temperature": 0,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Turn {turn}: go on."}],
        **extra})


def test_regular_mode_serves_tandem_workers_and_keeps_a_session_on_one(workers: list[LiveServer],
                                                                       tmp_path: Path) -> None:
    url, router = _launch(tmp_path / "sglang-router.log", "--policy", "cache_aware",
                          "--worker-urls", *(w.url for w in workers))
    try:
        before = [_finished(w) for w in workers]
        replies = [_chat(url, turn) for turn in range(3)]
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
        cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies]
        prompt = replies[0].json()["usage"]["prompt_tokens"]
        assert all(c >= prompt // 2 for c in cached[1:]), cached  # the shared system prompt, from cache
        served = [_finished(w) - b for w, b in zip(workers, before, strict=True)]
        assert sorted(served) == [0, 3], served  # one worker had the whole session

        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=120, json={
                "model": MODEL, "max_tokens": 6, "stream": True,
                "messages": [{"role": "user", "content": "Hello"}]}) as stream:
            assert stream.status_code == 200
            lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                       for line in lines[:-1] if json.loads(line[6:])["choices"])
        assert text
    finally:
        router.terminate()
        router.wait(timeout=30)


def test_pd_mode_computes_the_request_on_both_workers(workers: list[LiveServer], tmp_path: Path) -> None:
    prefill, decode = workers
    url, router = _launch(tmp_path / "sglang-router-pd.log", "--pd-disaggregation",
                          "--prefill", prefill.url, "--decode", decode.url)
    try:
        before = [_finished(w) for w in workers]
        reply = _chat(url, 9)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"]
        deadline = time.monotonic() + 30
        while [_finished(w) - b for w, b in zip(workers, before, strict=True)] != [1, 1]:
            assert time.monotonic() < deadline, "expected one whole request on each worker (no KV handoff)"
            time.sleep(0.2)
    finally:
        router.terminate()
        router.wait(timeout=30)
