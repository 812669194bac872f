"""The KV tiers' scheduler side, alone (torch-free): what it stores, where it finds chunks,
when it declines to load, and what it tells its worker side."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tandem.batch.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from tandem.config import EngineConfig, KVTiersConfig
from tandem.kvcache.block_hash import block_hashes, root_hash
from tandem.kvcache.connector.base import KVConnectorOutput
from tandem.kvcache.connector.tiers import TiersConnectorScheduler
from tandem.kvcache.tiers.metadata import TiersMetadata
from tandem.types import Request, SamplingParams

B = 4  # tokens per block
K = 2  # blocks per chunk
CHUNK_BYTES = 1000
ROOT = root_hash("LlamaForCausalLM/float32/abc", "float32", B)
PROMPT = list(range(100, 121))  # 21 tokens: 5 full blocks, 2 full chunks


def make(cpu_chunks: int = 8, **tiers) -> TiersConnectorScheduler:
    config = EngineConfig("m", kv_tiers=KVTiersConfig(cpu_bytes=cpu_chunks * CHUNK_BYTES, chunk_blocks=K, **tiers))
    config = replace(config, cache=replace(config.cache, block_size=B))
    connector = TiersConnectorScheduler(config)
    connector.set_worker_info([{"chunk_bytes": CHUNK_BYTES}])
    return connector


def request(request_id: str, prompt: list[int] = PROMPT) -> Request:
    req = Request(request_id, list(prompt), SamplingParams(max_tokens=4))
    req.block_hashes = block_hashes(req.all_token_ids, B, ROOT)
    return req


def step(connector: TiersConnectorScheduler, req: Request, num_new: int, block_ids: list[int] | None = None,
         new: bool = True) -> TiersMetadata:
    """One scheduled step of `req` computing `num_new` tokens; returns the step's metadata."""
    out = SchedulerOutput()
    if new:
        out.new_requests.append(NewRequestData(req.request_id, req.prompt_token_ids, [], req.sampling_params,
                                               (), block_ids or list(range(10, 16)), req.num_computed_tokens))
    else:
        out.cached_requests.append(CachedRequestData(req.request_id, [], [], req.num_computed_tokens))
    out.num_scheduled_tokens[req.request_id] = num_new
    meta = connector.build_connector_meta(out)
    req.num_computed_tokens += num_new
    connector.update_connector_output(KVConnectorOutput())
    return meta or TiersMetadata()


def compute_prompt(connector: TiersConnectorScheduler, req: Request) -> TiersMetadata:
    assert connector.get_num_new_matched_tokens(req, 0) == (0, False)
    return step(connector, req, req.num_tokens)


def test_computed_chunks_are_written_through_to_cpu() -> None:
    connector = make()
    meta = compute_prompt(connector, request("a"))
    assert [len(s.block_ids) for s in meta.saves] == [K, K]
    assert meta.saves[0].block_ids == [10, 11] and meta.saves[1].block_ids == [12, 13]
    assert all(s.to_cpu and s.to_slow == () for s in meta.saves)
    assert meta.saves[0].token_ids == tuple(PROMPT[: K * B])
    events = connector.drain_events()
    assert len(events) == 2 * K and {e[0] for e in events} == {"stored"} and {e[2] for e in events} == {"cpu"}
    assert connector.counters()["media"]["cpu"]["blocks"] == 2 * K


def test_a_chunk_is_saved_once_its_step_completes_it() -> None:
    connector = make()
    req = request("a")
    assert connector.get_num_new_matched_tokens(req, 0) == (0, False)
    assert step(connector, req, 5).saves == []  # 5 tokens: no chunk of 8 complete
    meta = step(connector, req, 5, new=False)
    assert [s.block_ids for s in meta.saves] == [[10, 11]]


def test_a_device_miss_loads_from_cpu_asynchronously() -> None:
    connector = make()
    compute_prompt(connector, request("a"))
    again = request("b")
    # Nothing on the device: both chunks (16 tokens) come from the CPU tier.
    assert connector.get_num_new_matched_tokens(again, 0) == (16, True)
    connector.update_state_after_alloc(again, [20, 21, 22, 23, 24, 25], 16)
    meta = connector.build_connector_meta(SchedulerOutput())
    (load,) = meta.loads
    assert [(c.medium, c.skip, c.dest_block_ids) for c in load.chunks] == [("cpu", 0, [20, 21]), ("cpu", 0, [22, 23])]
    assert connector.pending_work() is not None


def test_a_partial_device_hit_loads_only_the_rest_of_the_chunk() -> None:
    connector = make()
    compute_prompt(connector, request("a"))
    again = request("b")
    assert connector.get_num_new_matched_tokens(again, B) == (12, True)  # block 0 on device
    again.num_computed_tokens = B  # as the scheduler sets it before telling the connector
    connector.update_state_after_alloc(again, [20, 21, 22, 23, 24, 25], 12)
    chunks = connector.build_connector_meta(SchedulerOutput()).loads[0].chunks
    assert [(c.skip, c.dest_block_ids) for c in chunks] == [(1, [21]), (0, [22, 23])]


def test_the_last_prompt_token_is_always_computed() -> None:
    connector = make()
    prompt = list(range(100, 116))  # exactly 2 chunks
    compute_prompt(connector, request("a", prompt))
    # The second chunk's last block holds the last token: only blocks 0..2 are loaded.
    assert connector.get_num_new_matched_tokens(request("b", prompt), 0) == (12, True)


def test_two_requests_share_one_load() -> None:
    connector = make()
    compute_prompt(connector, request("a"))
    first, second = request("b"), request("c")
    assert connector.get_num_new_matched_tokens(first, 0) == (16, True)
    connector.update_state_after_alloc(first, list(range(20, 26)), 16)
    assert connector.get_num_new_matched_tokens(second, 0) is None  # waits for b's load
    connector.build_connector_meta(SchedulerOutput())
    connector.update_connector_output(KVConnectorOutput(finished_loads={"b"}))
    assert connector.get_num_new_matched_tokens(second, 16) == (0, False)  # now on the device


def test_concurrent_loads_are_capped() -> None:
    connector = make(max_concurrent_loads=1)
    compute_prompt(connector, request("a"))
    other = list(range(300, 321))
    compute_prompt(connector, request("x", other))
    first = request("b")
    assert connector.get_num_new_matched_tokens(first, 0) == (16, True)
    connector.update_state_after_alloc(first, list(range(20, 26)), 16)
    assert connector.get_num_new_matched_tokens(request("c", other), 0) is None
    connector.request_finished(first, [])
    assert connector.get_num_new_matched_tokens(request("d", other), 0) == (16, True)


def test_cpu_budget_evicts_least_recently_used_chunks() -> None:
    connector = make(cpu_chunks=2)
    compute_prompt(connector, request("a"))
    connector.drain_events()
    meta = compute_prompt(connector, request("x", list(range(300, 321))))
    assert len(meta.evictions) == 2 and all(e.demote_to == () for e in meta.evictions)
    removed = [e for e in connector.drain_events() if e[0] == "removed"]
    assert len(removed) == 2 * K and {e[2] for e in removed} == {"cpu"}
    assert connector.get_num_new_matched_tokens(request("b"), 0) == (0, False)


def test_a_timed_out_load_is_cancelled() -> None:
    connector = make(load_timeout=0.0)
    compute_prompt(connector, request("a"))
    req = request("b")
    connector.get_num_new_matched_tokens(req, 0)
    connector.update_state_after_alloc(req, list(range(20, 26)), 16)
    connector.build_connector_meta(SchedulerOutput())
    import time

    assert connector.timed_out_loads(time.monotonic() + 1) == ["b"]
    assert connector.build_connector_meta(SchedulerOutput()).cancels == ["b"]
    assert connector.counters()["loads_timed_out"] == 1


def test_an_aborted_load_is_cancelled() -> None:
    connector = make()
    compute_prompt(connector, request("a"))
    req = request("b")
    connector.get_num_new_matched_tokens(req, 0)
    connector.update_state_after_alloc(req, list(range(20, 26)), 16)
    connector.build_connector_meta(SchedulerOutput())
    connector.request_finished(req, [])
    assert connector.build_connector_meta(SchedulerOutput()).cancels == ["b"]
    assert connector.pending_work() is None


def test_cost_model_declines_a_tier_slower_than_recompute() -> None:
    connector = make()
    compute_prompt(connector, request("a"))
    connector.cost.observe_load("cpu", CHUNK_BYTES, 10.0, 1)  # 100 bytes/s: hopeless
    connector.cost.observe_step(1000, 1.0)
    b = request("b")
    assert connector.get_num_new_matched_tokens(b, 0) == (0, False)
    assert connector.get_num_new_matched_tokens(b, 0) == (0, False)  # asked again: waits for room
    assert connector.counters()["loads_skipped_by_cost"] == 1
    connector.cost.observe_load("cpu", CHUNK_BYTES, 1e-6, 1)
    connector.cost.observe_load("cpu", CHUNK_BYTES, 1e-6, 1)
    connector.cost.observe_load("cpu", CHUNK_BYTES, 1e-6, 1)
    assert connector.get_num_new_matched_tokens(request("c"), 0) == (16, True)


@pytest.mark.parametrize("admit_after", [1, 2])
def test_slow_tiers_admit_on_the_configured_sighting(tmp_path, admit_after: int) -> None:
    connector = make(disk_path=str(tmp_path), admit_after=admit_after)
    meta = compute_prompt(connector, request("a"))
    if admit_after == 1:
        assert all(s.to_slow == ("disk",) for s in meta.saves)
        return
    assert all(s.to_slow == () for s in meta.saves)
    connector.drain_events()
    # The second sighting writes the chunks down from the CPU tier's copy (no device read).
    again = request("b")
    connector.get_num_new_matched_tokens(again, 16)  # all on the device
    again.num_computed_tokens = 16
    meta = step(connector, again, 5)
    assert [(s.block_ids, s.to_cpu, s.to_slow) for s in meta.saves] == [([], False, ("disk",))] * 2
    # Confirmed writes become events with their medium; unconfirmed ones are not announced.
    connector.update_connector_output(KVConnectorOutput(reports={"tiers": {
        "stored": [(meta.saves[0].chunk_hash, "disk")], "not_stored": [(meta.saves[1].chunk_hash, "disk")]}}))
    assert {e[2] for e in connector.drain_events()} == {"disk"}
    assert connector.counters()["writer"]["pending"] == 0


def test_a_request_continuing_a_known_prefix_has_its_new_chunks_admitted_at_once(tmp_path) -> None:
    """A conversation's next turn: its new chunks go to the slow tiers on their first sighting,
    since the turn after re-sends them (under round robin on a worker that never held them)."""
    connector = make(disk_path=str(tmp_path), admit_after=2)
    compute_prompt(connector, request("a"))  # chunk 0 and chunk 1, one sighting each
    turn = request("b", PROMPT[: K * B] + list(range(500, 513)))  # chunk 0 again, chunk 1 new
    assert connector.get_num_new_matched_tokens(turn, K * B) == (0, False)
    turn.num_computed_tokens = K * B
    meta = step(connector, turn, turn.num_tokens - K * B)
    assert [(s.token_ids[0], s.to_slow) for s in meta.saves] == [(PROMPT[0], ("disk",)), (500, ("disk",))]
    # A prompt sharing nothing seen before still waits for its second sighting.
    meta = compute_prompt(connector, request("c", list(range(700, 721))))
    assert [s.to_slow for s in meta.saves] == [(), ()]


def test_a_finished_requests_tail_is_saved_under_a_hold_and_found_by_the_next() -> None:
    connector = make()
    req = request("a")
    compute_prompt(connector, req)
    decision = connector.request_finished(req, list(range(10, 16)))
    # 21 tokens: 5 full blocks, 2 whole chunks, and a 1-block tail held until it is copied.
    assert decision.num_blocks == 5 and decision.hold_id is not None
    (tail,) = connector.build_connector_meta(SchedulerOutput()).saves
    assert (tail.num_blocks, tail.block_ids, tail.hold_id) == (1, [14], decision.hold_id)
    assert tail.token_ids == tuple(PROMPT[16:20])
    assert connector.pending_work() is not None  # until the worker side reports the copy
    connector.update_connector_output(KVConnectorOutput(finished_holds={decision.hold_id}))
    assert connector.pending_work() is None
    nxt = request("b", PROMPT + [7, 8, 9])  # the next turn: everything up to the tail loads
    assert connector.get_num_new_matched_tokens(nxt, 0) == (20, True)
    connector.update_state_after_alloc(nxt, list(range(20, 27)), 20)
    chunks = connector.build_connector_meta(SchedulerOutput()).loads[0].chunks
    assert [(c.num_blocks, c.dest_block_ids) for c in chunks] == [(2, [20, 21]), (2, [22, 23]), (1, [24])]


def test_cpu_budget_evicts_retained_chunks_last_until_their_ttl() -> None:
    """A cache breakpoint's chunks stay in the CPU tier while unmarked ones go, until the TTL."""
    from tandem.types import CacheRetention
    from tests.support.fake_clock import FakeClock

    clock = FakeClock()
    config = EngineConfig("m", kv_tiers=KVTiersConfig(cpu_bytes=2 * CHUNK_BYTES, chunk_blocks=K))
    connector = TiersConnectorScheduler(replace(config, cache=replace(config.cache, block_size=B)), clock=clock)
    connector.set_worker_info([{"chunk_bytes": CHUNK_BYTES}])
    marked = request("a")
    marked.retention = CacheRetention(2 * K * B, 300.0)  # both chunks
    compute_prompt(connector, marked)
    assert connector.counters()["media"]["cpu"]["chunks_retained"] == 2
    meta = compute_prompt(connector, request("x", list(range(300, 321))))
    assert len(meta.evictions) == 2  # the unmarked newcomers, not the older marked chunks
    assert connector.get_num_new_matched_tokens(request("b"), 0) == (16, True)
    clock.advance(300)
    assert connector.counters()["media"]["cpu"]["chunks_retained"] == 0
    compute_prompt(connector, request("y", list(range(500, 521))))
    assert connector.get_num_new_matched_tokens(request("c"), 0) == (0, False)


def test_retention_never_lets_the_cpu_tier_exceed_its_budget() -> None:
    """Retained chunks are evicted when nothing else is left: ordering, not pinning."""
    from tandem.types import CacheRetention
    from tests.support.fake_clock import FakeClock

    config = EngineConfig("m", kv_tiers=KVTiersConfig(cpu_bytes=2 * CHUNK_BYTES, chunk_blocks=K))
    connector = TiersConnectorScheduler(replace(config, cache=replace(config.cache, block_size=B)),
                                        clock=FakeClock())
    connector.set_worker_info([{"chunk_bytes": CHUNK_BYTES}])
    for request_id, prompt in (("a", PROMPT), ("x", list(range(300, 321)))):
        req = request(request_id, prompt)
        req.retention = CacheRetention(2 * K * B, 3600.0)
        compute_prompt(connector, req)
    cpu = connector.counters()["media"]["cpu"]
    assert cpu["blocks"] == 2 * K and cpu["chunks_retained"] == 2  # the evicted ones are no longer retained
    assert connector.get_num_new_matched_tokens(request("b"), 0) == (0, False)  # the older pair went
