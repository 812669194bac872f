"""kv_aware and session routing in front of two real colocated `tandem serve` workers.

Without any header, the second turn of a conversation (its first turn's prompt as a long
shared prefix) must go to the worker that served the first turn, as the router learned from
that worker's KV events, and be served from its prefix cache (`cached_tokens` > 0). Plain
token scoring would send it to the other, idle worker: ties go to the least recently chosen.
With `x-session-affinity`, unrelated prompts of one session all land on one worker.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tandem.router.config import HealthPolicy, RouterConfig, WorkerSpec
from tandem.router.http.app import build_app
from tests.support.live_server import LiveServer, start_server, stop_server
from tests.support.router_helpers import ThreadServer, metric, wait_for

MODEL = "smollm2-135m"
# Blocks of 16 tokens: the turns' shared prefixes are a few blocks of that size.
WORKER_ARGS = ("--kv-cache-memory", "256MiB", "--threads", "1", "--max-num-seqs", "8", "--block-size", "16")
SYSTEM = (
    "You are a helpful assistant for a travel agency. You answer questions about cities, "
    "their history, food and weather briefly and precisely. "
) * 4


@dataclass
class Pair:
    workers: list[LiveServer]
    router: str

    def served(self) -> dict[str, float]:
        """Requests each worker has answered through the router (its hop counter)."""
        text = httpx.get(f"{self.router}/metrics", timeout=10).text
        counts = dict.fromkeys((w.url for w in self.workers), 0.0)
        for line in text.splitlines():
            if line.startswith("tandem_router_worker_requests_total{") and 'outcome="200"' in line:
                for url in counts:
                    if f'worker="{url}"' in line:
                        counts[url] += float(line.rsplit(" ", 1)[1])
        return counts

    def cached_blocks(self, url: str) -> int:
        for worker in httpx.get(f"{self.router}/workers", timeout=10).json()["workers"]:
            if worker["url"] == url:
                return int((worker["kv"] or {}).get("cached_blocks") or 0)
        return 0

    def chat(self, messages: list[dict[str, str]], **headers: str) -> tuple[dict[str, Any], str]:
        """(reply, URL of the worker that served it)."""
        before = self.served()
        reply = httpx.post(
            f"{self.router}/v1/chat/completions",
            json={"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0},
            headers=headers,
            timeout=180,
        )
        assert reply.status_code == 200, reply.text
        after = self.served()
        (url,) = [u for u in after if after[u] > before[u]]
        return reply.json(), url


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    logs = tmp_path_factory.mktemp("router-policy-e2e")
    workers: list[LiveServer] = []
    server: ThreadServer | None = None
    try:
        for i in range(2):
            workers.append(start_server(logs / f"worker-{i}.log", *WORKER_ARGS))
        config = RouterConfig(
            workers=tuple(WorkerSpec(w.url, "both") for w in workers),
            health=HealthPolicy(interval_s=0.2, timeout_s=2.0),
        )
        server = ThreadServer(build_app(config)).start()
        yield Pair(workers, server.url)
    finally:
        if server is not None:
            server.stop()
        for worker in workers:
            assert not stop_server(worker)


def _cached_tokens(reply: dict[str, Any]) -> int:
    return int((reply["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def test_kv_aware_sends_the_second_turn_to_the_worker_holding_the_first(pair: Pair) -> None:
    for n in range(3):
        system = {"role": "system", "content": f"Ticket {uuid.uuid4().hex[:12]}. {SYSTEM}"}
        turn1 = [system, {"role": "user", "content": f"Question {n}: what should I eat?"}]
        before = {w.url: pair.cached_blocks(w.url) for w in pair.workers}
        first, url = pair.chat(turn1)
        # The router learns the new blocks from the worker's KV events (polled every 0.25 s).
        assert wait_for(lambda u=url, b=before[url]: pair.cached_blocks(u) > b, timeout=10)
        turn2 = [
            *turn1,
            {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And what should I drink with it?"},
        ]
        second, url2 = pair.chat(turn2)
        assert url2 == url
        assert _cached_tokens(second) >= 64, second["usage"]
    workers = httpx.get(f"{pair.router}/workers", timeout=10).json()["workers"]
    assert all(w["kv"]["synced"] and w["kv"]["block_size"] == 16 for w in workers), workers
    metrics = httpx.get(f"{pair.router}/metrics", timeout=10).text
    # Every second turn was tokenized by a worker and placed by the kv_aware rule.
    assert metric(metrics, "tandem_router_tokenize_seconds_count") >= 3
    assert metric(metrics, "tandem_router_policy_decisions_total", rule="kv_aware") >= 3


def test_a_repeated_prompt_reports_exactly_its_cached_blocks(pair: Pair) -> None:
    """Colocated mode: usage.cached_tokens is the serving worker's count, passed through as is."""
    prompt = [
        {"role": "system", "content": f"Ticket {uuid.uuid4().hex[:12]}. {SYSTEM}"},
        {"role": "user", "content": "Which city has the best museums?"},
    ]
    before = {w.url: pair.cached_blocks(w.url) for w in pair.workers}
    first, url = pair.chat(prompt)
    assert _cached_tokens(first) == 0  # a new prompt
    assert wait_for(lambda: pair.cached_blocks(url) > before[url], timeout=10)
    again, url2 = pair.chat(prompt)
    assert url2 == url
    # Every whole 16-token block of the prompt, short of the last token (always computed).
    assert _cached_tokens(again) == (again["usage"]["prompt_tokens"] - 1) // 16 * 16 > 0


def test_a_session_header_keeps_unrelated_prompts_on_one_worker(pair: Pair) -> None:
    for key in ("session-a", "session-b"):
        urls = set()
        for n in range(3):
            prompt = [{"role": "user", "content": f"{uuid.uuid4().hex} Tell me fact {n}."}]
            _, url = pair.chat(prompt, **{"x-session-affinity": key})
            urls.add(url)
        assert len(urls) == 1, urls
