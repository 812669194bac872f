"""Engine settings that cannot work together, refused from the config alone.

A rank used to find these only once it ran: after the processes had started, sometimes after
the model was resolved. Every one of them is decided by the `EngineConfig` itself (the device
is settled when the config is made, tandem/platform/device.py), so the flag parser runs them
too and `tandem serve` / `generate` / `chat` fail at once with one line; the worker still runs
them, for engines built another way (`tandem.LLM`, a headless rank).

What only a rank can know stays there (tandem/worker/): whether this torch sees the GPU and
has the int8 GEMM, whether the weights fit this host's memory, the model's own limits
(positions, heads, layers) and the KV blocks that fit. torch-free: the API process imports it.
"""

from __future__ import annotations

from tandem.config import (
    ASYNC_SCHEDULING,
    DECODE_WEIGHT_FORMATS,
    DTYPES,
    KV_CACHE_DTYPES,
    EngineConfig,
)

MAX_BLOCK_SIZE = 1024  # a block is allocated whole: beyond this, most of one would sit empty


def check_engine_config(config: EngineConfig) -> None:
    """ValueError, saying why, for settings that cannot work together."""
    _check_parallel(config)
    _check_async_scheduling(config)
    load = config.load
    if load.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {load.dtype!r}")
    _check_kv_cache_dtype(config)
    block_size = config.cache.block_size
    if not (isinstance(block_size, int) and not isinstance(block_size, bool) and 1 <= block_size <= MAX_BLOCK_SIZE):
        raise ValueError(f"--block-size must be a whole number of tokens from 1 to {MAX_BLOCK_SIZE}, not {block_size!r}")
    if not 0 < config.cache.memory_utilization <= 1:
        raise ValueError(f"--memory-utilization must be in (0, 1], not {config.cache.memory_utilization!r}")
    if load.quantization not in ("none", "int8", "w8a16"):
        raise ValueError(f"--quantization must be none, int8 or w8a16, not {load.quantization!r}")
    if load.quantization == "w8a16" and load.dtype != "bfloat16":
        raise ValueError(f"--quantization w8a16 widens 8-bit weights to bf16 rows: it needs --dtype bfloat16, "
                         f"not {load.dtype}")
    if load.device == "cuda":
        if load.quantization != "none" or load.decode_weights != "none":
            raise ValueError("--quantization and --decode-weights are CPU kernels; on a GPU the model runs in "
                             f"--dtype ({load.dtype}); drop them or pass --device cpu")
    else:
        _check_decode_weights(config)


def _check_parallel(config: EngineConfig) -> None:
    parallel = config.parallel
    if parallel.splits_model and config.speculative.method in ("draft_model", "eagle3"):
        raise ValueError(f"speculative method {config.speculative.method!r} runs its model beside a whole "
                         "target on one rank; it does not yet work with --tensor-parallel-size or "
                         "--pipeline-parallel-size > 1")
    if parallel.splits_model and (config.kv_transfer.role != "both" or config.kv_tiers.enabled):
        raise ValueError(
            "--tensor-parallel-size or --pipeline-parallel-size > 1 does not yet work with --role "
            "prefill/decode or the KV tiers: each rank holds its own part of every block, and they "
            "move whole blocks"
        )


def _check_async_scheduling(config: EngineConfig) -> None:
    choice = config.scheduler.async_scheduling
    if choice not in ASYNC_SCHEDULING:
        raise ValueError(f"--async-scheduling must be one of {', '.join(ASYNC_SCHEDULING)}, not {choice!r}")
    if choice == "on" and not config.runs_ahead_possible:
        raise ValueError("--async-scheduling on needs one rank in the engine's process and no speculative "
                         "decoding: with several ranks or a pipeline the steps already overlap as micro-batches, "
                         "and drafts are proposed from the tokens the step before kept")


def _check_kv_cache_dtype(config: EngineConfig) -> None:
    """Every attention backend reads every KV cache dtype: int8 rows with their scales
    (tandem/kernels/kv_format.py) and float8 e4m3 (fp8) values in the C decode kernel, the
    torch path and the Triton kernels. int8 rows the PD handoff over tcp and the tiers move
    (to and from caches of any dtype: the reader rounds what it receives into its rows; a
    shared-memory copy only between two int8 caches, a float reader asks over the port), and
    speculative decoding takes them (the target's cache is int8, a draft model or Eagle head
    keeps its own cache in the model's dtype). An fp8 cache's blocks leave and enter as its
    e4m3 bytes, its layers' scales in the layout they name (kvcache/codec.py converts to and from
    any cache dtype, and between fp8 caches of other scales); a shared-memory copy only between
    two fp8 caches of the same scales, another reader asks over the port.
    Speculative decoding takes it as it takes int8. A bf16 cache under an fp32 model is a float cache
    like any other (the C decode kernel widens bf16 rows for fp32 queries, the C layer stack
    narrows each decode step's keys and values into it, and a prefill chunk widens its blocks
    for the C prefill kernel, as for int8 and fp8). Tested
    on the CPU backends, the PD handoff, the tiers and the (interpreted) Triton kernels."""
    choice = config.cache.kv_cache_dtype
    if choice == "auto":
        return
    if choice not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {choice!r}")


def _check_decode_weights(config: EngineConfig) -> None:
    """--decode-weights on the CPU: a known compact format, and float32 only for an fp32 model."""
    load = config.load
    choice = load.decode_weights
    if choice == "none" or load.decode_weights_max_tokens < 1:
        return
    if choice not in DECODE_WEIGHT_FORMATS:
        raise ValueError(f"decode weights must be none or one of {', '.join(DECODE_WEIGHT_FORMATS)}, not {choice!r}")
    if choice == "float32" and load.dtype != "float32":
        raise ValueError(f"--decode-weights float32 keeps an fp32 model's own rows; this model runs in {load.dtype} "
                         "(its compact copies are float16, bfloat16 or int4)")
