"""KV connectors by name: an open registry of what `KVTransferConfig.connectors` may list.

A connector registers under a name with its two sides (scheduler and worker, built lazily so
the engine core never imports a worker side's torch) and its own config section: the
`EngineConfig` attribute that configures it, which is also the key its counters are reported
under (`EngineLoad.connectors`, and from there `/load` and `/metrics`). Nothing outside a
connector's module needs to know what it is: the engine asks the chain, the server reads the
generic counters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tandem.config import EngineConfig
from tandem.kvcache.connector.base import (
    KVConnectorScheduler,
    KVConnectorWorker,
    MultiConnectorScheduler,
    MultiConnectorWorker,
)

SchedulerFactory = Callable[[EngineConfig], KVConnectorScheduler]
WorkerFactory = Callable[[EngineConfig, int], KVConnectorWorker]


@dataclass(frozen=True)
class ConnectorSpec:
    """One registered connector."""

    name: str  # what `KVTransferConfig.connectors` lists
    section: str  # its EngineConfig section; its counters are reported under this key
    scheduler: SchedulerFactory
    worker: WorkerFactory
    # On without being listed when this says so (e.g. the KV tiers, when any tier is on).
    implied_by: Callable[[EngineConfig], bool] | None = None


class ConnectorRegistry:
    """Connectors by name, in registration order (the order implied connectors chain in)."""

    def __init__(self) -> None:
        self._specs: dict[str, ConnectorSpec] = {}

    def register(self, spec: ConnectorSpec) -> None:
        if spec.name in self._specs:
            raise ValueError(f"KV connector {spec.name!r} is already registered")
        self._specs[spec.name] = spec

    def names(self) -> tuple[str, ...]:
        return tuple(self._specs)

    def sections(self) -> tuple[str, ...]:
        """The counter keys every engine reports (empty for a connector that is off)."""
        return tuple(dict.fromkeys(spec.section for spec in self._specs.values()))

    def chain(self, config: EngineConfig) -> tuple[ConnectorSpec, ...]:
        """The configured connectors, then those their own config turns on.

        The handoff goes first: a decode worker's request that arrives with a handle loads from
        its prefill worker (which releases its lease at once); the tiers serve every other one."""
        names = list(config.kv_transfer.connectors)
        unknown = [n for n in names if n not in self._specs]
        if unknown:
            raise ValueError(f"unknown KV connector(s) {', '.join(unknown)}; known: {', '.join(self._specs)}")
        names += [s.name for s in self._specs.values()
                  if s.name not in names and s.implied_by is not None and s.implied_by(config)]
        return tuple(self._specs[n] for n in names)


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


def builtin_registry() -> ConnectorRegistry:
    """The connectors tandem ships: the prefill/decode handoff and the KV tiers."""
    registry = ConnectorRegistry()
    registry.register(ConnectorSpec("pd", "kv_transfer", _pd_scheduler, _pd_worker))
    registry.register(ConnectorSpec("tiers", "kv_tiers", _tiers_scheduler, _tiers_worker,
                                    implied_by=lambda config: config.kv_tiers.enabled))
    return registry


# The registry engines build their connectors from; `register_connector` adds to it.
CONNECTORS = builtin_registry()


def register_connector(name: str, section: str, scheduler: SchedulerFactory, worker: WorkerFactory,
                       implied_by: Callable[[EngineConfig], bool] | None = None) -> None:
    """Make a connector available by name to `--kv-connector` (and to `connector_sections`)."""
    CONNECTORS.register(ConnectorSpec(name, section, scheduler, worker, implied_by))


def connector_names(config: EngineConfig, registry: ConnectorRegistry = CONNECTORS) -> tuple[str, ...]:
    return tuple(spec.name for spec in registry.chain(config))


def connector_sections(registry: ConnectorRegistry = CONNECTORS) -> tuple[str, ...]:
    return registry.sections()


def _built(spec: ConnectorSpec, side: KVConnectorScheduler) -> KVConnectorScheduler:
    if side.section != spec.section:
        raise TypeError(f"KV connector {spec.name!r} registered for section {spec.section!r} "
                        f"but its scheduler side reports under {side.section!r}")
    return side


def make_connector_scheduler(config: EngineConfig,
                             registry: ConnectorRegistry = CONNECTORS) -> KVConnectorScheduler | None:
    sides = [_built(spec, spec.scheduler(config)) for spec in registry.chain(config)]
    if not sides:
        return None
    return sides[0] if len(sides) == 1 else MultiConnectorScheduler(sides)


def make_connector_worker(config: EngineConfig, rank: int,
                          registry: ConnectorRegistry = CONNECTORS) -> KVConnectorWorker | None:
    sides = [spec.worker(config, rank) for spec in registry.chain(config)]
    if not sides:
        return None
    return sides[0] if len(sides) == 1 else MultiConnectorWorker(sides)
