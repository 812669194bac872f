"""The worker calls its KV connector around the forward pass in the order the contract says."""

from __future__ import annotations

from typing import Any

from tandem.batch.scheduler_output import ModelRunnerOutput, SchedulerOutput
from tandem.config import EngineConfig
from tandem.kvcache.connector.base import KVConnectorOutput, KVConnectorWorker
from tandem.worker.worker import Worker


class Recording(KVConnectorWorker):
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def start_load_kv(self, metadata: Any) -> None:
        self.calls.append(f"start_load_kv({metadata})")

    def wait_for_load(self) -> None:
        self.calls.append("wait_for_load")

    def save_kv(self, metadata: Any) -> None:
        self.calls.append(f"save_kv({metadata})")

    def wait_for_save(self) -> None:
        self.calls.append("wait_for_save")

    def get_finished(self) -> KVConnectorOutput:
        self.calls.append("get_finished")
        return KVConnectorOutput(finished_loads={"r"})


class Runner:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.calls.append("forward")
        return ModelRunnerOutput()


def test_loads_before_the_forward_saves_after_and_the_report_comes_back() -> None:
    calls: list[str] = []
    worker = Worker(EngineConfig("smollm2-135m"))
    worker.runner, worker.connector = Runner(calls), Recording(calls)  # type: ignore[assignment]
    result = worker.execute_model(SchedulerOutput(kv_connector_metadata="m"))
    assert calls == ["start_load_kv(m)", "wait_for_load", "forward", "save_kv(m)", "wait_for_save", "get_finished"]
    assert result.kv_connector_output is not None and result.kv_connector_output.finished_loads == {"r"}


def test_without_a_connector_there_is_no_report() -> None:
    calls: list[str] = []
    worker = Worker(EngineConfig("smollm2-135m"))
    worker.runner = Runner(calls)  # type: ignore[assignment]
    assert worker.execute_model(SchedulerOutput()).kv_connector_output is None and calls == ["forward"]
