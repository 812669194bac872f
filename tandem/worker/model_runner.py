"""The one place that builds tensors: flattens a scheduled batch, runs the model, samples.

The runner reads only the plain `SchedulerOutput` and keeps its own state per request (its
tokens, blocks and sampling parameters), so it can live in another process or on another
rank than the scheduler. A step's chunks become one flat token stream, decodes (one token
each) first and prefill chunks after, with positions, slot mapping and block tables for the
attention backend. Only the rows that produce a token go through the LM head.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.config import KVCacheSpec, ModelConfig
from tandem.distributed.pipeline_parallel import PipelineStage
from tandem.distributed.tensor_parallel import SINGLE_RANK, TensorParallel
from tandem.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from tandem.kernels.base import AttentionBackend, AttentionMetadata, PrefillSpan, kv_cache_shape
from tandem.layers.rejection_sampler import DraftedRequest, RejectionSampler
from tandem.layers.sampler import Sampler, SamplingRow
from tandem.platform.profiling import STEP, profiled
from tandem.types import SampledToken, SamplingParams
from tandem.worker.cuda_graphs import StaticDecodeStep, capture_sizes

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestState:
    """What the runner knows of one request, built from the scheduler's plain messages."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    block_ids: list[int]
    num_computed_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def tokens(self, start: int, count: int) -> list[int]:
        """Tokens [start, start + count) of prompt + output, without concatenating them."""
        prompt_len = len(self.prompt_token_ids)
        if start + count <= prompt_len:
            return self.prompt_token_ids[start : start + count]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : start - prompt_len + count]
        return self.prompt_token_ids[start:] + self.output_token_ids[: start + count - prompt_len]


@dataclass(slots=True)
class ScheduledChunk:
    """The slice of one request that runs this step, as the batch builder needs it."""

    request_id: str
    token_ids: list[int]
    start: int  # first position computed this step
    block_ids: list[int]
    samples: bool  # reaches the end of the known tokens, so produces the next token
    state: RequestState | None = field(default=None, repr=False)
    draft_token_ids: list[int] = field(default_factory=list)  # the chunk's last tokens: guesses to verify
    # Run each token as a decode row even without drafts (a proposer's short catch-up).
    rows_as_decodes: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_sample_rows(self) -> int:
        """Rows whose logits are needed: the last real token's and one per draft."""
        return len(self.draft_token_ids) + 1 if self.samples else 0


@dataclass(slots=True)
class PreparedBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # indices into the flat batch whose logits are needed
    sample_chunks: list[ScheduledChunk]
    sample_rows_in_order: bool = False  # every row is sampled, in order: no gather needed
    # request id -> the flat rows of its chunk's tokens, in token order
    rows_of: dict[str, Sequence[int]] = field(default_factory=dict)


@dataclass
class TargetStep:
    """What the target's step leaves for a model-running proposer (tandem/spec/paged_draft.py):
    each chunk, the tokens each request kept, the guesses the scheduler wants, and for EAGLE
    the target's aux hidden states with the flat rows of each chunk's tokens."""

    chunks: list[ScheduledChunk]
    kept: dict[str, list[int]]
    lookahead: dict[str, int]
    aux_hidden: torch.Tensor | None = None
    rows_of: dict[str, Sequence[int]] | None = None


def rank_kv_spec(config: ModelConfig, tp: TensorParallel = SINGLE_RANK) -> KVCacheSpec:
    """What one rank's cache keeps per token and layer: its share of the KV heads under
    tensor parallelism; a latent cache (one shared head) is whole on every rank."""
    spec = config.kv_spec
    if spec.num_planes == 1 or not tp.split:
        return spec
    return dataclasses.replace(spec, num_heads=tp.part(spec.num_heads)[1])


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1,
                       num_layers: int | None = None) -> int:
    """Bytes of one block on the rank with the most KV heads (rank 0) of a stage holding
    `num_layers` layers (default: all), so the ranks of a stage derive the same block count
    from the same budget; the engine takes the smallest count over the stages."""
    largest = TensorParallel(0, tp_size)
    layers = config.num_hidden_layers if num_layers is None else num_layers
    per_token = rank_kv_spec(config, largest).values_per_token(layers)
    return per_token * block_size * torch.empty((), dtype=dtype).element_size()


def _decodes_a_row_each(chunk: ScheduledChunk) -> bool:
    """A one-token step over cached context, or a verification of drafts: each of its tokens
    attends like a decode (its context is the cache up to its own position), so it runs
    through the decode kernel as that many rows sharing one block table instead of as a
    prefill chunk (one gather of the context and one SDPA per request per layer)."""
    return chunk.start > 0 and (chunk.num_tokens == 1 or bool(chunk.draft_token_ids) or chunk.rows_as_decodes)


def prepare_batch(chunks: list[ScheduledChunk], block_size: int, device: torch.device | None = None) -> PreparedBatch:
    """Flatten chunks (decode rows first) into the model inputs and attention metadata, on
    `device` (default: the CPU) in one copy; prefill spans' block lists stay on the host."""
    decodes = [c for c in chunks if _decodes_a_row_each(c)]
    prefills = [c for c in chunks if not _decodes_a_row_each(c)]
    # Decode rows ordered by context length: the attention backend pads similar lengths together.
    rows = sorted(((c.start + j, c, j) for c in decodes for j in range(c.num_tokens)), key=lambda r: r[0])

    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sample_rows: list[int] = []
    sample_chunks: list[ScheduledChunk] = []
    spans: list[PrefillSpan] = []
    row_of: dict[int, list[int]] = {id(c): [] for c in decodes}  # chunk -> its rows, in token order
    for position, chunk, j in rows:
        row_of[id(chunk)].append(len(input_ids))
        input_ids.append(chunk.token_ids[j])
        positions.append(position)
        slots.append(chunk.block_ids[position // block_size] * block_size + position % block_size)
    rows_of: dict[str, Sequence[int]] = {c.request_id: row_of[id(c)] for c in decodes}
    for chunk in sorted(decodes, key=lambda c: c.start):
        if chunk.samples:
            sample_rows.extend(row_of[id(chunk)][chunk.num_tokens - chunk.num_sample_rows :])
            sample_chunks.append(chunk)
    for chunk in prefills:
        q_start = len(input_ids)
        input_ids.extend(chunk.token_ids)
        chunk_positions = range(chunk.start, chunk.start + chunk.num_tokens)
        positions.extend(chunk_positions)
        blocks = chunk.block_ids
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in chunk_positions)
        if chunk.samples:
            sample_rows.extend(range(len(input_ids) - chunk.num_sample_rows, len(input_ids)))
            sample_chunks.append(chunk)
        rows_of[chunk.request_id] = range(q_start, len(input_ids))
        context_len = chunk.start + chunk.num_tokens
        num_blocks = -(-context_len // block_size)
        spans.append(PrefillSpan(q_start, chunk.num_tokens, context_len, torch.tensor(blocks[:num_blocks])))

    context_lens = [position + 1 for position, _, _ in rows]
    max_blocks = max((len(c.block_ids) for c in decodes), default=0)
    # One tensor built from one list, then split into views: each torch.tensor() call and
    # each row assignment costs microseconds, and at batch 1 they add up to a real share of
    # a step the model itself spends ~20 ms on.
    table_rows = [b for _, c, _ in rows for b in (*c.block_ids, *(0,) * (max_blocks - len(c.block_ids)))]
    sizes = [len(input_ids), len(positions), len(slots), len(sample_rows), len(context_lens), len(table_rows)]
    flat = torch.tensor(input_ids + positions + slots + sample_rows + context_lens + table_rows, dtype=torch.long)
    if device is not None and device.type != "cpu":
        flat = flat.to(device)
    ids_t, positions_t, slots_t, rows_t, lens_t, table_t = flat.split(sizes)
    meta = AttentionMetadata(
        slot_mapping=slots_t,
        num_decode_tokens=len(rows),
        decode_block_tables=table_t.view(len(rows), max_blocks),
        decode_context_lens=lens_t,
        decode_max_context_len=max(context_lens, default=0),
        prefills=spans,
        block_size=block_size,
    )
    return PreparedBatch(
        input_ids=ids_t,
        positions=positions_t,
        meta=meta,
        sample_rows=rows_t,
        sample_chunks=sample_chunks,
        sample_rows_in_order=sample_rows == list(range(len(input_ids))),
        rows_of=rows_of,
    )


def lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor backed by an anonymous mmap: the OS hands out zero pages on first write.

    The KV budget may be gigabytes; zero-filling it would cost seconds at start-up and make
    it all resident. Uninitialised memory would be free but may hold any bit pattern, and a
    padded attention read multiplies slots past a sequence's end by zero probability, which
    a NaN survives. Fresh anonymous pages are both free and zero. The tensor keeps the
    mapping alive.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=dtype, count=math.prod(shape)).view(shape)


def shared_zeroed(path: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Like `lazily_zeroed`, but in a file (under /dev/shm) that other processes can map.

    A decode worker on the same host reads a prefill worker's KV blocks straight from this
    mapping instead of over a socket. A sparse file reads as zeros and commits pages on first
    write, so the lazy-zero property holds.
    """
    nbytes = max(math.prod(shape) * torch.empty((), dtype=dtype).element_size(), 1)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return torch.frombuffer(mapping, dtype=dtype, count=math.prod(shape)).view(shape)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        config: ModelConfig,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        seed: int = 0,
        kv_shm_path: str | None = None,
        tp: TensorParallel = SINGLE_RANK,
        stage: PipelineStage | None = None,
        device: torch.device | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.device = device = device or torch.device("cpu")
        self.config = config
        self.backend = backend
        self.block_size = block_size
        self.dtype = dtype
        self.stage = stage = stage or PipelineStage.whole(config.num_hidden_layers)
        spec = rank_kv_spec(config, tp)
        shape = kv_cache_shape(num_blocks, block_size, spec.num_heads, spec.head_dim, spec.num_planes)
        full_shape = (stage.num_layers, *shape)  # this stage's layers only
        self.kv_shm_path = kv_shm_path
        cache_dtype = kv_dtype or dtype  # float8 under --kv-cache-dtype fp8; the model keeps its own
        if device.type != "cpu":
            if kv_shm_path:
                raise ValueError("a KV cache in shared host memory needs --device cpu")
            self.kv_cache = torch.zeros(full_shape, dtype=cache_dtype, device=device)
        elif kv_shm_path:
            self.kv_cache = shared_zeroed(kv_shm_path, full_shape, cache_dtype)
        else:
            self.kv_cache = lazily_zeroed(full_shape, cache_dtype)
        self.kv_caches = list(self.kv_cache.unbind(0))
        self.sampler = Sampler(seed, getattr(model, "layer_ops", None))  # the C argmax, where attached
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.requests: dict[str, RequestState] = {}
        self._generators: dict[str, torch.Generator] = {}
        # A draft model proposing after each step (tandem/spec/draft_model.py), set by the worker.
        self.drafter: Any = None
        # Decode-only steps replayed as CUDA graphs (capture_decode_graphs), on a GPU.
        self.decode_graphs: StaticDecodeStep | None = None

    def capture_decode_graphs(self, max_batch: int, max_context_len: int, graphs: bool = True) -> bool:
        """Capture the forward of decode-only steps of up to `max_batch` rows (worker/cuda_graphs.py).
        `graphs=False` keeps the static buffers and padding but runs each step eagerly (how the
        CPU tests check them). False, with the reason logged, when this model or backend cannot."""
        why = None
        if not self.backend.capabilities.pads_decode_rows:
            why = f"the {self.backend.name} attention backend cannot take padded rows"
        elif self.stage.split or getattr(self.model, "aux_hidden_layers", ()) or self.drafter is not None:
            why = "pipeline stages and speculative decoding run eagerly"
        elif graphs and self.device.type != "cuda":
            why = "CUDA graphs need a GPU"
        if why:
            logger.info("decode steps run eagerly: %s", why)
            return False
        step = StaticDecodeStep(self._forward, capture_sizes(max_batch), max_context_len, self.block_size,
                                self.device, graphs)
        with torch.inference_mode():
            seconds = step.capture()
        self.decode_graphs = step
        if graphs:
            logger.info("CUDA graphs: decode batches of %s rows captured in %.1f s", _ranges(step.sizes), seconds)
        return True

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, self.kv_caches, meta, None)

    # --- KV blocks as data, for handoffs between workers ------------------------------
    # Dimension 3 of the cache is the block: [layers, planes (k/v), kv_heads, blocks, block_size, head_dim].
    # On a GPU the blocks travel through host memory: the connectors move host tensors.
    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return self.kv_cache.index_select(3, ids).cpu()

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        self.kv_cache.index_copy_(3, ids, data.to(self.device))
        if self.drafter is not None:  # the target's KV came from elsewhere; the draft's did not
            self.drafter.invalidate(block_ids)

    def _generator_for(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        generator = self._generators.get(request_id)
        if generator is None:
            generator = torch.Generator().manual_seed(seed)
            self._generators[request_id] = generator
        return generator

    # --- per-request state, from the scheduler's messages ---------------------------
    def update_states(self, out: SchedulerOutput) -> None:
        drafter = self.drafter
        for request_id in out.finished_request_ids:
            self.requests.pop(request_id, None)
            self._generators.pop(request_id, None)  # a seeded stream ends with its request
        for request_id in (*out.preempted_request_ids, *out.reset_request_ids):
            self.requests.pop(request_id, None)  # it comes back as a new request
        if drafter is not None:
            for request_id in (*out.finished_request_ids, *out.preempted_request_ids, *out.reset_request_ids,
                               *(new.request_id for new in out.new_requests)):
                drafter.forget(request_id)
        for new in out.new_requests:
            self.requests[new.request_id] = RequestState(
                new.request_id, list(new.prompt_token_ids), list(new.output_token_ids), new.sampling_params,
                new.eos_token_ids, list(new.block_ids), new.num_computed_tokens)
        for cached in out.cached_requests:
            state = self.requests[cached.request_id]
            state.output_token_ids.extend(cached.new_token_ids)
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def chunks(self, out: SchedulerOutput) -> list[ScheduledChunk]:
        chunks = []
        spec = out.spec_token_ids
        for request_id, count in out.num_scheduled_tokens.items():
            state = self.requests[request_id]
            start = state.num_computed_tokens
            drafts = spec.get(request_id) if spec else None
            if drafts:
                count -= len(drafts)
                chunks.append(ScheduledChunk(request_id, state.tokens(start, count) + drafts, start,
                                             state.block_ids, True, state, drafts))
                continue
            chunks.append(ScheduledChunk(request_id, state.tokens(start, count), start, state.block_ids,
                                         start + count == state.num_tokens, state))
        return chunks

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        with profiled(STEP):
            return self._execute_model(out)

    def _execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.update_states(out)
        result = ModelRunnerOutput()
        if out.empty:
            return result
        chunks = self.chunks(out)
        batch = prepare_batch(chunks, self.block_size, self.device)
        stage = self.stage
        incoming = None
        if not stage.is_first:  # this micro-batch's hidden states, from the stage before
            incoming = stage.recv(batch.input_ids.shape[0], self.config.hidden_size, self.dtype)
        graphs = self.decode_graphs
        if graphs is not None and graphs.takes(batch.meta, batch.input_ids.shape[0]):
            hidden = graphs.run(batch.input_ids, batch.positions, batch.meta)
        else:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta, incoming)
        if not stage.is_last:
            stage.send(hidden)  # asynchronous: this stage moves on to the next micro-batch
            return result
        if batch.sample_chunks:
            rows = hidden if batch.sample_rows_in_order else hidden[batch.sample_rows]
            greedy = self._greedy_without_logits(rows, batch.sample_chunks)
            if greedy is not None:
                result.sampled = greedy
            else:
                result.sampled = self._sample(self.model.compute_logits(rows), batch.sample_chunks)
        if self.drafter is not None:
            kept = {request_id: [t.token_id for t in tokens] for request_id, tokens in result.sampled.items()}
            result.draft_token_ids = self.drafter.propose(TargetStep(
                chunks, kept, out.draft_lookahead, self.model.aux_hidden, batch.rows_of))
            result.draft_seconds = self.drafter.report.seconds
            result.draft_forward_seconds = self.drafter.report.guess_forward_seconds
        return result

    def _greedy_without_logits(self, rows: torch.Tensor,
                               chunks: list[ScheduledChunk]) -> dict[str, list[SampledToken]] | None:
        """Plain greedy rows (every agent decode) through the model's bounded head, where it
        has one: the tokens without the fp32 logits. None: take the logits path."""
        greedy_tokens = getattr(self.model, "greedy_tokens", None)
        if greedy_tokens is None or not all(
                not c.draft_token_ids and Sampler.plain_greedy(
                    c.state.sampling_params, len(c.state.output_token_ids) < c.state.sampling_params.min_tokens)
                for c in chunks):
            return None
        tokens = greedy_tokens(rows)
        if tokens is None:
            return None
        return {c.request_id: [SampledToken(t)] for c, t in zip(chunks, tokens, strict=True)}

    def _sample(self, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> dict[str, list[SampledToken]]:
        if logits.device.type != "cpu" and not all(
                Sampler.plain_greedy(c.state.sampling_params, len(c.state.output_token_ids) < c.state.sampling_params.min_tokens)
                and not c.draft_token_ids for c in chunks):
            # Seeded draws, penalties and log-probs use the host's generators: the logits go there.
            # Plain greedy, the agent case, takes its argmax on the device.
            logits = logits.cpu()
        if any(chunk.draft_token_ids for chunk in chunks):
            kept = self.rejection_sampler(logits, [self._drafted_request(chunk) for chunk in chunks])
            return {chunk.request_id: tokens for chunk, tokens in zip(chunks, kept, strict=True)}
        states = [chunk.state for chunk in chunks]
        if all(Sampler.plain_greedy(s.sampling_params, len(s.output_token_ids) < s.sampling_params.min_tokens)
               for s in states):
            sampled = self.sampler.argmax(logits)
        else:
            sampled = self.sampler(logits, [self._sampling_row(state) for state in states])
        return {c.request_id: [s] for c, s in zip(chunks, sampled, strict=True)}

    def _drafted_request(self, chunk: ScheduledChunk) -> DraftedRequest:
        state = chunk.state
        params = state.sampling_params
        return DraftedRequest(
            params=params,
            prompt_token_ids=state.prompt_token_ids,
            output_token_ids=state.output_token_ids,
            draft_token_ids=chunk.draft_token_ids,
            generator=self._generator_for(state.request_id, params.seed),
            min_tokens_banned=self._min_tokens_banned(state) if params.min_tokens else [],
        )

    @staticmethod
    def _min_tokens_banned(state: RequestState) -> list[int]:
        params = state.sampling_params
        return list(params.stop_token_ids) + ([] if params.ignore_eos else list(state.eos_token_ids))

    def _sampling_row(self, state: RequestState) -> SamplingRow:
        params = state.sampling_params
        banned: list[int] = []
        if len(state.output_token_ids) < params.min_tokens:
            banned = self._min_tokens_banned(state)
        return SamplingRow(
            params=params,
            prompt_token_ids=state.prompt_token_ids,
            output_token_ids=state.output_token_ids,
            generator=self._generator_for(state.request_id, params.seed),
            banned_token_ids=banned,
        )


def _ranges(sizes: list[int]) -> str:
    """1, 2, 4, 8, 16, ..., 128 as '1, 2, 4, 8-128 (step 8)'."""
    small = [str(s) for s in sizes if s < 8]
    large = [s for s in sizes if s >= 8]
    if len(large) > 2:
        small.append(f"{large[0]}-{large[-1]} (every 8)")
    else:
        small += [str(s) for s in large]
    return ", ".join(small)
