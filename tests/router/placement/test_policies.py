"""Routing policies without processes: the bounded-load ring, the KV index and its event
feeds, the policies' choices, and the tokenize hop (httpx mock transports stand in for
workers)."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from tandem.kvcache.block_hash import block_hashes
from tandem.router.config import HealthPolicy, PolicyConfig, ScoringConfig, WorkerSpec
from tandem.router.placement.kv_events import KvEventPoller
from tandem.router.placement.kv_index import KvIndex
from tandem.router.placement.placement import Placement, PlacementMetrics
from tandem.router.placement.policies import Placer, PromptRoute, affinity_key, kv_cost
from tandem.router.placement.ring import HashRing, bounded_pick, load_bound
from tandem.router.placement.tokenize import RemoteTokenizer, token_id_prompt, tokenize_body
from tandem.router.workers.health import HealthMonitor
from tandem.router.workers.registry import LoadSnapshot, WorkerEndpoint, WorkerRegistry

ROOT = 12345
BS = 4
KEYS = [f"session-{i}" for i in range(3000)]


def _worker(url: str, role: str = "both", **load: int) -> WorkerEndpoint:
    worker = WorkerEndpoint(WorkerSpec(url, role), HealthPolicy())  # type: ignore[arg-type]
    worker.health.record(True)
    if load:
        worker.on_load(LoadSnapshot.from_json(load), poll_started_at=0.0, reflect_delay_s=0.25)
    return worker


def _snapshot(worker_id: str, hashes: list[int], last_id: int = 0) -> dict[str, Any]:
    return {
        "worker_id": worker_id,
        "root_hash": ROOT,
        "block_size": BS,
        "last_id": last_id,
        "block_hashes": hashes,
    }


def _events(
    worker_id: str, events: list[tuple[Any, ...]], gap: bool = False
) -> dict[str, Any]:
    """Events as (id, type, hashes) — no medium, as older workers send — or (id, type,
    hashes, medium)."""
    return {
        "worker_id": worker_id,
        "root_hash": ROOT,
        "block_size": BS,
        "last_id": max((e[0] for e in events), default=0),
        "gap": gap,
        "events": [
            {"id": e[0], "type": e[1], "block_hashes": e[2], **({"medium": e[3]} if e[3:] else {})}
            for e in events
        ],
    }


# --- the ring ----------------------------------------------------------------------------
def test_ring_is_stable_and_even() -> None:
    ring = HashRing(["http://a", "http://b", "http://c"])
    owners = [ring.owner(k) for k in KEYS]
    assert owners == [HashRing(["http://c", "http://a", "http://b"]).owner(k) for k in KEYS]
    shares = {m: owners.count(m) / len(KEYS) for m in ring.members}
    assert all(0.22 < share < 0.45 for share in shares.values()), shares


def test_adding_a_fourth_worker_moves_about_a_quarter_of_sessions() -> None:
    three = HashRing(["http://a", "http://b", "http://c"])
    four = HashRing(["http://a", "http://b", "http://c", "http://d"])
    moved = [k for k in KEYS if three.owner(k) != four.owner(k)]
    assert 0.15 < len(moved) / len(KEYS) < 0.35, len(moved) / len(KEYS)
    assert all(four.owner(k) == "http://d" for k in moved)  # only onto the new worker
    # Removing it again sends exactly those sessions back.
    assert [k for k in KEYS if four.owner(k) != three.owner(k)] == moved


def test_removing_a_worker_moves_only_its_sessions() -> None:
    three = HashRing(["http://a", "http://b", "http://c"])
    two = HashRing(["http://a", "http://b"])
    for key in KEYS:
        if three.owner(key) != "http://c":
            assert two.owner(key) == three.owner(key)


def test_load_bound() -> None:
    assert load_bound([0, 0, 0], 1.25) == 1  # ceil(1.25 * 1 / 3)
    assert load_bound([4, 4, 4], 1.25) == 6  # ceil(1.25 * 13 / 3)
    assert load_bound([10, 0], 1.0) == 6


def test_bounded_pick_walks_past_a_full_owner() -> None:
    ring = HashRing(["http://a", "http://b", "http://c"])
    key = "hot"
    order = ring.walk(key)
    loads = {order[0]: 5, order[1]: 0, order[2]: 0}
    # bound = ceil(1.25 * 6 / 3) = 3: the owner (5) is full, the next on the ring takes it.
    assert bounded_pick(ring, key, loads.__getitem__, 1.25) == (order[1], 1)
    loads = {order[0]: 2, order[1]: 1, order[2]: 1}  # bound = ceil(1.25 * 5 / 3) = 3
    assert bounded_pick(ring, key, loads.__getitem__, 1.25) == (order[0], 0)


def test_no_worker_ever_exceeds_the_bound_under_skewed_sessions() -> None:
    """A few hot sessions and many cold ones, requests arriving and finishing at random."""
    rng = random.Random(7)
    members = [f"http://w{i}" for i in range(4)]
    ring = HashRing(members)
    loads = dict.fromkeys(members, 0)
    open_requests: list[str] = []
    sticky = 0
    for _ in range(5000):
        if open_requests and rng.random() < 0.45:
            loads[open_requests.pop(rng.randrange(len(open_requests)))] -= 1
            continue
        key = "hot-1" if rng.random() < 0.5 else f"cold-{rng.randrange(500)}"
        member, position = bounded_pick(ring, key, loads.__getitem__, 1.25)  # type: ignore[misc]
        total = sum(loads.values()) + 1
        loads[member] += 1
        open_requests.append(member)
        assert loads[member] <= math.ceil(1.25 * total / len(members))
        sticky += position == 0
    assert sticky > 0.6 * 5000 * 0.55  # most placements are still the key's owner


# --- affinity keys -----------------------------------------------------------------------
def test_affinity_key_precedence() -> None:
    headers = {"x-session-affinity": "s1", "x-conversation": "c1"}
    body = {"user": "u1"}
    assert affinity_key(headers, body, "x-conversation") == "s1"
    assert affinity_key({"x-conversation": "c1"}, body, "x-conversation") == "c1"
    assert affinity_key({"x-conversation": "c1"}, body, None) == "u1"
    assert affinity_key({}, {"user": ""}, None) is None
    assert affinity_key({}, {"user": 7}, None) is None


def test_an_agents_own_session_id_comes_after_the_headers_and_before_user() -> None:
    """The documented order (docs/routing.md): x-session-affinity, --affinity-header, the
    agent's session (Claude Code's, Codex's, read by its protocol adapter), then `user`."""
    body = {"user": "u1"}
    assert affinity_key({"x-session-affinity": "s1"}, body, None, "agent") == "s1"
    assert affinity_key({"x-conversation": "c1"}, body, "x-conversation", "agent") == "c1"
    assert affinity_key({}, body, "x-conversation", "agent") == "agent"
    assert affinity_key({}, body, None, None) == "u1"
    assert affinity_key({}, body, None, "") == "u1"


# --- the KV index ------------------------------------------------------------------------
def _chain_route(tokens: list[int]) -> PromptRoute:
    return PromptRoute(len(tokens), token_ids=tokens)


def test_index_applies_events_and_finds_the_longest_cached_prefix() -> None:
    tokens = list(range(40))  # 10 blocks of 4
    chain = block_hashes(tokens, BS, ROOT)
    index = KvIndex()
    index.apply_snapshot("a", _snapshot("wa", chain[:3], last_id=5))
    assert index.apply_events("a", _events("wa", [(6, "stored", chain[3:6])]))
    route = _chain_route(tokens)
    assert index.cached_prefix("a", route.block_hash) == 6
    assert index.apply_events("a", _events("wa", [(7, "removed", [chain[2]])]))
    assert index.cached_prefix("a", route.block_hash) == 2  # a hole ends the prefix
    assert index.apply_events("a", _events("wa", [(7, "removed", [chain[0]])]))  # replayed: skip
    assert index.cached_prefix("a", route.block_hash) == 2
    assert index.apply_events("a", _events("wa", [(8, "cleared", [])]))
    assert index.cached_prefix("a", route.block_hash) == 0 and index.cached_blocks("a") == 0
    assert index.cached_prefix("unknown", route.block_hash) == 0


def test_a_salted_prompt_matches_only_blocks_cached_under_its_salt() -> None:
    """Workers salt a request's chain with its cache_salt; the index must look it up the same way."""
    from tandem.kvcache.block_hash import salted_root

    tokens = list(range(40))
    salted = block_hashes(tokens, BS, ROOT, parent_hash=salted_root(ROOT, "tenant-a"))
    index = KvIndex()
    index.apply_snapshot("a", _snapshot("wa", salted[:5], last_id=1))
    assert index.cached_prefix("a", PromptRoute(40, token_ids=tokens, cache_salt="tenant-a").block_hash) == 5
    assert index.cached_prefix("a", PromptRoute(40, token_ids=tokens, cache_salt="tenant-b").block_hash) == 0
    assert index.cached_prefix("a", _chain_route(tokens).block_hash) == 0


def test_a_fresh_feed_from_id_one_needs_no_snapshot() -> None:
    index = KvIndex()
    assert index.apply_events("a", _events("wa", [(1, "stored", [1, 2]), (2, "stored", [3])]))
    assert index.cached_blocks("a") == 3 and index.state("a").last_id == 2


@pytest.mark.parametrize(
    "reply, reason",
    [
        (_events("wa", [(5, "stored", [9])]), "gap"),  # id 4 missing
        (_events("wa", [(4, "stored", [9])], gap=True), "gap"),  # the worker's own flag
        (_events("wb", [(1, "stored", [9])]), "restart"),  # a new process
        ({**_events("wa", []), "last_id": 1}, "restart"),  # ids went back
    ],
    ids=["missing-id", "gap-flag", "new-worker-id", "ids-back"],
)
def test_gaps_and_restarts_unsync_until_a_snapshot(reply: dict[str, Any], reason: str) -> None:
    index = KvIndex()
    index.apply_snapshot("a", _snapshot("wa", [1, 2, 3], last_id=3))
    assert not index.apply_events("a", reply)
    state = index.state("a")
    assert not state.synced and state.unsynced_by == reason and index.cached_blocks("a") == 0
    # Further events are ignored until the snapshot...
    assert not index.apply_events("a", _events("wa", [(4, "stored", [4])]))
    index.apply_snapshot("a", _snapshot(reply["worker_id"], [7, 8], last_id=10))
    # ...after which the feed continues from the snapshot's id.
    assert index.apply_events("a", _events(reply["worker_id"], [(11, "stored", [9])]))
    assert index.state("a").blocks == {7, 8, 9}


def test_index_tracks_each_medium_and_reads_events_without_one_as_device() -> None:
    tokens = list(range(40))  # 10 blocks of 4
    chain = block_hashes(tokens, BS, ROOT)
    route = _chain_route(tokens)
    index = KvIndex()
    snapshot = {**_snapshot("wa", chain[:2], last_id=1),
                "tiers": {"cpu": chain[:4], "disk": [], "cluster": []}}
    index.apply_snapshot("a", snapshot)
    assert index.apply_events("a", _events("wa", [
        (2, "stored", chain[4:6], "disk"),
        (3, "stored", [chain[2]]),  # no medium: the device pool's
        (4, "removed", [chain[0]], "cpu"),  # leaves cpu; block 0 is still on the device
    ]))
    entry = index.state("a")
    assert entry.blocks == set(chain[:3]) and entry.media["cpu"] == set(chain[1:4])
    assert entry.media["disk"] == set(chain[4:6])
    # The device's own prefix is unchanged; the tiered run goes on through cpu and disk, each
    # block from the best medium holding it.
    assert index.cached_prefix("a", route.block_hash) == 3
    assert index.tiered_prefix("a", route.block_hash) == ["device"] * 3 + ["cpu"] + ["disk"] * 2
    # A medium left out of the ranking (credit 0) does not count: the run ends at block 4.
    assert index.tiered_prefix("a", route.block_hash, ["device", "cpu"]) == ["device"] * 3 + ["cpu"]
    assert index.tier_blocks("a") == {"device": 3, "cpu": 3, "disk": 2}
    assert index.describe("a")["tier_blocks"] == {"cpu": 3, "disk": 2}  # type: ignore[index]
    # `cleared` without a medium resets the device only.
    assert index.apply_events("a", _events("wa", [(5, "cleared", [])]))
    assert index.tier_blocks("a") == {"device": 0, "cpu": 3, "disk": 2}
    assert index.apply_events("a", _events("wa", [(6, "cleared", [], "disk")]))
    assert index.tiered_prefix("a", route.block_hash) == []  # block 0 is nowhere now
    # An old worker's snapshot (no `tiers`) is all device.
    index.apply_snapshot("b", _snapshot("wb", chain[:5]))
    assert index.tiered_prefix("b", route.block_hash) == ["device"] * 5


def test_the_cluster_set_is_shared_by_every_worker_of_the_pool() -> None:
    tokens = list(range(40))
    chain = block_hashes(tokens, BS, ROOT)
    route = _chain_route(tokens)
    index = KvIndex()
    for url in ("a", "b"):
        index.apply_snapshot(url, _snapshot("w" + url, [], last_id=1))
    assert index.apply_events("a", _events("wa", [(2, "stored", chain[:6], "cluster")]))
    index.apply_snapshot("c", {**_snapshot("wc", chain[:1], last_id=3),
                               "tiers": {"cluster": chain[6:8]}})  # written by c, as a snapshot
    assert index.cluster_blocks() == 8
    # b never wrote anything and still loads what a and c wrote.
    assert index.tiered_prefix("b", route.block_hash) == ["cluster"] * 8
    assert index.tiered_prefix("c", route.block_hash) == ["device"] + ["cluster"] * 7
    assert index.tiered_prefix("b", route.block_hash, reads_cluster=False) == []
    assert (index.writes_cluster("a"), index.writes_cluster("b"), index.writes_cluster("c")) == (
        True, False, True)
    # Any worker's `removed` takes a block out for all (here b found block 3 gone).
    assert index.apply_events("b", _events("wb", [(2, "removed", [chain[3]], "cluster")]))
    assert index.tiered_prefix("a", route.block_hash) == ["cluster"] * 3
    # The store outlives its writers: a's restart or departure keeps what a wrote.
    assert not index.apply_events("a", _events("wa2", [(1, "stored", [99])]))
    index.remove("c")
    assert index.cluster_blocks() == 7 and index.tiered_prefix("b", route.block_hash) == ["cluster"] * 3
    # An unsynced worker is credited nothing, not even the cluster's blocks.
    assert index.tiered_prefix("a", route.block_hash) == []


def test_the_cluster_set_is_bounded_dropping_the_least_recently_reported() -> None:
    index = KvIndex(cluster_capacity=3)
    index.apply_snapshot("a", _snapshot("wa", [], last_id=0))
    assert index.apply_events("a", _events("wa", [(1, "stored", [1, 2, 3], "cluster")]))
    assert index.apply_events("a", _events("wa", [(2, "stored", [1, 4], "cluster")]))  # 1 again
    assert index.cluster_blocks() == 3 and set(index._cluster) == {3, 1, 4}


class FakeFeed:
    """A worker's /kv/snapshot and /kv/events behind an httpx mock transport."""

    def __init__(self, worker_id: str = "w1") -> None:
        self.worker_id = worker_id
        self.blocks: set[int] = set()
        self.log: list[dict[str, Any]] = []
        self.dropped_before = 1  # events below this id are gone from the bounded log
        self.snapshots = 0
        self.calls: list[str] = []
        self.page = 1000  # events per reply, as a worker's `limit`

    def store(self, *hashes: int) -> None:
        self.blocks.update(hashes)
        self.log.append({"id": len(self.log) + 1, "type": "stored", "block_hashes": list(hashes)})

    def remove(self, *hashes: int) -> None:
        self.blocks.difference_update(hashes)
        self.log.append({"id": len(self.log) + 1, "type": "removed", "block_hashes": list(hashes)})

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.calls.append(request.url.path)
        head = {"worker_id": self.worker_id, "root_hash": ROOT, "block_size": BS}
        last_id = len(self.log)
        if request.url.path == "/kv/snapshot":
            self.snapshots += 1
            return httpx.Response(
                200, json={**head, "last_id": last_id, "block_hashes": sorted(self.blocks)}
            )
        if request.url.path == "/kv/events":
            since = int(request.url.params["since"])
            gap = since + 1 < self.dropped_before
            events = [e for e in self.log if e["id"] > since and e["id"] >= self.dropped_before]
            events = events[: self.page]
            return httpx.Response(
                200, json={**head, "last_id": last_id, "gap": gap, "events": events}
            )
        return httpx.Response(404)


def _poll(feed: FakeFeed, steps: list[Any]) -> tuple[KvIndex, list[str]]:
    """Run the poller step by step against `feed`; callables in `steps` change the feed."""
    index = KvIndex()
    worker = _worker("http://w")
    registry = WorkerRegistry((worker.spec,), HealthPolicy())
    resyncs: list[str] = []

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(feed.handler)) as client:
            poller = KvEventPoller(
                registry, client, index, 0.25, 1.0, lambda w, why: resyncs.append(why)
            )
            for step in steps:
                if callable(step):
                    step()
                else:
                    await poller.poll_once(worker)

    asyncio.run(run())
    return index, resyncs


def test_poller_starts_from_a_snapshot_then_follows_events() -> None:
    feed = FakeFeed()
    feed.store(1, 2)
    index, resyncs = _poll(feed, ["poll", lambda: feed.store(3), lambda: feed.remove(1), "poll"])
    assert index.state("http://w").blocks == {2, 3} and index.state("http://w").last_id == 3
    assert resyncs == ["start"] and feed.snapshots == 1


def test_poller_reads_a_backlog_page_after_page() -> None:
    feed = FakeFeed()
    feed.page = 2
    delays: list[float] = []
    index = KvIndex()
    worker = _worker("http://w")
    registry = WorkerRegistry((worker.spec,), HealthPolicy())

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(feed.handler)) as client:
            poller = KvEventPoller(registry, client, index, 0.25, 1.0)
            delays.append(await poller.poll_once(worker))  # snapshot (empty) + no events
            for i in range(5):
                feed.store(i)
            for _ in range(3):
                delays.append(await poller.poll_once(worker))

    asyncio.run(run())
    assert index.state("http://w").blocks == set(range(5))
    assert delays == [0.25, 0.01, 0.01, 0.25]  # pages follow at once; the last one waits


def test_poller_resyncs_after_the_log_dropped_events_and_after_a_restart() -> None:
    feed = FakeFeed()
    feed.store(1)

    def overflow() -> None:  # the worker's bounded log forgets events 2..3
        feed.store(2)
        feed.store(3)
        feed.remove(1)
        feed.dropped_before = 4

    def restart() -> None:
        feed.worker_id, feed.log, feed.blocks, feed.dropped_before = "w2", [], set(), 1
        feed.store(42)

    index, resyncs = _poll(feed, ["poll", overflow, "poll", "poll", restart, "poll", "poll"])
    assert resyncs == ["start", "gap", "restart"]
    assert index.state("http://w").blocks == {42} and index.state("http://w").worker_id == "w2"


def test_poller_leaves_a_worker_without_kv_events_alone() -> None:
    index = KvIndex()
    worker = _worker("http://old")
    registry = WorkerRegistry((worker.spec,), HealthPolicy())

    async def run() -> float:
        transport = httpx.MockTransport(lambda request: httpx.Response(404))
        async with httpx.AsyncClient(transport=transport) as client:
            return await KvEventPoller(registry, client, index, 0.25, 1.0).poll_once(worker)

    assert asyncio.run(run()) >= 10 and index.cached_blocks("http://old") == 0


# --- the policies ------------------------------------------------------------------------
def _placer(name: str = "kv_aware", index: KvIndex | None = None, **fields: Any) -> Placer:
    config = PolicyConfig(name=name, **fields)  # type: ignore[arg-type]
    return Placer(config, ScoringConfig(), index or KvIndex())


def _index_with(url: str, hashes: list[int]) -> KvIndex:
    index = KvIndex()
    index.apply_snapshot(url, _snapshot("w-" + url, hashes))
    return index


def test_kv_aware_picks_the_worker_holding_the_prefix() -> None:
    tokens = list(range(400))  # 100 blocks
    index = _index_with("http://b", block_hashes(tokens, BS, ROOT)[:80])
    a, b = _worker("http://a"), _worker("http://b")
    choice = _placer(index=index).choose([a, b], _chain_route(tokens), "direct")
    assert choice is not None
    assert (choice.worker, choice.rule, choice.cached_blocks, choice.prompt_blocks) == (
        b,
        "kv_aware",
        80,
        100,
    )
    assert kv_cost(b, 80, 400, BS, 1.0) == 80.0 and kv_cost(a, 0, 400, BS, 1.0) == 400.0


def test_kv_aware_weighs_the_hit_against_the_queue() -> None:
    tokens = list(range(400))
    index = _index_with("http://b", block_hashes(tokens, BS, ROOT)[:80])
    a = _worker("http://a")
    # b saves 320 prompt tokens but has 2000 queued: a is cheaper.
    b = _worker("http://b", num_waiting_prefill_tokens=2000)
    choice = _placer(index=index).choose([a, b], _chain_route(tokens), "direct")
    assert choice is not None and choice.worker is a
    # The decode load counts too (running KV tokens).
    b = _worker("http://b", running_kv_tokens=100)
    choice = _placer(index=index).choose([a, b], _chain_route(tokens), "direct")
    assert choice is not None and choice.worker is b


def test_kv_aware_keeps_a_session_on_its_worker_while_that_worker_decodes_another() -> None:
    """An agent turn: 5,000 tokens, 4,700 cached on `a`, only the shared 2,000-token prefix on
    `b`. `a` is decoding another session with 6,000 tokens of KV, `b` is idle. Moving the turn
    would recompute 2,700 tokens (and split the session's history over two workers); staying
    costs a share of decode steps. With the default prefill weight the turn stays."""
    block = BS
    tokens = list(range(5000))
    chain = block_hashes(tokens, block, ROOT)
    index = KvIndex()
    index.apply_snapshot("http://a", _snapshot("w-a", chain[: 4700 // block]))
    index.apply_snapshot("http://b", _snapshot("w-b", chain[: 2000 // block]))
    a = _worker("http://a", running_kv_tokens=6000, num_running_requests=1)
    b = _worker("http://b")
    route = _chain_route(tokens)
    choice = _placer(index=index).choose([a, b], route, "direct")
    assert choice is not None and choice.worker is a
    assert (choice.cached_blocks, choice.best_cached_blocks) == (4700 // block, 4700 // block)
    # What the router counts on each worker until its load shows the request: the uncached part.
    assert route.prefill_work("http://a") == 5000 - 4700 // block * block
    assert route.prefill_work("http://b") == 5000 - 2000 // block * block
    assert route.prefill_work("http://elsewhere") == 5000
    # Weighing a prefill token like a token of decode KV (Dynamo's w = 1) moves it.
    choice = _placer(index=index, prefill_weight=1.0).choose([a, b], _chain_route(tokens), "direct")
    assert choice is not None and choice.worker is b
    assert choice.best_skipped.startswith("cost +")  # the log line says why the hit lost


def _tiered_index(
    blocks: dict[str, dict[str, list[int]]], cluster: list[int] | tuple[int, ...] = ()
) -> KvIndex:
    """Workers' snapshots by URL: {url: {medium: hashes}}; `cluster` as written by the first."""
    index = KvIndex()
    for n, (url, media) in enumerate(blocks.items()):
        tiers = {m: media.get(m, []) for m in ("cpu", "disk")}
        tiers["cluster"] = list(cluster) if n == 0 else []
        index.apply_snapshot(url, {**_snapshot("w-" + url, media.get("device", [])), "tiers": tiers})
    return index


def test_kv_aware_credits_a_device_hit_over_a_disk_hit_over_none() -> None:
    """400 tokens, 80 of the 100 blocks cached on a's device and on b's disk, c has nothing.
    Costs (w = 4, B = 4): a 4 × (400 − 80 × 1.0 × 4) = 320, b 4 × (400 − 80 × 0.25 × 4) = 1280,
    c 4 × 400 = 1600."""
    tokens = list(range(400))
    prefix = block_hashes(tokens, BS, ROOT)[:80]
    index = _tiered_index({"http://a": {"device": prefix}, "http://b": {"disk": prefix},
                           "http://c": {}})
    a, b, c = _worker("http://a"), _worker("http://b"), _worker("http://c")
    placer = _placer(index=index)
    choice = placer.choose([a, b, c], _chain_route(tokens), "direct")
    assert choice is not None and choice.worker is a
    assert (choice.cached_blocks, choice.credited_blocks, choice.cached_by_tier) == (
        80, 80.0, {"device": 80})
    route = _chain_route(tokens)
    choice = placer.choose([b, c], route, "direct")
    assert choice is not None and choice.worker is b
    assert (choice.cached_blocks, choice.credited_blocks, choice.cached_by_tier) == (
        80, 20.0, {"disk": 80})
    assert (kv_cost(b, 20.0, 400, BS, 4.0), kv_cost(c, 0, 400, BS, 4.0)) == (1280.0, 1600.0)
    # What the router counts on b until its load shows the request: the credited remainder.
    assert route.prefill_work("http://b") == 400 - 20 * BS
    # With the disk's credit at 0 the disk is not looked at: b holds nothing for routing.
    choice = _placer(index=index, kv_credit_disk=0.0).choose([b], _chain_route(tokens), "direct")
    assert choice is not None and (choice.cached_blocks, choice.cached_by_tier) == (0, {})


def test_kv_aware_sends_a_long_prefix_in_cpu_memory_to_a_busy_worker_over_an_idle_one() -> None:
    """4,000 tokens (1,000 blocks). `a` decodes another session (6,000 KV tokens) and holds the
    prompt's first N tokens in its CPU tier; `b` is idle and holds nothing (b costs 4 × 4,000 =
    16,000). With w = 4 and cpu credit 0.75, a costs 4 × (4,000 − 0.75 × N) + 6,000:
    N = 3,600 → 11,200 (a wins); N = 400 → 20,800 (b wins). The same 3,600 on a's disk
    (credit 0.25) → 18,400: a slow tier's long prefix is not worth the queue."""
    tokens = list(range(4000))
    chain = block_hashes(tokens, BS, ROOT)
    b = _worker("http://b")
    a = _worker("http://a", running_kv_tokens=6000, num_running_requests=1)
    for medium, cached, winner, cost in (("cpu", 3600, a, 11200.0), ("cpu", 400, b, 20800.0),
                                         ("disk", 3600, b, 18400.0)):
        index = _tiered_index({"http://a": {medium: chain[: cached // BS]}, "http://b": {}})
        placer = _placer(index=index)
        choice = placer.choose([a, b], _chain_route(tokens), "direct")
        assert choice is not None and choice.worker is winner, (medium, cached)
        credit = PolicyConfig().tier_credits[medium]
        assert kv_cost(a, credit * (cached // BS), 4000, BS, 4.0) == cost
        assert kv_cost(b, 0, 4000, BS, 4.0) == 16000.0
        assert (choice.best_cached_blocks, choice.best_credited_blocks) == (
            cached // BS, credit * (cached // BS))


def test_kv_aware_credits_each_block_from_its_best_medium() -> None:
    """Device for blocks 0-29, cpu for 30-59 (0-9 are in cpu too), the cluster store for
    60-79: credited = 30 × 1.0 + 30 × 0.75 + 20 × 0.25 = 57.5 of a run of 80."""
    tokens = list(range(400))
    chain = block_hashes(tokens, BS, ROOT)
    index = _tiered_index({"http://a": {"device": chain[:30], "cpu": chain[:60]}},
                          cluster=chain[60:80])
    choice = _placer(index=index).choose([_worker("http://a")], _chain_route(tokens), "direct")
    assert choice is not None
    assert (choice.cached_blocks, choice.credited_blocks) == (80, 57.5)
    assert choice.cached_by_tier == {"device": 30, "cpu": 30, "cluster": 20}


def test_kv_aware_with_the_prefix_only_in_the_cluster_store_routes_by_load() -> None:
    """Nothing on any device; the cluster store holds the whole prompt (a wrote it). Every
    worker that reads the store gets the same credit, so load decides among them; a worker
    without a cluster tier gets none."""
    tokens = list(range(400))
    chain = block_hashes(tokens, BS, ROOT)
    index = _tiered_index({"http://a": {}, "http://b": {}, "http://c": {}}, cluster=chain)
    a = _worker("http://a", running_kv_tokens=100)  # wrote the blocks: it has the tier
    b = _worker("http://b")
    b.on_load(LoadSnapshot.from_json({"kv_tiers": {"media": {"cpu": {}, "cluster": {}}}}), 0.0, 0.25)
    c = _worker("http://c")  # idle, but no cluster tier: it would compute all 400 tokens
    placer = _placer(index=index)
    assert [placer.reads_cluster(w) for w in (a, b, c)] == [True, True, False]
    route = _chain_route(tokens)
    choice = placer.choose([a, b, c], route, "direct")
    assert choice is not None and choice.worker is b
    assert (choice.cached_blocks, choice.credited_blocks, choice.cached_by_tier) == (
        100, 25.0, {"cluster": 100})
    # a and b would each compute 300 tokens (b's 1,200 cost beats a's 1,300 and c's 1,600).
    assert [route.prefill_work(w.url) for w in (a, b, c)] == [300, 300, 400]


def test_kv_aware_skips_a_worker_above_the_load_bound() -> None:
    tokens = list(range(400))
    index = _index_with("http://b", block_hashes(tokens, BS, ROOT))
    a, b = _worker("http://a"), _worker("http://b")
    b.in_flight = 4  # bound = ceil(1.25 * 5 / 2) = 4: b is full
    choice = _placer(index=index).choose([a, b], _chain_route(tokens), "direct")
    assert choice is not None and choice.worker is a


def test_kv_aware_without_tokens_falls_back_to_least_tokens() -> None:
    a = _worker("http://a", num_waiting_prefill_tokens=500)
    b = _worker("http://b", num_waiting_prefill_tokens=10)
    choice = _placer().choose([a, b], PromptRoute(100), "prefill")
    assert choice is not None and (choice.worker, choice.rule) == (b, "least_tokens")


def test_an_affinity_key_decides_under_every_policy() -> None:
    workers = [_worker(f"http://w{i}") for i in range(3)]
    owner = HashRing([w.url for w in workers]).owner("conv-9")
    for name in ("kv_aware", "least_tokens", "session", "round_robin"):
        for hop in ("prefill", "direct", "decode"):
            choice = _placer(name).choose(workers, PromptRoute(100, "conv-9"), hop)
            assert choice is not None and (choice.worker.url, choice.rule) == (owner, "session")


def test_session_overflows_to_the_next_worker_when_the_owner_is_full() -> None:
    workers = [_worker(f"http://w{i}") for i in range(3)]
    placer = _placer("session")
    order = HashRing([w.url for w in workers]).walk("conv-9")
    by_url = {w.url: w for w in workers}
    by_url[order[0]].in_flight = 3  # bound = ceil(1.25 * 4 / 3) = 2
    choice = placer.choose(workers, PromptRoute(100, "conv-9"), "direct")
    assert choice is not None and (choice.worker.url, choice.overflow) == (order[1], 1)
    # An unhealthy owner is simply not in the pool: the same next worker takes the session.
    pool = [w for w in workers if w.url != order[0]]
    choice = placer.choose(pool, PromptRoute(100, "conv-9"), "direct")
    assert choice is not None and choice.worker.url == order[1]


def test_round_robin_and_least_tokens_and_the_decode_hop() -> None:
    a = _worker("http://a", running_kv_tokens=1000, kv_blocks_total=100, block_size=16)
    b = _worker("http://b", running_kv_tokens=0, kv_blocks_total=100, block_size=16)
    placer = _placer("round_robin")
    choices = [placer.choose([a, b], PromptRoute(10), "direct") for _ in range(4)]
    assert [c.worker for c in choices if c is not None] == [a, b, a, b]
    # The decode hop ignores round_robin and kv_aware: the decode score (KV in use) decides.
    for name in ("round_robin", "kv_aware", "least_tokens"):
        choice = _placer(name).choose([a, b], PromptRoute(10), "decode")
        assert choice is not None and (choice.worker, choice.rule) == (b, "least_tokens")


# --- the tokenize hop and placement ------------------------------------------------------
def test_tokenize_bodies() -> None:
    chat = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function"}],
        "max_tokens": 5,
        "stream": True,
    }
    assert tokenize_body(chat, "chat") == {
        "messages": chat["messages"],
        "tools": chat["tools"],
        "model": "m",
        "add_generation_prompt": True,
    }
    assert tokenize_body({"prompt": "abc"}, "completion") == {"prompt": "abc"}
    assert tokenize_body({"prompt": ["abc"]}, "completion") == {"prompt": "abc"}
    assert tokenize_body({"prompt": ["a", "b"]}, "completion") is None
    assert token_id_prompt({"prompt": [1, 2, 3]}, "completion") == [1, 2, 3]
    assert token_id_prompt({"prompt": [[1, 2]]}, "completion") == [1, 2]
    assert token_id_prompt({"prompt": "abc"}, "completion") is None


def _placement(
    handler: Any, index: KvIndex, urls: list[str], name: str = "kv_aware"
) -> tuple[Placement, PlacementMetrics, httpx.AsyncClient, CollectorRegistry]:
    registry = WorkerRegistry(tuple(WorkerSpec(u, "both") for u in urls), HealthPolicy())
    for worker in registry.workers:
        worker.health.record(True)
    prometheus = CollectorRegistry()
    metrics = PlacementMetrics(prometheus, index, registry)
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    placement = Placement(
        PolicyConfig(name=name),  # type: ignore[arg-type]
        ScoringConfig(),
        registry,
        index,
        RemoteTokenizer(client, 0.5),
        metrics,
    )
    return placement, metrics, client, prometheus


def test_placement_tokenizes_only_when_it_can_pay() -> None:
    tokens = list(range(64))
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json={"count": 64, "tokens": tokens, "max_model_len": 2048})

    body = {"messages": [{"role": "user", "content": "x" * 400}]}
    empty = KvIndex()

    async def run(index: KvIndex, headers: dict[str, str]) -> PromptRoute:
        placement, _, client, _ = _placement(handler, index, ["http://a", "http://b"])
        async with client:
            return await placement.prepare(body, "chat", headers, {}, 100)

    route = asyncio.run(run(empty, {}))  # nothing cached anywhere: no hop
    assert route.token_ids is None and not seen
    index = _index_with("http://a", block_hashes(tokens, BS, ROOT)[:2])
    route = asyncio.run(run(index, {"x-session-affinity": "s"}))  # a key decides: no hop
    assert route.token_ids is None and route.affinity_key == "s" and not seen
    route = asyncio.run(run(index, {}))
    assert route.token_ids == tokens and route.prompt_tokens == 64
    assert seen == [{"messages": body["messages"], "add_generation_prompt": True}]


def test_placement_notes_and_counts_the_tiers_of_a_hit() -> None:
    tokens = list(range(64))  # 16 blocks
    chain = block_hashes(tokens, BS, ROOT)
    index = _tiered_index({"http://a": {"device": chain[:4], "cpu": chain[:10]}})
    placement, _, client, prometheus = _placement(
        lambda request: httpx.Response(404), index, ["http://a"]
    )
    route = _chain_route(tokens)
    assert placement.choose(placement.registry.workers, route, "direct") is not None
    assert route.notes == ["direct:kv_aware(10/16 cpu:6)"]
    hits = {m: prometheus.get_sample_value("tandem_router_kv_predicted_hit_blocks_total",
                                           {"worker": "http://a", "medium": m})
            for m in ("device", "cpu")}
    assert hits == {"device": 4.0, "cpu": 6.0}
    assert prometheus.get_sample_value(
        "tandem_router_worker_kv_tier_blocks", {"worker": "http://a", "medium": "cpu"}) == 10
    assert prometheus.get_sample_value("tandem_router_kv_cluster_blocks") == 0
    asyncio.run(client.aclose())


def test_placement_tokenizes_when_only_a_lower_tier_holds_blocks() -> None:
    """Nothing on any device, but the cluster store has blocks: worth the tokenize hop."""
    tokens = list(range(64))

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"count": 64, "tokens": tokens, "max_model_len": 2048})

    index = _tiered_index({"http://a": {}}, cluster=block_hashes(tokens, BS, ROOT)[:2])

    async def run() -> PromptRoute:
        placement, _, client, _ = _placement(handler, index, ["http://a"])
        async with client:
            return await placement.prepare({"prompt": "x" * 400}, "completion", {}, {}, 100)

    assert asyncio.run(run()).token_ids == tokens


def test_a_failed_or_slow_tokenize_hop_routes_by_load() -> None:
    async def slow(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(2)
        return httpx.Response(200, json={"tokens": [1]})

    index = _index_with("http://a", [1])
    for handler in (lambda request: httpx.Response(500), slow):

        async def run(handler: Any = handler) -> tuple[PromptRoute, str | None]:
            placement, _, client, prometheus = _placement(handler, index, ["http://a"])
            async with client:
                route = await placement.prepare({"prompt": "y" * 400}, "completion", {}, {}, 100)
                worker = placement.choose(placement.registry.workers, route, "direct")
            assert worker is not None
            failures = prometheus.get_sample_value("tandem_router_tokenize_failures_total")
            assert failures == 1
            return route, route.notes[0]

        route, note = asyncio.run(run())
        assert route.token_ids is None and route.prompt_tokens == 100
        assert note == "direct:least_tokens"


def test_a_finished_request_makes_the_router_reread_the_load_at_once() -> None:
    running = {"tokens": 500}

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"running_kv_tokens": running["tokens"]})

    worker = _worker("http://w")
    registry = WorkerRegistry((worker.spec,), HealthPolicy())

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            monitor = HealthMonitor(registry, client, HealthPolicy(), ScoringConfig())
            monitor.refresh_load(worker)
            await asyncio.sleep(0.05)
            assert worker.load is not None and worker.load.running_kv_tokens == 500
            running["tokens"] = 0  # the request ended
            monitor.refresh_load(worker)
            await asyncio.sleep(0.05)
            assert worker.load.running_kv_tokens == 0
            await monitor.stop()

    asyncio.run(run())
    # A poll that started before the refresh and answers after it is ignored.
    assert worker.load_at is not None
    worker.on_load(LoadSnapshot(running_kv_tokens=900), worker.load_at - 1.0, 0.25)
    assert worker.load is not None and worker.load.running_kv_tokens == 0


def test_policy_flags_on_route_and_up() -> None:
    from tandem.cli.main import build_parser
    from tandem.launch.cluster_plan import plan_cluster
    from tandem.router.cli import router_config

    args = build_parser().parse_args(["route", "--worker", "http://a:1"])
    assert router_config(args).policy == PolicyConfig()  # kv_aware, 1.25, no extra header
    args = build_parser().parse_args(
        ["route", "--worker", "a:1", "--policy", "session", "--affinity-header", "x-conv"]
        + ["--balance-factor", "1.5", "--prefill-weight", "2", "--kv-events-interval", "0.1"]
    )
    policy = router_config(args).policy
    assert (policy.name, policy.affinity_header, policy.balance_factor) == (
        "session",
        "x-conv",
        1.5,
    )
    assert (policy.prefill_weight, policy.kv_events_interval_s) == (2.0, 0.1)
    assert PolicyConfig().tier_credits == {"device": 1.0, "cpu": 0.75, "disk": 0.25, "cluster": 0.25}
    args = build_parser().parse_args(
        ["route", "--worker", "a:1", "--kv-credit-cpu", "0.5", "--kv-credit-disk", "0.1"]
        + ["--kv-credit-cluster", "0"]
    )
    assert router_config(args).policy.tier_credits == {
        "device": 1.0, "cpu": 0.5, "disk": 0.1, "cluster": 0.0}
    with pytest.raises(ValueError, match="balance-factor"):
        PolicyConfig(balance_factor=0.9)
    with pytest.raises(ValueError, match="kv-credit-cpu"):
        PolicyConfig(kv_credit_cpu=1.5)
    with pytest.raises(ValueError, match="kv-credit-cluster"):
        PolicyConfig(kv_credit_cluster=-0.1)
    ports = itertools.count(9000)
    up = build_parser().parse_args(["up", "--policy", "round_robin", "--affinity-header", "x-c"])
    argv = list(plan_cluster(up, None, lambda: next(ports)).router.argv)
    assert argv[argv.index("--policy") + 1] == "round_robin"
    assert argv[argv.index("--affinity-header") + 1] == "x-c"
    assert argv[argv.index("--balance-factor") + 1] == "1.25"


def test_tier_credits_are_measured_per_worker_unless_given() -> None:
    from tandem.router.placement.policies import measured_credits

    raw = {"block_size": 16, "kv_tiers": {"block_bytes": 720_000, "cost_model": {
        "prefill_tokens_per_s": 533.0, "cpu_bytes_per_s": 1.2e9, "cluster_bytes_per_s": 20e6}}}
    credits = measured_credits(raw, ("cpu", "disk", "cluster"))
    # A block takes 30 ms to compute: 0.6 ms to load from CPU memory (credit 0.98), 36 ms
    # from a slow store (slower than computing: 0); the disk tier was never loaded from.
    assert credits["cpu"] == pytest.approx(0.98, abs=0.005) and credits["cluster"] == 0.0
    assert "disk" not in credits and measured_credits({}, ("cpu",)) == {}
    assert PolicyConfig().measured_media == ("cpu", "disk", "cluster")
    fixed = PolicyConfig(kv_credit_cpu=0.5)
    assert fixed.measured_media == ("disk", "cluster") and fixed.tier_credits["cpu"] == 0.5
    assert PolicyConfig().tier_credits == {"device": 1.0, "cpu": 0.75, "disk": 0.25, "cluster": 0.25}
