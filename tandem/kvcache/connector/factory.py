"""KV connectors by name: what `KVTransferConfig.connectors` may list, in chain order."""

from __future__ import annotations

from collections.abc import Callable

from tandem.config import EngineConfig
from tandem.kvcache.connector.base import (
    KVConnectorScheduler,
    KVConnectorWorker,
    MultiConnectorScheduler,
    MultiConnectorWorker,
)


def _pd_scheduler(config: EngineConfig) -> KVConnectorScheduler:
    from tandem.kvcache.connector.pd import PDConnectorScheduler

    return PDConnectorScheduler(config.kv_transfer, config.cache.block_size)


def _pd_worker(config: EngineConfig, rank: int) -> KVConnectorWorker:
    from tandem.kvcache.connector.pd import PDConnectorWorker

    return PDConnectorWorker(config.kv_transfer)


def _tiers_scheduler(config: EngineConfig) -> KVConnectorScheduler:
    from tandem.kvcache.connector.tiers import TiersConnectorScheduler

    return TiersConnectorScheduler(config)


def _tiers_worker(config: EngineConfig, rank: int) -> KVConnectorWorker:
    from tandem.kvcache.connector.tiers_worker import TiersConnectorWorker

    return TiersConnectorWorker(config, rank)


SCHEDULER_SIDES: dict[str, Callable[[EngineConfig], KVConnectorScheduler]] = {
    "pd": _pd_scheduler, "tiers": _tiers_scheduler}
WORKER_SIDES: dict[str, Callable[[EngineConfig, int], KVConnectorWorker]] = {
    "pd": _pd_worker, "tiers": _tiers_worker}


def connector_names(config: EngineConfig) -> tuple[str, ...]:
    """The chain: the configured connectors, then the KV tiers when any tier is on.

    The handoff goes first: a decode worker's request that arrives with a handle loads from its
    prefill worker (which releases its lease at once); the tiers serve every other request."""
    names = config.kv_transfer.connectors
    if config.kv_tiers.enabled and "tiers" not in names:
        names = (*names, "tiers")
    return names


def _check(names: tuple[str, ...]) -> None:
    unknown = [n for n in names if n not in SCHEDULER_SIDES]
    if unknown:
        raise ValueError(f"unknown KV connector(s) {', '.join(unknown)}; known: {', '.join(SCHEDULER_SIDES)}")


def make_connector_scheduler(config: EngineConfig) -> KVConnectorScheduler | None:
    names = connector_names(config)
    _check(names)
    sides = [SCHEDULER_SIDES[name](config) for name in names]
    if not sides:
        return None
    return sides[0] if len(sides) == 1 else MultiConnectorScheduler(sides)


def make_connector_worker(config: EngineConfig, rank: int) -> KVConnectorWorker | None:
    names = connector_names(config)
    _check(names)
    sides = [WORKER_SIDES[name](config, rank) for name in names]
    if not sides:
        return None
    return sides[0] if len(sides) == 1 else MultiConnectorWorker(sides)
