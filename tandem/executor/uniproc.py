"""One worker inside the engine core's own process: no IPC, the default for one rank.

Under asynchronous scheduling (`EngineConfig.runs_ahead`) it keeps two steps in flight: `submit`
runs the worker's step, which on a GPU returns once the step is launched with its sampled
tokens still on their way to the host, and `collect` waits for them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tandem.batch.scheduler_output import ModelRunnerOutput, SchedulerOutput
from tandem.config import EngineConfig
from tandem.executor.base import Executor

if TYPE_CHECKING:
    from tandem.worker.worker import Worker, WorkerInfo


class InProcessExecutor(Executor):
    def __init__(self, config: EngineConfig, owns_process: bool = False) -> None:
        super().__init__(config)
        self.worker: Worker | None = None
        self.owns_process = owns_process

    @property
    def recovers_from_step_errors(self) -> bool:
        return True  # one rank, here: a step that raised left nothing waiting elsewhere

    @property
    def runs_ahead(self) -> bool:
        return self.config.runs_ahead

    @property
    def max_concurrent_batches(self) -> int:
        return 2 if self.runs_ahead else 1

    def start(self) -> list[WorkerInfo]:
        from tandem.worker.worker import Worker

        self.worker = Worker(self.config, owns_process=self.owns_process)
        return [self.worker.load_model()]

    def initialize_cache(self, num_blocks: int) -> list[dict[str, Any]]:
        assert self.worker is not None
        return [self.worker.initialize_cache(num_blocks)]

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        assert self.worker is not None
        return self.worker.execute_model(out).resolve()

    def submit(self, out: SchedulerOutput) -> None:
        assert self.worker is not None
        self._done.append(self.worker.execute_model(out))  # resolved by collect

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        from tandem.worker.worker import RPC_METHODS

        assert self.worker is not None
        if method not in RPC_METHODS:
            raise ValueError(f"{method!r} is not a worker RPC; one of {', '.join(RPC_METHODS)}")
        return [getattr(self.worker, method)(*args)]

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None
