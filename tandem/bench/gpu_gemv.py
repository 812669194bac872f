"""`tandem bench gpu --gemv`: tandem's one-row GEMV against cuBLAS on a model's projections.

For each matrix of the config's layers and its LM head as one GPU holds them (the fused q/k/v
projection, o_proj with the residual add, the fused gate/up projection, down_proj reading the
gate/up row through silu-and-mul with the residual add, the head), in bf16 with one row:
cuBLAS's way (torch.mm, or torch.addmm with the residual, after the silu-and-mul kernel for
down_proj) and each of tandem/kernels/gpu/gemv.py's candidate block shapes, timed as the
engine runs them, in a CUDA graph (no host launch cost), each launch on its own copy of the
weight (so none is in L2), against the copy bound of the weight's bytes. Each candidate's output is checked against fp32 first. Writes the device's
table (the best candidate for each matrix it beats cuBLAS on by 3% or more, nothing for the
others) beside the figures; copied into tandem/kernels/gpu/gemv_configs/, it is what the
engine reads at start-up.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

WIN_MARGIN = 0.97  # the kernel must take at most this share of cuBLAS's time to replace it
MAX_ERROR = 2e-2  # largest difference from cuBLAS's output, over its largest value, a candidate may have
COLD_BYTES = 512 << 20  # weight copies a timing cycles through, at least: several times any L2


@dataclass(frozen=True)
class GemvCase:
    """One matrix [n, k] a batch-1 step multiplies by, in the form the model calls it."""

    name: str
    n: int
    k: int
    residual: bool = False
    silu_mul: bool = False


def gemv_cases(config: dict[str, Any]) -> list[GemvCase]:
    """A dense decoder's projections as one GPU holds them (no tensor parallelism)."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config.get("num_key_value_heads", heads)
    intermediate = config["intermediate_size"]
    return [
        GemvCase("qkv_proj", (heads + 2 * kv_heads) * head_dim, hidden),
        GemvCase("o_proj", hidden, heads * head_dim, residual=True),
        GemvCase("gate_up_proj", 2 * intermediate, hidden),
        GemvCase("down_proj", hidden, intermediate, residual=True, silu_mul=True),
        GemvCase("lm_head", config["vocab_size"], hidden),
    ]


def measure_case(torch: Any, case: GemvCase, timer: Any, copy_gb_s: float, device: str = "cuda") -> dict[str, Any]:
    """cuBLAS and every candidate on one case: times, GB/s, share of the copy bound, error
    (bf16 on a GPU; fp16 on the CPU, under Triton's interpreter, for tests). `timer` takes a
    list of launches, each reading its own copy of the weight (enough copies that the device's
    L2 holds none of them when its turn comes, as a model's step reads each weight once), and
    gives the seconds of one."""
    from tandem.kernels.gpu.gemv import CANDIDATES, gemv
    from tandem.kernels.gpu.silu_mul import silu_mul

    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    generator = torch.Generator(device=device).manual_seed(case.n + case.k)
    moved = case.n * case.k * 2
    copies = [(torch.randn(case.n, case.k, device=device, generator=generator) / case.k**0.5).to(dtype)
              for _ in range(min(16, max(2, -(-COLD_BYTES // moved))))]
    x = torch.randn(1, 2 * case.k if case.silu_mul else case.k, device=device, generator=generator).to(dtype)
    residual = torch.randn(1, case.n, device=device, generator=generator).to(dtype) if case.residual else None

    def cublas(weight: Any) -> Any:
        row = silu_mul(x) if case.silu_mul else x
        return torch.mm(row, weight.t()) if residual is None else torch.addmm(residual, row, weight.t())

    reference = cublas(copies[0]).float()
    bound_us = moved / (copy_gb_s * 1e9) * 1e6

    def figures(seconds: float) -> dict[str, float]:
        return {"us": seconds * 1e6, "gb_s": moved / seconds / 1e9, "of_bound": bound_us / (seconds * 1e6)}

    entry: dict[str, Any] = {"case": asdict(case), "bound_us": bound_us, "copies": len(copies),
                             "cublas": figures(timer([functools.partial(cublas, w) for w in copies])),
                             "candidates": []}
    for config in CANDIDATES:
        launches = [functools.partial(gemv, x, w, config, None, residual, case.silu_mul) for w in copies]
        try:
            error = ((launches[0]().float() - reference).abs().max() / reference.abs().max()).item()
            measured = figures(timer(launches))
        except Exception as failure:  # a Triton without PDL, say: the others still count
            entry["failed"] = entry.get("failed", []) + [f"{_label(asdict(config))}: {failure!r}"[:300]]
            continue
        if error > MAX_ERROR:
            entry["failed"] = entry.get("failed", []) + [f"{_label(asdict(config))}: error {error:.1e}"]
            continue
        entry["candidates"].append({"config": asdict(config), "max_rel_error": error} | measured)
    return entry


def graph_timer(torch: Any, launches: list[Any], repeats: int = 20) -> float:
    """Seconds of one launch: `launches` captured once into a CUDA graph, its replays timed
    with events (median), over their count. In a graph, as in the engine's decode step, the
    host's launch cost is out of the figure; timed one by one, a 10 us kernel read 20-40 us."""
    for launch in launches:  # compiles, and sets up cuBLAS, outside the capture
        launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for launch in launches:
            launch()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(launches))
    del graph
    return statistics.median(times)


def _label(config: dict[str, Any]) -> str:
    pdl = " pdl" if config.get("pdl") else ""
    return f"{config['block_n']}x{config['block_k']} w{config['num_warps']} s{config['num_stages']}{pdl}"


def winner(entry: dict[str, Any]) -> dict[str, Any] | None:
    """The fastest candidate of a measured case where it beats cuBLAS by the margin, else None."""
    best = min(entry["candidates"], key=lambda c: c["us"])
    return best if best["us"] <= WIN_MARGIN * entry["cublas"]["us"] else None


def run_gemv_bench(torch: Any, args: argparse.Namespace, config: dict[str, Any], limits: dict[str, float]) -> int:
    """`--gemv` (see the module's docstring)."""
    from tandem.kernels.gpu.gemv import GemvConfig, shape_key, table_entry, table_path, write_table

    def timer(launches: list[Any]) -> float:
        return graph_timer(torch, launches)

    device = torch.cuda.get_device_name()
    out = Path(args.output_dir) / f"gpu-gemv-{dt.datetime.now():%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    print(f"tandem bench gpu --gemv: {device}, {args.config}'s matrices in bf16, one row; copy "
          f"{limits['copy_gb_s']:.0f} GB/s (read + written)")
    results: dict[str, Any] = {"device": device, "config": args.config, "limits": limits, "cases": []}
    table: dict[str, dict] = {}
    saved_us = 0.0
    layers = config["num_hidden_layers"]
    for case in gemv_cases(config):
        entry = measure_case(torch, case, timer, limits["copy_gb_s"])
        torch.cuda.empty_cache()
        results["cases"].append(entry)
        cublas = entry["cublas"]
        if not entry["candidates"]:
            print(f"{case.name} [{case.n} x {case.k}]: no candidate ran; cuBLAS {cublas['us']:.1f} us")
            continue
        best = min(entry["candidates"], key=lambda c: c["us"])
        form = " + residual" if case.residual else ""
        form = (" from silu(gate) * up" if case.silu_mul else "") + form
        print(f"{case.name} [{case.n} x {case.k}]{form}: copy bound {entry['bound_us']:.1f} us; cuBLAS "
              f"{cublas['us']:.1f} us ({cublas['gb_s']:.0f} GB/s, {cublas['of_bound']:.0%}); tandem's best "
              f"{best['us']:.1f} us ({best['gb_s']:.0f} GB/s, {best['of_bound']:.0%}) at {_label(best['config'])}; "
              f"largest error against cuBLAS {max(c['max_rel_error'] for c in entry['candidates']):.1e}")
        print("    every candidate (rows x K step, warps, stages: us): " + ", ".join(
            f"{_label(c['config'])}: {c['us']:.1f}" for c in entry["candidates"]))
        for failure in entry.get("failed", []):
            print(f"    left out: {failure}")
        if winner(entry) is not None:
            table[shape_key(case.n, case.k)] = table_entry(GemvConfig(**best["config"]), best["us"], cublas["us"])
            saved_us += (cublas["us"] - best["us"]) * (1 if case.name == "lm_head" else layers)
    print(f"tandem's GEMV wins {len(table)} of {len(results['cases'])} matrices by {1 - WIN_MARGIN:.0%} or more; "
          f"a batch-1 step of {layers} layers would save ~{saved_us:.0f} us")
    path = out / table_path(device).name
    write_table(path, device, torch.bfloat16, table)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"table: {path} (copy it into tandem/kernels/gpu/gemv_configs/ for the engine to read)\n"
          f"figures: {out / 'results.json'}")
    return 0
