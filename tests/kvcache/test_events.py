"""KV events: the block pool's record, the worker's log with gaps and snapshots, and live."""

from __future__ import annotations

import httpx

from tandem.engine.block_pool import BlockPool
from tandem.kvcache.block_hash import block_hashes
from tandem.kvcache.events import KVEventLog


def test_block_pool_records_stored_removed_cleared_in_order() -> None:
    pool = BlockPool(2, record_events=True)
    a, b = pool.allocate(2)
    pool.cache(a, 11, [1])
    pool.cache(b, 12, [2])
    pool.free([a, b])
    (c,) = pool.allocate(1)  # evicts the head of the free queue: block a
    assert c is a
    assert pool.drain_events() == [("stored", 11), ("stored", 12), ("removed", 11)]
    pool.free([c])
    assert pool.reset_prefix_cache()
    assert pool.drain_events() == [("cleared", 0)]
    assert pool.drain_events() == []


def test_block_pool_records_nothing_unless_asked() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache(a, 11, [1])
    assert pool.events == []


def test_log_groups_batches_and_serves_what_followed() -> None:
    log = KVEventLog(root_hash=7, block_size=16)
    log.append([("stored", 1), ("stored", 2), ("removed", 1)])
    log.append([("stored", 3)])
    reply = log.since(0)
    assert not reply["gap"] and reply["last_id"] == 3
    assert [(e["id"], e["type"], e["block_hashes"]) for e in reply["events"]] == [
        (1, "stored", [1, 2]), (2, "removed", [1]), (3, "stored", [3])]
    assert log.since(2)["events"] == [
        {"id": 3, "type": "stored", "medium": "device", "block_hashes": [3]}]
    assert log.since(3)["events"] == [] and not log.since(3)["gap"]
    assert log.snapshot()["block_hashes"] == [2, 3] and log.snapshot()["last_id"] == 3


def test_log_groups_runs_of_the_same_type_and_medium() -> None:
    """A 2-tuple is the device pool's; a run breaks where the type or the medium changes."""
    log = KVEventLog(root_hash=7, block_size=16)
    log.append([("stored", 1), ("stored", 2, "device"), ("stored", 1, "cpu"), ("stored", 2, "cpu"),
                ("stored", 5, "disk"), ("removed", 1, "cpu"), ("removed", 3, "cpu")])
    log.append([("stored", 9, "cluster")])
    events = log.since(0)["events"]
    assert [(e["id"], e["type"], e["medium"], e["block_hashes"]) for e in events] == [
        (1, "stored", "device", [1, 2]), (2, "stored", "cpu", [1, 2]), (3, "stored", "disk", [5]),
        (4, "removed", "cpu", [1, 3]), (5, "stored", "cluster", [9])]
    assert all(set(e) == {"id", "type", "medium", "block_hashes"} for e in events)


def test_snapshot_keeps_device_hashes_and_adds_each_lower_tier() -> None:
    log = KVEventLog(root_hash=7, block_size=16)
    snapshot = log.snapshot()
    assert snapshot["block_hashes"] == [] and snapshot["tiers"] == {"cpu": [], "disk": [], "cluster": []}
    # Block 2 is on the device and in CPU memory at once; removing it from one keeps the other.
    log.append([("stored", 2), ("stored", 1), ("stored", 2, "cpu"), ("stored", 3, "cpu"),
                ("stored", 3, "disk"), ("stored", 4, "cluster"), ("removed", 2)])
    snapshot = log.snapshot()
    assert snapshot["block_hashes"] == [1]
    assert snapshot["tiers"] == {"cpu": [2, 3], "disk": [3], "cluster": [4]}
    assert snapshot["last_id"] == log.since(0)["last_id"]


def test_cleared_resets_the_device_unless_it_names_a_medium() -> None:
    log = KVEventLog(root_hash=7, block_size=16)
    log.append([("stored", 1), ("stored", 1, "cpu"), ("stored", 2, "disk")])
    log.append([("cleared", 0)])  # the device pool's prefix-cache reset
    assert log.snapshot()["block_hashes"] == [] and log.snapshot()["tiers"]["cpu"] == [1]
    log.append([("cleared", 0, "cpu")])
    snapshot = log.snapshot()
    assert snapshot["tiers"] == {"cpu": [], "disk": [2], "cluster": []}
    assert [(e["type"], e["medium"]) for e in log.since(3)["events"]] == [
        ("cleared", "device"), ("cleared", "cpu")]


def test_events_of_an_unknown_medium_are_dropped_not_raised() -> None:
    """The log runs in the server's output reader: one bad event must not stop it."""
    log = KVEventLog(root_hash=7, block_size=16)
    log.append([("stored", 1, "tape"), ("stored", 2, "cpu")])
    assert [e["medium"] for e in log.since(0)["events"]] == ["cpu"]
    assert "tape" not in log.snapshot()["tiers"]


def test_log_reports_a_gap_when_events_were_dropped_or_ids_are_foreign() -> None:
    log = KVEventLog(root_hash=7, block_size=16, capacity=2)
    for kind, block_hash in [("stored", 1), ("removed", 1), ("stored", 2), ("removed", 2)]:
        log.append([(kind, block_hash)])
    assert log.since(0)["gap"] and log.since(0)["events"] == []
    assert not log.since(2)["gap"]  # events 3 and 4 are still held
    assert log.since(99)["gap"]  # an id this worker never issued: it restarted
    log.append([("cleared", 0)])
    assert log.snapshot()["block_hashes"] == [] and log.since(4)["events"][0]["type"] == "cleared"


def test_live_worker_publishes_the_prompt_blocks(tandem_server: str) -> None:
    snapshot = httpx.get(f"{tandem_server}/kv/snapshot").json()
    start = snapshot["last_id"]
    messages = [{"role": "user", "content": "Events test: " + "the quick brown fox jumps " * 30}]
    reply = httpx.post(f"{tandem_server}/v1/chat/completions", timeout=120,
                       json={"model": "smollm2-135m", "messages": messages, "max_tokens": 2, "temperature": 0})
    assert reply.status_code == 200
    tokens = httpx.post(f"{tandem_server}/tokenize", json={"messages": messages}).json()["tokens"]
    expected = block_hashes(tokens[: len(tokens) // 16 * 16], snapshot["block_size"], snapshot["root_hash"])
    events = httpx.get(f"{tandem_server}/kv/events", params={"since": start}).json()
    assert not events["gap"] and events["worker_id"] == snapshot["worker_id"]
    stored = [h for e in events["events"] if e["type"] == "stored" for h in e["block_hashes"]]
    already = set(snapshot["block_hashes"])  # e.g. the chat template's system block
    assert set(expected) - already <= set(stored) and set(expected) - already
    assert set(expected) <= set(httpx.get(f"{tandem_server}/kv/snapshot").json()["block_hashes"])
