"""Which executor a config gets, and the errors for configs no executor can run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tandem.config import EngineConfig, ParallelConfig
from tandem.executor.factory import make_executor
from tandem.executor.multiproc import MultiprocExecutor
from tandem.executor.uniproc import InProcessExecutor


def _config(**parallel: object) -> EngineConfig:
    return EngineConfig("smollm2-135m", parallel=ParallelConfig(**parallel))  # type: ignore[arg-type]


def test_one_rank_runs_in_process_and_more_in_processes() -> None:
    assert isinstance(make_executor(_config()), InProcessExecutor)
    assert isinstance(make_executor(_config(world_size=2)), MultiprocExecutor)
    assert isinstance(make_executor(_config(executor_backend="mp")), MultiprocExecutor)


@pytest.mark.parametrize("parallel, message", [
    ({"world_size": 0}, "world size must be >= 1"),
    ({"world_size": 2, "executor_backend": "uni"}, "in-process executor runs one rank"),
    ({"executor_backend": "ray"}, "executor backend must be one of auto, uni, mp"),
])
def test_configs_no_executor_can_run_are_refused(parallel: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_executor(_config(**parallel))


def test_the_cli_reports_them_without_a_traceback() -> None:
    done = subprocess.run([sys.executable, "-m", "tandem", "generate", "-p", "Hi", "--world-size", "2",
                           "--distributed-executor-backend", "uni"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 2 and "in-process executor runs one rank" in done.stderr
    assert "Traceback" not in done.stderr
