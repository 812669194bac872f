"""Where rank processes meet the engine, and how a host starts its share of them.

One host (`--nnodes 1`, the default): the executor starts every rank itself; each rank talks
to it over a private ipc socket, and torch.distributed meets on a free loopback port.

Several hosts (`--nnodes N`, torch.distributed's usual MASTER_ADDR / MASTER_PORT): node 0
runs the engine core and its own ranks; every other node runs `tandem serve --headless
--node-rank K` (headless.py), which starts that node's ranks. They all meet at node 0's
`--master-addr`: torch.distributed's store on `--master-port`, and rank r's channel to the
executor on `--master-port + 1 + r` (tcp, with heartbeats, so a lost host is noticed).
Node k holds ranks [k * R, (k + 1) * R), R = world / nnodes, so a stage's tensor-parallel
group stays on one host whenever R is a multiple of the tensor-parallel size.
Torch-free: the engine core starts ranks without importing torch.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from tandem.config import ParallelConfig

HEARTBEAT_IVL_MS = 1000  # zmq heartbeats on tcp channels: a silent host is lost after
HEARTBEAT_TIMEOUT_MS = 10_000


def node_ranks(parallel: ParallelConfig, node_rank: int) -> range:
    per_node = parallel.ranks_per_node
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def rank_channel(parallel: ParallelConfig, rank: int, ipc_dir: str | None = None) -> str:
    """The zmq address the executor binds for `rank` (and the rank connects to)."""
    if parallel.nnodes == 1:
        assert ipc_dir is not None
        return f"ipc://{ipc_dir}/rank{rank}"
    return f"tcp://{parallel.master_addr}:{parallel.master_port + 1 + rank}"


def dist_init_url(parallel: ParallelConfig, free_port: int | None = None) -> str:
    """torch.distributed's rendezvous: node 0's master address, or loopback on one host."""
    if parallel.nnodes == 1:
        return f"tcp://127.0.0.1:{parallel.master_port or free_port}"
    return f"tcp://{parallel.master_addr}:{parallel.master_port}"


def threads_per_rank(parallel: ParallelConfig, wanted: int | None) -> int:
    """--threads, or this host's cores shared by its ranks."""
    return wanted or max(1, (os.cpu_count() or 1) // parallel.ranks_per_node)


def die_with_parent() -> None:
    """In the child, before exec: get SIGKILL when the parent dies."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def spawn_rank(parallel: ParallelConfig, rank: int, channel: str, dist_url: str, threads: int) -> subprocess.Popen[bytes]:
    """Start `python -m tandem.executor.rank_process` for `rank`; it dies with this process."""
    argv = [sys.executable, "-m", "tandem.executor.rank_process", "--address", channel,
            "--rank", str(rank), "--world-size", str(parallel.world_size), "--dist-url", dist_url,
            "--parent-pid", str(os.getpid()), "--threads", str(threads),
            "--join-timeout", str(parallel.join_timeout),
            "--log-level", str(logging.getLogger("tandem").getEffectiveLevel())]
    return subprocess.Popen(argv, preexec_fn=die_with_parent)
