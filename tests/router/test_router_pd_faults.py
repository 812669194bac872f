"""A prefill/decode pair whose prefill leg fails, on real workers: before connecting, in the
middle of the prefill, and when the decode worker pulls the KV. Each time the client gets the
text a clean run gives, nothing hangs, and neither worker is left holding KV blocks. (A decode
worker killed mid-stream is tests/launch/test_up.py's SIGKILL test: the stream moves.)"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import httpx
import psutil
import pytest

from tandem.platform.ports import free_port
from tandem.router.config import Timeouts, WorkerSpec
from tests.support.live_server import TEST_SECRET, LiveServer, start_server, stop_server
from tests.support.router_helpers import metric

WORKER_ARGS = ("--kv-cache-memory", "256MiB", "--threads", "1", "--max-num-seqs", "8")
CONTEXT = "Our travel agency answers questions about cities, food, history and weather. " * 60


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, LiveServer]]:
    logs = tmp_path_factory.mktemp("pd-faults")
    started: dict[str, LiveServer] = {}
    try:
        started["prefill"] = start_server(logs / "prefill.log", "--role", "prefill", *WORKER_ARGS,
                                          secret=TEST_SECRET)
        # Its leases end almost at once: a decode worker's pull comes too late and is refused.
        started["short_lease"] = start_server(logs / "short.log", "--role", "prefill", *WORKER_ARGS,
                                              "--kv-transfer-hold-timeout", "0.001", secret=TEST_SECRET)
        started["decode"] = start_server(logs / "decode.log", "--role", "decode", *WORKER_ARGS,
                                         "--kv-transfer-fetch-timeout", "3", secret=TEST_SECRET)
        # A GPU's blocks (16 tokens) beside the CPU decode worker's (64, the default here).
        started["small_blocks"] = start_server(logs / "small_blocks.log", "--role", "prefill", *WORKER_ARGS,
                                               "--block-size", "16", secret=TEST_SECRET)
        yield started
    finally:
        for server in started.values():
            assert not stop_server(server)


def _body() -> dict:
    return {"model": "smollm2-135m", "max_tokens": 24, "temperature": 0, "stream": True,
            "messages": [{"role": "system", "content": f"Ticket {uuid.uuid4().hex}. {CONTEXT}"},
                         {"role": "user", "content": "What should I eat in Lisbon?"}]}


def _stream(url: str, body: dict) -> tuple[str, list[dict]]:
    text, errors = [], []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    errors.append(chunk)
                for choice in chunk.get("choices") or []:
                    text.append(choice["delta"].get("content") or "")
    return "".join(text), errors


def _expected(tandem_server: str, body: dict) -> str:
    reply = httpx.post(f"{tandem_server}/v1/chat/completions", json={**body, "stream": False}, timeout=120)
    return reply.json()["choices"][0]["message"]["content"]


def _idle(server: LiveServer) -> dict:
    # Generous: a thawed prefill worker finishes its abandoned chunk first, on one thread.
    load = server.wait_idle(timeout=120)
    deadline = time.monotonic() + 60
    while load["kv_transfer"].get("held", 0) and time.monotonic() < deadline:
        time.sleep(0.1)
        load = server.load()
    return load


def _tree(server: LiveServer) -> list[psutil.Process]:
    root = psutil.Process(server.process.pid)
    return [root, *root.children(recursive=True)]


def _router(start_router: Callable[..., str], prefill: str, decode: str, first_byte_s: float = 30.0) -> str:
    return start_router([WorkerSpec(prefill, "prefill"), WorkerSpec(decode, "decode")], migration_limit=0,
                        timeouts=Timeouts(connect_s=1.0, first_byte_s=first_byte_s, idle_s=30.0))


def test_prefill_worker_unreachable(workers: dict[str, LiveServer], tandem_server: str,
                                    start_router: Callable[..., str]) -> None:
    url = _router(start_router, f"http://127.0.0.1:{free_port()}", workers["decode"].url)
    body = _body()
    assert _stream(url, body) == (_expected(tandem_server, body), [])
    assert _idle(workers["decode"])["kv_blocks_used"] == 0


def test_prefill_worker_stalls_mid_prefill(workers: dict[str, LiveServer], tandem_server: str,
                                           start_router: Callable[..., str]) -> None:
    """Frozen (SIGSTOP) while it computes the prompt: the prefill hop times out, the request is
    served whole by the decode worker; thawed, the prefill worker drops the abandoned request."""
    prefill = workers["prefill"]
    # The default 30 s first-byte limit: the frozen hop waits it out whatever the box, and the
    # fallback, the whole ~900-token prompt on the decode worker's one thread (8 s on an
    # AVX2-only EPYC), has to fit in the same limit.
    url = _router(start_router, prefill.url, workers["decode"].url)
    body = _body()
    expected = _expected(tandem_server, body)
    result: list = []
    thread = threading.Thread(target=lambda: result.append(_stream(url, body)))
    thread.start()
    deadline = time.monotonic() + 60
    while prefill.load()["num_requests_in_flight"] == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    frozen = _tree(prefill)
    for process in frozen:
        os.kill(process.pid, signal.SIGSTOP)
    try:
        # Served while the prefill worker is still frozen (no bound in seconds: a loaded 2-core
        # box takes a while to compute the whole prompt on the decode worker's one thread).
        thread.join(300)
        served_while_frozen = not thread.is_alive()
    finally:
        for process in frozen:
            os.kill(process.pid, signal.SIGCONT)
    thread.join(120)
    assert served_while_frozen and result == [(expected, [])], result
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert metric(metrics, "tandem_router_pd_fallbacks_total") == 1  # it was caught mid-prefill
    load = _idle(prefill)
    assert load["kv_blocks_used"] == 0 and load["kv_transfer"].get("held", 0) == 0
    assert _idle(workers["decode"])["kv_blocks_used"] == 0


def test_the_kv_pull_is_refused_after_the_lease(workers: dict[str, LiveServer], tandem_server: str,
                                                start_router: Callable[..., str]) -> None:
    """The prefill worker's lease ended before the decode worker read it: the read is
    refused (never stale blocks), and the decode worker computes the prompt itself."""
    decode = workers["decode"]
    url = _router(start_router, workers["short_lease"].url, decode.url)
    body = _body()
    before = decode.load()["kv_transfer"]
    assert _stream(url, body) == (_expected(tandem_server, body), [])
    after = decode.load()["kv_transfer"]
    assert after["pulls"] == before["pulls"] + 1
    assert after["pull_failures"] == before["pull_failures"] + 1  # refused: computed here
    load = _idle(workers["short_lease"])
    assert load["kv_blocks_used"] == 0 and load["kv_transfer"].get("held", 0) == 0
    assert _idle(decode)["kv_blocks_used"] == 0


def test_a_prefill_worker_of_another_block_size_is_not_split_to(workers: dict[str, LiveServer], tandem_server: str,
                                                                start_router: Callable[..., str]) -> None:
    """The decode worker would refuse a handoff of 16-token blocks into its 64-token ones and
    compute the prompt again: once the router has both workers' /load, it serves the request
    whole on the decode worker and never asks the prefill worker."""
    small, decode = workers["small_blocks"], workers["decode"]
    assert (small.load()["block_size"], decode.load()["block_size"]) == (16, 64)
    url = _router(start_router, small.url, decode.url)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        listed = httpx.get(f"{url}/workers", timeout=10).json()["workers"]
        if all((w.get("load") or {}).get("block_size") for w in listed):
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the router never read its workers' /load: {listed}")
    prompts_before = small.load()["prefix_cache_queries"]
    pulls_before = decode.load()["kv_transfer"]["pulls"]
    body = _body()
    assert _stream(url, body) == (_expected(tandem_server, body), [])
    assert small.load()["prefix_cache_queries"] == prompts_before  # never asked
    assert decode.load()["kv_transfer"]["pulls"] == pulls_before  # nothing to pull: served whole
    assert _idle(decode)["kv_blocks_used"] == 0
