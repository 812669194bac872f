"""`tandem bench gpu`: the GPU runner against the device's own limits and transformers.

On one GPU, with random ("dummy") weights of a config (default: Llama-3.1-8B's, shipped in
tandem/bench/configs), in bf16, all in one run:

1. the device's limits, measured: copy bandwidth (a 2 GiB device-to-device copy; bytes read
   plus written per second) and the bf16 matmul rate ([8192, 4096] x [4096, 14336]);
2. tandem, batch-1 decode: milliseconds per decode step after the prompt, with CUDA graphs
   and with --enforce-eager. The bound is the copy bandwidth over the bytes a step must read
   (every weight it multiplies by and the context's KV, once; the embedding is a lookup of
   one row); the goal is >= 85% of it. The share of the looser bound that counts the
   embedding too, as SGLang's published "76%" does, is printed beside it. With graphs, the
   batch-1 graph's replay is timed alone too: the forward on the GPU, apart from the host.
   The engine runs with its default asynchronous scheduling (each step launched before the
   last one's token reaches the host); a second engine with `--async-scheduling off` times
   batch-1 decode one step at a time beside it (`--no-sync` skips it);
3. tandem, prefill: prompts of --prefill-len tokens, one token out, as tokens/s and as
   achieved TFLOP/s (2 x the weights' multiply-adds per token plus attention's) against the
   matmul rate; the goal is >= 60%;
4. tandem and transformers (`generate`, greedy, static lengths), --batch sequences of
   --prompt-len tokens, --output-len tokens each: output tokens/s;
5. KV room: the tokens tandem's paged cache holds at its budget (--memory-utilization of the
   device, less the weights and the planned activations), beside what tandem's memory plan
   said for the same settings, what vLLM's defaults would hold on this GPU at the same KV
   dtype (tandem's memory plan of vLLM's policy; vLLM has no int8 cache, so an int8 run is
   set beside its fp8), the device memory in use once the runs are done (CUDA's context
   included), and how many of the throughput run's sequences fit in the same bytes as a
   contiguous cache reserved at the engine's context length, as transformers' static cache
   reserves it, against tandem's pages, which hold what the sequences use.

`--kv-cache-dtypes auto,fp8,int8` repeats 2-5 with each KV cache dtype (the decode bound
counts each one's KV bytes). The engines run tandem's default batch limits. The engine's own
memory split (weights, activation plan, KV) is logged as it starts.
Writes the figures as JSON to --output-dir.

`--gemv` times tandem's one-row GEMV against cuBLAS on the config's matrices instead
(tandem/bench/gpu_gemv.py) and writes the device's table of the matrices it wins.

`--int4-moe` measures one kernel instead: the INT4 MoE grouped GEMM
(tandem/kernels/gpu/int4_moe.py) on Kimi K2.5's routed experts as one rank holds them under
tensor parallelism over 8 GPUs (all 384 experts, each intermediate / 8) and expert
parallelism (48 whole experts), --moe-active-experts of them with rows, at 1 to 64 rows an
expert: the median time of a launch (Triton's do_bench, L2 flushed before each) against
the copy bound of the bytes it must move (the active experts' packed weights and scales,
the rows in and out) at the measured copy bandwidth (and at the device's nominal HBM
bandwidth, where known); the goal is >= 70%. Each shape is checked against a dequantized
fp32 reference first (bf16: what the CPU interpreter cannot test).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.flags.table import Command, Flag, FlagTable

CONFIGS = Path(__file__).parent / "configs"
DECODE_GOAL = 0.85
PREFILL_GOAL = 0.60
MOE_GOAL = 0.70
MOE_ROWS = (1, 2, 4, 8, 16, 32, 64)  # rows an active expert gets (decode: batch x top-k / experts)
MOE_CONFIG = "kimi-k2"  # tandem/sizing/configs; K2.5's text model has K2's experts (384 of 7168 x 2048)
MOE_RANKS = 8
GPU_KV_DTYPES = ("auto", "fp8", "int8")
# NVIDIA's datasheet HBM bandwidth (GB/s), by the first name that torch's device name contains
NOMINAL_HBM_GB_S = (("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0))


# The model shape, the three runs' sizes and what to skip or add, in one group.
GPU_FLAGS = FlagTable(None, (
    Flag(
        "--config", default="llama-3.1-8b", metavar="NAME_OR_FILE",
        help=f"a config.json, or one of: {', '.join(sorted(p.stem for p in CONFIGS.glob('*.json')))} "
        "(default: llama-3.1-8b)",
    ),
    Flag(
        "--decode-steps", default=128, type=int, metavar="N",
        help="timed batch-1 decode steps (default: 128)",
    ),
    Flag(
        "--prefill-len", default=2048, type=int, metavar="N",
        help="prefill prompt length (default: 2048)",
    ),
    Flag("--prefill-prompts", default=8, type=int, metavar="N", help="prefill prompts (default: 8)"),
    Flag(
        "--batch", default=64, type=int, metavar="N",
        help="sequences of the throughput run (default: 64)",
    ),
    Flag(
        "--prompt-len", default=128, type=int, metavar="N",
        help="throughput prompt length (default: 128)",
    ),
    Flag(
        "--output-len", default=128, type=int, metavar="N",
        help="throughput output length (default: 128)",
    ),
    Flag(
        "--kv-cache-dtypes", default="auto", metavar="LIST",
        help="KV cache dtypes to run the engine with, comma-separated, from auto (the model's "
        "bf16), fp8, int8 (default: auto)",
    ),
    Flag("--no-transformers", switch=True, help="skip transformers' run"),
    Flag(
        "--int4-moe", switch=True,
        help="measure the INT4 MoE GEMM on Kimi K2.5's experts (TP 8 and EP 8 shapes, 1-64 rows an "
        "expert) against the copy bound of its bytes, instead of the model runs",
    ),
    Flag(
        "--gemv", switch=True,
        help="time tandem's one-row GEMV against cuBLAS on the config's matrices and write this "
        "device's table of winners, instead of the model runs",
    ),
    Flag(
        "--moe-active-experts", default=8, type=int, metavar="N",
        help="--int4-moe: experts with rows in each launch (default: 8)",
    ),
    Flag("--no-eager", switch=True, help="skip the --enforce-eager decode run"),
    Flag("--no-sync", switch=True, help="skip the batch-1 decode run with --async-scheduling off"),
    Flag(
        "--profile", switch=True,
        help="also write torch.profiler tables (kernels by GPU time) of batch-1 decode steps "
        "(graphs and eager) and of the prefill to --output-dir",
    ),
    Flag(
        "--output-dir", default="bench-results",
        help="where the JSON goes (default: bench-results)",
    ),
))


def add_gpu_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "gpu", help="the GPU runner: batch-1 decode against copy bandwidth, prefill against the matmul "
                    "rate, batch throughput against transformers (needs a GPU)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    GPU_FLAGS.add_to(parser)
    Command(run_gpu_bench, check_gpu).install(parser)


def check_gpu(args: argparse.Namespace) -> None:
    """A --config that names no file and no shipped config fails at parse time."""
    config_path(args.config)
    if args.moe_active_experts < 1:
        raise ValueError(f"--moe-active-experts {args.moe_active_experts}: at least 1")
    kv_cache_dtypes(args.kv_cache_dtypes)


def kv_cache_dtypes(text: str) -> list[str]:
    """--kv-cache-dtypes as a list, each one the engine can hold on a GPU, none twice."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in GPU_KV_DTYPES]
    if not names or unknown or len(set(names)) != len(names):
        raise ValueError(f"--kv-cache-dtypes {text!r}: a comma-separated list of distinct names from "
                         f"{', '.join(GPU_KV_DTYPES)}")
    return names


def config_path(name: str) -> Path:
    path = Path(name)
    if path.is_file():
        return path
    shipped = CONFIGS / f"{name}.json"
    if not shipped.is_file():
        raise ValueError(f"--config {name}: no such file, and not one of "
                         f"{', '.join(sorted(p.stem for p in CONFIGS.glob('*.json')))}")
    return shipped


def recorded_args(args: argparse.Namespace) -> dict[str, Any]:
    """The command line's values for results.json: not the handler and check functions that
    the parser leaves beside them (json cannot write those)."""
    return {k: v for k, v in vars(args).items() if not callable(v)}


def _cuda_timer(torch: Any, fn: Any, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats`, timed with CUDA events after a warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def device_limits(torch: Any) -> dict[str, float]:
    """Copy bandwidth (GB/s, read + written) and the bf16 matmul rate (TFLOP/s), measured."""
    nbytes = 2 << 30
    buffers = torch.empty(2, nbytes, dtype=torch.uint8, device="cuda")
    copy_s = _cuda_timer(torch, lambda: buffers[1].copy_(buffers[0]), 20)
    buffers.resize_(0)  # its memory back before the matmul's
    m, k, n = 8192, 4096, 14336
    a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(k, n, dtype=torch.bfloat16, device="cuda")
    mm_s = _cuda_timer(torch, lambda: a @ b, 20)
    return {"copy_gb_s": 2 * nbytes / copy_s / 1e9, "matmul_tflop_s": 2 * m * k * n / mm_s / 1e12}


def weight_shape(config: dict[str, Any]) -> dict[str, int]:
    """Parameter counts of a Llama-shaped config: every weight, and those a token multiplies."""
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or h // heads
    vocab = config["vocab_size"]
    per_layer = h * head_dim * (heads + 2 * kv_heads) + heads * head_dim * h + 3 * h * i
    matmul = layers * per_layer + vocab * h  # the embedding is a lookup; the head a matmul
    total = matmul + (0 if config.get("tie_word_embeddings") else vocab * h)
    return {"params": total, "matmul_params": matmul, "layers": layers, "heads": heads, "kv_heads": kv_heads,
            "head_dim": head_dim}


def _engine(hf_dir: Path, eager: bool, max_model_len: int, kv_cache_dtype: str, async_scheduling: str = "auto") -> Any:
    """The engine on dummy bf16 weights, at tandem's default batch limits and memory share."""
    from tandem.llm import LLM

    return LLM(str(hf_dir), load_format="dummy", dtype="bfloat16", device="cuda", enforce_eager=eager,
               max_model_len=max_model_len, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False,
               async_scheduling=async_scheduling)


def decode_step_seconds(llm: Any, prompt_len: int, steps: int) -> float:
    """Median seconds of a batch-1 decode step after a prompt of `prompt_len` tokens."""
    from tandem.types import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 3, temperature=0, ignore_eos=True)
    engine.add_request(None, None, params, prompt_token_ids=[(7 * j) % 1000 + 100 for j in range(prompt_len)])
    engine.step()  # prefill
    engine.step()
    times = []
    while engine.has_unfinished() and len(times) < steps:
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times)


def graph_replay_seconds(torch: Any, llm: Any) -> float | None:
    """GPU seconds of the batch-1 decode graph alone: the forward without the step's host work
    (scheduling, input copies, the head and sampling, output processing)."""
    graphs = llm.engine.core.executor.worker.runner.decode_graphs
    if graphs is None or not graphs.use_graphs:
        return None
    return _cuda_timer(torch, lambda: graphs.replay(1), 50)


def profile_table(torch: Any, fn: Any, path: Path, title: str) -> None:
    """torch.profiler over `fn()`: the kernels by GPU time, as a table appended to `path` under
    `title` (one file a KV dtype keeps the returned files few)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as table:
        table.write(f"== {title} ==\n{prof.key_averages().table(sort_by='cuda_time_total', row_limit=40)}\n")
    print(f"profile: {title} -> {path}")


def batch_decode_steps(llm: Any, batch: int, prompt_len: int, steps: int) -> None:
    """`steps` decode steps of `batch` sequences, run after their prompts' prefill (for the
    profiler: the decode steps alone, not the prefill before them)."""
    from tandem.types import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    for prompt in _prompts(batch, prompt_len, 5):
        engine.add_request(None, None, params, prompt_token_ids=prompt)
    while engine.core.scheduler.waiting or any(r.num_computed_tokens < len(r.prompt_token_ids)
                                               for r in engine.core.scheduler.running):
        engine.step()
    for _ in range(steps):
        engine.step()
    while engine.has_unfinished():
        engine.step()


def kv_room(llm: Any, config: dict[str, Any], max_len: int, sequence_len: int, device_bytes: int,
            kv_cache_dtype: str = "auto") -> dict[str, Any]:
    """tandem's KV tokens as allocated, beside its own plan for the engine's settings, vLLM's
    defaults (planned) at the same KV dtype, and a contiguous per-sequence cache."""
    from tandem.sizing.devices import parse_devices
    from tandem.sizing.memory import PlanRequest, plan_memory

    core = llm.engine.core
    settings = llm.engine.config.scheduler
    tokens = core.num_blocks * core.block_size
    devices = parse_devices(f"1xgpu:{device_bytes}B")
    request = PlanRequest(devices, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, max_model_len=max_len,
                          max_num_batched_tokens=settings.max_num_batched_tokens,
                          max_num_seqs=settings.max_num_seqs,
                          memory_utilization=llm.engine.config.cache.memory_utilization)
    planned = plan_memory(config, request)
    kv_per_token = planned.tandem.stages[0].kv_bytes_per_token
    # vLLM has no int8 KV cache: its nearest, fp8 (one byte a value, no scales), stands beside it.
    peer_kv = "fp8" if kv_cache_dtype == "int8" else kv_cache_dtype
    peer = planned if peer_kv == kv_cache_dtype else plan_memory(
        config, PlanRequest(devices, dtype="bfloat16", kv_cache_dtype=peer_kv, max_model_len=max_len))
    vllm_tokens = peer.vllm.kv_tokens if peer.vllm is not None else None
    kv_bytes = tokens * kv_per_token
    room = {"kv_cache_dtype": kv_cache_dtype, "kv_bytes_per_token": kv_per_token,
            "tandem_tokens": tokens, "tandem_gib": kv_bytes / (1 << 30),
            "tandem_planned_tokens": planned.tandem.kv_tokens, "vllm_kv_cache_dtype": peer_kv,
            "vllm_default_tokens": vllm_tokens,
            "of_vllm": tokens / vllm_tokens if vllm_tokens else None,
            "contiguous_sequences": kv_bytes // (max_len * kv_per_token),
            "paged_sequences": tokens // sequence_len}
    vllm = "?" if vllm_tokens is None else f"{vllm_tokens:,} tokens ({tokens / vllm_tokens:.2f}x)"
    print(f"KV ({kv_cache_dtype}): tandem {tokens:,} tokens in {room['tandem_gib']:.1f} GiB at "
          f"{kv_per_token:,} B/token (planned for these settings: {planned.tandem.kv_tokens:,}); vLLM's "
          f"defaults here in {peer_kv} (planned): {vllm}; sequences of {sequence_len} tokens in "
          f"the same bytes: {room['paged_sequences']:,} paged, {room['contiguous_sequences']:,} in a "
          f"contiguous cache reserved at {max_len} positions each")
    return room


def device_in_use(torch: Any) -> dict[str, float]:
    """The device memory in use now (CUDA's context and every allocator included) and torch's
    own peak reservation, in GiB."""
    free, total = torch.cuda.mem_get_info()
    return {"in_use_gib": (total - free) / (1 << 30), "total_gib": total / (1 << 30),
            "torch_peak_reserved_gib": torch.cuda.max_memory_reserved() / (1 << 30)}


def _timed_generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> float:
    from tandem.types import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    llm.generate(prompts, params)
    return time.perf_counter() - started


def _prompts(count: int, length: int, salt: int) -> list[list[int]]:
    return [[(salt + 31 * i + 7 * j) % 30000 + 100 for j in range(length)] for i in range(count)]


def transformers_throughput(torch: Any, config_file: Path, batch: int, prompt_len: int, output_len: int) -> float:
    """Output tokens/s of transformers' greedy `generate` on the same config, random bf16 weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(config_file.parent))
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16).eval()
    ids = torch.tensor(_prompts(batch, prompt_len, 3), device="cuda")
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                  attention_mask=torch.ones_like(ids), pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:, :16], **(kwargs | {"max_new_tokens": 4, "min_new_tokens": 4,
                                                 "attention_mask": torch.ones_like(ids[:, :16])}))
        torch.cuda.synchronize()
        started = time.perf_counter()
        model.generate(ids, **kwargs)
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    del model
    torch.cuda.empty_cache()
    return batch * output_len / seconds


@dataclass(frozen=True)
class MoeCase:
    """One stacked expert matrix as a rank holds it: `experts` of [n, k] (n outputs)."""

    plan: str  # "TP 8" or "EP 8"
    name: str  # "w13 + silu" (gate and up, silu-and-mul fused), "w13", "w2"
    experts: int
    n: int
    k: int
    silu_mul: bool

    @property
    def width(self) -> int:
        """Output columns: n, or n / 2 with silu-and-mul fused."""
        return self.n // 2 if self.silu_mul else self.n


def int4_moe_cases(config: dict[str, Any], ranks: int = MOE_RANKS) -> list[MoeCase]:
    """A MoE config's routed experts on one of `ranks` GPUs: under tensor parallelism every
    expert with its intermediate split (w13 [E, 2I/r, H], w2 [E, H, I/r]), under expert
    parallelism E/r experts whole."""
    text = config.get("text_config", config)
    hidden, inter, experts = text["hidden_size"], text["moe_intermediate_size"], text["n_routed_experts"]
    cases = []
    for plan, stacked, part in ((f"TP {ranks}", experts, inter // ranks), (f"EP {ranks}", experts // ranks, inter)):
        cases += [MoeCase(plan, "w13 + silu", stacked, 2 * part, hidden, True),
                  MoeCase(plan, "w13", stacked, 2 * part, hidden, False),
                  MoeCase(plan, "w2", stacked, hidden, part, False)]
    return cases


def int4_moe_bytes(case: MoeCase, active: int, rows: int, act_bytes: int = 2, scale_bytes: int = 2) -> dict[str, int]:
    """What one launch must move at least: the active experts' packed weights (half a byte
    each) and group scales (one per 32), the rows read and the outputs written."""
    weights = active * (case.n * case.k // 2 + case.n * (case.k // 32) * scale_bytes)
    m = active * rows
    return {"weight_bytes": weights, "bytes": weights + m * case.k * act_bytes + m * case.width * act_bytes}


def active_offsets(experts: int, active: int, rows: int) -> list[int]:
    """expert_offsets [E + 1] with `rows` rows for each of `active` experts spread evenly over
    the stack (0, E/active, 2E/active, ...), none for the others."""
    chosen = {j * experts // active for j in range(active)}
    offsets = [0]
    for e in range(experts):
        offsets.append(offsets[-1] + (rows if e in chosen else 0))
    return offsets


def nominal_hbm_gb_s(device_name: str) -> float | None:
    for name, gb_s in NOMINAL_HBM_GB_S:
        if name in device_name:
            return gb_s
    return None


def moe_figures(seconds: float, moved: dict[str, int], copy_gb_s: float, nominal_gb_s: float | None) -> dict[str, Any]:
    """One launch's time against the copy bound of its bytes (measured and nominal bandwidth)."""
    bound = moved["bytes"] / (copy_gb_s * 1e9)
    figures = {"us": seconds * 1e6, "gb_s": moved["bytes"] / seconds / 1e9, "bound_us": bound * 1e6,
               "of_bound": bound / seconds} | moved
    if nominal_gb_s is not None:
        figures["of_nominal"] = moved["bytes"] / (nominal_gb_s * 1e9) / seconds
    return figures


def measure_int4_moe(torch: Any, case: MoeCase, active: int, rows_list: tuple[int, ...], timer: Any,
                     device: str = "cuda") -> dict[str, Any]:
    """One stacked case: random packed weights and bf16 scales on `device`, then for each row
    count the seconds `timer(launch)` gives, and at 4 rows (else the first count) the largest
    error against fp32 over the dequantized weights, relative to each expert's largest output."""
    from tandem.kernels.gpu.int4_moe import dequantize_int4, int4_moe_config, int4_moe_gemm

    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # the interpreter mangles bf16
    generator = torch.Generator(device=device).manual_seed(0)
    packed = torch.randint(-2**31, 2**31 - 1, (case.experts, case.n, case.k // 8), dtype=torch.int32,
                           device=device, generator=generator)
    scales = (torch.rand(case.experts, case.n, case.k // 32, device=device, generator=generator) * 0.02
              + 0.002).to(dtype)
    entry: dict[str, Any] = {"plan": case.plan, "name": case.name, "experts": case.experts, "n": case.n,
                             "k": case.k, "rows": {}}
    checked = 4 if 4 in rows_list else rows_list[0]
    for rows in rows_list:
        offsets = active_offsets(case.experts, active, rows)
        offsets_t = torch.tensor(offsets, dtype=torch.int32, device=device)
        x = torch.randn(active * rows, case.k, device=device, generator=generator).to(dtype)
        y = torch.empty(active * rows, case.width, dtype=dtype, device=device)

        def launch(x=x, offsets_t=offsets_t, y=y, rows=rows) -> None:
            int4_moe_gemm(x, offsets_t, packed, scales, silu_mul=case.silu_mul, max_rows=rows, out=y)

        if rows == checked:
            launch()
            worst = 0.0
            for e in range(case.experts):
                if offsets[e + 1] > offsets[e]:
                    want = x[offsets[e]:offsets[e + 1]].float() @ dequantize_int4(packed[e], scales[e]).T
                    if case.silu_mul:
                        want = torch.nn.functional.silu(want[:, :case.width]) * want[:, case.width:]
                    got = y[offsets[e]:offsets[e + 1]].float()
                    worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
            entry["max_rel_error"] = worst
        entry["rows"][rows] = {"seconds": timer(launch), "config": int4_moe_config(rows, case.width, case.k)}
    return entry


def run_int4_moe_bench(torch: Any, args: argparse.Namespace) -> int:
    """`--int4-moe`: the INT4 MoE GEMM on K2.5's expert shapes (see the module's docstring)."""
    from tandem.kernels.gpu import available

    why = available("cuda")
    if why is not None:
        raise ValueError(f"tandem bench gpu --int4-moe: {why}")
    import triton.testing

    from tandem.sizing.examples import load_config

    def timer(fn: Any) -> float:  # median seconds, L2 flushed before each launch
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3

    device = torch.cuda.get_device_name()
    limits = device_limits(torch)
    nominal = nominal_hbm_gb_s(device)
    active = args.moe_active_experts
    out = Path(args.output_dir) / f"gpu-int4-moe-{dt.datetime.now():%Y%m%d-%H%M%S}"
    results: dict[str, Any] = {"device": device, "limits": limits, "nominal_hbm_gb_s": nominal,
                               "active_experts": active, "cases": []}
    print(f"tandem bench gpu --int4-moe: {device}, copy {limits['copy_gb_s']:.0f} GB/s (read + written), nominal "
          f"HBM {'?' if nominal is None else f'{nominal:.0f}'} GB/s; Kimi K2.5's experts ({MOE_CONFIG}'s shapes), "
          f"{active} active, bf16")
    for case in int4_moe_cases(load_config(MOE_CONFIG)[1]):
        if active > case.experts:
            continue
        entry = measure_int4_moe(torch, case, active, MOE_ROWS, timer)
        torch.cuda.empty_cache()
        for rows, measured in entry["rows"].items():
            measured |= moe_figures(measured["seconds"], int4_moe_bytes(case, active, rows), limits["copy_gb_s"],
                                    nominal)
            nominal_part = "" if nominal is None else f" ({measured['of_nominal']:.0%} of nominal)"
            print(f"{case.plan} {case.name} [{case.experts} x {case.n} x {case.k}], {rows:>2} rows an expert: "
                  f"{measured['us']:8.1f} us, {measured['gb_s']:5.0f} GB/s = {measured['of_bound']:4.0%} of the "
                  f"copy bound {measured['bound_us']:.1f} us{nominal_part}")
        shares = [f["of_bound"] for f in entry["rows"].values()]
        print(f"{case.plan} {case.name}: {min(shares):.0%}-{max(shares):.0%} of the copy bound (goal {MOE_GOAL:.0%}: "
              f"{'met' if min(shares) >= MOE_GOAL else 'missed'}); largest error against fp32 "
              f"{entry['max_rel_error']:.1e} of the output's scale")
        results["cases"].append(entry)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results | {"args": recorded_args(args)}, indent=2))
    print(f"figures: {out / 'results.json'}")
    return 0


def measure_engine(torch: Any, llm: Any, args: argparse.Namespace, config: dict[str, Any], shape: dict[str, int],
                   limits: dict[str, float], name: str, kv: str, max_len: int, run: dict[str, Any],
                   profile_dir: Path | None) -> None:
    """One engine's figures into `run`: with graphs the KV room, batch-1 decode, the prefill and
    the batch throughput; eager (`name` "eager") or one step at a time ("sync") batch-1 decode alone."""
    eager = name in ("eager", "sync")
    if not eager:
        run["kv"] = kv_room(llm, config, max_len, args.prompt_len + args.output_len,
                            torch.cuda.mem_get_info()[1], kv)
    kv_per_token = run["kv"]["kv_bytes_per_token"]
    decode_prompt = 128
    step = decode_step_seconds(llm, decode_prompt, args.decode_steps)
    kv_read = kv_per_token * (decode_prompt + args.decode_steps // 2)
    read = 2 * shape["matmul_params"] + kv_read  # the embedding is one row's lookup
    bound = read / (limits["copy_gb_s"] * 1e9)
    # As SGLang's "76% of the bound" counts it: every weight, the embedding too.
    loose = (2 * shape["params"] + kv_read) / (limits["copy_gb_s"] * 1e9)
    decode = run[f"decode_{name}"] = {"step_ms": step * 1e3, "tok_s": 1 / step, "bound_tok_s": 1 / bound,
                                      "of_bound": bound / step, "gb_s": read / step / 1e9,
                                      "of_bound_every_weight": loose / step}
    print(f"batch-1 decode ({name}, KV {kv}): {1 / step:.1f} tok/s ({step * 1e3:.2f} ms/step), "
          f"{read / step / 1e9:.0f} GB/s = {bound / step:.1%} of the copy bound "
          f"{1 / bound:.1f} tok/s (goal {DECODE_GOAL:.0%}); counting every weight as SGLang's "
          f"figure does, {loose / step:.0%} of {1 / loose:.1f} tok/s")
    replay = graph_replay_seconds(torch, llm)
    if replay is not None:
        decode |= {"graph_ms": replay * 1e3, "host_ms": (step - replay) * 1e3}
        print(f"  of which the batch-1 graph (the forward, on the GPU): {replay * 1e3:.2f} ms = "
              f"{read / replay / 1e9:.0f} GB/s; the rest of the step (head, sampling, host work): "
              f"{(step - replay) * 1e3:.2f} ms")
    if profile_dir is not None and name != "sync":
        profile_table(torch, lambda: decode_step_seconds(llm, decode_prompt, 8),
                      profile_dir / f"profile-decode-{kv}.txt", f"batch-1 decode, {name}, KV {kv}, 8 steps")
        if not eager:
            profile_table(torch, lambda: batch_decode_steps(llm, args.batch, args.prompt_len, 8),
                          profile_dir / f"profile-decode-{kv}.txt",
                          f"batch-{args.batch} decode, {name}, KV {kv}, 8 steps after {args.prompt_len}-token prompts")
    if eager:
        return
    prompts = _prompts(args.prefill_prompts, args.prefill_len, 1)
    _timed_generate(llm, prompts[:1], 1)  # warm-up at this length
    seconds = _timed_generate(llm, prompts, 1)
    tokens = args.prefill_prompts * args.prefill_len
    attention = 4 * shape["layers"] * shape["heads"] * shape["head_dim"] * (args.prefill_len / 2) * tokens
    tflops = (2 * shape["matmul_params"] * tokens + attention) / seconds / 1e12
    run["prefill"] = {"tok_s": tokens / seconds, "tflop_s": tflops, "of_matmul": tflops / limits["matmul_tflop_s"]}
    print(f"prefill (KV {kv}): {tokens / seconds:,.0f} tok/s, {tflops:.0f} TFLOP/s = "
          f"{tflops / limits['matmul_tflop_s']:.0%} of the matmul rate (goal {PREFILL_GOAL:.0%})")
    if profile_dir is not None:
        profile_table(torch, lambda: _timed_generate(llm, prompts, 1), profile_dir / "profile-prefill.txt",
                      f"prefill, {args.prefill_prompts} x {args.prefill_len} tokens, KV {kv}")
    batch_prompts = _prompts(args.batch, args.prompt_len, 2)
    _timed_generate(llm, batch_prompts[:4], 4)
    seconds = _timed_generate(llm, batch_prompts, args.output_len)
    run["batch_tandem_tok_s"] = args.batch * args.output_len / seconds
    print(f"batch {args.batch} (KV {kv}): tandem {run['batch_tandem_tok_s']:,.0f} output tok/s")


def run_gpu_bench(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        raise ValueError("tandem bench gpu needs a GPU this torch can drive (torch.cuda.is_available() is False)")
    if args.int4_moe:
        return run_int4_moe_bench(torch, args)
    source = config_path(args.config)
    config = json.loads(source.read_text())
    if args.gemv:
        from tandem.bench.gpu_gemv import run_gemv_bench

        return run_gemv_bench(torch, args, config, device_limits(torch))
    shape = weight_shape(config)
    workdir = Path(tempfile.mkdtemp(prefix="tandem-bench-gpu-"))
    out = Path(args.output_dir) / f"gpu-{dt.datetime.now():%Y%m%d-%H%M%S}"
    shutil.copy(source, workdir / "config.json")
    device = torch.cuda.get_device_name()
    results: dict[str, Any] = {"device": device, "config": args.config, "shape": shape}
    print(f"tandem bench gpu: {device}, {args.config} (dummy bf16 weights, {shape['params'] / 1e9:.2f} B parameters)")
    try:
        limits = results["limits"] = device_limits(torch)
        print(f"device: copy {limits['copy_gb_s']:.0f} GB/s (read + written), bf16 matmul "
              f"{limits['matmul_tflop_s']:.0f} TFLOP/s")
        max_len = max(args.prefill_len, args.prompt_len + args.output_len, 512) + 64
        batch_tok_s = None
        for index, kv in enumerate(kv_cache_dtypes(args.kv_cache_dtypes)):
            modes = [("graphs", False, "auto")] + ([] if args.no_sync or index else [("sync", False, "off")])
            modes += [] if args.no_eager or index else [("eager", True, "auto")]
            for name, eager, async_scheduling in modes:
                llm = _engine(workdir, eager, max_len, kv, async_scheduling)
                try:
                    run = results.setdefault(kv, {})
                    measure_engine(torch, llm, args, config, shape, limits, name, kv, max_len, run,
                                   out if args.profile else None)
                    if name == "graphs":
                        run["memory"] = device_in_use(torch)
                        print(f"device memory in use after the runs: {run['memory']['in_use_gib']:.1f} of "
                              f"{run['memory']['total_gib']:.1f} GiB (torch's peak reservation "
                              f"{run['memory']['torch_peak_reserved_gib']:.1f} GiB)")
                        batch_tok_s = batch_tok_s or run.get("batch_tandem_tok_s")
                finally:
                    llm.shutdown()
                    del llm
                    gc.collect()  # the engine's cycles hold the KV cache: free it for the next engine
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
        if not args.no_transformers:
            hf = transformers_throughput(torch, workdir / "config.json", args.batch, args.prompt_len, args.output_len)
            results["batch_transformers_tok_s"] = hf
            print(f"batch {args.batch}: transformers {hf:,.0f} output tok/s; tandem / transformers = "
                  f"{batch_tok_s / hf:.2f}x")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results | {"args": recorded_args(args)}, indent=2))
    print(f"figures: {out / 'results.json'}")
    return 0
