"""The connector registry: open by name, each connector reporting under its own section."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.config import EngineConfig, KVTiersConfig, KVTransferConfig
from tandem.kvcache.connector.base import (
    KVConnectorOutput,
    KVConnectorScheduler,
    KVConnectorWorker,
    MultiConnectorScheduler,
)
from tandem.kvcache.connector.factory import (
    ConnectorRegistry,
    ConnectorSpec,
    builtin_registry,
    connector_names,
    connector_sections,
    make_connector_scheduler,
    make_connector_worker,
)
from tandem.types import EngineLoad, Request


class Lender(KVConnectorScheduler):
    name, section = "lender", "kv_lender"

    def __init__(self, held: int) -> None:
        self.held = held

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return None

    def counters(self) -> dict[str, Any]:
        return {"held": self.held, "lent": 3}


class LenderWorker(KVConnectorWorker):
    def start_load_kv(self, metadata: Any) -> None:
        pass

    def get_finished(self) -> KVConnectorOutput:
        return KVConnectorOutput()


def config(*connectors: str, tiers: bool = False) -> EngineConfig:
    return EngineConfig(model="m", kv_transfer=KVTransferConfig(connectors=connectors),
                        kv_tiers=KVTiersConfig(cpu_bytes=1 << 20 if tiers else 0))


def registry_with_lender() -> ConnectorRegistry:
    registry = builtin_registry()
    registry.register(ConnectorSpec("lender", "kv_lender", lambda c: Lender(2), lambda c, rank: LenderWorker()))
    return registry


def test_a_registered_connector_is_built_by_name() -> None:
    registry = registry_with_lender()
    side = make_connector_scheduler(config("lender"), registry)
    assert isinstance(side, Lender)
    assert isinstance(make_connector_worker(config("lender"), 0, registry), LenderWorker)
    assert "kv_lender" in registry.sections()


def test_an_unknown_connector_is_refused_with_the_known_names() -> None:
    with pytest.raises(ValueError, match="unknown KV connector.*known: pd, tiers"):
        make_connector_scheduler(config("nope"), builtin_registry())


def test_a_name_registers_once() -> None:
    registry = registry_with_lender()
    with pytest.raises(ValueError, match="already registered"):
        registry.register(ConnectorSpec("lender", "kv_other", lambda c: Lender(0), lambda c, r: LenderWorker()))


def test_a_side_that_reports_under_another_section_is_refused() -> None:
    registry = ConnectorRegistry()
    registry.register(ConnectorSpec("lender", "kv_transfer", lambda c: Lender(0), lambda c, r: LenderWorker()))
    with pytest.raises(TypeError, match="section"):
        make_connector_scheduler(config("lender"), registry)


def test_the_tiers_join_the_chain_when_a_tier_is_on() -> None:
    assert connector_names(config()) == ()
    assert connector_names(config(tiers=True)) == ("tiers",)
    assert connector_names(config("pd", tiers=True)) == ("pd", "tiers")
    assert make_connector_scheduler(config()) is None


def test_the_builtin_sections_are_the_load_keys_routers_read() -> None:
    assert connector_sections() == ("kv_transfer", "kv_tiers")


def test_a_chain_reports_each_connector_under_its_section_and_held_sums_them() -> None:
    chain = MultiConnectorScheduler([Lender(2), Offering(0)])
    counters = chain.counters_by_section()
    assert counters == {"kv_lender": {"held": 2, "lent": 3}, "kv_offering": {"held": 1}}
    load = EngineLoad(connectors=counters)
    assert load.kv_held == 3
    assert load.connector("kv_lender")["lent"] == 3 and load.connector("kv_absent") == {}


class Offering(Lender):
    name, section = "offering", "kv_offering"

    def counters(self) -> dict[str, Any]:
        return {"held": 1}
