"""N ranks, one process each, joined by torch.distributed (gloo on CPU, NCCL on CUDA).

Each rank runs `python -m tandem.worker.rank_process` and talks to this executor over a ZMQ
PAIR socket of its own: a call (method name and arguments) goes to every rank at once, and
the executor waits for every reply while watching the processes, so a rank that dies turns
into a `WorkerDiedError` naming it instead of a hang. The output rank (rank 0, or the first
rank of the last pipeline stage) samples: its tokens are the step's; the others answer with
their KV connector reports only. The ranks' collectives and the pipeline's sends run over
torch.distributed among themselves; the executor is not a member of the group. Steps may be
submitted before earlier ones are collected (pipeline parallelism): each socket delivers
its rank's replies in order, so the oldest step's replies are the next ones read.

Children die with this process (PR_SET_PDEATHSIG on Linux, and they also watch their parent
pid), and `shutdown` stops them all, so no rank outlives the engine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any

import zmq

from tandem.config import EngineConfig
from tandem.distributed.layout import RankLayout
from tandem.engine.executor.base import Executor, WorkerDiedError
from tandem.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from tandem.kvcache.connector.base import KVOutputAggregator

if TYPE_CHECKING:
    from tandem.worker.worker import WorkerInfo

logger = logging.getLogger(__name__)

_POLL_MS = 100
_START_TIMEOUT_S = 900.0  # a first start may convert a GGUF
_STOP_GRACE_S = 5.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """In the child, before exec: get SIGKILL when the parent (the engine core) dies."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _rank_error(rank: int, exc: Exception | None, text: str) -> Exception:
    """A rank's failure as the engine raises it: the same exception type when it could be
    sent (a missing model stays a FileNotFoundError), else a RuntimeError with its text."""
    if exc is None:
        return RuntimeError(f"rank {rank} failed: {text}")
    exc.add_note(f"(raised on rank {rank})")
    return exc


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.aggregator = KVOutputAggregator(self.world_size)
        self._dir = tempfile.mkdtemp(prefix="tandem-ranks-")
        self._context = zmq.Context()
        self._sockets: list[zmq.Socket] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        self._poller = zmq.Poller()
        self._dead: str | None = None
        self._in_flight = 0
        parallel = config.parallel
        self._output_rank = RankLayout(parallel.tensor_parallel_size, parallel.pipeline_parallel_size).output_rank

    # --- life cycle -----------------------------------------------------------------
    def start(self) -> list[WorkerInfo]:
        world = self.world_size
        dist_port = _free_port()
        threads = self.config.load.num_threads or max(1, (os.cpu_count() or 1) // world)
        for rank in range(world):
            sock = self._context.socket(zmq.PAIR)
            sock.setsockopt(zmq.LINGER, 0)
            address = f"ipc://{self._dir}/rank{rank}"
            sock.bind(address)
            self._sockets.append(sock)
            self._poller.register(sock, zmq.POLLIN)
            argv = [sys.executable, "-m", "tandem.worker.rank_process", "--address", address,
                    "--rank", str(rank), "--world-size", str(world), "--dist-port", str(dist_port),
                    "--parent-pid", str(os.getpid()), "--threads", str(threads),
                    "--log-level", str(logging.getLogger("tandem").getEffectiveLevel())]
            self._procs.append(subprocess.Popen(argv, preexec_fn=_die_with_parent))
        logger.info("started %d ranks (pids %s), torch.distributed on 127.0.0.1:%d", world,
                    ", ".join(str(p.pid) for p in self._procs), dist_port)
        try:
            self._broadcast("init", self.config)
            self._gather(_START_TIMEOUT_S)
            infos = self._call("load_model", timeout=_START_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        return infos

    def initialize_cache(self, num_blocks: int) -> list[dict[str, Any]]:
        return self._call("initialize_cache", num_blocks, timeout=_START_TIMEOUT_S)

    @property
    def max_concurrent_batches(self) -> int:
        return self.config.parallel.pipeline_parallel_size

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(out)
        return self.collect()

    def submit(self, out: SchedulerOutput) -> None:
        # Every rank gets every step; each works through its socket's calls in order, so a
        # stage starts the next micro-batch as soon as it has handed this one on.
        self._broadcast("execute_model", out)
        self._in_flight += 1

    def collect(self) -> ModelRunnerOutput:
        if not self._in_flight:
            raise RuntimeError("collect() without a submitted step")
        results: list[ModelRunnerOutput] = self._gather()
        self._in_flight -= 1
        output = results[self._output_rank]
        if output.kv_connector_output is not None:
            output.kv_connector_output = self.aggregator.aggregate([r.kv_connector_output for r in results])
        return output

    def check_health(self) -> None:
        for rank, proc in enumerate(self._procs):
            code = proc.poll()
            if code is not None:
                self._dead = f"rank {rank} (pid {proc.pid}) exited with code {code}"
                raise WorkerDiedError(f"{self._dead}; the engine stops")

    def shutdown(self) -> None:
        for rank, proc in enumerate(self._procs):
            if proc.poll() is None:
                with contextlib.suppress(zmq.ZMQError):
                    self._sockets[rank].send(pickle.dumps(("shutdown", ())), zmq.NOBLOCK)
        deadline = time.monotonic() + _STOP_GRACE_S
        for proc in self._procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(2)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for sock in self._sockets:
            sock.close(0)
        self._sockets, self._procs = [], []
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    # --- calls ----------------------------------------------------------------------
    def _broadcast(self, method: str, *args: Any) -> None:
        if self._dead is not None:
            raise WorkerDiedError(f"{self._dead}; the engine stops")
        self.check_health()
        payload = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        for sock in self._sockets:
            # A PAIR socket whose peer is gone blocks a send: never wait without looking.
            while True:
                try:
                    sock.send(payload, zmq.NOBLOCK)
                    break
                except zmq.Again:
                    self.check_health()
                    time.sleep(0.001)

    def _gather(self, timeout: float | None = None) -> list[Any]:
        """Every rank's reply, in rank order; raises if a rank failed, died or timed out."""
        pending = set(range(len(self._sockets)))
        replies: list[Any] = [None] * len(self._sockets)
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            ready = dict(self._poller.poll(_POLL_MS))
            for rank in sorted(pending):
                if self._sockets[rank] in ready:
                    status, value = pickle.loads(self._sockets[rank].recv())
                    if status == "error":
                        # A rank that lost its peer mid-collective reports the broken
                        # connection; the peer's death is the cause worth naming.
                        self.check_health()
                        raise _rank_error(rank, *value)
                    replies[rank] = value
                    pending.discard(rank)
            if pending:
                self.check_health()
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"ranks {sorted(pending)} did not answer in {timeout:.0f} s")
        return replies

    def _call(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        self._broadcast(method, *args)
        return self._gather(timeout)
