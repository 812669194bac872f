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
    prior_output_ids: list[int] | None = None  # generated elsewhere (a prefill worker)
    keep_prompt_kv: bool = False  # prefill for a remote decode: keep the prompt's KV blocks
    kv_pull: dict[str, Any] | None = None  # a KVTransferHandle (JSON) to fetch the prompt's KV from


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
class ReleaseTransfer:
    """The server decided nobody will fetch these kept blocks (the output ended at once)."""

    transfer_id: str


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
    root_hash: int = 0  # of the block-hash chain (DESIGN.md), for routers hashing prompts
    role: str = "both"
    kv_source: str | None = None  # tcp://host:port of this worker's KV source


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
    kv_transfer: dict[str, Any] | None = None  # on the last delta of a keep_prompt_kv request
    kv_adopted_blocks: int = 0  # on the first delta of a kv_pull request: blocks fetched


@dataclass
class CoreOutputs:
    deltas: list[RequestDelta] = field(default_factory=list)
    load: EngineLoad | None = None
    reset_prefix_cache: bool | None = None
    kv_events: list[tuple[str, int]] = field(default_factory=list)  # the block pool's, in order


class _DeltaTracker:
    """Turns the engine's cumulative outputs into per-step deltas."""

    def __init__(self) -> None:
        self._sent: dict[str, list[int]] = {}
        self.adopted: dict[str, int] = {}

    def add(self, request_id: str, n: int, already: int = 0) -> None:
        self._sent[request_id] = [already] * n

    def drop(self, request_id: str) -> None:
        self._sent.pop(request_id, None)
        self.adopted.pop(request_id, None)

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
        adopted = self.adopted.pop(output.request_id, 0)
        if output.finished:
            self.drop(output.request_id)
        return RequestDelta(output.request_id, sequences, output.finished, output.num_cached_tokens,
                            queue_seconds, kv_adopted_blocks=adopted)


@dataclass
class _PendingPull:
    message: AddRequest
    blocks: list[Any]  # reserved destination blocks
    first_index: int  # handle index of the first fetched block
    aborted: bool = False


@dataclass
class TransferStats:
    held: int = 0  # prefill side: transfers kept now
    blocks_sent: int = 0
    pulls: int = 0  # decode side: requests that arrived with a handle
    blocks_received: int = 0
    blocks_already_cached: int = 0
    pull_failures: int = 0  # ... that computed their prompt here instead
    pull_seconds: float = 0.0


class EngineCore:
    """The loop around an LLMEngine; separated from the process entry point for tests."""

    def __init__(self, engine: Any, inputs: zmq.Socket, outputs: zmq.Socket, parent_pid: int,
                 source: Any = None, sink: Any = None) -> None:
        self.engine = engine
        self.inputs = inputs
        self.outputs = outputs
        self.parent_pid = parent_pid
        self.source = source  # KVSource when this worker serves KV to decode workers
        self.sink = sink  # KVSink when it fetches KV from prefill workers
        self.tracker = _DeltaTracker()
        self._unreported_queue: set[str] = set()
        self._keep: dict[str, list[int]] = {}  # keep_prompt_kv request -> its prompt
        self._pulls: dict[str, _PendingPull] = {}
        self._adopted: dict[str, tuple[list[Any], int]] = {}  # held until the request is admitted
        self.transfers = TransferStats()
        self._running = True

    def run(self) -> None:
        self.outputs.send_pyobj(CoreOutputs(load=self._load()))  # the server's first /load
        while self._running:
            if os.getppid() != self.parent_pid:
                logger.warning("the API server (pid %d) is gone; engine core exits", self.parent_pid)
                return
            busy = self.engine.has_unfinished()
            timeout = 0 if busy else 5 if self._pulls else 100 if self._keeping else _IDLE_POLL_MS
            has_input = self.inputs.poll(timeout)
            out = CoreOutputs()
            changed = self._drain(out) if has_input else False
            changed |= self._transfers_done(out)
            if self._running and self.engine.has_unfinished():
                self._step(out)
                changed = True
            out.kv_events = self.engine.block_pool.drain_events()
            if changed or out.kv_events:
                out.load = self._load()
                self.outputs.send_pyobj(out)

    @property
    def _keeping(self) -> bool:
        return self.source is not None and self.source.num_held > 0

    def _load(self) -> EngineLoad:
        load = self.engine.load()
        stats = self.transfers
        if self.source is not None:
            stats.held, stats.blocks_sent = self.source.num_held, self.source.blocks_sent
        load.kv_transfer = dict(stats.__dict__)
        return load

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
            if message.kv_pull is not None and self._start_pull(message):
                return
            self._add(message, out)
        elif isinstance(message, AbortRequests):
            logger.debug("aborted %s", ", ".join(message.request_ids))
            for request_id in message.request_ids:
                engine.abort(request_id)
                self.tracker.drop(request_id)
                self._unreported_queue.discard(request_id)
                self._keep.pop(request_id, None)
                self._release_adopted(request_id)
                if request_id in self._pulls:
                    self._pulls[request_id].aborted = True  # dropped when its fetch comes back
        elif isinstance(message, FinishSequence):
            engine.finish_sequence(message.request_id, message.index)
            if not engine.has_request(message.request_id):
                self.tracker.drop(message.request_id)
                self._unreported_queue.discard(message.request_id)
        elif isinstance(message, ReleaseTransfer):
            if self.source is not None:
                self.source.release(message.transfer_id)
        elif isinstance(message, ResetPrefixCache):
            out.reset_prefix_cache = engine.block_pool.reset_prefix_cache()
        elif isinstance(message, Shutdown):
            self._running = False
        else:
            logger.error("engine core ignored an unknown message %r", type(message).__name__)

    def _add(self, message: AddRequest, out: CoreOutputs, adopted: int = 0) -> None:
        keep = message.keep_prompt_kv and self.source is not None
        try:
            self.engine.add_request(message.request_id, None, message.params, message.prompt_token_ids,
                                    prior_output_ids=message.prior_output_ids, keep_prompt_kv=keep)
        except ValueError as exc:
            out.deltas.append(RequestDelta(message.request_id, [], True, 0, error=str(exc)))
            return
        logger.debug("added %s (%d prompt tokens)", message.request_id, len(message.prompt_token_ids))
        self.tracker.add(message.request_id, message.params.n, len(message.prior_output_ids or []))
        self._unreported_queue.add(message.request_id)
        if keep:
            self._keep[message.request_id] = message.prompt_token_ids
        if adopted:
            self.tracker.adopted[message.request_id] = adopted

    # --- decode side: adopting a prompt's KV from a prefill worker ------------------------
    def _start_pull(self, message: AddRequest) -> bool:
        """Reserve blocks and start fetching; False means: just compute the prompt here."""
        from tandem.kvcache.transfer.base import KVTransferError, KVTransferHandle
        from tandem.kvcache.transfer.sink import PullJob

        self.transfers.pulls += 1
        if self.sink is None:
            return False
        try:
            handle = KVTransferHandle.from_json(message.kv_pull or {})
        except KVTransferError as exc:
            logger.warning("request %s: %s; computing its prompt here", message.request_id, exc)
            self.transfers.pull_failures += 1
            return False
        kv = self.engine.kv_manager
        ours = kv.prompt_block_hashes(message.prompt_token_ids)
        usable = 0
        while usable < min(len(ours), handle.num_blocks) and ours[usable] == handle.block_hashes[usable]:
            usable += 1
        local = min(kv.cached_prefix_blocks(message.prompt_token_ids), usable)
        self.transfers.blocks_already_cached += local
        wanted = list(range(local, usable))
        if usable < handle.num_blocks:
            logger.warning("request %s: only %d of %d transferred block hashes match ours (another model "
                           "or block size?); computing the rest here", message.request_id, usable,
                           handle.num_blocks)
        blocks = self.engine.reserve_blocks(len(wanted)) if wanted else []
        if blocks is None:
            logger.info("request %s: no room for %d transferred blocks; computing its prompt here",
                        message.request_id, len(wanted))
            blocks, wanted = [], []
        self._pulls[message.request_id] = _PendingPull(message, blocks, local)
        self.sink.submit(PullJob(message.request_id, handle, wanted, [b.block_id for b in blocks]))
        return True

    def _transfers_done(self, out: CoreOutputs) -> bool:
        changed = False
        if self.sink is not None:
            for result in self.sink.results():
                changed = True
                pull = self._pulls.pop(result.job.request_id, None)
                if pull is None:
                    continue
                self.transfers.pull_seconds += result.seconds
                adopted = 0
                if result.ok and pull.blocks:
                    self.engine.kv_manager.adopt(pull.message.prompt_token_ids, pull.first_index, pull.blocks)
                    adopted = len(pull.blocks)
                    self.transfers.blocks_received += adopted
                elif not result.ok:
                    self.transfers.pull_failures += 1
                    logger.warning("request %s: KV fetch failed (%s); computing its prompt here",
                                   result.job.request_id, result.error)
                if pull.aborted:
                    self.engine.release_blocks(pull.blocks)
                    continue
                self._add(pull.message, out, adopted)
                if pull.blocks and self.engine.has_request(pull.message.request_id):
                    self._adopted[pull.message.request_id] = (pull.blocks, 0)
                else:
                    self.engine.release_blocks(pull.blocks)
        if self.source is not None:
            for blocks in self.source.collect_released():
                self.engine.release_blocks(blocks)
                changed = True
        return changed

    def _release_adopted(self, request_id: str) -> None:
        entry = self._adopted.pop(request_id, None)
        if entry is not None:
            self.engine.release_blocks(entry[0])

    # --- stepping -------------------------------------------------------------------
    def _step(self, out: CoreOutputs) -> None:
        for output in self.engine.step():
            queue_seconds = None
            if output.request_id in self._unreported_queue:
                self._unreported_queue.discard(output.request_id)
                queue_seconds = output.queue_seconds
            delta = self.tracker.delta(output, queue_seconds)
            if output.finished:
                delta.kv_transfer = self._hand_over(output.request_id)
            out.deltas.append(delta)
        # Adopted blocks were held so nothing could evict them before their request was
        # admitted; once it holds them itself, our extra reference goes.
        for request_id in list(self._adopted):
            if not self.engine.has_request(request_id) or self.engine.is_scheduled(request_id):
                self._release_adopted(request_id)

    def _hand_over(self, request_id: str) -> dict[str, Any] | None:
        """A finished prefill-for-remote-decode: keep its prompt blocks, return the handle."""
        prompt = self._keep.pop(request_id, None)
        if prompt is None or self.source is None:
            return None
        blocks = self.engine.take_kept_blocks(request_id)
        if not blocks:
            return None
        hashes = self.engine.kv_manager.prompt_block_hashes(prompt)[: len(blocks)]
        return self.source.hold(request_id, blocks, hashes).to_json()


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
    source, sink = _start_transfers(config, engine)
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
        root_hash=engine.kv_manager.root_hash,
        role=config.kv_transfer.role,
        kv_source=None if source is None else f"tcp://{source.host}:{source.port}",
    ))
    engine.block_pool.record_events = True  # the server publishes them at /kv/events
    started = time.monotonic()
    try:
        EngineCore(engine, inputs, outputs, parent_pid, source, sink).run()
    finally:
        logger.info("engine core stops after %.0f s", time.monotonic() - started)
        for part in (source, sink):
            if part is not None:
                part.close()
        engine.close()
        inputs.close(linger=0)
        outputs.close()
        context.term()


def _start_transfers(config: EngineConfig, engine: Any) -> tuple[Any, Any]:
    """The KV source and sink this worker's role calls for (imported only when used)."""
    from tandem.kvcache.transfer.base import KVLayout
    from tandem.kvcache.transfer.sink import KVSink
    from tandem.kvcache.transfer.source import KVSource

    transfer = config.kv_transfer
    model = engine.model_config
    layout = KVLayout(model.num_hidden_layers, model.num_key_value_heads, config.cache.block_size,
                      model.head_dim, config.load.dtype)
    source = sink = None
    if transfer.serves_kv:
        source = KVSource(engine.runner.read_blocks, layout, transfer.host, transfer.port,
                          transfer.hold_timeout, engine.kv_shm_path, engine.block_pool.num_blocks)
    if transfer.fetches_kv:
        sink = KVSink(engine.runner.write_blocks, transfer.fetch_timeout)
    return source, sink
