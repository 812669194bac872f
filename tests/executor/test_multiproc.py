"""The multi-process executor: N ranks joined by torch.distributed (gloo here, on CPU).

Each rank holds the whole model today, so 2 ranks must give exactly 1 rank's tokens; a rank
that dies must stop the engine with an error that names it, leaving no process behind.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tandem import LLM, SamplingParams
from tandem.executor.base import WorkerDiedError
from tests.support.live_server import start_server, stop_server

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "Q: What is 7 times 8?\nA:"]
KV = "128MiB"


def _ranks(llm: LLM) -> list[psutil.Process]:
    return [psutil.Process(p.pid) for p in llm.engine.core.executor._procs]


def test_two_ranks_give_the_tokens_of_one() -> None:
    greedy = SamplingParams(max_tokens=16, temperature=0)
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, n=2)
    with LLM(kv_cache_memory=KV, num_threads=1) as one:
        expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, greedy)]
        expected_seeded = [[s.token_ids for s in o.outputs] for o in one.generate(PROMPTS[:2], seeded)]
    with LLM(kv_cache_memory=KV, num_threads=1, world_size=2) as two:
        ranks = _ranks(two)
        assert len(ranks) == 2 and all(p.is_running() for p in ranks)
        assert [o.outputs[0].token_ids for o in two.generate(PROMPTS, greedy)] == expected
        assert [[s.token_ids for s in o.outputs] for o in two.generate(PROMPTS[:2], seeded)] == expected_seeded
        assert two.engine.block_pool.num_free_blocks == two.engine.block_pool.num_blocks
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks)


def test_a_dead_rank_stops_the_engine_with_a_clear_error() -> None:
    llm = LLM(kv_cache_memory=KV, num_threads=1, world_size=2)
    ranks = _ranks(llm)
    try:
        assert llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, temperature=0))
        ranks[1].kill()  # not reaped here: the executor must find out itself
        with pytest.raises(WorkerDiedError, match=rf"rank 1 \(pid {ranks[1].pid}\) exited with code -9"):
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=8, temperature=0))
    finally:
        llm.shutdown()
    gone, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive, f"ranks left behind: {[p.pid for p in alive]}"


def test_a_rank_that_fails_to_start_raises_its_own_error_and_leaves_nothing() -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(FileNotFoundError, match="not found") as failure:
        LLM("/nonexistent/model/dir", kv_cache_memory=KV, num_threads=1, world_size=2)
    assert any("raised on rank" in note for note in failure.value.__notes__)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and {p.pid for p in psutil.Process().children(recursive=True)} - before:
        time.sleep(0.1)
    assert {p.pid for p in psutil.Process().children(recursive=True)} - before == set()


def test_a_served_engine_whose_rank_dies_fails_loudly_and_leaves_nothing(tmp_path: Path) -> None:
    server = start_server(tmp_path / "serve.log", "--world-size", "2", "--kv-cache-memory", KV, "--threads", "1")
    try:
        body = {"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
        tree = psutil.Process(server.process.pid).children(recursive=True)
        ranks = [p for p in tree if "tandem.executor.rank_process" in " ".join(p.cmdline())]
        assert len(ranks) == 2
        ranks[0].send_signal(signal.SIGKILL)
        codes = set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and server.process.poll() is None:
            try:  # a step notices; then requests fail until the server stops itself
                failed = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
                codes.add(failed.status_code)
                if failed.status_code == 503:
                    assert failed.json()["error"]["code"] == "engine_dead"
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        # The server stops itself so that its supervisor can start a fresh one.
        assert server.process.wait(10) is not None
        assert codes <= {200, 503}
        assert f"rank 0 (pid {ranks[0].pid}) exited with code -9" in server.log()
        assert "stopping this server in 2 s so that its supervisor can start a new one" in server.log()
    finally:
        left = stop_server(server)
    assert not left, f"processes left behind: {left}"
    assert not [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
