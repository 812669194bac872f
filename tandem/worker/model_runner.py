"""The one place that builds tensors: flattens a scheduled batch, runs the model, samples.

The runner reads only the plain `SchedulerOutput` and keeps its own state per request (its
tokens, blocks and sampling parameters), so it can live in another process or on another
rank than the scheduler. A step's chunks become one flat token stream, decodes (one token
each) first and prefill chunks after, with positions, slot mapping and block tables for the
attention backend. Only the rows that produce a token go through the LM head.

Under asynchronous scheduling (`run_ahead`) a step may be scheduled before the one in front of
it has reported its tokens: the scheduler names the requests whose input is the token that step
samples (`SchedulerOutput.last_step_inputs`), and the runner takes each from the last step's
samples on the device. A plain greedy step's tokens then stay on the device until the executor
collects them (`ModelRunnerOutput.resolve`), so launching the next step never waits for them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch

from tandem.batch.prepared import (
    RequestState,
    ScheduledChunk,
    TargetStep,
    prepare_batch,
)
from tandem.batch.scheduler_output import ModelRunnerOutput, SchedulerOutput
from tandem.config import KVCacheSpec, ModelConfig
from tandem.distributed.pipeline_parallel import PipelineStage
from tandem.distributed.tensor_parallel import SINGLE_RANK, TensorParallel
from tandem.kernels.base import AttentionBackend, AttentionMetadata, kv_cache_shape
from tandem.kernels.kv_format import FP8, stored_row_width
from tandem.layers.attention import PagedAttention
from tandem.layers.rejection_sampler import DraftedRequest, RejectionSampler
from tandem.layers.sampler import Sampler, SamplingRow
from tandem.layers.token_mask import apply_token_masks
from tandem.platform.lazy_memory import lazily_zeroed, shared_zeroed
from tandem.platform.pages import commit_for_write
from tandem.platform.profiling import STEP, profiled
from tandem.types import SampledToken
from tandem.worker.cuda_graphs import StaticDecodeStep, capture_sizes

logger = logging.getLogger(__name__)


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
    spec = rank_kv_spec(config, largest)
    rows_per_token = spec.values_per_token(layers) // spec.head_dim  # an int8 row also holds its scale
    return rows_per_token * stored_row_width(spec.head_dim, dtype) * block_size * torch.empty((), dtype=dtype).element_size()


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
        commit_kv: bool = False,
        run_ahead: bool = False,
    ) -> None:
        self.model = model
        self.device = device = device or torch.device("cpu")
        self.config = config
        self.backend = backend
        self.block_size = block_size
        self.dtype = dtype
        self.stage = stage = stage or PipelineStage.whole(config.num_hidden_layers)
        spec = rank_kv_spec(config, tp)
        cache_dtype = kv_dtype or dtype  # float8 or int8 rows (uint8) under --kv-cache-dtype; the model keeps its own
        shape = kv_cache_shape(num_blocks, block_size, spec.num_heads, stored_row_width(spec.head_dim, cache_dtype),
                               spec.num_planes)
        full_shape = (stage.num_layers, *shape)  # this stage's layers only
        self.kv_shm_path = kv_shm_path
        if device.type != "cpu":
            if kv_shm_path:
                raise ValueError("a KV cache in shared host memory needs --device cpu")
            self.kv_cache = torch.zeros(full_shape, dtype=cache_dtype, device=device)
        elif kv_shm_path:
            self.kv_cache = shared_zeroed(kv_shm_path, full_shape, cache_dtype)
        else:
            self.kv_cache = lazily_zeroed(full_shape, cache_dtype)
        if commit_kv and device.type == "cpu":
            self._commit_kv_cache()
        self.kv_caches = list(self.kv_cache.unbind(0))
        self.sampler = Sampler(seed, getattr(model, "layer_ops", None))  # the C argmax, where attached
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.requests: dict[str, RequestState] = {}
        self._generators: dict[str, torch.Generator] = {}
        # A draft model proposing after each step (tandem/spec/draft_model.py), set by the worker.
        self.drafter: Any = None
        # Decode-only steps replayed as CUDA graphs (capture_decode_graphs), on a GPU.
        self.decode_graphs: StaticDecodeStep | None = None
        # Asynchronous scheduling: the last step's sampled tokens on the device, in its sampling
        # chunks' order, and each request's index among them.
        self.run_ahead = run_ahead
        self._last_sampled: tuple[torch.Tensor, dict[str, int]] | None = None

    def _commit_kv_cache(self) -> None:
        """Fault the whole CPU cache in now rather than a page at a time inside the steps.

        A zero mapping's page costs ~2 us at its first write (the kernel allocates and zeroes
        it), and a block of one layer's head is one 4 KiB page: a first prefill-heavy pass
        took 778 MB of such faults, ~3% of its time (the 2-core AVX-512 EPYC VM, exact fp32:
        1,286-1,523 prompt tok/s lazily against 1,443-1,460 committed, alternating runs).
        Committing the range is one madvise at ~1.4 us a page (0.8 s for 2 GiB, once at
        start). vLLM zero-fills its CPU cache at start, so this is also how its figures are
        taken, and it makes a budget the machine cannot hold fail at start instead of as a
        fault mid-step. `--lazy-kv-cache` keeps the pages lazy (a faster start, less resident
        memory)."""
        start = time.perf_counter()
        size = self.kv_cache.numel() * self.kv_cache.element_size()
        if commit_for_write(self.kv_cache, f"the KV cache (--kv-cache-memory {size / 2**30:.2f}GiB)"):
            logger.info("KV cache: %.2f GiB committed in %.2f s (--lazy-kv-cache commits pages on first write)",
                        size / 2**30, time.perf_counter() - start)
        else:
            logger.info("KV cache: this kernel cannot commit memory ahead (MADV_POPULATE_WRITE, Linux 5.14): "
                        "pages come on first write")

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
    # Every cache's blocks leave and enter as its rows are stored: an fp8 cache's as its e4m3
    # bytes, whose meaning is its layers' scales (`kv_scales`, carried in the KV layout a
    # handoff or tier chunk names; kvcache/codec.py converts between writers and readers).
    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        if self.kv_cache.dtype == FP8:  # (no float8 index_select on a CPU: as bytes)
            return self.kv_cache.view(torch.uint8).index_select(3, ids).cpu().view(FP8)
        return self.kv_cache.index_select(3, ids).cpu()

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        if self.kv_cache.dtype == FP8:
            if data.dtype != FP8:
                raise ValueError(f"an fp8 cache takes fp8 rows over its own scales, not {data.dtype}")
            self.kv_cache.view(torch.uint8).index_copy_(3, ids, data.view(torch.uint8).to(self.device))
        else:
            self.kv_cache.index_copy_(3, ids, data.to(self.device))
        if self.drafter is not None:  # the target's KV came from elsewhere; the draft's did not
            self.drafter.invalidate(block_ids)

    def kv_scales(self) -> tuple[float, ...]:
        """An fp8 cache's scales as its KV layout carries them: (k_scale, v_scale) per layer,
        1.0 for MLA's latent plane (never scaled); () for a cache of another dtype."""
        if self.kv_cache.dtype != FP8:
            return ()
        layers, planes = self.kv_cache.shape[:2]
        modules = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        if planes != 2 or not modules:
            return (1.0,) * (layers * planes)
        if len(modules) != layers:
            raise RuntimeError(f"an fp8 cache of {layers} layers beside {len(modules)} attention modules: which "
                               "scale is whose is not known, so its blocks cannot be moved")
        return tuple(float(scale) for m in modules for scale in (m.k_scale, m.v_scale))

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
        ahead = set(out.last_step_inputs)
        for request_id, count in out.num_scheduled_tokens.items():
            state = self.requests[request_id]
            start = state.num_computed_tokens
            if request_id in ahead:  # its one token: the last step's sample, filled in on the device
                chunks.append(ScheduledChunk(request_id, [0], start, state.block_ids, True, state))
                continue
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
        if out.last_step_inputs:
            self._fill_last_step_inputs(batch.input_ids, batch.rows_of, out.last_step_inputs)
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
            greedy = None if out.token_masks is not None else self._greedy_without_logits(rows, batch.sample_chunks)
            if greedy is not None:
                result.sampled = greedy
            else:
                logits = self.model.compute_logits(rows)
                if out.token_masks is not None:  # filled meanwhile on the engine core's helper thread
                    apply_token_masks(logits, [(c.request_id, c.num_sample_rows) for c in batch.sample_chunks],
                                      out.token_masks.resolve())
                if self.run_ahead and out.token_masks is None and _all_plain_greedy(batch.sample_chunks):
                    # The agent's case: the tokens stay on the device for the next step, and
                    # reach the host when the executor collects this step.
                    ids = self.sampler.argmax_ids(logits)
                    self._keep_samples(ids, batch.sample_chunks)
                    result.pending_sampled = _tokens_when_copied(ids, batch.sample_chunks)
                else:
                    result.sampled = self._sample(logits, batch.sample_chunks)
            if self.run_ahead and result.pending_sampled is None:
                last = [result.sampled[c.request_id][-1].token_id for c in batch.sample_chunks]
                self._keep_samples(torch.tensor(last, dtype=torch.long).to(self.device), batch.sample_chunks)
        if self.drafter is not None:
            kept = {request_id: [t.token_id for t in tokens] for request_id, tokens in result.sampled.items()}
            result.draft_token_ids = self.drafter.propose(TargetStep(
                chunks, kept, out.draft_lookahead, self.model.aux_hidden, batch.rows_of))
            result.draft_seconds = self.drafter.report.seconds
            result.draft_forward_seconds = self.drafter.report.guess_forward_seconds
        return result

    def _keep_samples(self, ids: torch.Tensor, chunks: list[ScheduledChunk]) -> None:
        self._last_sampled = (ids, {chunk.request_id: i for i, chunk in enumerate(chunks)})

    def _fill_last_step_inputs(self, input_ids: torch.Tensor, rows_of: dict[str, Any], request_ids: list[str]) -> None:
        """Write each named request's input token, the last step's sample for it, into its row
        of `input_ids`: a gather on the device, so nothing waits for that step to finish."""
        last = self._last_sampled
        missing = [r for r in request_ids if last is None or r not in last[1]]
        if last is None or missing:
            raise RuntimeError(f"requests {missing} were scheduled on the last step's samples, but that step "
                               "sampled none for them")
        ids, index_of = last
        where = [rows_of[r][0] for r in request_ids] + [index_of[r] for r in request_ids]
        where_t = _to_device(torch.tensor(where, dtype=torch.long), self.device)
        count = len(request_ids)
        input_ids.index_copy_(0, where_t[:count], ids.index_select(0, where_t[count:]))

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


def _all_plain_greedy(chunks: list[ScheduledChunk]) -> bool:
    return all(not c.draft_token_ids and Sampler.plain_greedy(
        c.state.sampling_params, len(c.state.output_token_ids) < c.state.sampling_params.min_tokens) for c in chunks)


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device` without waiting: a GPU copy from pageable memory
    synchronizes with the stream (every step queued before it), one from pinned memory does not."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _tokens_when_copied(ids: torch.Tensor, chunks: list[ScheduledChunk]) -> Any:
    """A call that returns the step's tokens per request once `ids` (on the device) reach the
    host. On a GPU the copy is started now, into pinned memory, and the call waits for its event."""
    request_ids = [chunk.request_id for chunk in chunks]
    if ids.device.type == "cpu":
        return lambda: {r: [SampledToken(t)] for r, t in zip(request_ids, ids.tolist(), strict=True)}
    host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
    host.copy_(ids, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def tokens() -> dict[str, list[SampledToken]]:
        copied.synchronize()
        return {r: [SampledToken(t)] for r, t in zip(request_ids, host.tolist(), strict=True)}

    return tokens


def _ranges(sizes: list[int]) -> str:
    """1, 2, 4, 8, 16, ..., 128 as '1, 2, 4, 8-128 (step 8)'."""
    small = [str(s) for s in sizes if s < 8]
    large = [s for s in sizes if s >= 8]
    if len(large) > 2:
        small.append(f"{large[0]}-{large[-1]} (every 8)")
    else:
        small += [str(s) for s in large]
    return ", ".join(small)
