"""N ranks, one process each, joined by torch.distributed (gloo on CPU, NCCL on CUDA).

Each rank runs `python -m tandem.executor.rank_process` and talks to this executor over a ZMQ
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
import pickle
import shutil
import subprocess
import tempfile
import time
from typing import TYPE_CHECKING, Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from tandem.batch.scheduler_output import ModelRunnerOutput, SchedulerOutput
from tandem.config import EngineConfig
from tandem.distributed.layout import RankLayout
from tandem.executor.base import Executor, WorkerDiedError
from tandem.executor.ranks import (
    HEARTBEAT_IVL_MS,
    HEARTBEAT_TIMEOUT_MS,
    dist_init_url,
    node_ranks,
    rank_channel,
    spawn_rank,
    threads_per_rank,
)
from tandem.kvcache.connector.base import KVOutputAggregator
from tandem.platform.ports import free_port

if TYPE_CHECKING:
    from tandem.worker.worker import WorkerInfo

logger = logging.getLogger(__name__)

_POLL_MS = 100
_START_TIMEOUT_S = 900.0  # a first start may convert a GGUF
_STOP_GRACE_S = 5.0


def _rank_error(rank: int, exc: Exception | None, text: str) -> Exception:
    """A rank's failure as the engine raises it: the same exception type when it could be
    sent (a missing model stays a FileNotFoundError), else a RuntimeError with its text."""
    if exc is None:
        return RuntimeError(f"rank {rank} failed: {text}")
    exc.add_note(f"(raised on rank {rank})")
    return exc


def _broken_connection(text: str) -> bool:
    return any(sign in text for sign in ("Connection closed by peer", "Connection reset", "Broken pipe"))


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
        self._channels: list[str] = []
        self._monitors: dict[int, zmq.Socket] = {}  # rank on another host -> its connection events
        self._joined: set[int] = set()
        parallel = config.parallel
        self._output_rank = RankLayout(parallel.tensor_parallel_size, parallel.pipeline_parallel_size).output_rank

    # --- life cycle -----------------------------------------------------------------
    def start(self) -> list[WorkerInfo]:
        parallel = self.config.parallel
        world = self.world_size
        dist_url = dist_init_url(parallel, free_port())
        threads = threads_per_rank(parallel, self.config.load.num_threads)
        local = node_ranks(parallel, 0)
        for rank in range(world):
            sock = self._context.socket(zmq.PAIR)
            sock.setsockopt(zmq.LINGER, 0)
            channel = rank_channel(parallel, rank, self._dir)
            if channel.startswith("tcp://"):
                sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
                sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
                if rank not in local:  # a rank on another host: watch its connection
                    self._monitors[rank] = sock.get_monitor_socket(
                        zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
            try:
                sock.bind(channel)
            except zmq.ZMQError as exc:
                raise OSError(f"cannot listen for rank {rank} on {channel}: {exc} (is --master-addr "
                              "an address of this host, and the port free?)") from exc
            self._sockets.append(sock)
            self._channels.append(channel)
            self._poller.register(sock, zmq.POLLIN)
        for rank in local:
            self._procs.append(spawn_rank(parallel, rank, self._channels[rank], dist_url, threads))
        logger.info("started %d of %d ranks here (pids %s), torch.distributed at %s", len(local), world,
                    ", ".join(str(p.pid) for p in self._procs), dist_url)
        try:
            self._wait_for_ranks(parallel.join_timeout)
            self._broadcast("init", self.config)
            self._gather(_START_TIMEOUT_S)
            infos = self._call("load_model", timeout=_START_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        return infos

    def _wait_for_ranks(self, timeout: float) -> None:
        """Every rank says hello once it has connected: a rank on a host that cannot reach
        this one, or never started, fails start-up with the address it should have used."""
        try:
            hellos = self._gather(timeout)
        except TimeoutError:
            missing = [rank for rank in range(self.world_size) if rank not in self._joined]
            where = ", ".join(f"rank {r} at {self._channels[r]}" for r in missing)
            raise TimeoutError(
                f"ranks {missing} did not join in {timeout:.0f} s ({where}); start the other nodes with "
                "`tandem serve --headless --nnodes N --node-rank K --master-addr ADDR --master-port PORT` "
                "and check that they can reach this host"
            ) from None
        if self.config.parallel.nnodes > 1:
            logger.info("all %d ranks joined: %s", self.world_size, ", ".join(
                f"rank {rank} on {hello['host']} ({hello['address']})" for rank, hello in enumerate(hellos)))

    def initialize_cache(self, num_blocks: int) -> list[dict[str, Any]]:
        return self._call("initialize_cache", num_blocks, timeout=_START_TIMEOUT_S)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        if self._in_flight:
            raise RuntimeError("collective_rpc with steps in flight: collect them first")
        return self._call("rpc", method, *args, timeout=_START_TIMEOUT_S)

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

    def check_health(self, besides: int | None = None) -> None:
        """Raise WorkerDiedError if a rank (other than `besides`) is gone."""
        for rank, proc in enumerate(self._procs):
            code = proc.poll()
            if code is not None and rank != besides:
                self._dead = f"rank {rank} (pid {proc.pid}) exited with code {code}"
                raise WorkerDiedError(f"{self._dead}; the engine stops")
        for rank, monitor in self._monitors.items():
            while monitor.poll(0):
                event = recv_monitor_message(monitor)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._joined.add(rank)
                elif event == zmq.EVENT_DISCONNECTED and rank in self._joined and rank != besides:
                    self._dead = f"rank {rank} on another host lost its connection ({self._channels[rank]})"
                    raise WorkerDiedError(f"{self._dead}; the engine stops")

    def shutdown(self) -> None:
        for rank, sock in enumerate(self._sockets):
            if rank >= len(self._procs) or self._procs[rank].poll() is None:  # remote ranks: tell them too
                with contextlib.suppress(zmq.ZMQError):
                    sock.send(pickle.dumps(("shutdown", ())), zmq.NOBLOCK)
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
        for rank, sock in enumerate(self._sockets):
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            # A remote rank's shutdown must leave this host before the socket goes.
            sock.close(1000 if rank in self._monitors else 0)
        for monitor in self._monitors.values():
            monitor.close(0)
        self._monitors = {}
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
                    self._joined.add(rank)
                    if status == "error":
                        raise self._root_cause(rank, value, pending - {rank})
                    replies[rank] = value
                    pending.discard(rank)
            if pending:
                self.check_health()
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"ranks {sorted(pending)} did not answer in {timeout:.0f} s")
        return replies

    def _root_cause(self, failed: int, error: tuple, others: set[int], grace: float = 1.0) -> Exception:
        """The error worth raising when rank `failed` reported one.

        A rank whose peer died mid-collective reports only a broken connection; the death is
        the cause to name. So for a moment watch for a rank killed by a signal or a host lost
        (a WorkerDiedError), and for the other ranks' own errors: one that is not about a
        broken connection explains more than one that is."""
        errors = {failed: error}
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            for rank, proc in enumerate(self._procs):
                code = proc.poll()
                if code is not None and code < 0:
                    self._dead = f"rank {rank} (pid {proc.pid}) exited with code {code}"
                    return WorkerDiedError(f"{self._dead}; the engine stops")
            try:
                self.check_health(besides=failed)
            except WorkerDiedError as died:
                if self._monitors:  # a lost host
                    return died
            for rank in sorted(others - errors.keys()):
                if self._sockets[rank].poll(0):
                    status, value = pickle.loads(self._sockets[rank].recv())
                    if status == "error":
                        errors[rank] = value
            if len(errors) > len(others):
                break
            time.sleep(0.05)
        rank = next((r for r, (_, text) in sorted(errors.items()) if not _broken_connection(text)), failed)
        return _rank_error(rank, *errors[rank])

    def _call(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        self._broadcast(method, *args)
        return self._gather(timeout)
