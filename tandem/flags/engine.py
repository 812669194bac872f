"""Engine and server flags, and the config dataclasses built from them.

One leaf module that every command starting or launching an engine shares: `tandem serve`,
`generate` and `chat` parse these flags, `tandem up` and `tandem bench` take the engine flags
too and pass them on to the processes they start. It imports only `tandem.config` and the
default model's alias, so the command table (`tandem.cli.main`), `tandem.launch.up` and `tandem.bench.*`
can all depend on it without depending on each other, and `tandem route` stays torch-free.

The engine flags are data (`ENGINE_FLAGS`), not just `add_argument` calls: the same table
registers them, lists their defaults and turns a parsed namespace back into argv, so code
that forwards "the engine flags the user set" never has to read argparse's private state.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Collection
from typing import Any

from tandem.config import (
    DECODE_WEIGHT_FORMATS,
    KV_CACHE_DTYPES,
    CacheConfig,
    EngineConfig,
    GenerationDefaults,
    KVTiersConfig,
    KVTransferConfig,
    LoadConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
    SpeculativeConfig,
    parse_memory_size,
)
from tandem.config_checks import check_engine_config
from tandem.flags.limits import REQUEST_LIMIT_FLAGS, request_limits
from tandem.flags.table import Flag, FlagTable
from tandem.loader.resolve import DEFAULT_MODEL
from tandem.platform.device import DEVICES, resolve_device, resolve_dtype
from tandem.sizing.memory import DEFAULT_MEMORY_UTILIZATION
from tandem.trust.keys import CLUSTER_SECRET_ENV, admin_key_from_env, secret_from_env

# Names follow `vllm serve`. Order is the --help order and the order of `engine_argv`.
ENGINE_FLAGS = FlagTable("engine", (
    Flag("--dtype", "weight and activation dtype; auto = bfloat16 on a GPU; on a CPU the default mode's: "
         "bfloat16 where the CPU multiplies it natively (AMX, AVX-512-BF16), else float32 (default: auto)", "auto",
         choices=("auto", "float32", "bfloat16", "float16")),
    Flag("--exact", "the token-identical fp32 path: float32 with the checkpoint's own weights everywhere "
         "(greedy tokens equal transformers'), instead of the CPU's default mode (--dtype, --quantization "
         "and --decode-weights auto: the fastest mode measured within 1%% perplexity of fp32). One-token "
         "steps read the plain fp32 rows through tandem's GEMV kernel, kept beside the packed ones "
         "(--decode-weights none: one copy)", False,
         switch=True),
    Flag("--device", "where the model runs: cuda (one GPU per rank), cpu, or auto = cuda when this "
         "torch sees a GPU, else cpu (default: auto)", "auto", choices=DEVICES),
    Flag("--enforce-eager", "GPU: run every step eagerly; by default decode-only steps of up to "
         "--max-cudagraph-batch sequences replay CUDA graphs captured at start", False, switch=True),
    Flag("--max-cudagraph-batch", "GPU: the largest decode batch captured as a CUDA graph; bigger "
         "ones run eagerly (default: 128)", 128, type=int, metavar="N"),
    Flag("--block-size", "tokens per KV block (default: 64 on a CPU, where longer blocks read faster, "
         "16 on a GPU); a prefix is cached in whole blocks", type=int),
    Flag("--kv-cache-memory", "KV cache budget, e.g. 2GiB (default: 25%% of free RAM, at most 4GiB)",
         metavar="SIZE"),
    Flag("--lazy-kv-cache", "CPU: commit the KV budget's pages as they are first written instead of "
         "at start (a faster start and less resident memory, but each first write of a 4 KiB page "
         "costs ~2 us inside a step); by default the budget is committed whole at start, as vLLM "
         "zero-fills its cache, and a budget the machine cannot hold fails there", False, switch=True),
    Flag("--memory-utilization", "GPU: the share of each device the weights and KV cache may take; one "
         "step's activations and the CUDA context must fit in the rest, else the KV cache gives way "
         "(SGLang's --mem-fraction-static; vLLM's --gpu-memory-utilization caps activations too). "
         f"`tandem plan memory` prints what it leaves (default: {DEFAULT_MEMORY_UTILIZATION})", DEFAULT_MEMORY_UTILIZATION,
         type=float, metavar="FRACTION"),
    Flag("--kv-cache-dtype", "auto = the model's dtype; bfloat16 = bf16 rows (half an fp32 model's bytes); int8 = 8-bit rows with a scale each (every backend: CPU, torch, Triton): "
         "0.53x bf16's bytes for 64-wide heads, perplexity within 0.2%% on SmolLM2 and Qwen2.5; fp8 = float8 e4m3 with per-layer scales measured at start, "
         "every backend, 0.5x bf16's bytes, but over the quality bar where measured (+1.6%% / +2.5%% perplexity on "
         "SmolLM2 / Qwen2.5; prefer int8); its blocks hand off and tier as its bytes, the scales in the header (default: auto)", "auto", choices=KV_CACHE_DTYPES),
    Flag("--max-num-seqs", "most sequences per step (default: 128)", 128, type=int),
    Flag("--max-num-batched-tokens",
         "token budget per step, shared by decodes and prefill chunks (default: 2048)", 2048, type=int),
    Flag("--max-model-len", "context length (default: the model's, capped by the KV cache)", type=int),
    Flag("--no-prefix-caching", "disable automatic prefix caching", False, switch=True),
    Flag("--async-scheduling", "launch each step before the last one's tokens reach the host, decode "
         "inputs taken from its samples on the device, so scheduling and output handling overlap the "
         "forward; auto = on for a GPU with one rank and no speculative decoding, off on a CPU (where the "
         "host is the device); requests with penalties, a grammar or min_tokens still pending wait for "
         "their tokens as before (default: auto)", "auto", choices=("auto", "on", "off")),
    Flag("--no-jump-forward", "structured outputs: sample every token, even those the grammar forces "
         "(by default a JSON key or a tool call's envelope is appended without sampling)", False, switch=True),
    Flag("--load-format",
         "'dummy' fills random weights (for performance work on configs without weights)", "auto",
         choices=("auto", "dummy")),
    Flag("--seed", "engine seed for unseeded sampling (default: 0)", 0, type=int),
    Flag("--threads", "torch intra-op threads (default: torch's)", type=int),
    Flag("--decode-weights",
         "fast mode: small (decode) steps, bound by weight bandwidth, read a compact copy of the "
         "weights: half precision, or int4 (4-bit, a scale and zero per 32 columns; 8-bit where "
         "4 bits would spoil a matrix; perplexity +0.02%% on the default model); float32 "
         "(an fp32 model), or bfloat16 in a bf16 model, keeps the model's own plain rows beside "
         "the packed ones for tandem's GEMV kernel: no rounding of its own, the layers' weights "
         "held twice; auto = int4 on a CPU with AVX2 or "
         "AVX-512 and one rank (the CPU's default mode), else none (default: auto)", "auto",
         choices=("auto", "none", *DECODE_WEIGHT_FORMATS)),
    Flag("--decode-weights-max-tokens",
         "largest step, in tokens, that reads the --decode-weights copy (default: 2)", 2, type=int,
         metavar="N"),
    Flag("--quantization",
         "int8: the decoder layers' projections multiply 8-bit weights (a scale per output row) by "
         "8-bit activations (a scale per token, its 4 largest values kept exact) with integer dot "
         "products, about twice bf16's rate on prefill and batched decode; perplexity within 0.6%% "
         "of fp32 on the default model; the LM head and any --decode-weights steps keep their "
         "weights; auto = int8 in the CPU's default mode (--dtype auto) for a quantized (GGUF) "
         "checkpoint on a CPU with AMX or AVX-512-VNNI and one rank, else none (default: auto). "
         "w8a16: with --dtype bfloat16 on a CPU with AMX, the decoder layers' projections keep "
         "8-bit weights (a scale per output row) widened to bf16 on the tiles: half the bytes a "
         "batched decode step reads", "auto", choices=("auto", "none", "int8", "w8a16")),
    Flag("--no-weight-packing", "keep weights dense for F.linear instead of oneDNN's packed layout",
         False, switch=True),
    Flag("--attention-backend",
         "decode attention: cpu = a C kernel reading the paged cache in place (compiled on first "
         "use with the system C compiler), torch = gather + matmuls, triton = the Triton kernels "
         "(a GPU's; on a CPU only under TRITON_INTERPRET=1, slowly: for tests), auto = cpu when it "
         "compiles, else torch (default: auto)", "auto", choices=("auto", "cpu", "torch", "triton")),
    Flag("--world-size",
         "ranks that run the model, one process each, joined by torch.distributed (gloo on CPU, NCCL "
         "on GPU); each holds the whole model unless --tensor-parallel-size splits it (default: 1)",
         1, type=int, metavar="N"),
    Flag("--tensor-parallel-size",
         "ranks that split every layer between them (heads, MLP width, vocabulary), one process "
         "each, joined by torch.distributed; sets --world-size (default: 1)", 1, type=int, metavar="N"),
    Flag("--pipeline-parallel-size",
         "stages that split the layers between them, each a rank (or a tensor-parallel group); the "
         "engine keeps a micro-batch in flight per stage; world size = TP x PP (default: 1)", 1,
         type=int, metavar="N"),
    Flag("--enable-expert-parallel",
         "MoE models: shard whole experts over the tensor-parallel ranks and send each token to "
         "its experts by all-to-all, instead of splitting every expert", False, switch=True),
    Flag("--nnodes",
         "hosts the ranks span; node 0 runs the engine, the others `tandem serve --headless` "
         "(default: 1)", 1, type=int, metavar="N"),
    Flag("--node-rank", "this host's place among the --nnodes (default: 0)", 0, type=int, metavar="K"),
    Flag("--master-addr",
         "node 0's address, where every rank meets: torch.distributed on --master-port, rank r's "
         "channel to the engine on --master-port + 1 + r (default: 127.0.0.1)", "127.0.0.1", metavar="ADDR"),
    Flag("--master-port", "see --master-addr; needed with --nnodes > 1 (default: a free port)", 0,
         type=int, metavar="PORT"),
    Flag("--join-timeout",
         "seconds for every rank, on every node, to join before start-up fails naming the ranks "
         "missing and the address they should reach (default: 120)", 120.0, type=float, metavar="S"),
    Flag("--distributed-executor-backend",
         "uni = the one rank inside the engine core process, mp = one process per rank, auto = uni "
         "for one rank, else mp (default: auto)", "auto", choices=("auto", "uni", "mp")),
    Flag("--speculative-config",
         "speculative decoding, as JSON in vLLM's shape, e.g. '{\"method\": \"ngram\", "
         "\"num_speculative_tokens\": 4}'; methods: ngram, suffix, draft_model, eagle3; "
         "\"adaptive\": false pins k (default: off)", metavar="JSON"),
    Flag("--kv-offload-cpu-bytes",
         "KV tier in CPU memory: prefix chunks are copied here as they are computed and outlive "
         "their eviction from the KV cache, e.g. 8GiB (default: off)", metavar="SIZE"),
    Flag("--kv-offload-disk-path",
         "KV tier on local disk: one file per chunk in DIR, kept across restarts (default: off)",
         metavar="DIR"),
    Flag("--kv-offload-disk-bytes", "budget of the disk tier, oldest chunks deleted first "
         "(default: 16GiB)", metavar="SIZE"),
    Flag("--kv-store",
         "cluster KV store every worker reads and writes: redis://HOST:PORT, valkey://HOST:PORT, "
         "or mooncake://MASTER:PORT[?segment=1GiB] for Mooncake Store (default: off)", metavar="URL"),
    Flag("--kv-chunk-blocks", "KV blocks per tier chunk, the unit stored and loaded (default: 256 "
         "tokens' worth: 4 blocks of 64 on a CPU, 16 of 16 on a GPU)", type=int, metavar="N"),
    Flag("--kv-store-admit-after",
         "a chunk enters the disk tier and the cluster store once N requests contained it, or at once "
         "when its request continues a prefix seen in N (a conversation's next turn); keeps one-shot "
         "prompts out (default: 2; 1 = every chunk)", 2, type=int, metavar="N"),
    Flag("--kv-tier-dtype",
         "how chunks are kept in the tiers (CPU memory, disk, cluster store): auto = the cache's "
         "own bytes; bfloat16; int8 = 8 bits a value, an fp32 scale per 64 of a token; int4 = 4 "
         "bits, values so, keys per channel over 64 tokens (0.53x / 0.29x of bf16's bytes: more "
         "chunks in the same budget); a reader decodes whatever a chunk holds (default: auto)", "auto",
         choices=["auto", "bfloat16", "int8", "int4"]),
))

# The positional MODEL and its vLLM spelling, outside any group.
MODEL_FLAGS = FlagTable(None, (
    Flag("model", f"HF directory, .gguf file or alias (default: {DEFAULT_MODEL})", DEFAULT_MODEL,
         nargs="?"),
    Flag("--model", "the same as the positional MODEL, as vLLM also takes it", dest_name="model_flag",
         metavar="MODEL"),
))


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The positional MODEL and the engine group, shared by every command that runs an engine."""
    MODEL_FLAGS.add_to(parser)
    ENGINE_FLAGS.add_to(parser)


def settle_model(args: argparse.Namespace) -> None:
    """`--model X` stands for the positional MODEL; giving two different ones is an error."""
    flag = getattr(args, "model_flag", None)
    if flag is None:
        return
    if args.model not in (DEFAULT_MODEL, flag):
        raise ValueError(f"two models given: {args.model!r} and --model {flag!r}")
    args.model = flag


def engine_defaults() -> dict[str, Any]:
    """dest -> default of MODEL and every engine flag."""
    return {"model": DEFAULT_MODEL, **ENGINE_FLAGS.defaults()}


def engine_values(args: argparse.Namespace) -> dict[str, Any]:
    """dest -> value of MODEL and every engine flag in `args` (the default where it is absent)."""
    return {dest: getattr(args, dest, default) for dest, default in engine_defaults().items()}


def settle_device(args: argparse.Namespace) -> None:
    """Replace `--dtype auto` in `args` by what it means on the device this host gives, so every
    reader (the GGUF conversion, the bench's peers, the child processes' argv) sees the dtype
    the engine will run in. `--device` stays as given: each engine settles it the same way. A
    command without the engine flags is left alone."""
    if hasattr(args, "device") and hasattr(args, "dtype") and args.device in DEVICES:
        args.dtype = resolve_dtype(args.dtype, resolve_device(args.device), getattr(args, "exact", False))


def engine_argv(args: argparse.Namespace, exclude: Collection[str] = ()) -> list[str]:
    """The engine flags set to something other than their default, as argv again (MODEL is not
    included). `exclude` names options (e.g. "--threads") the caller sets itself."""
    return ENGINE_FLAGS.argv(args, exclude)


def engine_config(args: argparse.Namespace, kv_transfer: KVTransferConfig | None = None) -> EngineConfig:
    """The engine's config; a ValueError (one line, exit 2) for flags that cannot work together,
    before any process starts. `kv_transfer`: a worker's role, given here, not replaced after,
    because the default mode depends on it (a prefill worker takes no decode copy)."""
    config = EngineConfig(
        model=args.model,
        load=LoadConfig(dtype=args.dtype, load_format=args.load_format, seed=args.seed,
                        num_threads=args.threads, decode_weights=args.decode_weights,
                        decode_weights_max_tokens=args.decode_weights_max_tokens,
                        quantization=args.quantization, exact=args.exact, pack_weights=not args.no_weight_packing,
                        attention_backend=args.attention_backend, device=args.device,
                        enforce_eager=args.enforce_eager, max_cudagraph_batch=args.max_cudagraph_batch),
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory_bytes=None if args.kv_cache_memory is None else parse_memory_size(args.kv_cache_memory),
            enable_prefix_caching=not args.no_prefix_caching,
            kv_cache_dtype=args.kv_cache_dtype,
            memory_utilization=args.memory_utilization,
            lazy_kv_cache=args.lazy_kv_cache,
        ),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                                  jump_forward=not getattr(args, "no_jump_forward", False),
                                  async_scheduling=getattr(args, "async_scheduling", "auto")),
        parallel=parallel_config(args),
        kv_tiers=kv_tiers_config(args),
        speculative=SpeculativeConfig.from_json(getattr(args, "speculative_config", None)),
        kv_transfer=kv_transfer or KVTransferConfig(),
    )
    check_engine_config(config)
    return config


def parallel_config(args: argparse.Namespace) -> ParallelConfig:
    """Ranks and how they split the model, from the parallelism flags."""
    return ParallelConfig.of(args.world_size, args.tensor_parallel_size, args.distributed_executor_backend,
                             pipeline_parallel_size=args.pipeline_parallel_size,
                             enable_expert_parallel=args.enable_expert_parallel,
                             nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
                             master_port=args.master_port, join_timeout=args.join_timeout)


def kv_tiers_config(args: argparse.Namespace) -> KVTiersConfig:
    """The KV tiers below the device pool, from the --kv-offload-* and --kv-store flags."""
    def size(value: Any, default: int) -> int:
        return default if value is None else parse_memory_size(value)

    get = lambda name: getattr(args, name, None)  # noqa: E731 - commands without the flags
    config = KVTiersConfig(
        cpu_bytes=size(get("kv_offload_cpu_bytes"), 0),
        disk_path=get("kv_offload_disk_path"),
        disk_bytes=size(get("kv_offload_disk_bytes"), KVTiersConfig.disk_bytes),
        store_url=get("kv_store"),
        chunk_blocks=get("kv_chunk_blocks"),  # None: 256 tokens' worth (EngineConfig settles it)
        admit_after=get("kv_store_admit_after") or KVTiersConfig.admit_after,
        codec="raw" if get("kv_tier_dtype") in (None, "auto") else get("kv_tier_dtype"),
    )
    if (config.chunk_blocks is not None and config.chunk_blocks < 1) or config.admit_after < 1:
        raise ValueError("--kv-chunk-blocks and --kv-store-admit-after must be at least 1")
    return config


def llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments of `tandem.LLM(args.model, **...)` (offline commands and bench runs),
    which takes the engine settings as keywords rather than an EngineConfig."""
    engine_config(args)  # refuses flags that cannot work together before the engine starts
    return {
        "dtype": args.dtype,
        "block_size": args.block_size,
        "kv_cache_memory": args.kv_cache_memory,
        "enable_prefix_caching": not args.no_prefix_caching,
        "kv_cache_dtype": args.kv_cache_dtype,
        "memory_utilization": args.memory_utilization,
        "lazy_kv_cache": args.lazy_kv_cache,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "jump_forward": not getattr(args, "no_jump_forward", False),
        "async_scheduling": getattr(args, "async_scheduling", "auto"),
        "load_format": args.load_format,
        "seed": args.seed,
        "num_threads": args.threads,
        "decode_weights": args.decode_weights,
        "decode_weights_max_tokens": args.decode_weights_max_tokens,
        "quantization": args.quantization,
        "exact": args.exact,
        "pack_weights": not args.no_weight_packing,
        "attention_backend": args.attention_backend,
        "device": args.device,
        "enforce_eager": args.enforce_eager,
        "max_cudagraph_batch": args.max_cudagraph_batch,
        "world_size": args.world_size,
        "tensor_parallel_size": args.tensor_parallel_size,
        "pipeline_parallel_size": args.pipeline_parallel_size,
        "enable_expert_parallel": args.enable_expert_parallel,
        "nnodes": args.nnodes,
        "node_rank": args.node_rank,
        "master_addr": args.master_addr,
        "master_port": args.master_port,
        "join_timeout": args.join_timeout,
        "distributed_executor_backend": args.distributed_executor_backend,
        "kv_tiers": kv_tiers_config(args),
        "speculative_config": SpeculativeConfig.from_json(getattr(args, "speculative_config", None)),
    }


SERVER_FLAGS = FlagTable("server", (
    Flag("--host", "address to bind (default: 127.0.0.1)", "127.0.0.1"),
    Flag("--port", "port (default: 8000)", 8000, type=int),
    Flag("--served-model-name",
         "model name(s) clients send; the first is reported (default: the MODEL argument)",
         nargs="+", metavar="NAME"),
    Flag("--api-key", "require 'Authorization: Bearer KEY' on /v1 endpoints (default: env TANDEM_API_KEY)"),
    Flag("--admin-key",
         "bearer token for the control endpoints (/reset_prefix_cache, /kv/*) and, once any "
         "key or secret is set, /metrics and /load (default: env TANDEM_ADMIN_KEY, else the "
         "cluster secret)", metavar="KEY"),
    Flag("--public-metrics",
         "keep /metrics, /load and /version open to anyone even with keys or a cluster "
         "secret set (e.g. for a Prometheus without credentials)", switch=True),
    Flag("--max-waiting",
         "sequences (prompts x n) accepted but not yet generating; a request that would "
         "take more gets 429 with Retry-After before anything is queued, one that alone "
         "asks for more gets 400; 0 = no limit (default: 512)", 512, type=int, metavar="N"),
    Flag("--max-waiting-tokens",
         "the same for prompt tokens waiting at once; 0 = no limit (default: 64 times "
         "the context length)", type=int, metavar="N"),
    Flag("--max-tokens-policy",
         "a request whose max_tokens exceeds what the context leaves after its prompt: cap "
         "serves it with max_tokens capped there (finish_reason 'length' when it gets that "
         "far; the applied and requested values in the x-tandem-max-tokens-applied and "
         "-requested response headers); reject answers 400, as vLLM does (default: cap)", "cap",
         choices=["cap", "reject"]),
    Flag("--override-generation-config",
         "sampling defaults for requests that leave a field out, as JSON (vLLM's flag): "
         "temperature, top_p, top_k, min_p, repetition_penalty, presence_penalty, "
         "frequency_penalty, and max_new_tokens for a request that names no max_tokens, e.g. "
         "'{\"temperature\": 0.7, \"max_new_tokens\": 2048}' (default: 1.0, no cut-off, "
         "and the context's rest)", metavar="JSON"),
    Flag("--tool-call-parser",
         "tool-call format (default: chosen from the chat template; hermes when it has none)",
         choices=["hermes", "qwen", "llama3_json", "kimi_k2", "deepseek_v3", "deepseek_v31", "qwen3_coder"]),
    Flag("--reasoning-parser",
         "return a reasoning model's <think> text apart from its answer, as reasoning_content "
         "(default: off, the answer holds it)",
         choices=["deepseek_r1", "qwen3", "kimi_k2"]),
    Flag("--no-access-log", "do not log one line per HTTP request", switch=True),
    Flag("--shutdown-timeout",
         "SIGTERM drains: new requests get a retryable 503, /health fails, running ones "
         "finish (and handed-over KV is read) for up to S seconds, then the server stops; "
         "a second SIGTERM or Ctrl-C stops it at once (default: 30)", 30.0, type=float, metavar="S"),
))

PD_FLAGS = FlagTable("prefill/decode disaggregation", (
    Flag("--role",
         "prefill: computes prompts and hands their KV to decode workers; decode: fetches "
         "that KV and generates; both: either, or whole requests (default: both)", "both",
         choices=["both", "prefill", "decode"]),
    Flag("--kv-transfer-host", "address this worker's KV source listens on (default: 127.0.0.1)",
         "127.0.0.1"),
    Flag("--kv-transfer-port", "its port (default: any free port)", 0, type=int),
    Flag("--kv-transfer-hold-timeout",
         "free kept prompt KV after S seconds if no decode worker released it (default: 60)", 60.0,
         type=float, metavar="S"),
    Flag("--kv-transfer-fetch-timeout",
         "a decode worker computes the prompt itself after S seconds (default: 10)", 10.0,
         type=float, metavar="S"),
    Flag("--cluster-secret",
         "the secret this worker's cluster shares: with it, the worker answers only requests "
         "its router signs (any other gets 401, /health aside), takes the handoff fields "
         "only from them, and its KV port serves only peers that sign with it; needed by "
         "--role prefill|decode (default: env TANDEM_CLUSTER_SECRET; tandem up makes one "
         "per cluster)", metavar="SECRET"),
    Flag("--kv-transfer-shm",
         "keep the KV cache in /dev/shm so decode workers on this host copy it directly", switch=True),
    Flag("--kv-transfer-dtype",
         "how a decode worker asks for prompt KV over tcp: auto = the cache's own bytes; "
         "bfloat16; int8 = 8 bits a value, an fp32 scale per 64 of a token; int4 = 4 bits, "
         "values so, keys per channel over 64 tokens (0.53x / 0.29x of bf16's bytes; a "
         "same-host shm copy stays raw) (default: auto)", "auto", choices=["auto", "bfloat16", "int8", "int4"]),
))


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """`tandem serve`'s HTTP and prefill/decode flags."""
    SERVER_FLAGS.add_to(parser)
    REQUEST_LIMIT_FLAGS.add_to(parser)
    PD_FLAGS.add_to(parser)


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The HTTP side of `tandem serve`; the API key falls back to env TANDEM_API_KEY."""
    config = ServerConfig(
        host=args.host, port=args.port, served_model_names=tuple(args.served_model_name or ()),
        api_key=args.api_key or os.environ.get("TANDEM_API_KEY") or None,
        admin_key=admin_key_from_env(getattr(args, "admin_key", None)),
        public_metrics=getattr(args, "public_metrics", False), max_waiting=args.max_waiting,
        max_waiting_tokens=getattr(args, "max_waiting_tokens", None),
        max_tokens_policy=args.max_tokens_policy, tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser, log_level=args.log_level.lower(),
        limits=request_limits(args), shutdown_timeout_s=args.shutdown_timeout,
        generation_defaults=GenerationDefaults.from_json(getattr(args, "override_generation_config", None)),
    )
    if config.max_waiting < 0 or (config.max_waiting_tokens or 0) < 0:
        raise ValueError("--max-waiting and --max-waiting-tokens must be >= 0")
    return config


def kv_transfer_config(args: argparse.Namespace) -> KVTransferConfig:
    """The worker's prefill/decode role and how its prompt KV moves between workers. A prefill
    or decode worker needs the cluster secret: the handoff's fields reach it only on requests
    its router signed, and its KV port talks only to peers that sign (tandem/trust)."""
    secret = secret_from_env(getattr(args, "cluster_secret", None))
    if args.role != "both" and secret is None:
        raise ValueError(f"--role {args.role} needs the cluster secret (--cluster-secret or env "
                         f"{CLUSTER_SECRET_ENV}), the same on every worker and the router: the prefill/decode "
                         "handoff moves other requests' KV and is taken only from peers that sign with it")
    return KVTransferConfig(connectors=("pd",), role=args.role, host=args.kv_transfer_host,
                            port=args.kv_transfer_port,
                            hold_timeout=args.kv_transfer_hold_timeout,
                            fetch_timeout=args.kv_transfer_fetch_timeout,
                            shared_memory=args.kv_transfer_shm, secret=secret,
                            transfer_codec="raw" if args.kv_transfer_dtype == "auto" else args.kv_transfer_dtype)


def serve_engine_config(args: argparse.Namespace) -> EngineConfig:
    """A worker's engine: the engine flags plus its KV-transfer role."""
    return engine_config(args, kv_transfer_config(args))
