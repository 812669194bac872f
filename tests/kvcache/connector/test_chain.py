"""Chained connectors and the merge of the ranks' reports (torch-free units)."""

from __future__ import annotations

from typing import Any

from tandem.kvcache.connector.base import (
    NO_HOLD,
    HoldDecision,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVConnectorWorker,
    KVOutputAggregator,
    MultiConnectorScheduler,
    MultiConnectorWorker,
)
from tandem.types import Request, SamplingParams


class Offering(KVConnectorScheduler):
    def __init__(self, name: str, tokens: int | None, hold: int = 0) -> None:
        self.name, self.tokens, self.hold = name, tokens, hold
        self.allocated: list[tuple[str, int]] = []
        self.finished: list[str] = []

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool] | None:
        return None if self.tokens is None else (self.tokens, True)

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        self.allocated.append((request.request_id, num_external_tokens))

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return f"{self.name}-meta"

    def request_finished(self, request: Request, block_ids: list[int]) -> HoldDecision:
        self.finished.append(request.request_id)
        if self.hold:
            return HoldDecision(self.hold, f"{self.name}-hold", {self.name: True})
        return HoldDecision(0, None, {self.name: False})


class Reporting(KVConnectorWorker):
    def __init__(self, out: KVConnectorOutput) -> None:
        self.out = out
        self.metas: list[Any] = []

    def start_load_kv(self, metadata: Any) -> None:
        self.metas.append(metadata)

    def get_finished(self) -> KVConnectorOutput:
        return self.out


def request() -> Request:
    return Request("r", list(range(20)), SamplingParams())


def test_the_first_connector_that_offers_tokens_loads_them() -> None:
    empty, tier = Offering("empty", 0), Offering("tier", 8)
    chain = MultiConnectorScheduler([empty, tier])
    assert chain.get_num_new_matched_tokens(request(), 0) == (8, True)
    chain.update_state_after_alloc(request(), [1, 2, 3], 8)
    assert tier.allocated == [("r", 8)] and empty.allocated == []
    assert chain.build_connector_meta(None) == ["empty-meta", "tier-meta"]


def test_a_connector_that_cannot_tell_yet_makes_the_chain_wait() -> None:
    assert MultiConnectorScheduler([Offering("a", None), Offering("b", 8)]).get_num_new_matched_tokens(
        request(), 0) is None
    assert MultiConnectorScheduler([Offering("a", 0), Offering("b", 0)]).get_num_new_matched_tokens(
        request(), 0) == (0, False)


def test_every_connector_sees_the_end_and_one_may_hold() -> None:
    plain, holder = Offering("plain", 0), Offering("holder", 0, hold=3)
    decision = MultiConnectorScheduler([plain, holder]).request_finished(request(), [1, 2, 3, 4])
    assert (decision.num_blocks, decision.hold_id) == (3, "holder-hold")
    assert decision.kv_transfer_params == {"plain": False, "holder": True}
    assert plain.finished == holder.finished == ["r"]
    assert MultiConnectorScheduler([]).request_finished(request(), []) == NO_HOLD


def test_two_holders_share_one_composite_hold_that_ends_with_both() -> None:
    chain = MultiConnectorScheduler([Offering("a", 0, hold=2), Offering("b", 0, hold=4)])
    decision = chain.request_finished(request(), [1, 2, 3, 4])
    assert (decision.num_blocks, decision.hold_id) == (4, "a-hold+b-hold")
    first = KVConnectorOutput(finished_holds={"a-hold"})
    chain.update_connector_output(first)
    assert "a-hold+b-hold" not in first.finished_holds  # b still copies
    second = KVConnectorOutput(finished_holds={"b-hold"})
    chain.update_connector_output(second)
    assert "a-hold+b-hold" in second.finished_holds


def test_worker_sides_get_their_own_metadata_and_their_reports_merge() -> None:
    first = Reporting(KVConnectorOutput(finished_loads={"a"}, counters={"x": 1}))
    second = Reporting(KVConnectorOutput(failed_loads={"b"}, finished_holds={"h"}, counters={"y": 2}))
    chain = MultiConnectorWorker([first, second])
    chain.start_load_kv(["m1", "m2"])
    assert first.metas == ["m1"] and second.metas == ["m2"]
    out = chain.get_finished()
    assert (out.finished_loads, out.failed_loads, out.finished_holds) == ({"a"}, {"b"}, {"h"})
    assert out.counters == {"x": 1, "y": 2}


def test_a_load_is_done_when_every_rank_says_so_and_failed_if_any_failed() -> None:
    merge = KVOutputAggregator(world_size=2)
    out = merge.aggregate([KVConnectorOutput(finished_loads={"a", "b"}, counters={"n": 1}),
                           KVConnectorOutput(failed_loads={"b"}, counters={"n": 9})])
    assert out.finished_loads == set() and out.failed_loads == {"b"}  # a waits for rank 1
    assert out.counters == {"n": 1}  # the output rank's
    out = merge.aggregate([KVConnectorOutput(finished_holds={"h"}), KVConnectorOutput(finished_loads={"a"})])
    assert out.finished_loads == {"a"} and out.finished_holds == set()
    out = merge.aggregate([KVConnectorOutput(), KVConnectorOutput(finished_holds={"h"})])
    assert out.finished_holds == {"h"}
    single = KVConnectorOutput(finished_loads={"z"})
    assert KVOutputAggregator(world_size=1).aggregate([single]) is single
