"""The executor seam: the engine core's only way to its workers.

The core never holds a model. It asks the executor to start the workers (each loads the model
and sizes its KV cache), to allocate every rank's cache for one agreed block count, and to
run each step's plain `SchedulerOutput` on every rank; it gets back one `ModelRunnerOutput`,
the output rank's sampled tokens with the ranks' KV connector reports merged. An executor
with one worker runs it in this process; one with many runs a process per rank, joined by
torch.distributed, which tensor / pipeline / expert parallelism fill in.

Under pipeline parallelism a step is a micro-batch that passes through the stages in turn,
so the core keeps up to `max_concurrent_batches` of them in flight: `submit` hands one to the
ranks without waiting and `collect` returns the oldest one's result (results come back in the
order the batches went out). Asynchronous scheduling (`runs_ahead`) uses the same two calls
with one rank: `submit` launches a step on the device and returns, `collect` waits for the
oldest one's tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from typing import TYPE_CHECKING, Any

from tandem.batch.scheduler_output import ModelRunnerOutput, SchedulerOutput
from tandem.config import EngineConfig

if TYPE_CHECKING:
    from tandem.worker.worker import WorkerInfo


class WorkerDiedError(RuntimeError):
    """A rank's process is gone: the engine cannot step any more."""


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._done: deque[ModelRunnerOutput] = deque()

    @property
    def world_size(self) -> int:
        return self.config.parallel.world_size

    @property
    def recovers_from_step_errors(self) -> bool:
        """Whether a step that raised leaves every rank able to run the next one. Only an
        executor whose one rank runs in this process can tell: with several ranks, one that
        raised mid-forward may leave the others waiting in a collective."""
        return False

    @property
    def max_concurrent_batches(self) -> int:
        """Micro-batches worth keeping in flight: one per pipeline stage."""
        return 1

    @property
    def runs_ahead(self) -> bool:
        """Asynchronous scheduling: the steps in flight are consecutive steps of the same
        requests, the later ones taking their inputs from the earlier ones' samples on the
        device (EngineConfig.runs_ahead), not pipeline micro-batches of different requests."""
        return False

    def submit(self, out: SchedulerOutput) -> None:
        """Start a step; its result comes from a later `collect`. Here: run it now."""
        self._done.append(self.execute_model(out))

    def collect(self) -> ModelRunnerOutput:
        """The result of the oldest submitted step, waiting for it if need be."""
        return self._done.popleft().resolve()

    @abstractmethod
    def start(self) -> list[WorkerInfo]:
        """Start the workers and load the model on each; one report per rank."""

    @abstractmethod
    def initialize_cache(self, num_blocks: int) -> list[dict[str, Any]]:
        """Allocate every rank's KV cache; the connectors' handshake info, per rank."""

    @abstractmethod
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; the output rank's result, connector reports merged."""

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call `method` (one of the worker's RPC_METHODS) on every rank; replies in rank order."""

    def check_health(self) -> None:  # noqa: B027 - nothing to check in-process
        """Raise WorkerDiedError if a rank is gone."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every worker; no process is left behind."""
