"""The engine core as its own process: a step loop fed and drained over ZMQ.

An API server must never make a step wait for HTTP parsing, chat templates, tokenization or
detokenization, and a step (tens of milliseconds of matrix work) must never hold up the
event loop that answers health checks. So the engine core runs here, in a process of its
own, and speaks plain messages (engine/messages.py) with the server: requests as token ids
in, per-step deltas of new token ids out. The server (tandem.server.engine_client) owns the
text.

The loop drains every pending message, runs one step if anything is unfinished (or a KV
connector has work pending: a load arriving, a handoff held), and sends one `CoreOutputs` per
step with every request that moved plus the engine's load. When idle it blocks on the input
socket with a timeout, to notice an orphaning parent.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import zmq

from tandem.config import EngineConfig
from tandem.engine.engine_core import EngineCore, EngineCoreRequest
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
from tandem.executor.base import WorkerDiedError
from tandem.executor.factory import make_executor

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 1000


class EngineCoreProc:
    """The loop around an EngineCore; separated from the process entry point for tests."""

    def __init__(self, core: EngineCore, inputs: zmq.Socket, outputs: zmq.Socket, parent_pid: int) -> None:
        self.core = core
        self.inputs = inputs
        self.outputs = outputs
        self.parent_pid = parent_pid
        self._running = True

    def run(self) -> None:
        core = self.core
        self.outputs.send_pyobj(CoreOutputs(load=core.load()))  # the server's first /load
        while self._running:
            if os.getppid() != self.parent_pid:
                logger.warning("the API server (pid %d) is gone; engine core exits", self.parent_pid)
                return
            pending = core.pending_kv_work()
            if core.has_unfinished():
                timeout = 0
            elif pending is not None:
                timeout = int(pending * 1000)
            else:
                timeout = _IDLE_POLL_MS
            has_input = self.inputs.poll(timeout)
            out = CoreOutputs()
            changed = self._drain(out) if has_input else False
            if self._running and (core.has_unfinished() or core.pending_kv_work() is not None):
                out.deltas.extend(core.step())
                changed = True
            out.kv_events = core.drain_kv_events()
            if changed or out.kv_events:
                out.load = core.load()
                self.outputs.send_pyobj(out)

    def _drain(self, out: CoreOutputs) -> bool:
        changed = False
        while True:
            try:
                message = self.inputs.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                return changed
            changed = True
            self._handle(message, out)

    def _handle(self, message: object, out: CoreOutputs) -> None:
        core = self.core
        if isinstance(message, AddRequest):
            try:
                core.add_request(EngineCoreRequest(message.request_id, message.prompt_token_ids, message.params,
                                                   message.prior_output_ids, message.kv_transfer_params,
                                                   message.cache_salt,
                                                   retention=message.retention))
            except Exception as exc:  # refused (ValueError) or not understood: that request alone fails
                message_text = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
                out.deltas.append(RequestDelta(message.request_id, [], True, 0, error=message_text))
                return
            logger.debug("added %s (%d prompt tokens)", message.request_id, len(message.prompt_token_ids))
        elif isinstance(message, AbortRequests):
            logger.debug("aborted %s", ", ".join(message.request_ids))
            core.abort(message.request_ids)
        elif isinstance(message, FinishSequence):
            core.finish_sequence(message.request_id, message.index)
        elif isinstance(message, ReleaseTransfer):
            core.release_hold(message.transfer_id)
        elif isinstance(message, ResetPrefixCache):
            out.reset_prefix_cache = core.reset_prefix_cache()
        elif isinstance(message, Shutdown):
            self._running = False
        else:
            logger.error("engine core ignored an unknown message %r", type(message).__name__)


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str, parent_pid: int,
                    log_level: int) -> None:
    """Process entry point: build the engine, announce it, serve until told to stop."""
    # Ctrl-C reaches the whole process group; the server decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_addr)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 1000)
    outputs.connect(output_addr)
    try:
        # this process is the core's own: a worker inside it may freeze its start-up objects
        core = EngineCore(config, make_executor(config, owns_process=True),
                          record_kv_events=True)  # the server publishes them at /kv/events
    except Exception as exc:  # any start failure must reach the server, not vanish with us
        logger.exception("engine failed to start")
        outputs.send_pyobj(CoreFailed(f"{type(exc).__name__}: {exc}"))
        outputs.close()
        context.term()
        return
    outputs.send_pyobj(EngineInfo(
        model_name=core.model_name,
        hf_dir=str(core.hf_dir),
        max_model_len=core.max_model_len,
        vocab_size=core.model_config.vocab_size,
        eos_token_ids=sorted(core.eos_token_ids),
        block_size=config.cache.block_size,
        num_blocks=core.block_pool.num_blocks,
        startup_seconds=core.startup_seconds,
        pid=os.getpid(),
        root_hash=core.root_hash,
        fingerprint=core.fingerprint,
        role=config.kv_transfer.role,
        kv_source=core.kv_source,
        world_size=config.parallel.world_size,
    ))
    started = time.monotonic()
    exit_code = 0
    try:
        EngineCoreProc(core, inputs, outputs, parent_pid).run()
    except WorkerDiedError as exc:
        logger.error("%s", exc)
        exit_code = 1
    finally:
        logger.info("engine core stops after %.0f s", time.monotonic() - started)
        core.shutdown()
        inputs.close(linger=0)
        outputs.close()
        context.term()
    # Everything this process owns is closed above. Skip the interpreter's teardown (freeing
    # every tensor and module one by one took ~1.2 s of a 2.2 s stop of the default model):
    # the server waits for this process to end before it exits itself.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
