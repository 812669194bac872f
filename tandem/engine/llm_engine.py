"""The synchronous engine for offline use (`LLM`): an engine core in this process, plus text.

The engine core (engine_core.py) turns token ids into per-step token deltas; this wraps it
with the model's tokenizer and the same output processor the API server uses
(output_processor.py), so `LLM.generate` and `tandem serve` make text, stop strings and
logprobs the same way. Prompts are validated here, at the edge; the core trusts them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tandem.config import EngineConfig
from tandem.engine.block_pool import BlockPool
from tandem.engine.engine_core import EngineCore, EngineCoreRequest
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.output_processor import RequestText
from tandem.engine.scheduler import Scheduler
from tandem.executor.base import Executor
from tandem.types import CompletionOutput, EngineLoad, RequestOutput, SamplingParams, TokenLogprob

logger = logging.getLogger(__name__)


@dataclass
class _SequenceOutput:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[list[TokenLogprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _OfflineRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: RequestText
    sequences: list[_SequenceOutput]
    num_cached_tokens: int = 0
    queue_seconds: float | None = None

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[CompletionOutput(i, s.text, s.token_ids, s.cumulative_logprob, s.logprobs, s.finish_reason,
                                      s.stop_reason) for i, s in enumerate(self.sequences)],
            finished=self.text.finished,
            num_cached_tokens=self.num_cached_tokens,
            queue_seconds=self.queue_seconds,
        )


class LLMEngine:
    """Requests in, finished outputs out, one engine step at a time."""

    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        self.config = config
        self.core = EngineCore(config, executor)
        hf_dir = Path(self.core.hf_dir)
        # Dummy weights may come with a bare config.json; then callers pass token ids.
        self.tokenizer: Any = None
        if config.load.load_format != "dummy" or _has_tokenizer(hf_dir):
            from tandem.loader.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(hf_dir)
        self._requests: dict[str, _OfflineRequest] = {}
        self._next_id = 0

    # --- what the engine is ----------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.core.model_name

    @property
    def hf_dir(self) -> Path:
        return Path(self.core.hf_dir)

    @property
    def model_config(self) -> Any:
        return self.core.model_config

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def startup_seconds(self) -> float:
        return self.core.startup_seconds

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.core.eos_token_ids

    @property
    def block_pool(self) -> BlockPool:
        return self.core.block_pool

    @property
    def kv_manager(self) -> KVCacheManager:
        return self.core.kv_manager

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def worker(self) -> Any:
        """The in-process worker (its model runner, model and KV cache), for tests and benches."""
        worker = getattr(self.core.executor, "worker", None)
        if worker is None:
            raise RuntimeError("the ranks run in other processes; there is no in-process worker")
        return worker

    @property
    def runner(self) -> Any:
        return self.worker.runner

    def load(self) -> EngineLoad:
        return self.core.load()

    def close(self) -> None:
        self.core.shutdown()

    # --- requests -------------------------------------------------------------------
    def new_request_id(self) -> str:
        self._next_id += 1
        return f"req-{self._next_id}"

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer; pass prompt_token_ids")
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """The edge check for offline requests (the API server has its own, in OpenAI's terms)."""
        del params  # a SamplingParams validates itself when it is built
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

    def add_request(self, request_id: str | None, prompt: str | None, params: SamplingParams,
                    prompt_token_ids: list[int] | None = None, cache_salt: str | None = None,
                    validated: bool = False) -> str:
        """Queue a request (validated here unless the caller just did); returns its id."""
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("give a prompt or prompt_token_ids")
            prompt_token_ids = self.tokenize(prompt)
        if not validated:
            self.validate_prompt(prompt_token_ids, params)
        request_id = request_id or self.new_request_id()
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = list(prompt_token_ids)
        self.core.add_request(EngineCoreRequest(request_id, token_ids, params, cache_salt=cache_salt))
        sequences = [_SequenceOutput(logprobs=[] if params.logprobs is not None else None,
                                     cumulative_logprob=0.0 if params.logprobs is not None else None)
                     for _ in range(params.n)]
        self._requests[request_id] = _OfflineRequest(request_id, prompt, token_ids,
                                                     RequestText(self.tokenizer, token_ids, params), sequences)
        return request_id

    def abort(self, request_id: str) -> None:
        if self._requests.pop(request_id, None) is not None:
            self.core.abort([request_id])

    def has_unfinished(self) -> bool:
        """Requests to finish, or pipeline steps still in flight to collect."""
        return bool(self._requests) or self.core.has_in_flight

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    # --- stepping -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; the outputs of the requests that finished in it."""
        finished = []
        for delta in self.core.step():
            request = self._requests.get(delta.request_id)
            if request is None:
                continue
            request.num_cached_tokens = delta.num_cached_tokens
            if delta.queue_seconds is not None:
                request.queue_seconds = delta.queue_seconds
            if delta.error is not None:  # the engine stopped this request; the others go on
                logger.error("request %s failed: %s", request.request_id, delta.error)
                for sequence in request.sequences:
                    sequence.finish_reason = sequence.finish_reason or "abort"
                del self._requests[request.request_id]
                finished.append(replace(request.output(), finished=True))
                continue
            step, stopped = request.text.process(delta)
            for index in stopped:
                self.core.finish_sequence(request.request_id, index)
            for seq_step in step.sequences if step is not None else []:
                self._accumulate(request.sequences[seq_step.index], seq_step)
            if request.text.finished:
                del self._requests[request.request_id]
                if self.core.has_request(request.request_id):
                    self.core.abort([request.request_id])
                finished.append(request.output())
        return finished

    @staticmethod
    def _accumulate(sequence: _SequenceOutput, step: Any) -> None:
        sequence.text += step.text
        sequence.token_ids.extend(step.token_ids)
        if sequence.logprobs is not None and step.logprobs:
            sequence.logprobs.extend(step.logprobs)
            sequence.cumulative_logprob = (sequence.cumulative_logprob or 0.0) + sum(
                entry[0].logprob for entry in step.logprobs if entry)
        if step.finish_reason is not None:
            sequence.finish_reason, sequence.stop_reason = step.finish_reason, step.stop_reason


def _has_tokenizer(hf_dir: Path) -> bool:
    return any((hf_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
