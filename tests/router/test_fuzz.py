"""Fuzzing: schemathesis against the worker's OpenAPI schema on the worker, and against the
router's (whose /v1 bodies are the worker's models) through the router, a bounded number of
cases each.

Checks: no 5xx for any generated request (malformed bodies, wrong types, boundary numbers),
and afterwards both servers are alive and hold no KV blocks and no requests. The worker runs
with a 64-token context so that no generated max_tokens can make a case slow. A full run of
schemathesis' coverage phase (boundary values of every field; about 1,300 cases, 3 minutes)
passed on both too; CI runs the examples and fuzzing phases only.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tandem.router.config import Timeouts, WorkerSpec
from tests.support.live_server import LiveServer, start_server, stop_server

pytest.importorskip("schemathesis", reason="schemathesis comes with the test extras")


@pytest.fixture(scope="module")
def small_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = start_server(tmp_path_factory.mktemp("fuzz") / "serve.log", "--kv-cache-memory", "64MiB",
                          "--max-model-len", "64")
    yield server
    assert not stop_server(server)


def _schemathesis(schema: str, base_url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    command = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    assert command, "schemathesis is not installed next to this Python"
    return subprocess.run(
        [command, "run", schema, "--url", base_url, "--checks", "not_a_server_error",
         "--max-examples", "25", "--seed", "7", "--phases", "examples,fuzzing",
         "--exclude-path", "/reset_prefix_cache", "--request-timeout", "60", "--no-color", *extra],
        capture_output=True, text=True, timeout=600,
    )


def _assert_clean(worker: LiveServer) -> None:
    load = worker.wait_idle()
    assert load["kv_blocks_used"] == 0 and load["num_requests_in_flight"] == 0, load
    assert httpx.get(f"{worker.url}/health", timeout=10).status_code == 200


def test_fuzz_the_worker(small_worker: LiveServer) -> None:
    url = small_worker.url
    result = _schemathesis(f"{url}/openapi.json", url)
    assert result.returncode == 0, result.stdout[-6000:]
    assert " passed" in result.stdout and "failed" not in result.stdout.split("SUMMARY")[-1]
    _assert_clean(small_worker)


def test_fuzz_the_router(small_worker: LiveServer, start_router: Callable[..., str],
                         tmp_path: Path) -> None:
    router = start_router([WorkerSpec(small_worker.url, "both")],
                          timeouts=Timeouts(connect_s=5.0, first_byte_s=120.0, idle_s=60.0))
    # The router's own schema: its /v1 bodies are the worker's models (router/http/openapi.py).
    # Only /v1: the admin routes would drain the worker or reload the list.
    schema = httpx.get(f"{router}/openapi.json", timeout=10).json()
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletionRequest")
    result = _schemathesis(f"{router}/openapi.json", router, "--include-path-regex", "^/v1/")
    assert result.returncode == 0, result.stdout[-6000:]
    assert httpx.get(f"{router}/health", timeout=10).status_code == 200
    _assert_clean(small_worker)
