"""`tandem bench offline --layouts`: one model in several parallel layouts, side by side.

A layout names how the ranks split the model: `tp2` (tensor parallelism over 2 ranks), `pp2`
(2 pipeline stages), `ep2` (2 ranks, experts sharded whole, tokens moved by all-to-all, the
attention tensor-parallel), joined by `+` (`tp2+pp2`); `tp1` is one rank. Each runs the same
workloads in its own process; the table gives each layout's figures and its ratio to the first.

With `--profile` each run makes a second, untimed pass with the ranks' profilers on and
reports where a step's time goes, per phase (tandem/platform/profiling.py), averaged over the ranks:
attention (projections and the attention itself), MoE routing, the experts' GEMMs, the
all-to-all dispatch and combine (and the all-gather after it), the tensor-parallel
all-reduces, the pipeline's sends and its wait for the previous stage, and the rest.

`+dense-experts` runs a layout on the same config with its `quantization_config` dropped:
a model whose routed experts ship as INT4 (Kimi K2.5) then holds them in the run dtype, so
`--layouts tp1,tp1+dense-experts` puts the packed experts beside bf16 ones (with
`--load-format dummy`: a checkpoint has no bf16 experts to load).
"""

from __future__ import annotations

import hashlib
import json
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.bench.offline_report import METRICS, WORKLOAD_METRICS, _cell, _ratio_cell, ratio

_PART = re.compile(r"^(tp|pp|ep)(\d+)$")
NO_MATMUL_PATH = 1e9  # FLOP/s: below this a dtype's matmul is an emulation, not a bound
DENSE_EXPERTS = "dense-experts"

# Report columns of the step breakdown: (label, the phases summed into it).
BREAKDOWN_COLUMNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("attention",)),
    ("routing", ("moe.route",)),
    ("expert GEMMs", ("moe.experts",)),
    ("all-to-all", ("moe.dispatch", "moe.combine", "moe.gather")),
    ("all-reduce", ("tp.all_reduce", "tp.all_gather")),
    ("pipeline", ("pp.send", "pp.recv")),
    ("other", ("other",)),
)


def parse_layout(name: str) -> dict[str, Any]:
    """tandem.LLM keywords for a layout name ("tp2", "pp2", "ep2", "tp2+pp2", "tp1")."""
    sizes = {"tp": 1, "pp": 1, "ep": 1}
    for part in name.split("+"):
        if part.strip() == DENSE_EXPERTS:
            continue  # the config, not the split (dense_experts_config)
        match = _PART.match(part.strip())
        if match is None or int(match.group(2)) < 1:
            raise ValueError(f"layout {name!r}: each part is tpN, ppN, epN or {DENSE_EXPERTS} (e.g. tp2, pp2, ep2, "
                             f"tp2+pp2, tp1+{DENSE_EXPERTS})")
        sizes[match.group(1)] = int(match.group(2))
    if sizes["ep"] > 1 and sizes["tp"] not in (1, sizes["ep"]):
        raise ValueError(f"layout {name!r}: experts are sharded over the tensor-parallel ranks, so epN needs tpN "
                         "alike or none")
    return {"tensor_parallel_size": max(sizes["tp"], sizes["ep"]), "pipeline_parallel_size": sizes["pp"],
            "enable_expert_parallel": sizes["ep"] > 1}


def wants_dense_experts(layout: str) -> bool:
    return DENSE_EXPERTS in (part.strip() for part in layout.split("+"))


def dense_experts_config(hf_dir: Path) -> Path:
    """A directory beside nothing else: `hf_dir`'s config.json without its quantization_config
    (top level and text_config), for a dummy-weight run with the experts in the run dtype."""
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    config.pop("quantization_config", None)
    if isinstance(config.get("text_config"), dict):
        config["text_config"].pop("quantization_config", None)
    text = json.dumps(config, indent=2, sort_keys=True)
    directory = Path(tempfile.gettempdir()) / f"tandem-dense-experts-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(text)
    for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (Path(hf_dir) / extra).is_file() and not (directory / extra).exists():
            (directory / extra).write_bytes((Path(hf_dir) / extra).read_bytes())
    return directory


def layout_of(engine: str) -> str:
    return engine.partition("@")[2]


def format_layout_table(results: dict[str, dict[str, dict[str, Any]]], engines: list[str], title: str) -> str:
    """Each layout's figures, and each one's ratio to the first layout (x first)."""
    first = engines[0]
    header = ["workload", "metric", layout_of(first)]
    for engine in engines[1:]:
        header += [layout_of(engine), f"x {layout_of(first)}"]
    rows = [header]
    errors = []
    for workload, by_engine in results.items():
        for metric in WORKLOAD_METRICS.get(workload, ()):
            if metric == "agreement":
                continue
            label, _ = METRICS[metric]
            values = [by_engine.get(e, {}).get(metric) if by_engine.get(e, {}).get("ok") else None for e in engines]
            row = [workload, label, _cell(values[0])]
            for value in values[1:]:
                row += [_cell(value), _ratio_cell(ratio(value, values[0]))]
            rows.append(row)
        errors += [f"{layout_of(e)} / {workload}: {r.get('error')}" for e, r in by_engine.items() if not r.get("ok")]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [title, ""] + ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
                           for r in rows]
    if errors:
        lines += ["", *errors]
    return "\n".join(lines)


def mean_breakdown(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """The ranks' breakdowns averaged, as shares of the mean step time (%), plus step ms."""
    ranks = len(per_rank)
    step = sum(r["step"] for r in per_rank) / ranks
    steps = max(r["steps"] for r in per_rank) or 1
    shares = {label: 100 * sum(r.get(p, 0.0) for r in per_rank for p in phases) / ranks / step if step else 0.0
              for label, phases in BREAKDOWN_COLUMNS}
    return {"step_ms": step / steps, "steps": steps, **shares}


def format_breakdown_table(results: dict[str, dict[str, dict[str, Any]]], engines: list[str]) -> str:
    """Where a step's time goes, per layout and workload (profiled pass, mean over ranks)."""
    header = ["workload", "layout", "ms/step", *(label + " %" for label, _ in BREAKDOWN_COLUMNS)]
    rows = [header]
    for workload, by_engine in results.items():
        for engine in engines:
            profile = by_engine.get(engine, {}).get("profile")
            if not profile:
                continue
            mean = mean_breakdown(profile)
            rows.append([workload, layout_of(engine), f"{mean['step_ms']:.1f}",
                         *(f"{mean[label]:.1f}" for label, _ in BREAKDOWN_COLUMNS)])
    if len(rows) == 1:
        return ""
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
                     for r in rows)


def plot_breakdown(results: dict[str, dict[str, dict[str, Any]]], engines: list[str], path: Path, title: str) -> Path | None:
    """Stacked bars: ms per step by phase, one bar per (workload, layout)."""
    bars = [(f"{workload}\n{layout_of(e)}", mean_breakdown(by_engine[e]["profile"]))
            for workload, by_engine in results.items() for e in engines if by_engine.get(e, {}).get("profile")]
    if not bars:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(bars)), 4.5))
    bottoms = [0.0] * len(bars)
    for label, _ in BREAKDOWN_COLUMNS:
        heights = [b[label] / 100 * b["step_ms"] for _, b in bars]
        ax.bar(range(len(bars)), heights, bottom=bottoms, label=label)
        bottoms = [x + h for x, h in zip(bottoms, heights, strict=True)]
    ax.set_xticks(range(len(bars)), [name for name, _ in bars], fontsize=8)
    ax.set_ylabel("ms per step (mean over ranks)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, ncols=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def machine_ceilings(hf_dir: Path, dtype: str, workloads: dict[str, Any],
                     variants: dict[str, Path] | None = None, own: dict[str, Any] | None = None) -> dict[str, Any]:
    """The best this machine could do on each workload, from the model's shape and two rates
    measured now: a `dtype` matmul on every core (the fastest of torch.mm, oneDNN's packed
    linear and tandem's packed GEMM, at 2,048^3 and on the model's layers, `matmul_shapes`),
    and a memory copy. These are the dtype's limits, the same for every engine. `own` maps
    an engine to what its worker said its steps read (`StepReads` as the offline worker
    reports it): that engine's mode also gets limits of its own (`own_limits`), under "own".

    prefill-heavy (prompt tok/s) and decode-heavy (output tok/s), each over its whole timed
    run: every prompt token costs 2 x active parameters of FLOPs, less the LM head's share (a
    prompt's logits are taken at its last token only), and each prompt's last token goes
    through the LM head, which gives its first output token; then the run takes a decode step
    for every further token; a step of B sequences reads the weights once
    at the read rate (`step_read_bytes`: of a MoE's routed experts, those some token chose)
    and every running sequence's KV in the run dtype, and does B x 2 x active FLOPs and its
    attention's, whichever takes longer bounding it. A prompt's attention is its causal
    (query, key) pairs at the matmul rate (`AttentionWork`): at 64 sequences of ~150 tokens the
    default model's decode step reads about as much KV as weights, so a bound that left
    attention out was ~40% high there. Every layer counts full attention (Llama 4's chunked
    layers would do less). single-stream keeps the weights' read alone: its KV is a few MB.

    bf16 on a CPU with no bf16 matmul (an AVX2-only EPYC) is computed by tandem's kernels in
    fp32 (widened in registers or per call), so there the fp32 rate bounds it. A 4-bit layout's
    experts are multiplied by 16-bit integer dot products, counted at the same rate: on the
    2-core AMD EPYC (Zen 1) `vpmaddwd` does 38 G multiply-adds/s against the FMA's 36 (a
    hand-written loop of each, both cores); Intel cores issue it twice as often, so there the
    4-bit layout's bound is low. With 16 sequences a step, a 2-core box cannot multiply as fast
    as it reads: the compute bound holds, and it is the same for 4-bit and bf16 experts.
    """
    import json

    from tandem.platform.machine import (
        matmul_flops_per_s,
        memory_copy_bytes_per_s,
        memory_read_bytes_per_s,
    )
    from tandem.sizing.kv import kv_bytes_per_token
    from tandem.sizing.shape import read_shape
    from tandem.sizing.tensors import count_params

    shape = read_shape(json.loads((Path(hf_dir) / "config.json").read_text()))
    params = count_params(shape)
    shapes = matmul_shapes(shape)
    flops = max(max(matmul_flops_per_s(dtype, *mkn) for mkn in shapes), own_gemm_flops_per_s(dtype, shapes))
    compute_dtype = dtype
    if flops < NO_MATMUL_PATH and dtype == "bfloat16":  # tandem's kernels widen it to fp32 here
        flops = max(max(matmul_flops_per_s("float32", *mkn) for mkn in shapes),
                    own_gemm_flops_per_s("float32", shapes))
        compute_dtype = "float32"
    # single-stream: read bandwidth / the bytes a one-token step reads (a 4-bit mode reads
    # fewer, so it can pass this ceiling)
    bandwidth = memory_copy_bytes_per_s(256 << 20)
    read = memory_read_bytes_per_s(256 << 20)
    weight_bytes = stored_weight_bytes(hf_dir, dtype)
    per_token = 2 * params.active
    # A dtype this CPU has no matmul path for (bf16 on an AVX2-only EPYC: ~0.1 GFLOP/s through
    # torch's fallback) bounds nothing a tuned kernel would meet: the read bound alone is kept.
    compute_bound = flops >= NO_MATMUL_PATH
    per_prompt_token = per_token - 2 * shape.vocab_size * shape.hidden_size
    attention = AttentionWork.of(shape, kv_bytes_per_token(shape, 1, shape.num_layers, dtype) / read)
    ceilings: dict[str, Any] = {"matmul_flops_per_s": flops, "compute_bound": compute_bound,
                                "compute_dtype": compute_dtype, "widened": compute_dtype != dtype,
                                "memory_bytes_per_s": bandwidth,
                                "memory_read_bytes_per_s": read,
                                "weight_bytes": weight_bytes, "flops_per_token": per_token}
    for name, workload in workloads.items():
        if name == "single-stream":  # one token a step: the weights read once a token
            ceilings[name] = ("decode_tok_s", read / step_read_bytes(hf_dir, dtype, 1))
        elif name in ("prefill-heavy", "decode-heavy"):
            seconds = _batch_seconds(workload, lambda batch: step_read_bytes(hf_dir, dtype, batch) / read,
                                     per_prompt_token, per_token, flops if compute_bound else None, attention)
            ceilings[name] = _batch_ceiling(name, workload, seconds)
    # a layout on another config (+dense-experts) reads other bytes: its own read-bound limits
    by_layout: dict[str, dict[str, float]] = {}
    for layout, other_dir in (variants or {}).items():
        other_bytes = stored_weight_bytes(other_dir, dtype)
        limits = by_layout[layout] = {"weight_bytes": other_bytes}
        for name, workload in workloads.items():
            if name == "single-stream":
                limits[name] = read / step_read_bytes(other_dir, dtype, 1)
            elif name in ("prefill-heavy", "decode-heavy"):
                seconds = _batch_seconds(
                    workload, lambda batch, other_dir=other_dir: step_read_bytes(other_dir, dtype, batch) / read,
                    per_prompt_token, per_token, flops if compute_bound else None, attention)
                limits[name] = _batch_ceiling(name, workload, seconds)[1]
    if by_layout:
        ceilings["by_layout"] = by_layout
    # each engine that reported what its steps read (tandem's modes): its own limits
    rates: dict[str, float] = {}

    def int8_flops() -> float:
        if "int8" not in rates:
            rates["int8"] = own_int8_flops_per_s(dtype, shapes)
        return rates["int8"]

    if own:
        ceilings["own"] = {engine: own_limits(reads, workloads, flops if compute_bound else 0.0, read, int8_flops,
                                              per_prompt_token, per_token, attention)
                           for engine, reads in own.items()}
    return ceilings


def matmul_shapes(shape: Any, rows: int = 2048) -> list[tuple[int, int, int]]:
    """The (m, k, n) products the matmul rate is measured on: 2,048^3, and the model's own
    dense layers at `rows` rows (q/k/v, o, gate/up, down). On the 2-core AMX Xeon tandem's GEMM
    ran SmolLM2's K = 576 layers at 2.6-2.8 TFLOP/s and 2,048^3 at 2.4: a rate from the square
    alone was below what the box does on the model's layers, so its ceilings read low."""
    shapes = [(2048, 2048, 2048)]
    if shape.mla is None:
        q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        shapes += [(rows, shape.hidden_size, q + 2 * kv), (rows, q, shape.hidden_size)]
    if shape.intermediate_size:
        shapes += [(rows, shape.hidden_size, 2 * shape.intermediate_size), (rows, shape.intermediate_size,
                                                                              shape.hidden_size)]
    return shapes


def own_gemm_flops_per_s(dtype: str, shapes: list[tuple[int, int, int]]) -> float:
    """tandem's packed GEMM's best rate over `shapes` ((m, k, n) products) in `dtype` (0.0
    where it does not build or multiply the dtype). On the 2-core AMX Xeon it ran at ~3.2
    TFLOP/s against oneDNN's ~2.5 at 2,048 rows, so the box's matmul rate is the faster of the
    two: a ceiling from oneDNN alone was passed by tandem's own linears."""
    import torch

    from tandem.kernels.dense_gemm import load_dense_gemm_kernel, packed_gemm_flops_per_s
    from tandem.platform.cache_dir import default_cache_dir

    kernel = load_dense_gemm_kernel(default_cache_dir())
    if kernel is None:
        return 0.0
    return max(packed_gemm_flops_per_s(kernel, getattr(torch, dtype), *mkn) for mkn in shapes)


def own_int8_flops_per_s(dtype: str, shapes: list[tuple[int, int, int]]) -> float:
    """tandem's 8-bit linear's best rate over `shapes` with activations in `dtype`, as the
    worker builds it (`--quantization int8`: the packed int8 GEMM where VNNI is the CPU's
    fastest multiply, else torch._int_mm, AMX's tiles where it has them); 0.0 where the rows'
    kernel does not build."""
    import torch

    from tandem.kernels.int8_gemm import load_int8_gemm_kernel
    from tandem.kernels.int8_rows import load_int8_rows_kernel
    from tandem.layers.int8 import int8_linear_flops_per_s
    from tandem.platform.cache_dir import default_cache_dir

    cache = default_cache_dir()
    rows = load_int8_rows_kernel(cache)
    gemm = load_int8_gemm_kernel(cache)
    if rows is None:
        return 0.0
    return max(int8_linear_flops_per_s(m, k, n, getattr(torch, dtype), rows, gemm)
               for m, k, n in shapes if k % 8 == 0 and n % 8 == 0)


def own_limits(reads: dict[str, Any], workloads: dict[str, Any], dtype_flops: float, read: float,
               int8_flops: Callable[[], float], per_prompt_token: float, per_token: float,
               attention: AttentionWork) -> dict[str, Any]:
    """A mode's own limits from what its worker reported (worker/step_reads.py: the bytes a
    step of n tokens reads, the arithmetic of larger steps): single-stream, its one-token
    bytes at the read rate; the batch workloads, its bytes by step size and its own matmul
    rate (the int8 linear's under --quantization int8, else the dtype's). Attention stays at
    the dtype's rate either way: its products are over the cache's values, in the run dtype
    (the decode and prefill kernels' bf16 dot products), never int8; counted at the int8
    rate, a prompt's causal pairs made the default mode's prefill-heavy bound ~10% high."""
    up_to = [(int(tokens), float(nbytes)) for tokens, nbytes in reads["up_to"]]

    def step_bytes(tokens: int) -> float:
        return next((nbytes for limit, nbytes in up_to if tokens <= limit), up_to[-1][1])

    flops = int8_flops() if reads.get("gemm") == "int8" else dtype_flops
    limits: dict[str, Any] = {"matmul_flops_per_s": flops, "gemm": reads.get("gemm"), "one_token_bytes": step_bytes(1)}
    for name, workload in workloads.items():
        if name == "single-stream":
            limits[name] = read / step_bytes(1)
        elif name in ("prefill-heavy", "decode-heavy"):
            seconds = _batch_seconds(workload, lambda batch: step_bytes(batch) / read, per_prompt_token, per_token,
                                     flops or None, attention, dtype_flops or None)
            limits[name] = _batch_ceiling(name, workload, seconds)[1]
    return limits


def _batch_ceiling(name: str, workload: Any, seconds: float) -> tuple[str, float]:
    """A batch workload's bound in its metric: prompt tok/s for prefill-heavy, output tok/s
    for decode-heavy, both over the whole run's time (as the runs are timed)."""
    metric, tokens = (("prompt_tok_s", workload.prompt_tokens) if name == "prefill-heavy"
                      else ("output_tok_s", workload.output_tokens))
    return metric, tokens / seconds if seconds > 0 else float("inf")


@dataclass(frozen=True)
class AttentionWork:
    """What attention adds to a batch run at the machine's rates, whole model on one rank:
    FLOPs per (query, key) pair in a prompt and in a decode step, and the seconds one cached
    token's KV takes to read."""

    prefill_flops_per_pair: float
    decode_flops_per_pair: float
    kv_read_seconds_per_token: float

    @classmethod
    def of(cls, shape: Any, kv_read_seconds_per_token: float) -> AttentionWork:
        """GQA: q.k and p.v, 2 x head_dim FLOPs each, per query head and layer. MLA: a
        prompt's keys and values are expanded per head (q.k over nope + rope, p.v over
        v_head_dim); a decode step attends to the latent itself (the up-projections absorbed
        into q and the output, as a decode kernel must: expanding every cached latent each
        step costs more), q.k over kv_lora_rank + rope and p.v over kv_lora_rank."""
        mla = shape.mla
        if mla is None:
            prefill = decode = 4 * shape.num_heads * shape.head_dim
        else:
            prefill = 2 * shape.num_heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim + mla.v_head_dim)
            decode = 2 * shape.num_heads * (2 * mla.kv_lora_rank + mla.qk_rope_head_dim)
        return cls(prefill * shape.num_layers, decode * shape.num_layers, kv_read_seconds_per_token)


def _batch_seconds(workload: Any, read_seconds: Callable[[int], float], per_prompt_token: float,
                   per_token: float, flops: float | None, attention: AttentionWork,
                   attention_flops: float | None = None) -> float:
    """The seconds a batch workload takes at the machine's rates: its prefill (compute-bound:
    every prompt token's FLOPs, its causal attention, and the LM head once a prompt for the
    first output token), then one decode step per further token of the sequences still
    running, each bounded by its reads (`read_seconds(batch)` for the weights, and each
    sequence's KV so far) or its FLOPs (the layers' and attention to that KV), whichever is
    longer. `flops` None: no matmul path bounds it (the reads alone). prefill-heavy's run
    times its 16 output tokens a prompt too, so its ceiling counts them. `attention_flops`:
    the rate attention's products run at where it is not `flops` (an int8 mode's)."""
    attention_flops = attention_flops or flops
    seconds = 0.0
    prompt_lengths = [len(prompt) for prompt in workload.prompts]
    if flops is not None:
        head = per_token - per_prompt_token
        pairs = sum(n * (n + 1) // 2 for n in prompt_lengths)
        seconds += ((workload.prompt_tokens * per_prompt_token + len(workload.prompts) * head) / flops
                    + pairs * attention.prefill_flops_per_pair / attention_flops)
    lengths = workload.max_tokens
    for step in range(1, max(lengths, default=0)):
        # output token `step` is the input: it attends to its prompt, the tokens before it and itself
        contexts = [prompt + step for prompt, n in zip(prompt_lengths, lengths, strict=True) if n > step]
        reads = read_seconds(len(contexts)) + sum(contexts) * attention.kv_read_seconds_per_token
        work = (len(contexts) * per_token / flops + sum(contexts) * attention.decode_flops_per_pair / attention_flops
                if flops else 0.0)
        seconds += max(reads, work)
    return seconds


def step_read_bytes(hf_dir: Path, dtype: str, batch: int) -> float:
    """The weight bytes one decode step of `batch` sequences reads, whole model on one rank:
    every matrix once, except a MoE's routed experts, of which only those some token chose
    (with top-k of E chosen uniformly, as a dummy checkpoint's random router does, each expert
    is read with probability 1 - (1 - k/E)^B: 8 of 48 at one sequence, 95% at 16), and an
    untied input embedding, of which a step reads B rows (left out)."""
    import json

    from tandem.sizing.shape import read_shape
    from tandem.sizing.sharding import Parallel, WeightFormat, stages, tensor_bytes
    from tandem.sizing.tensors import Part

    shape = read_shape(json.loads((Path(hf_dir) / "config.json").read_text()))
    whole = Parallel(1, 1, False)
    fmt = WeightFormat(dtype, int_quant=shape.int_quant)
    chosen = 1 - (1 - shape.moe.top_k / shape.moe.num_experts) ** batch if shape.moe else 1.0
    total = 0.0
    for tensor in stages(shape, whole)[0].tensors:
        if tensor.part is Part.EMBEDDING and not shape.tie_word_embeddings:
            continue
        total += tensor_bytes(tensor, whole, fmt) * (chosen if tensor.experts else 1.0)
    return total


def stored_weight_bytes(hf_dir: Path, dtype: str) -> int:
    """The bytes one rank holding the whole model keeps: the run dtype's, except matmuls a
    compressed-tensors checkpoint ships packed (Kimi K2.5's INT4 experts), at their packed
    size (tandem keeps them so), as the memory plan counts them."""
    import json

    from tandem.sizing.shape import read_shape
    from tandem.sizing.sharding import Parallel, WeightFormat, stage_weight_bytes, stages

    shape = read_shape(json.loads((Path(hf_dir) / "config.json").read_text()))
    whole = Parallel(1, 1, False)
    return stage_weight_bytes(stages(shape, whole)[0], whole, WeightFormat(dtype, int_quant=shape.int_quant))


def reported_step_reads(results: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """engine -> what its worker said its steps read (one report each: the model and mode
    are the same in every workload), for the engines that said (tandem)."""
    reads: dict[str, Any] = {}
    for by_engine in results.values():
        for engine, result in by_engine.items():
            reported = (result.get("engine_info") or {}).get("step_reads")
            if result.get("ok") and reported:
                reads.setdefault(engine, reported)
    return reads


def format_ceilings(ceilings: dict[str, Any], results: dict[str, dict[str, dict[str, Any]]], engines: list[str]) -> str:
    read = ceilings.get("memory_read_bytes_per_s")
    rate = ceilings["matmul_flops_per_s"]
    widened = ceilings.get("widened", False)  # a bf16 run on a CPU without a bf16 matmul
    matmul = (f"{rate / 1e9:.0f} GFLOP/s matmul" + (" in fp32 (no bf16 matmul here: tandem's kernels widen bf16 "
                                                    "to fp32)" if widened
                                                    else " in fp32" if ceilings.get("compute_dtype") == "float32"
                                                    else "")
              if ceilings.get("compute_bound", True)
              else f"{rate / 1e9:.2f} GFLOP/s matmul (no fast path for this dtype here: read bounds only)")
    lines = [f"this machine, measured now: {matmul}, "
             f"{ceilings['memory_bytes_per_s'] / 1e9:.1f} GB/s memory copy"
             + (f", {read / 1e9:.1f} GB/s memory read" if read else "")
             + f"; the model is {ceilings['weight_bytes'] / 1e9:.2f} GB of weights"
             + "".join(f" ({layout}: {limits['weight_bytes'] / 1e9:.2f} GB)"
                       for layout, limits in ceilings.get("by_layout", {}).items())
             + ", "
             f"{ceilings['flops_per_token'] / 1e9:.2f} GFLOP per token. The ceilings below follow from "
             "those rates (the matmul: the fastest of torch.mm, oneDNN's packed linear and tandem's packed "
             "GEMM, at 2,048^3 and on the model's layers at 2,048 rows) and the dtype's bytes"]
    modes = ceilings.get("own", {})
    for engine, limits in modes.items():
        gemm = "8-bit (int8)" if limits["gemm"] == "int8" else limits["gemm"]
        lines.append(f"  {engine}'s own mode: a one-token step reads {limits['one_token_bytes'] / 1e6:,.0f} MB of "
                     f"weights, larger steps multiply {gemm} at {limits['matmul_flops_per_s'] / 1e9:,.0f} GFLOP/s "
                     "(attention at the dtype's rate); its own limits below")
    for workload, by_engine in results.items():
        if workload not in ceilings:
            continue
        metric, limit = ceilings[workload]
        layouts = ceilings.get("by_layout", {})
        shares = ", ".join(
            f"{layout_of(e) or e} {100 * r[metric] / layouts.get(layout_of(e), {}).get(workload, limit):.0f}%"
            for e, r in by_engine.items() if r.get("ok") and r.get(metric))
        own = "".join(
            f"; {e}'s own mode <= {modes[e][workload]:,.0f}: {100 * r[metric] / modes[e][workload]:.0f}%"
            for e, r in by_engine.items() if r.get("ok") and r.get(metric) and workload in modes.get(e, {}))
        lines.append(f"  {workload}: {METRICS[metric][0]} <= {limit:,.0f}; reached: {shares}{own}")
    return "\n".join(lines)
