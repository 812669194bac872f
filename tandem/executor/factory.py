"""Which executor an engine config asks for."""

from __future__ import annotations

from tandem.config import EXECUTOR_BACKENDS, EngineConfig
from tandem.executor.base import Executor


def make_executor(config: EngineConfig, owns_process: bool = False) -> Executor:
    """The executor for `config`. `owns_process`: this process is one tandem started for the
    engine core (not a caller's, as under `tandem.LLM`), so a worker inside it may freeze the
    cycle collector's start-up objects (platform/collector.py)."""
    parallel = config.parallel
    if parallel.executor_backend not in EXECUTOR_BACKENDS:
        raise ValueError(f"executor backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                         f"not {parallel.executor_backend!r}")
    if parallel.world_size < 1:
        raise ValueError(f"world size must be >= 1, got {parallel.world_size}")
    if parallel.node_rank != 0:
        raise ValueError(f"--node-rank {parallel.node_rank}: only node 0 runs the engine; start the other "
                         "nodes with `tandem serve --headless`")
    if parallel.uses_processes:
        from tandem.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    if parallel.world_size != 1:
        raise ValueError("the in-process executor runs one rank; use --distributed-executor-backend mp")
    from tandem.executor.uniproc import InProcessExecutor

    return InProcessExecutor(config, owns_process)
