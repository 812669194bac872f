"""One rank of a multi-process engine: a Worker answering its executor's calls.

Started by tandem.executor.multiproc as `python -m tandem.executor.rank_process`. It
joins the torch.distributed group (gloo on CPU, NCCL on CUDA), then serves calls from its
PAIR socket until told to shut down, its parent disappears, or a call fails: a failure is
reported to the executor, which stops the engine. After loading, the ranks check over the
group that they hold the same weights, so the collectives later issues add are known to run.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import pickle
import signal
import socket
import time
import traceback
from datetime import timedelta
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from tandem.executor.ranks import HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS

logger = logging.getLogger("tandem.worker.rank")

_IDLE_POLL_MS = 1000


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tandem.executor.rank_process")
    parser.add_argument("--address", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--dist-url", required=True, help="torch.distributed rendezvous, tcp://HOST:PORT")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--join-timeout", type=float, default=120.0)
    parser.add_argument("--log-level", type=int, default=logging.INFO)
    return parser.parse_args(argv)


def _init_distributed(args: argparse.Namespace, backend: str) -> None:
    import torch
    import torch.distributed as dist

    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not args.dist_url.startswith("tcp://127."):
        _choose_interface(args.dist_url)
    dist.init_process_group(backend, init_method=args.dist_url, rank=args.rank,
                            world_size=args.world_size, timeout=timedelta(minutes=10))


def _local_address(url: str) -> str:
    """This host's address on the route to `url` (tcp://HOST:PORT), or "local" for ipc."""
    if not url.startswith("tcp://"):
        return "local"
    host, _, port = url.removeprefix("tcp://").rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, int(port)))  # UDP: picks a route, sends nothing
        return probe.getsockname()[0]


def _choose_interface(dist_url: str) -> None:
    """Across hosts, gloo must listen on the interface that reaches the others; by default
    it takes the address the host name resolves to, which in a container or a network
    namespace may be nowhere the peers can reach. The interface that routes to the master
    is the one: set GLOO_SOCKET_IFNAME to it unless the operator already chose."""
    import psutil

    if "GLOO_SOCKET_IFNAME" in os.environ:
        return
    local = _local_address(dist_url)
    host = dist_url.removeprefix("tcp://").rpartition(":")[0]
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == local for a in addresses):
            os.environ["GLOO_SOCKET_IFNAME"] = name
            logger.info("gloo on interface %s (%s), the route to %s", name, local, host)
            return


def _tensor_parallel_group(config: Any, rank: int) -> Any:
    """This rank's tensor-parallel group: the default group while it is the whole world, else
    one new group per pipeline stage (every rank creates every group, in the same order)."""
    import torch.distributed as dist

    from tandem.distributed.layout import RankLayout

    parallel = config.parallel
    layout = RankLayout(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
    if layout.pipeline_parallel_size == 1 or layout.tensor_parallel_size == 1:
        return None
    mine = None
    for stage in range(layout.pipeline_parallel_size):
        ranks = layout.stage_ranks(stage)
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def _agree(value: float, what: str, group: Any = None) -> None:
    """Every rank of `group` holds the same `value`: the smallest and the largest agree."""
    import torch
    import torch.distributed as dist

    low = torch.tensor([value], dtype=torch.float64)
    high = low.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    if float(low) != float(high):
        raise RuntimeError(f"ranks loaded different {what} ({float(low)} .. {float(high)})")


def _check_same_model(worker: Any, fingerprint: str) -> None:
    """Every rank loaded the same model (the fingerprint of its files), and the ranks of a
    stage the same weights (a checksum of the norms they all hold whole)."""
    import xxhash

    _agree(float(xxhash.xxh32_intdigest(fingerprint.encode())), "models")
    if worker.tp.split:
        _agree(worker.weights_checksum(), "weights", worker.tp.group)
    elif worker.layout.world_size == 1:  # replicas: every rank holds the whole model
        _agree(worker.weights_checksum(), "weights")


def _picklable(exc: Exception) -> Exception | None:
    """The exception itself when it survives pickling, so the engine can raise the same type."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any failure means: send the text only
        return None
    return exc


class _Rank:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.worker: Any = None
        self.output_rank = 0

    def handle(self, method: str, args: tuple[Any, ...]) -> Any:
        if method == "init":
            import torch

            from tandem.worker.worker import Worker

            (config,) = args
            torch.set_num_threads(self.args.threads)
            _init_distributed(self.args, config.parallel.distributed_backend)
            self.worker = Worker(config, self.args.rank, self.args.world_size,
                                 _tensor_parallel_group(config, self.args.rank), owns_process=True)
            self.output_rank = self.worker.layout.output_rank
            return os.getpid()
        if method == "load_model":
            info = self.worker.load_model()
            _check_same_model(self.worker, info.fingerprint)
            return info
        if method == "initialize_cache":
            return self.worker.initialize_cache(*args)
        if method == "execute_model":
            result = self.worker.execute_model(*args)
            if self.args.rank != self.output_rank:
                result.sampled = {}  # the output rank's tokens are the step's
            return result
        if method == "rpc":
            from tandem.worker.worker import RPC_METHODS

            name, *rest = args
            if name not in RPC_METHODS:
                raise ValueError(f"{name!r} is not a worker RPC; one of {', '.join(RPC_METHODS)}")
            return getattr(self.worker, name)(*rest)
        raise ValueError(f"unknown call {method!r}")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine core decides when ranks stop
    logging.basicConfig(level=args.log_level, format=f"%(asctime)s %(levelname)s rank{args.rank} %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    context = zmq.Context()
    sock = context.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 1000)
    monitor = None
    if args.address.startswith("tcp://"):  # the engine is on another host: notice if it goes
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
    sock.connect(args.address)
    # Queued until connected; the executor waits for every rank's hello before it starts.
    sock.send(pickle.dumps(("ok", {"pid": os.getpid(), "host": socket.gethostname(),
                                   "address": _local_address(args.address)})))
    rank = _Rank(args)
    connected = heard = False
    started = time.monotonic()
    try:
        while True:
            if not sock.poll(_IDLE_POLL_MS):
                # Nothing to do: is the engine still there? (Messages first: a shutdown
                # arrives just before the connection closes.)
                while monitor is not None and monitor.poll(0):
                    event = recv_monitor_message(monitor)["event"]
                    if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                        connected = True
                    elif event == zmq.EVENT_DISCONNECTED and connected and not sock.poll(0):
                        logger.error("rank %d lost the engine at %s; exiting", args.rank, args.address)
                        return 1
                if os.getppid() != args.parent_pid:
                    logger.warning("the engine core (pid %d) is gone; rank %d exits", args.parent_pid, args.rank)
                    return 1
                if not heard and time.monotonic() - started > args.join_timeout:
                    logger.error("rank %d heard nothing from the engine at %s in %.0f s (is node 0 running, "
                                 "and can this host reach it?); exiting", args.rank, args.address, args.join_timeout)
                    return 1
                continue
            heard = True
            method, call_args = pickle.loads(sock.recv())
            if method == "shutdown":
                return 0
            try:
                reply = ("ok", rank.handle(method, call_args))
            except (ValueError, FileNotFoundError) as exc:  # a bad config or flag: its message says it
                logger.error("rank %d: %s failed: %s", args.rank, method, exc)
                reply = ("error", (_picklable(exc), f"{type(exc).__name__}: {exc}"))
                sock.send(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
                return 1
            except Exception as exc:
                logger.exception("rank %d: %s failed", args.rank, method)
                reply = ("error", (_picklable(exc), f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=5)}"))
                sock.send(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
                return 1
            sock.send(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
    finally:
        if rank.worker is not None:
            rank.worker.shutdown()
        with contextlib.suppress(Exception):  # best effort on the way out
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        if monitor is not None:
            sock.disable_monitor()
            monitor.close(0)
        sock.close()
        context.term()


if __name__ == "__main__":
    raise SystemExit(main())
