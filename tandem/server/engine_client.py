"""The API server's handle on an engine core process.

It starts the core (`tandem.engine.core_process`) in a spawned process, talks to it over two ZMQ
IPC sockets, and hands each request's token deltas to the coroutine that is serving it.
A reader task routes the core's outputs; a watchdog notices a dead core so that waiting
requests fail fast instead of hanging and `/health` turns red.

This module imports no torch: the server process stays light, and the core alone pays
for the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

import zmq
import zmq.asyncio

from tandem.config import EngineConfig
from tandem.engine.core_process import run_engine_core
from tandem.engine.messages import (
    AbortRequests,
    AddRequest,
    CoreFailed,
    CoreOutputs,
    EngineInfo,
    FinishSequence,
    ReleaseTransfer,
    RequestDelta,
    ResetPrefixCache,
    Shutdown,
)
from tandem.kvcache.events import KVEventLog
from tandem.types import CacheRetention, EngineLoad, SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core process is gone; no request can be served."""


class EngineRequestError(ValueError):
    """The engine core refused a request (a validation the server did not catch)."""


@dataclass
class Handoff:
    """A request's part in a prefill/decode handoff (all empty for an ordinary request)."""

    # For the engine's KV connector: {"do_remote_decode": true} on the prefill side; the
    # prefill worker's handle plus {"do_remote_prefill": true} on the decode side.
    kv_transfer_params: dict[str, Any] | None = None
    prior_output_ids: list[int] = field(default_factory=list)  # decode side: the first token(s)
    emit_prior: bool = False  # decode side: also send the prior tokens' text to the client
    # A migrated stream: prior_output_ids[streamed_from:] reached the client through another
    # worker's stream, whose hold-back (stop strings) kept their text's tail from it. None: a
    # prefill worker's first token(s), whose text the client saw in full (or not at all).
    streamed_from: int | None = None

    @property
    def prefill_side(self) -> bool:
        return bool(self.kv_transfer_params and self.kv_transfer_params.get("do_remote_decode"))


@dataclass
class _Stream:
    queue: asyncio.Queue[RequestDelta | BaseException]
    started: bool = False  # the engine has reported on it (its first step ran)
    sequences: int = 1  # what it counts for admission until it starts
    tokens: int = 0


@dataclass
class _Reserved:
    """Admitted, not yet sent: counted as waiting from admission on, so that a burst of
    requests cannot all pass admission before the first of them is queued."""

    sequences: int
    tokens: int
    deadline: float  # a request that never reached the engine (its client left) stops counting


_RESERVATION_S = 30.0


class AsyncEngineClient:
    def __init__(self, process: BaseProcess, contexts: tuple[zmq.Context, zmq.asyncio.Context],
                 inputs: zmq.Socket, outputs: zmq.asyncio.Socket, info: EngineInfo, socket_dir: str) -> None:
        self.process = process
        self.info = info
        self.load = EngineLoad(kv_blocks_total=info.num_blocks)
        self.kv_events = KVEventLog(info.root_hash, info.block_size)
        self._contexts = contexts
        self._inputs = inputs
        self._outputs = outputs
        self._socket_dir = socket_dir
        self._streams: dict[str, _Stream] = {}
        self._reserved: dict[str, _Reserved] = {}
        self._dead: str | None = None
        self._died = asyncio.Event()
        self._reset_waiters: list[asyncio.Future[bool]] = []
        self._tasks = [asyncio.create_task(self._read_outputs()), asyncio.create_task(self._watch())]

    # --- life cycle -----------------------------------------------------------------
    @classmethod
    async def start(cls, config: EngineConfig, startup_timeout: float = 900.0) -> AsyncEngineClient:
        socket_dir = tempfile.mkdtemp(prefix="tandem-core-")
        input_addr = f"ipc://{socket_dir}/input"
        output_addr = f"ipc://{socket_dir}/output"
        # Sends are a local queue append, so a plain socket serves them from sync code too
        # (an abort in a `finally` of a cancelled request must not need another await).
        sync_context = zmq.Context()
        inputs = sync_context.socket(zmq.PUSH)
        # No high-water mark: an abort or a lease release must never be dropped because the
        # queue is full (admission bounds what can be queued: serving.py check_admission).
        inputs.setsockopt(zmq.SNDHWM, 0)
        inputs.bind(input_addr)
        context = zmq.asyncio.Context()
        outputs = context.socket(zmq.PULL)
        outputs.bind(output_addr)
        spawn = multiprocessing.get_context("spawn")
        process = spawn.Process(
            target=run_engine_core,
            args=(config, input_addr, output_addr, os.getpid(), logging.getLogger("tandem").getEffectiveLevel()),
            name="tandem-engine-core",
            daemon=True,
        )
        process.start()
        try:
            first = await cls._await_ready(process, outputs, startup_timeout)
        except BaseException:
            _stop_process(process)
            inputs.close(linger=0)
            outputs.close(linger=0)
            sync_context.term()
            context.term()
            shutil.rmtree(socket_dir, ignore_errors=True)
            raise
        logger.info("engine core ready (pid %d): %s, %d KV blocks of %d tokens, context %d",
                    first.pid, first.model_name, first.num_blocks, first.block_size, first.max_model_len)
        return cls(process, (sync_context, context), inputs, outputs, first, socket_dir)

    @staticmethod
    async def _await_ready(process: BaseProcess, outputs: zmq.asyncio.Socket, timeout: float) -> EngineInfo:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if await outputs.poll(500):
                message = await outputs.recv_pyobj()
                if isinstance(message, CoreFailed):
                    raise RuntimeError(f"engine failed to start: {message.message}")
                if isinstance(message, EngineInfo):
                    return message
                continue
            if not process.is_alive():
                raise RuntimeError(f"engine core exited during start-up (exit code {process.exitcode})")
            if loop.time() > deadline:
                raise TimeoutError(f"engine core not ready after {timeout:.0f} s")

    async def shutdown(self) -> None:
        if self.process.is_alive():
            self._send(Shutdown())
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await asyncio.to_thread(_stop_process, self.process)
        self._fail_all("the server is shutting down")
        self._inputs.close(linger=0)
        self._outputs.close(linger=0)
        for context in self._contexts:
            context.term()
        shutil.rmtree(self._socket_dir, ignore_errors=True)

    @property
    def healthy(self) -> bool:
        return self._dead is None and self.process.is_alive()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def queued(self) -> tuple[int, int]:
        """Sequences and prompt tokens admitted or sent to the engine that have not produced
        anything yet.

        Counted here rather than read from the engine's load report, which arrives a step
        late: admission control must see a burst of requests as it comes in.
        """
        now = time.monotonic()
        for request_id in [r for r, held in self._reserved.items() if held.deadline < now]:
            del self._reserved[request_id]
        waiting = [s for s in self._streams.values() if not s.started]
        return (sum(s.sequences for s in waiting) + sum(r.sequences for r in self._reserved.values()),
                sum(s.tokens for s in waiting) + sum(r.tokens for r in self._reserved.values()))

    def reserve(self, request_id: str, sequences: int, tokens: int) -> None:
        """Count a request as waiting from now on, until `generate` sends it (or 30 s pass)."""
        self._reserved[request_id] = _Reserved(sequences, tokens, time.monotonic() + _RESERVATION_S)

    def unreserve(self, request_ids: list[str]) -> None:
        """The requests ended without reaching the engine (or did reach it): stop counting them."""
        for request_id in request_ids:
            self._reserved.pop(request_id, None)

    # --- requests -------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       handoff: Handoff | None = None, cache_salt: str | None = None,
                       retention: CacheRetention | None = None) -> AsyncIterator[RequestDelta]:
        """Deltas of one request until it finishes; abort it if the consumer stops early."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if request_id in self._streams:
            raise EngineRequestError(f"request id {request_id!r} is already in use")
        self._reserved.pop(request_id, None)
        stream = _Stream(asyncio.Queue(), sequences=params.n, tokens=len(prompt_token_ids))
        self._streams[request_id] = stream
        finished = False
        try:
            handoff = handoff or Handoff()
            message = AddRequest(request_id, prompt_token_ids, params, handoff.prior_output_ids or None,
                                 handoff.kv_transfer_params, cache_salt, retention)
            if not self._send(message):
                raise EngineDeadError("the engine core does not take requests")
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.error is not None:
                    finished = True
                    raise EngineRequestError(item.error)
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished and self._dead is None:
                self.abort([request_id])

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._streams.pop(request_id, None)
        self._send(AbortRequests(list(request_ids)))

    def release_transfer(self, transfer_id: str) -> None:
        self._send(ReleaseTransfer(transfer_id))

    def finish_sequence(self, request_id: str, index: int) -> None:
        self._send(FinishSequence(request_id, index))

    async def reset_prefix_cache(self) -> bool:
        waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._reset_waiters.append(waiter)
        self._send(ResetPrefixCache())
        return await asyncio.wait_for(waiter, timeout=30)

    def _send(self, message: object) -> bool:
        try:
            self._inputs.send_pyobj(message, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            # Only when the core is gone or hopelessly behind; the watchdog reports the former.
            logger.error("could not send %s to the engine core: %s", type(message).__name__, exc)
            return False
        return True

    # --- background -----------------------------------------------------------------
    async def _read_outputs(self) -> None:
        while True:
            message = await self._outputs.recv_pyobj()
            if not isinstance(message, CoreOutputs):
                continue
            if message.load is not None:
                self.load = message.load
            for delta in message.deltas:
                stream = self._streams.get(delta.request_id)
                if stream is not None:
                    stream.started = True
                    stream.queue.put_nowait(delta)
            if message.reset_prefix_cache is not None and self._reset_waiters:
                self._reset_waiters.pop(0).set_result(message.reset_prefix_cache)
            if message.kv_events:
                try:
                    self.kv_events.append(message.kv_events)
                except Exception:  # a bad event must not stop the outputs behind it
                    logger.exception("could not record %d KV events", len(message.kv_events))

    async def _watch(self) -> None:
        while self.process.is_alive():
            await asyncio.sleep(0.5)
        self._dead = f"the engine core process exited (code {self.process.exitcode})"
        logger.error("%s; requests in flight fail", self._dead)
        self._fail_all(self._dead)
        self._died.set()

    async def wait_dead(self) -> str:
        """Until the engine core process is gone; why."""
        await self._died.wait()
        return self._dead or "the engine core stopped"

    def _fail_all(self, reason: str) -> None:
        for stream in self._streams.values():
            stream.queue.put_nowait(EngineDeadError(reason))
        for waiter in self._reset_waiters:
            if not waiter.done():
                waiter.set_exception(EngineDeadError(reason))
        self._reset_waiters.clear()


def _stop_process(process: BaseProcess, grace: float = 10.0) -> None:
    process.join(grace)
    if process.is_alive():
        logger.warning("engine core did not stop in %.0f s; terminating it", grace)
        process.terminate()
        process.join(5)
    if process.is_alive():
        process.kill()
        process.join()
