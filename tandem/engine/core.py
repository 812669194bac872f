"""The engine core as its own process: a step loop fed and drained over ZMQ.

An API server must never make a step wait for HTTP parsing, chat templates, tokenization or
detokenization, and a step (tens of milliseconds of matrix work) must never hold up the
event loop that answers health checks. So the engine runs here, in a process of its own,
and speaks plain messages (pickled dataclasses) with the server: requests as token ids in,
new token ids out. The server (tandem.server.engine_client) owns the text.

The loop drains every pending message, runs one step if anything is unfinished, and
sends one `CoreOutputs` per step with every request that moved plus the engine's load.
When idle it blocks on the input socket with a timeout, to notice an orphaning parent.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from tandem.config import EngineConfig
from tandem.types import EngineLoad, RequestOutput, SamplingParams, TokenLogprob

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 1000


# --- messages: server -> core ----------------------------------------------------------
@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class FinishSequence:
    """A stop string was found in the text of one sequence: stop computing it."""

    request_id: str
    index: int


@dataclass
class ResetPrefixCache:
    pass


@dataclass
class Shutdown:
    pass


# --- messages: core -> server ----------------------------------------------------------
@dataclass
class EngineInfo:
    """Sent once when the engine is ready: what the server needs to serve it."""

    model_name: str
    hf_dir: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    block_size: int
    num_blocks: int
    startup_seconds: float
    pid: int


@dataclass
class CoreFailed:
    message: str


@dataclass
class SequenceDelta:
    index: int
    token_ids: list[int]
    logprobs: list[list[TokenLogprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class RequestDelta:
    """New tokens of one request since the last delta, per sequence."""

    request_id: str
    sequences: list[SequenceDelta]
    finished: bool
    num_cached_tokens: int
    queue_seconds: float | None = None  # arrival to first scheduling; on the first delta only
    error: str | None = None  # the core refused the request (the server validates first)


@dataclass
class CoreOutputs:
    deltas: list[RequestDelta] = field(default_factory=list)
    load: EngineLoad | None = None
    reset_prefix_cache: bool | None = None


class _DeltaTracker:
    """Turns the engine's cumulative outputs into per-step deltas."""

    def __init__(self) -> None:
        self._sent: dict[str, list[int]] = {}

    def add(self, request_id: str, n: int) -> None:
        self._sent[request_id] = [0] * n

    def drop(self, request_id: str) -> None:
        self._sent.pop(request_id, None)

    def delta(self, output: RequestOutput, queue_seconds: float | None) -> RequestDelta:
        sent = self._sent.setdefault(output.request_id, [0] * len(output.outputs))
        sequences = []
        for seq in output.outputs:
            start = sent[seq.index]
            new_ids = seq.token_ids[start:]
            if not new_ids and seq.finish_reason is None:
                continue
            sent[seq.index] = len(seq.token_ids)
            sequences.append(SequenceDelta(
                index=seq.index,
                token_ids=new_ids,
                logprobs=None if seq.logprobs is None else seq.logprobs[start:],
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            ))
        if output.finished:
            self.drop(output.request_id)
        return RequestDelta(output.request_id, sequences, output.finished, output.num_cached_tokens,
                            queue_seconds)


class EngineCore:
    """The loop around an LLMEngine; separated from the process entry point for tests."""

    def __init__(self, engine: Any, inputs: zmq.Socket, outputs: zmq.Socket, parent_pid: int) -> None:
        self.engine = engine
        self.inputs = inputs
        self.outputs = outputs
        self.parent_pid = parent_pid
        self.tracker = _DeltaTracker()
        self._unreported_queue: set[str] = set()
        self._running = True

    def run(self) -> None:
        while self._running:
            if os.getppid() != self.parent_pid:
                logger.warning("the API server (pid %d) is gone; engine core exits", self.parent_pid)
                return
            busy = self.engine.has_unfinished()
            if not self.inputs.poll(0 if busy else _IDLE_POLL_MS) and not busy:
                continue
            out = CoreOutputs()
            changed = self._drain(out)
            if self._running and self.engine.has_unfinished():
                self._step(out)
                changed = True
            if changed:
                out.load = self.engine.load()
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
        engine = self.engine
        if isinstance(message, AddRequest):
            try:
                engine.add_request(message.request_id, None, message.params, message.prompt_token_ids)
            except ValueError as exc:
                out.deltas.append(RequestDelta(message.request_id, [], True, 0, error=str(exc)))
                return
            logger.debug("added %s (%d prompt tokens)", message.request_id, len(message.prompt_token_ids))
            self.tracker.add(message.request_id, message.params.n)
            self._unreported_queue.add(message.request_id)
        elif isinstance(message, AbortRequests):
            logger.debug("aborted %s", ", ".join(message.request_ids))
            for request_id in message.request_ids:
                engine.abort(request_id)
                self.tracker.drop(request_id)
                self._unreported_queue.discard(request_id)
        elif isinstance(message, FinishSequence):
            engine.finish_sequence(message.request_id, message.index)
            if not engine.has_request(message.request_id):
                self.tracker.drop(message.request_id)
                self._unreported_queue.discard(message.request_id)
        elif isinstance(message, ResetPrefixCache):
            out.reset_prefix_cache = engine.block_pool.reset_prefix_cache()
        elif isinstance(message, Shutdown):
            self._running = False
        else:
            logger.error("engine core ignored an unknown message %r", type(message).__name__)

    def _step(self, out: CoreOutputs) -> None:
        for output in self.engine.step():
            queue_seconds = None
            if output.request_id in self._unreported_queue:
                self._unreported_queue.discard(output.request_id)
                queue_seconds = output.queue_seconds
            out.deltas.append(self.tracker.delta(output, queue_seconds))


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str, parent_pid: int,
                    log_level: int) -> None:
    """Process entry point: build the engine, announce it, serve until told to stop."""
    # Ctrl-C reaches the whole process group; the server decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_addr)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 1000)
    outputs.connect(output_addr)
    try:
        from tandem.engine.llm_engine import LLMEngine

        engine = LLMEngine(config, detokenize=False)
    except Exception as exc:  # any start failure must reach the server, not vanish with us
        logger.exception("engine failed to start")
        outputs.send_pyobj(CoreFailed(f"{type(exc).__name__}: {exc}"))
        outputs.close()
        context.term()
        return
    outputs.send_pyobj(EngineInfo(
        model_name=engine.model_name,
        hf_dir=str(engine.hf_dir),
        max_model_len=engine.max_model_len,
        vocab_size=engine.model_config.vocab_size,
        eos_token_ids=sorted(engine.eos_token_ids),
        block_size=config.cache.block_size,
        num_blocks=engine.block_pool.num_blocks,
        startup_seconds=engine.startup_seconds,
        pid=os.getpid(),
    ))
    started = time.monotonic()
    try:
        EngineCore(engine, inputs, outputs, parent_pid).run()
    finally:
        logger.info("engine core stops after %.0f s", time.monotonic() - started)
        inputs.close(linger=0)
        outputs.close()
        context.term()
