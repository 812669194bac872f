"""`tandem serve --headless`: a host that only runs ranks for an engine on another host.

Node K of a multi-host engine starts its ranks ([K * R, (K + 1) * R)), which connect to node 0's
executor and join torch.distributed there (ranks.py), then waits. It serves no HTTP and holds
no scheduler: the engine on node 0 drives its ranks step by step. When any of its ranks exits
(the engine shut down, or lost a rank and stopped), the others are stopped too and the
command exits with that rank's code; Ctrl-C or SIGTERM stops them all.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time

from tandem.config import EngineConfig
from tandem.executor.ranks import (
    dist_init_url,
    node_ranks,
    rank_channel,
    spawn_rank,
    threads_per_rank,
)

logger = logging.getLogger(__name__)


def run_headless(config: EngineConfig) -> int:
    parallel = config.parallel
    if parallel.nnodes < 2 or parallel.node_rank == 0:
        raise ValueError("--headless runs the ranks of a node other than node 0 of a multi-host engine: "
                         "give --nnodes N (>= 2), --node-rank K (>= 1), --master-addr and --master-port")
    ranks = node_ranks(parallel, parallel.node_rank)
    threads = threads_per_rank(parallel, config.load.num_threads)
    dist_url = dist_init_url(parallel)
    procs = {rank: spawn_rank(parallel, rank, rank_channel(parallel, rank), dist_url, threads) for rank in ranks}
    logger.info("node %d of %d: ranks %d-%d (pids %s) joining the engine at %s", parallel.node_rank, parallel.nnodes,
                ranks.start, ranks.stop - 1, ", ".join(str(p.pid) for p in procs.values()), parallel.master_addr)
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stopping:
            ended = {rank: proc.returncode for rank, proc in procs.items() if proc.poll() is not None}
            if ended:
                rank, code = min(ended.items())
                logger.log(logging.INFO if code == 0 else logging.ERROR, "rank %d exited with code %d; node %d stops",
                           rank, code, parallel.node_rank)
                return code
            time.sleep(0.2)
        logger.info("node %d stops its ranks", parallel.node_rank)
        return 0
    finally:
        _stop_all(list(procs.values()))
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop_all(procs: list[subprocess.Popen[bytes]], grace: float = 5.0) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
