"""The synchronous engine: requests in, one scheduler step + one model step at a time, outputs out.

It owns the pieces (tokenizer, scheduler, KV cache manager, model runner) and the per-
sequence output state (detokenizer, logprobs, stop strings). Requests with n > 1 are fanned
out into n sequences that share the prompt's cached blocks once the first has computed them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from tandem.config import DTYPES, EngineConfig, ModelConfig
from tandem.engine.block_pool import BlockPool, KVBlock
from tandem.engine.detokenizer import IncrementalDetokenizer, find_stop
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.model_runner import ModelRunner, kv_bytes_per_block
from tandem.engine.scheduler import Scheduler
from tandem.kernels.cpu_attention import make_attention_backend
from tandem.kernels.torch_attention import TorchAttentionBackend
from tandem.kvcache.block_hash import root_hash
from tandem.layers.linear import SmallStepWeights, attach_small_step_weights, pack_weights_for_cpu
from tandem.loader.model_loader import (
    build_model,
    init_dummy_weights,
    load_weights,
    read_model_config,
)
from tandem.loader.resolve import default_cache_dir, resolve_model
from tandem.loader.tokenizer import load_tokenizer
from tandem.types import (
    CompletionOutput,
    EngineLoad,
    Request,
    RequestOutput,
    RequestStatus,
    SampledToken,
    SamplingParams,
)

logger = logging.getLogger(__name__)

_DEFAULT_KV_FRACTION = 0.25
_DEFAULT_KV_CAP = 4 << 30


@dataclass
class _Sequence:
    index: int
    request: Request
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[Any] | None = None
    cumulative_logprob: float | None = None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.request.output_token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


@dataclass
class _Group:
    """A user request: one prompt, n sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[_Sequence] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)

    def output(self) -> RequestOutput:
        cached = max((s.request.num_cached_tokens for s in self.sequences), default=0)
        first = self.sequences[0].request if self.sequences else None
        queue_seconds = None
        if first is not None and first.first_scheduled_time is not None:
            queue_seconds = first.first_scheduled_time - first.arrival_time
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.output() for s in self.sequences],
            finished=self.finished,
            num_cached_tokens=max(cached, 0),
            queue_seconds=queue_seconds,
        )


def default_kv_cache_bytes() -> int:
    available = psutil.virtual_memory().available
    return int(min(available * _DEFAULT_KV_FRACTION, _DEFAULT_KV_CAP))


class LLMEngine:
    """Requests in, steps out.

    `detokenize=False` is for an engine core behind an API server: the server turns tokens
    into text (and finds stop strings) in its own process so text work never delays a step,
    and this engine then reports token ids only.
    """

    def __init__(self, config: EngineConfig, detokenize: bool = True) -> None:
        started = time.perf_counter()
        self.config = config
        self.detokenize = detokenize
        load = config.load
        if load.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {load.dtype!r}")
        if load.num_threads:
            torch.set_num_threads(load.num_threads)
        self.dtype = getattr(torch, load.dtype)
        resolved = resolve_model(config.model, load.dtype, load.cache_dir)
        self.model_name = resolved.name
        self.hf_dir = resolved.hf_dir
        self.model_config: ModelConfig = read_model_config(resolved.hf_dir)
        # Dummy weights may come with a bare config.json; then callers pass token ids.
        skip_tokenizer = load.load_format == "dummy" and not _has_tokenizer(resolved.hf_dir)
        self.tokenizer = None if skip_tokenizer else load_tokenizer(resolved.hf_dir)

        cache = config.cache
        block_bytes = kv_bytes_per_block(self.model_config, cache.block_size, self.dtype)
        budget = cache.kv_cache_memory_bytes or default_kv_cache_bytes()
        num_blocks = budget // block_bytes
        if num_blocks < 2:
            raise ValueError(
                f"--kv-cache-memory {budget} bytes holds {num_blocks} blocks of {block_bytes} bytes; need at least 2"
            )
        self.max_model_len = self._max_model_len(num_blocks * cache.block_size)

        backend = make_attention_backend(load.attention_backend, Path(load.cache_dir) if load.cache_dir else default_cache_dir())
        model = self._load_model(resolved.hf_dir, backend)

        self.block_pool = BlockPool(num_blocks, cache.enable_prefix_caching)
        self.kv_manager = KVCacheManager(
            self.block_pool, cache.block_size, root_hash(self.model_name, load.dtype, cache.block_size)
        )
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, self.max_model_len)
        self.kv_shm_path = None
        if config.kv_transfer.shared_memory:
            self.kv_shm_path = f"/dev/shm/tandem-kv-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.runner = ModelRunner(model, self.model_config, backend, num_blocks, cache.block_size, self.dtype,
                                  load.seed, kv_shm_path=self.kv_shm_path)
        self._groups: dict[str, _Group] = {}
        self._sequences: dict[str, tuple[_Group, _Sequence]] = {}
        self._next_id = 0
        self.startup_seconds = time.perf_counter() - started
        logger.info(
            "KV cache: %d blocks = %d tokens (%.2f GiB, %s); max model len %d; %s attention; ready in %.1f s",
            num_blocks, num_blocks * cache.block_size, num_blocks * block_bytes / (1 << 30),
            load.dtype, self.max_model_len, backend.name, self.startup_seconds,
        )

    def close(self) -> None:
        """Remove the shared KV cache file, if any (the mapping lives on until exit)."""
        if self.kv_shm_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.kv_shm_path)
            self.kv_shm_path = None

    def _load_model(self, hf_dir: Path, backend: TorchAttentionBackend) -> torch.nn.Module:
        """Build the model, fill its weights, then lay them out for the kernels that read them."""
        load = self.config.load
        model = build_model(self.model_config, backend, self.max_model_len, self.dtype)
        if load.load_format == "dummy":
            init_dummy_weights(model, load.seed)
        else:
            load_weights(model, hf_dir)
        small_step = self._small_step_weights()
        if small_step is not None:
            added = attach_small_step_weights(model, small_step)
            logger.info("%s small-step weight copy for steps of <= %d tokens (+%.0f MiB)",
                        str(small_step.dtype).removeprefix("torch."), small_step.max_tokens, added / (1 << 20))
        if load.pack_weights and pack_weights_for_cpu(model):
            logger.info("linear weights packed for oneDNN")
        return model

    def _small_step_weights(self) -> SmallStepWeights | None:
        load = self.config.load
        choice = load.decode_weights
        if choice == "none" or load.decode_weights_max_tokens < 1:
            return None
        if choice not in ("float16", "bfloat16"):
            raise ValueError(f"decode weights must be none, float16 or bfloat16, not {choice!r}")
        return SmallStepWeights(load.decode_weights_max_tokens, getattr(torch, choice))

    def _max_model_len(self, kv_tokens: int) -> int:
        limits = [self.model_config.max_position_embeddings, kv_tokens]
        if self.model_config.sliding_window:
            limits.append(self.model_config.sliding_window)
        if self.config.scheduler.max_model_len:
            if self.config.scheduler.max_model_len > self.model_config.max_position_embeddings:
                raise ValueError(
                    f"max_model_len {self.config.scheduler.max_model_len} exceeds the model's "
                    f"{self.model_config.max_position_embeddings} positions"
                )
            limits.append(self.config.scheduler.max_model_len)
        return min(limits)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    # --- requests -------------------------------------------------------------------
    def new_request_id(self) -> str:
        self._next_id += 1
        return f"req-{self._next_id}"

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer; pass prompt_token_ids")
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt is empty; give at least one token")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens but the context is {self.max_model_len}; "
                "shorten the prompt or raise --max-model-len"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        params.validate()

    def add_request(
        self,
        request_id: str | None,
        prompt: str | None,
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
        prior_output_ids: list[int] | None = None,
        keep_prompt_kv: bool = False,
    ) -> str:
        """Queue a request; returns its id.

        `prior_output_ids` are tokens already generated elsewhere (a prefill worker's first
        token): they count as output for max_tokens and penalties, and their KV is computed
        here. `keep_prompt_kv` keeps the prompt's full KV blocks referenced when the request
        ends, for a decode worker to read (`take_kept_blocks`).
        """
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("give a prompt or prompt_token_ids")
            prompt_token_ids = self.tokenize(prompt)
        self.validate_prompt(prompt_token_ids, params)
        request_id = request_id or self.new_request_id()
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if (prior_output_ids or keep_prompt_kv) and params.n != 1:
            raise ValueError("a KV handoff (prior output or kept prompt KV) needs n == 1")
        group = _Group(request_id, prompt, list(prompt_token_ids))
        expected_hit = self.kv_manager.cached_prefix_blocks(list(prompt_token_ids)) * self.kv_manager.block_size
        for index in range(params.n):
            child_params = params if params.n == 1 else params.for_child(index)
            seq_id = request_id if params.n == 1 else f"{request_id}#{index}"
            request = Request(seq_id, list(prompt_token_ids), child_params, self.eos_token_ids,
                              output_token_ids=list(prior_output_ids or []),
                              expected_cached_tokens=min(expected_hit, len(prompt_token_ids) - 1))
            detok = None
            if self.tokenizer is not None and self.detokenize:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, child_params.skip_special_tokens)
            seq = _Sequence(index, request, detok, [] if child_params.logprobs is not None else None,
                            0.0 if child_params.logprobs is not None else None)
            group.sequences.append(seq)
        if keep_prompt_kv:
            self.kv_manager.keep_prompt_blocks(request_id)
        for seq in group.sequences:
            self.scheduler.add_request(seq.request)
            self._sequences[seq.request.request_id] = (group, seq)
        self._groups[request_id] = group
        return request_id

    def abort(self, request_id: str) -> None:
        group = self._groups.pop(request_id, None)
        if group is None:
            return
        for seq in group.sequences:
            self._sequences.pop(seq.request.request_id, None)
            if seq.finish_reason is None:
                seq.finish_reason = RequestStatus.FINISHED_ABORTED.value
        self.scheduler.abort(s.request.request_id for s in group.sequences)

    def finish_sequence(self, request_id: str, index: int) -> None:
        """Stop one sequence of a request for a reason found outside (a stop string in text)."""
        group = self._groups.get(request_id)
        if group is None or not 0 <= index < len(group.sequences):
            return
        seq = group.sequences[index]
        if seq.finish_reason is None:
            seq.finish_reason = RequestStatus.FINISHED_STOPPED.value
            self.scheduler.finish(seq.request.request_id, RequestStatus.FINISHED_STOPPED)
        if group.finished:
            self._groups.pop(request_id, None)
            for s in group.sequences:
                self._sequences.pop(s.request.request_id, None)

    def load(self) -> EngineLoad:
        scheduler, pool = self.scheduler, self.block_pool
        # A waiting request's cached prefix costs nothing to compute: a router balancing
        # prefill work must not see a 6,000-token turn with 5,700 cached as 6,000 tokens.
        waiting_tokens = sum(
            r.num_tokens - max(r.num_computed_tokens, r.expected_cached_tokens) for r in scheduler.waiting
        )
        prefilling = sum(
            r.num_tokens - r.num_computed_tokens for r in scheduler.running
            if r.num_tokens - r.num_computed_tokens > 1
        )
        stats = self.kv_manager.stats
        return EngineLoad(
            num_waiting=len(scheduler.waiting),
            num_running=len(scheduler.running),
            waiting_prefill_tokens=waiting_tokens + prefilling,
            running_kv_tokens=sum(r.num_computed_tokens for r in scheduler.running),
            kv_blocks_used=pool.num_used_blocks,
            kv_blocks_total=pool.num_blocks,
            kv_blocks_cached=pool.num_cached_blocks,
            prefix_cache_queries=stats.queries,
            prefix_cache_hits=stats.hits,
            num_preemptions=scheduler.num_preemptions,
        )

    def has_unfinished(self) -> bool:
        return bool(self._groups)

    # --- KV handoff between workers ----------------------------------------------------
    def take_kept_blocks(self, request_id: str) -> list[KVBlock]:
        """The prompt blocks kept for a handoff; the caller owns one reference on each."""
        return self.kv_manager.take_kept(request_id)

    def reserve_blocks(self, count: int) -> list[KVBlock] | None:
        """Blocks to fill with KV from another worker, or None when the pool is too full."""
        if count > self.block_pool.num_free_blocks:
            return None
        return self.block_pool.allocate(count)

    def release_blocks(self, blocks: list[KVBlock]) -> None:
        self.block_pool.free(list(reversed(blocks)))

    def is_scheduled(self, request_id: str) -> bool:
        """True once every sequence of the request has been admitted at least once."""
        group = self._groups.get(request_id)
        return group is not None and all(s.request.first_scheduled_time is not None for s in group.sequences)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._groups

    @property
    def num_unfinished(self) -> int:
        return len(self._groups)

    # --- stepping -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduler + model step; outputs of every request that changed."""
        out = self.scheduler.schedule()
        sampled = self.runner.execute(out)
        progressed, finished = self.scheduler.update_from_output(out, sampled)
        touched: dict[str, _Group] = {}
        for request in progressed:
            group, seq = self._sequences[request.request_id]
            self._on_token(seq, sampled[request.request_id])
            touched[group.request_id] = group
        for done in finished:
            entry = self._sequences.get(done.request.request_id)
            if entry is None:
                continue
            group, seq = entry
            if seq.finish_reason is None:
                if seq.detokenizer is not None:
                    seq.text += seq.detokenizer.flush()
                seq.finish_reason = done.reason.value
                seq.stop_reason = done.request.stop_reason
            touched[group.request_id] = group
        outputs = []
        for group in touched.values():
            outputs.append(group.output())
            if group.finished:
                self._groups.pop(group.request_id, None)
                for seq in group.sequences:
                    self._sequences.pop(seq.request.request_id, None)
        return outputs

    def _on_token(self, seq: _Sequence, token: SampledToken) -> None:
        if seq.finish_reason is not None:
            return
        if seq.logprobs is not None and token.logprob is not None:
            seq.logprobs.append(token.top_logprobs or [])
            seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + token.logprob
        if seq.detokenizer is None:
            return
        delta = seq.detokenizer.add(token.token_id)
        seq.text += delta
        params = seq.request.sampling_params
        if params.stop and delta:
            hit = find_stop(seq.text, len(delta), params.stop)
            if hit is not None:
                index, stop = hit
                seq.text = seq.text[: index + (len(stop) if params.include_stop_str_in_output else 0)]
                seq.finish_reason = RequestStatus.FINISHED_STOPPED.value
                seq.stop_reason = stop
                self.scheduler.finish(seq.request.request_id, RequestStatus.FINISHED_STOPPED)


def _has_tokenizer(hf_dir: Path) -> bool:
    return any((hf_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
