"""The prefill/decode connector's scheduler side, alone (torch-free): what it offers, what it
tells its worker side, and how leases and loads end."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.config import KVTransferConfig
from tandem.kvcache.block_hash import block_hashes, root_hash
from tandem.kvcache.connector.base import KVConnectorOutput
from tandem.kvcache.connector.pd import PDConnectorScheduler, PDMetadata
from tandem.types import Request, RequestStatus, SamplingParams

B = 4
ROOT = root_hash("LlamaForCausalLM/float32/abc", "float32", B)
SOURCE = {"host": "127.0.0.1", "port": 5555}  # what the worker side reports of its KV source
PROMPT = list(range(100, 122))  # 22 tokens: 5 full blocks


def request(request_id: str, params: dict[str, Any] | None = None, prompt: list[int] = PROMPT,
            first_token: int | None = 7) -> Request:
    req = Request(request_id, list(prompt), SamplingParams(max_tokens=4),
                  output_token_ids=[] if first_token is None else [first_token], kv_transfer_params=params)
    req.block_hashes = block_hashes(req.all_token_ids, B, ROOT)
    return req


def handle(num_blocks: int = 5, hashes: list[int] | None = None, transfer_id: str = "lease-1") -> dict[str, Any]:
    return {"do_remote_prefill": True, "transfer_id": transfer_id, "host": "127.0.0.1", "port": 5555,
            "block_hashes": hashes if hashes is not None else block_hashes(PROMPT, B, ROOT)[:num_blocks],
            "expires_in": 60.0}


@pytest.fixture
def decode() -> PDConnectorScheduler:
    return PDConnectorScheduler(KVTransferConfig(connectors=("pd",), role="decode", fetch_timeout=2.0, secret="s"), B)


@pytest.fixture
def prefill() -> PDConnectorScheduler:
    connector = PDConnectorScheduler(KVTransferConfig(connectors=("pd",), role="prefill", hold_timeout=30.0, secret="s"), B)
    connector.set_worker_info([SOURCE])
    return connector


def meta(connector: PDConnectorScheduler) -> PDMetadata:
    out = connector.build_connector_meta()
    return out if out is not None else PDMetadata()


def test_an_ordinary_request_gets_nothing(decode: PDConnectorScheduler) -> None:
    assert decode.get_num_new_matched_tokens(request("r"), 0) == (0, False)
    assert decode.build_connector_meta() is None and decode.pending_work() is None


def test_offers_only_blocks_it_lacks_and_loads_them_asynchronously(decode: PDConnectorScheduler) -> None:
    req = request("r", handle())
    assert decode.get_num_new_matched_tokens(req, 2 * B) == (3 * B, True)  # 2 of 5 blocks cached here
    req.num_computed_tokens = 2 * B
    decode.update_state_after_alloc(req, [40, 41, 42, 43, 44, 45], 3 * B)
    step = meta(decode)
    assert [(m.request_id, m.indices, m.dest_block_ids) for m in step.loads] == [("r", [2, 3, 4], [42, 43, 44])]
    assert step.loads[0].handle["transfer_id"] == "lease-1"
    counters = decode.counters()
    assert (counters["pulls"], counters["blocks_already_cached"]) == (1, 2)
    assert decode.pending_work() is not None  # a load is in flight: poll the worker side
    decode.update_connector_output(KVConnectorOutput(finished_loads={"r"}))
    step = meta(decode)
    assert [h["transfer_id"] for h in step.remote_releases] == ["lease-1"]  # done with the source
    assert decode.pending_work() is None and decode.counters()["pull_failures"] == 0


def test_hashes_of_another_model_or_salt_are_not_loaded(decode: PDConnectorScheduler) -> None:
    foreign = block_hashes(PROMPT, B, root_hash("OtherModel/float32/def", "float32", B))
    req = request("r", handle(hashes=foreign))
    assert decode.get_num_new_matched_tokens(req, 0) == (0, False)
    assert [h["transfer_id"] for h in meta(decode).remote_releases] == ["lease-1"]


def test_everything_already_cached_loads_nothing_and_releases_the_source(decode: PDConnectorScheduler) -> None:
    req = request("r", handle())
    assert decode.get_num_new_matched_tokens(req, 5 * B) == (0, False)
    assert decode.get_num_new_matched_tokens(req, 5 * B) == (0, False)  # asked again: no double count
    assert decode.counters()["blocks_already_cached"] == 5 and decode.counters()["pulls"] == 1
    assert len(meta(decode).remote_releases) == 1


def test_a_second_request_waits_for_blocks_being_loaded(decode: PDConnectorScheduler) -> None:
    first, second = request("a", handle()), request("b", handle(transfer_id="lease-2"))
    assert decode.get_num_new_matched_tokens(first, 0) == (5 * B, True)
    decode.update_state_after_alloc(first, list(range(6)), 5 * B)
    assert decode.get_num_new_matched_tokens(second, 0) is None  # ask again after the load
    decode.update_connector_output(KVConnectorOutput(finished_loads={"a"}))
    assert decode.get_num_new_matched_tokens(second, 5 * B) == (0, False)  # now a local prefix hit


def test_a_failed_load_counts_and_releases(decode: PDConnectorScheduler) -> None:
    req = request("r", handle())
    decode.get_num_new_matched_tokens(req, 0)
    decode.update_state_after_alloc(req, list(range(6)), 5 * B)
    meta(decode)
    decode.update_connector_output(KVConnectorOutput(failed_loads={"r"}))
    assert decode.counters()["pull_failures"] == 1
    assert len(meta(decode).remote_releases) == 1


def test_a_late_load_is_cancelled_and_released(decode: PDConnectorScheduler) -> None:
    req = request("r", handle())
    decode.get_num_new_matched_tokens(req, 0)
    decode.update_state_after_alloc(req, list(range(6)), 5 * B)
    meta(decode)
    assert decode.timed_out_loads(now=0.0) == []
    assert decode.timed_out_loads(now=1e12) == ["r"]
    step = meta(decode)
    assert step.cancels == ["r"] and len(step.remote_releases) == 1
    assert decode.counters()["pull_failures"] == 1 and decode.pending_work() is None


def test_aborting_a_loading_request_cancels_its_load(decode: PDConnectorScheduler) -> None:
    req = request("r", handle())
    decode.get_num_new_matched_tokens(req, 0)
    decode.update_state_after_alloc(req, list(range(6)), 5 * B)
    meta(decode)
    req.status = RequestStatus.FINISHED_ABORTED
    assert decode.request_finished(req, list(range(6))).num_blocks == 0
    step = meta(decode)
    assert step.cancels == ["r"] and len(step.remote_releases) == 1


def test_a_malformed_handle_means_computing_here(decode: PDConnectorScheduler) -> None:
    req = request("r", {"do_remote_prefill": True, "transfer_id": "x"})
    assert decode.get_num_new_matched_tokens(req, 0) == (0, False)
    assert decode.counters()["pull_failures"] == 1


def test_prefill_side_holds_the_prompt_under_a_lease(prefill: PDConnectorScheduler) -> None:
    req = request("p", {"do_remote_decode": True}, first_token=None)
    req.status = RequestStatus.FINISHED_LENGTH
    decision = prefill.request_finished(req, [10, 11, 12, 13, 14, 15])
    assert decision.num_blocks == 5  # the full prompt blocks, not the partial one
    params = decision.kv_transfer_params
    assert params["transfer_id"] == decision.hold_id and decision.hold_id.startswith("p-")
    assert params["block_hashes"] == req.block_hashes[:5] and params["port"] == 5555
    assert params["expires_in"] == 30.0
    step = meta(prefill)
    assert [(h.lease_id, h.block_ids) for h in step.holds] == [(decision.hold_id, [10, 11, 12, 13, 14])]
    assert prefill.counters()["held"] == 1 and prefill.pending_work() is not None
    prefill.release(decision.hold_id)  # the server found nobody will read it
    assert meta(prefill).releases == [decision.hold_id]
    prefill.update_connector_output(KVConnectorOutput(finished_holds={decision.hold_id}))
    assert prefill.counters()["held"] == 0 and prefill.pending_work() is None


def test_leases_are_unique_per_handoff(prefill: PDConnectorScheduler) -> None:
    ids = set()
    for _ in range(2):
        req = request("p", {"do_remote_decode": True}, first_token=None)
        req.status = RequestStatus.FINISHED_LENGTH
        ids.add(prefill.request_finished(req, list(range(6))).hold_id)
    assert len(ids) == 2  # a stale handle for a reused request id never names a new lease


def test_no_hold_when_aborted_or_without_a_source(prefill: PDConnectorScheduler,
                                                  decode: PDConnectorScheduler) -> None:
    req = request("p", {"do_remote_decode": True}, first_token=None)
    req.status = RequestStatus.FINISHED_ABORTED
    assert prefill.request_finished(req, list(range(6))).num_blocks == 0
    req.status = RequestStatus.FINISHED_LENGTH
    assert decode.request_finished(req, list(range(6))).num_blocks == 0  # --role decode serves none


def test_without_the_cluster_secret_a_decode_worker_offers_nothing() -> None:
    """No secret, no peers: a handle could only have come from someone who is not one."""
    connector = PDConnectorScheduler(KVTransferConfig(connectors=("pd",), role="decode"), B)
    assert connector.get_num_new_matched_tokens(request("r", handle()), 0) == (0, False)


def test_a_held_prompt_is_handed_over_by_lease_and_source_only(prefill: PDConnectorScheduler) -> None:
    """Block ids and the shared-memory file stay with the source: a handle cannot name them."""
    req = request("p", {"do_remote_decode": True}, first_token=None)
    req.status = RequestStatus.FINISHED_LENGTH
    decision = prefill.request_finished(req, list(range(10, 15)))
    assert set(decision.kv_transfer_params) == {"transfer_id", "host", "port", "block_hashes", "expires_in"}
    assert meta(prefill).holds[0].block_ids == list(range(10, 15))
