"""One rank of a multi-process engine: a Worker answering its executor's calls.

Started by tandem.engine.executor.multiproc as `python -m tandem.worker.rank_process`. It
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
import traceback
from datetime import timedelta
from typing import Any

import zmq

logger = logging.getLogger("tandem.worker.rank")

_IDLE_POLL_MS = 1000


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tandem.worker.rank_process")
    parser.add_argument("--address", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--dist-port", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--log-level", type=int, default=logging.INFO)
    return parser.parse_args(argv)


def _init_distributed(args: argparse.Namespace, backend: str) -> None:
    import torch
    import torch.distributed as dist

    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{args.dist_port}", rank=args.rank,
                            world_size=args.world_size, timeout=timedelta(minutes=10))


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
                                 _tensor_parallel_group(config, self.args.rank))
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
        raise ValueError(f"unknown call {method!r}")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine core decides when ranks stop
    logging.basicConfig(level=args.log_level, format=f"%(asctime)s %(levelname)s rank{args.rank} %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    context = zmq.Context()
    sock = context.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(args.address)
    rank = _Rank(args)
    try:
        while True:
            if not sock.poll(_IDLE_POLL_MS):
                if os.getppid() != args.parent_pid:
                    logger.warning("the engine core (pid %d) is gone; rank %d exits", args.parent_pid, args.rank)
                    return 1
                continue
            method, call_args = pickle.loads(sock.recv())
            if method == "shutdown":
                return 0
            try:
                reply = ("ok", rank.handle(method, call_args))
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
        sock.close()
        context.term()


if __name__ == "__main__":
    raise SystemExit(main())
