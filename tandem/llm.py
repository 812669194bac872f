"""`LLM`: offline batched generation, the same shape as vLLM's `LLM` class."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from tandem.config import (
    CacheConfig,
    EngineConfig,
    KVTiersConfig,
    LoadConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    parse_memory_size,
)
from tandem.engine.llm_engine import LLMEngine
from tandem.loader.tokenizer import render_chat
from tandem.sizing.memory import DEFAULT_MEMORY_UTILIZATION
from tandem.types import RequestOutput, SamplingParams

PromptInput = str | list[int] | dict[str, Any]
Messages = list[dict[str, Any]]


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        block_size: int | None = None,
        kv_cache_memory: str | int | None = None,
        enable_prefix_caching: bool = True,
        kv_cache_dtype: str = "auto",
        memory_utilization: float = DEFAULT_MEMORY_UTILIZATION,
        lazy_kv_cache: bool = False,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        jump_forward: bool = True,
        async_scheduling: str = "auto",
        load_format: str = "auto",
        seed: int = 0,
        num_threads: int | None = None,
        cache_dir: str | None = None,
        decode_weights: str = "auto",
        decode_weights_max_tokens: int = 2,
        quantization: str = "auto",
        exact: bool = False,
        pack_weights: bool = True,
        attention_backend: str = "auto",
        device: str = "auto",
        enforce_eager: bool = False,
        max_cudagraph_batch: int = 128,
        world_size: int = 1,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        nnodes: int = 1,
        node_rank: int = 0,
        master_addr: str = "127.0.0.1",
        master_port: int = 0,
        join_timeout: float = 120.0,
        distributed_executor_backend: str = "auto",
        kv_tiers: KVTiersConfig | None = None,
        speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None,
    ) -> None:
        config = EngineConfig(
            model=model or "smollm2-135m",
            load=LoadConfig(dtype=dtype, load_format=load_format, seed=seed, cache_dir=cache_dir,
                            num_threads=num_threads, decode_weights=decode_weights,
                            decode_weights_max_tokens=decode_weights_max_tokens, quantization=quantization,
                            exact=exact, pack_weights=pack_weights,
                            attention_backend=attention_backend, device=device, enforce_eager=enforce_eager,
                            max_cudagraph_batch=max_cudagraph_batch),
            cache=CacheConfig(
                block_size=block_size,
                kv_cache_memory_bytes=None if kv_cache_memory is None else parse_memory_size(kv_cache_memory),
                enable_prefix_caching=enable_prefix_caching,
                kv_cache_dtype=kv_cache_dtype,
                memory_utilization=memory_utilization,
                lazy_kv_cache=lazy_kv_cache,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                jump_forward=jump_forward,
                async_scheduling=async_scheduling,
            ),
            parallel=ParallelConfig.of(world_size, tensor_parallel_size, distributed_executor_backend,
                                       pipeline_parallel_size=pipeline_parallel_size,
                                       enable_expert_parallel=enable_expert_parallel, nnodes=nnodes,
                                       node_rank=node_rank, master_addr=master_addr, master_port=master_port,
                                       join_timeout=join_timeout),
            kv_tiers=kv_tiers or KVTiersConfig(),
            speculative=(speculative_config if isinstance(speculative_config, SpeculativeConfig)
                         else SpeculativeConfig.from_json(speculative_config)),
        )
        self.engine = LLMEngine(config)

    def shutdown(self) -> None:
        """Stop the engine (and its rank processes, if any)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt, batched together; outputs in prompt order.

        A prompt is text, a list of token ids, or {"prompt_token_ids": [...]}. Every prompt is
        validated before any is queued, so one bad prompt rejects the call cleanly.
        """
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        params_list = self._params_for(sampling_params, len(prompts))
        staged = []
        for prompt, params in zip(prompts, params_list, strict=True):
            text, token_ids = self._split_prompt(prompt)
            if token_ids is None:
                token_ids = self.engine.tokenize(text)
            self.engine.validate_prompt(token_ids, params)
            staged.append((text, token_ids, params))
        ids = [self.engine.add_request(None, text, params, token_ids, validated=True)
               for text, token_ids, params in staged]
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        prompts = [
            {"prompt": text, "prompt_token_ids": self.engine.tokenizer.encode(text, add_special_tokens=False)}
            for text in (
                render_chat(self.engine.tokenizer, list(conversation), add_generation_prompt, tools)
                for conversation in messages
            )
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    @staticmethod
    def _split_prompt(prompt: PromptInput) -> tuple[str | None, list[int] | None]:
        if isinstance(prompt, str):
            return prompt, None
        if isinstance(prompt, dict):
            return prompt.get("prompt"), prompt.get("prompt_token_ids")
        if isinstance(prompt, list):
            return None, list(prompt)
        raise ValueError(f"a prompt is text, a list of token ids or a dict, not {type(prompt).__name__}")

    @staticmethod
    def _params_for(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams() for _ in range(count)]
        if isinstance(params, SamplingParams):
            return [params] * count
        params = list(params)
        if len(params) != count:
            raise ValueError(f"got {len(params)} sampling params for {count} prompts")
        return params

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        bar = tqdm(total=len(request_ids), desc="generating", unit="req", disable=not use_tqdm)
        try:
            while wanted - finished.keys():
                for output in self.engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        bar.update(1)
        except BaseException:
            for request_id in wanted - finished.keys():
                self.engine.abort(request_id)
            raise
        finally:
            bar.close()
        return [finished[request_id] for request_id in request_ids]
