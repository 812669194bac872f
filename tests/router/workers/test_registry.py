"""The worker registry without processes: the health state machine, and reloading the list."""

from __future__ import annotations

import httpx

from tandem.router.config import HealthPolicy, ScoringConfig, WorkerSpec
from tandem.router.workers.health import HealthMonitor
from tandem.router.workers.registry import (
    HealthState,
    LoadSnapshot,
    WorkerEndpoint,
    WorkerRegistry,
    other_block_sizes,
)

POLICY = HealthPolicy()


# --- health ----------------------------------------------------------------------------
def test_health_state_machine() -> None:
    state = HealthState(failures_to_down=3, successes_to_up=2)
    assert not state.healthy
    assert state.record(True) and state.healthy  # first probe: up at once
    assert not state.record(False) and not state.record(False)
    assert state.healthy
    assert state.record(False) and not state.healthy  # third failure in a row
    assert not state.record(True) and not state.healthy  # one success is not enough
    assert not state.record(False)
    assert not state.record(True)
    assert state.record(True) and state.healthy  # two in a row
    assert state.consecutive_failures == 0


def test_failures_interrupted_by_a_success_do_not_mark_down() -> None:
    state = HealthState(3, 2)
    state.record(True)
    for ok in (False, False, True, False, False):
        state.record(ok)
    assert state.healthy




def test_reload_keeps_the_state_of_workers_that_stay() -> None:
    a, b, c = (
        WorkerSpec("http://a", "decode"),
        WorkerSpec("http://b", "decode"),
        WorkerSpec("http://c", "prefill"),
    )
    registry = WorkerRegistry((a, b), POLICY)
    kept = registry.workers[0]
    kept.health.record(True)
    kept.in_flight = 2
    added, removed = registry.replace((a, c))
    assert [w.spec for w in added] == [c] and [w.spec for w in removed] == [b]
    assert registry.workers[0] is kept and kept.healthy and kept.in_flight == 2
    assert [w.spec for w in registry.pool(("prefill",), healthy_only=False)] == [c]


def test_a_worker_going_down_tells_whoever_waits_on_it() -> None:
    """The health monitor's down transition calls WorkerEndpoint.lost, which ends every wait on the
    worker (upstream.LostWatch); unregistered callbacks are not called."""
    registry = WorkerRegistry((WorkerSpec("http://a:1", "decode"),), POLICY)
    worker = registry.workers[0]
    monitor = HealthMonitor(registry, httpx.AsyncClient(), POLICY, ScoringConfig())
    calls: list[str] = []
    worker.watch_lost(lambda: calls.append("stream"))
    unwatch = worker.watch_lost(lambda: calls.append("gone"))
    unwatch()
    monitor.record(worker, True)
    for _ in range(POLICY.failures_to_down - 1):
        monitor.record(worker, False, "ConnectTimeout")
    assert calls == [] and worker.healthy
    monitor.record(worker, False, "ConnectTimeout")
    assert calls == ["stream"] and not worker.healthy
    monitor.record(worker, False, "ConnectTimeout")  # already down: no second call
    assert calls == ["stream"]


def test_workers_of_another_block_size_are_named_once_both_have_said() -> None:
    """A prefill worker can hand a decode worker its KV only in blocks of the same size."""
    policy = HealthPolicy()
    decode = WorkerEndpoint(WorkerSpec("http://d:1", "decode"), policy)
    same, other, silent = (WorkerEndpoint(WorkerSpec(f"http://p{i}:1", "prefill"), policy) for i in range(3))
    pool = [same, other, silent]
    assert decode.block_size is None and other_block_sizes(pool, decode) == frozenset()  # nothing known yet
    decode.on_load(LoadSnapshot.from_json({"block_size": 64}), 1.0, 0.0)
    same.on_load(LoadSnapshot.from_json({"block_size": 64}), 1.0, 0.0)
    other.on_load(LoadSnapshot.from_json({"block_size": 16}), 1.0, 0.0)
    silent.on_load(LoadSnapshot.from_json({"block_size": True}), 1.0, 0.0)  # not a size: unknown
    assert (decode.block_size, other.block_size, silent.block_size) == (64, 16, None)
    assert other_block_sizes(pool, decode) == frozenset({"http://p1:1"})
