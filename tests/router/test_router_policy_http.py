"""Routing policies through a real router on real ports, in front of fake workers.

`KvWorker` is a fake colocated worker that speaks the KV contract: it "tokenizes" a chat as
the characters of its messages, keeps a prefix cache keyed by the shared block-hash chain,
publishes stored blocks at /kv/events (after /kv/snapshot) and reports cached prompt tokens
in its usage, so kv_aware routing can be checked end to end in a second, without a model.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request

from tandem.kvcache.block_hash import block_hashes, salted_root
from tandem.router.config import PolicyConfig, WorkerSpec
from tests.support.router_helpers import FakeWorker, ThreadServer, metric, wait_for

ROOT = 987654321
BLOCK = 4
FakeFactory = Callable[[str], tuple[FakeWorker, str]]


class KvWorker:
    def __init__(self, name: str) -> None:
        self.name = name
        self.worker_id = uuid.uuid4().hex
        self.blocks: set[int] = set()
        self.events: list[dict[str, Any]] = []
        self.served: list[dict[str, Any]] = []
        self.tokenized = 0

    @staticmethod
    def tokens(body: dict[str, Any]) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}" for m in body["messages"])
        return [ord(c) for c in text + "<assistant>"]

    def app(self) -> FastAPI:
        app = FastAPI()
        head = lambda: {  # noqa: E731
            "worker_id": self.worker_id,
            "root_hash": ROOT,
            "block_size": BLOCK,
            "last_id": len(self.events),
        }

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/load")
        async def load() -> dict[str, Any]:
            return {"kv_blocks_total": 1000, "block_size": BLOCK}

        @app.get("/kv/snapshot")
        async def snapshot() -> dict[str, Any]:
            return {**head(), "block_hashes": sorted(self.blocks)}

        @app.get("/kv/events")
        async def events(since: int) -> dict[str, Any]:
            return {**head(), "gap": False, "events": self.events[since:]}

        @app.post("/tokenize")
        async def tokenize(request: Request) -> dict[str, Any]:
            self.tokenized += 1
            tokens = self.tokens(await request.json())
            return {"count": len(tokens), "tokens": tokens, "max_model_len": 100000}

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> dict[str, Any]:
            body = await request.json()
            self.served.append(body)
            salt = body.get("cache_salt")  # as a real worker: the salt roots the request's chain
            chain = block_hashes(self.tokens(body), BLOCK, ROOT, parent_hash=salted_root(ROOT, salt))
            hits = next((i for i, h in enumerate(chain) if h not in self.blocks), len(chain))
            new = [h for h in chain if h not in self.blocks]
            if new:
                self.blocks.update(new)
                self.events.append(
                    {"id": len(self.events) + 1, "type": "stored", "block_hashes": new}
                )
            prompt = len(self.tokens(body))
            return {
                "id": "x",
                "object": "chat.completion",
                "created": 1,
                "model": "fake",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": f"from {self.name}"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {
                    "prompt_tokens": prompt,
                    "completion_tokens": 2,
                    "total_tokens": prompt + 2,
                    "prompt_tokens_details": {"cached_tokens": hits * BLOCK},
                },
            }

        return app


@pytest.fixture
def kv_workers() -> Iterator[Callable[[int], list[tuple[KvWorker, str]]]]:
    servers: list[ThreadServer] = []

    def start(count: int) -> list[tuple[KvWorker, str]]:
        out = []
        for i in range(count):
            worker = KvWorker(f"kv{i}")
            server = ThreadServer(worker.app()).start()
            servers.append(server)
            out.append((worker, server.url))
        return out

    yield start
    for server in servers:
        server.stop()


def _chat(router: str, messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    headers = extra.pop("headers", {})
    reply = httpx.post(
        f"{router}/v1/chat/completions",
        json={"model": "fake", "messages": messages, **extra},
        headers=headers,
        timeout=30,
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


def _cached_blocks(router: str, url: str) -> int:
    for worker in httpx.get(f"{router}/workers", timeout=10).json()["workers"]:
        if worker["url"] == url:
            return (worker["kv"] or {}).get("cached_blocks", 0)
    return 0


def test_kv_aware_sends_the_next_turn_where_its_prefix_is_cached(
    kv_workers: Callable[[int], list[tuple[KvWorker, str]]], start_router: Callable[..., str]
) -> None:
    workers = kv_workers(2)
    router = start_router([WorkerSpec(url, "both") for _, url in workers])
    by_name = {w.name: url for w, url in workers}
    for n in range(4):  # least_tokens alone would alternate: ties go to the least recent
        system = {"role": "system", "content": f"Conversation {n}. " + "Be brief. " * 20}
        turn1 = [system, {"role": "user", "content": "First question?"}]
        before = {url: _cached_blocks(router, url) for url in by_name.values()}
        first = _chat(router, turn1)
        served_by = first["choices"][0]["message"]["content"].split()[-1]
        url, floor = by_name[served_by], before[by_name[served_by]] + 50
        assert wait_for(lambda u=url, f=floor: _cached_blocks(router, u) >= f, timeout=5)
        turn2 = [*turn1, first["choices"][0]["message"], {"role": "user", "content": "And?"}]
        second = _chat(router, turn2)
        assert second["choices"][0]["message"]["content"] == f"from {served_by}"
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 200
    metrics = httpx.get(f"{router}/metrics", timeout=10).text
    decided = metric(
        metrics,
        "tandem_router_policy_decisions_total",
        hop="direct",
        policy="kv_aware",
        rule="kv_aware",
    )
    assert decided >= 4  # at least every second turn
    # ...each predicted to hit the >= 200 cached tokens its worker then reported.
    assert metric(metrics, "tandem_router_kv_predicted_hit_blocks_total") >= 4 * 200 // BLOCK
    assert sum(w.tokenized for w, _ in workers) >= 4


def test_kv_aware_predicts_a_hit_only_under_the_requests_own_salt(
    kv_workers: Callable[[int], list[tuple[KvWorker, str]]], start_router: Callable[..., str]
) -> None:
    """The router's KV index must salt a request's chain as the workers do: a prompt cached
    under one tenant's salt is no predicted hit for another's (it would send their requests to
    the first tenant's worker, and its metrics would claim hits that never happen)."""
    workers = kv_workers(2)
    router = start_router([WorkerSpec(url, "both") for _, url in workers])
    system = {"role": "system", "content": "Salted conversation. " + "Be brief. " * 20}
    turn = [system, {"role": "user", "content": "First question?"}]

    def predicted() -> float:
        return metric(httpx.get(f"{router}/metrics", timeout=10).text, "tandem_router_kv_predicted_hit_blocks_total")

    first = _chat(router, turn, cache_salt="tenant-a")
    served_by = first["choices"][0]["message"]["content"].split()[-1]
    url = next(u for w, u in workers if w.name == served_by)
    assert wait_for(lambda: _cached_blocks(router, url) >= 50, timeout=5)
    before = predicted()
    other = _chat(router, turn, cache_salt="tenant-b")
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert predicted() == before  # no hit predicted under another salt
    again = _chat(router, turn, cache_salt="tenant-a")
    assert again["choices"][0]["message"]["content"] == f"from {served_by}"
    assert predicted() >= before + 50  # the owner's salt: the hit is predicted, and real
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 200


@pytest.mark.parametrize(
    "affinity",
    [
        {"headers": {"x-session-affinity": "{key}"}},
        {"headers": {"x-conversation-id": "{key}"}},
        {"user": "{key}"},
    ],
    ids=["x-session-affinity", "affinity-header", "user-field"],
)
def test_sessions_stick_to_one_worker_and_spread_over_all(
    fake_workers: FakeFactory, start_router: Callable[..., str], affinity: dict[str, Any]
) -> None:
    fakes = [fake_workers(f"w{i}") for i in range(3)]
    router = start_router(
        [WorkerSpec(url, "both") for _, url in fakes],
        policy=PolicyConfig(affinity_header="x-conversation-id"),
        pd_min_prompt_tokens=10**6,
    )
    homes: dict[str, set[str]] = {}
    for key, _ in itertools.product([f"s{i}" for i in range(12)], range(3)):
        extra = {
            k: ({h: v.format(key=key) for h, v in v.items()} if isinstance(v, dict) else key)
            for k, v in affinity.items()
        }
        before = [len(w.requests) for w, _ in fakes]
        _chat(router, [{"role": "user", "content": f"hello from {key}"}], **extra)
        served = [w.name for (w, _), n in zip(fakes, before, strict=True) if len(w.requests) > n]
        homes.setdefault(key, set()).update(served)
    assert all(len(home) == 1 for home in homes.values()), homes
    assert len(set().union(*homes.values())) >= 2  # 12 sessions do not all hash to one worker


def test_pd_sessions_pick_prefill_and_decode_workers_by_the_ring(
    fake_workers: FakeFactory, start_router: Callable[..., str]
) -> None:
    prefill = [fake_workers(f"p{i}") for i in range(2)]
    decode = [fake_workers(f"d{i}") for i in range(2)]
    router = start_router(
        [WorkerSpec(url, "prefill") for _, url in prefill]
        + [WorkerSpec(url, "decode") for _, url in decode]
    )
    for key in ("alpha", "beta", "gamma"):
        seen: set[str] = set()
        for _ in range(3):
            before = {w.name: len(w.requests) for w, _ in prefill + decode}
            _chat(
                router,
                [{"role": "user", "content": "a long question " * 40}],
                headers={"x-session-affinity": key},
                max_tokens=5,
            )
            seen.update(w.name for w, _ in prefill + decode if len(w.requests) > before[w.name])
        assert len([s for s in seen if s.startswith("p")]) == 1, seen
        assert len([s for s in seen if s.startswith("d")]) == 1, seen
