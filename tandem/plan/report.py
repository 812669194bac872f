"""A `MemoryPlan` as the aligned text table `tandem plan memory` prints, or as JSON.

`format_memory_plan` is also what `tandem serve` can print at start-up (the same split for
the model it is about to load), so it takes only the plan and returns a string.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tandem.sizing.devices import GiB
from tandem.sizing.memory import EnginePlan, MemoryPlan, StagePlan

# Context lengths agents run at (32K, 128K, 256K tokens): the table also counts the sequences
# of each that fit at once, below --max-model-len.
CONTEXT_LENGTHS = (32768, 131072, 262144)


def sequence_lengths(max_model_len: int) -> list[int]:
    """The lengths the table counts sequences of: the usual ones below max-model-len, and it."""
    return [n for n in CONTEXT_LENGTHS if n < max_model_len] + [max_model_len]


def format_memory_plan(plan: MemoryPlan) -> str:
    """The plan as text: a header, one column per engine and rank kind, a summary, notes."""
    p = plan.params
    extra = f" (+{p.vision / 1e9:.2f}B vision tower)" if p.vision else ""
    parts = ", ".join(f"{name} {_count(count)}" for name, count in p.by_part.items())
    kind = plan.devices.kind
    lines = [
        f"{plan.model} ({plan.architecture})",
        f"  parameters  {p.total / 1e9:.2f}B, {p.active / 1e9:.2f}B active per token{extra}",
        f"              {parts}",
        f"  weights     {plan.weights}",
        f"  devices     {plan.devices}, {_gib(kind.memory_bytes)} each ({kind.source}); {plan.parallel}",
        f"  KV cache    {plan.kv_cache_dtype}; max-model-len {plan.max_model_len:,}",
        "",
        *_table(plan),
        "",
        *_summary(plan),
    ]
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)


def _table(plan: MemoryPlan) -> list[str]:
    engines = [plan.tandem] + ([plan.vllm] if plan.vllm else [])
    columns = [(engine, stage) for engine in engines for stage in engine.stages]
    head1 = [""] + [("tandem" if e is plan.tandem else "vLLM defaults") for e, _ in columns]
    head2 = [""] + [f"{s.label} (x{s.ranks})" for _, s in columns]
    rows = [
        ["memory utilization", *(f"{e.memory_utilization:g} of {_gib(s.device_bytes)}" for e, s in columns)],
        ["  = budget", *(_gib(s.budget_bytes) for _, s in columns)],
        ["weights", *(_gib(s.weight_bytes) for _, s in columns)],
        *([["  of which vision tower", *(_gib(s.vision_bytes) if s.vision_bytes else "-" for _, s in columns)]]
          if any(s.vision_bytes for _, s in columns) else []),
        ["activation peak", *(_gib(s.activation_bytes) for _, s in columns)],
        ["  batched tokens / seqs", *(f"{e.max_num_batched_tokens} / {e.max_num_seqs}" for e, _ in columns)],
        ["reserved (CUDA, NCCL)", *(_gib(s.reserved_bytes) for _, s in columns)],
        ["KV cache left", *(_kv_left(s) for _, s in columns)],
        ["KV bytes per token", *(_kib(s.kv_bytes_per_token) for _, s in columns)],
        ["KV tokens that fit", *(f"{s.kv_tokens:,}" for _, s in columns)],
        *([f"seqs of {n:,} tokens", *(f"{s.kv_tokens // n:,}" for _, s in columns)]
          for n in sequence_lengths(plan.max_model_len)),
    ]
    table = [head1, head2, *rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(head1))]

    def fmt(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip()

    return [fmt(head1), fmt(head2), "  ".join("-" * w for w in widths), *(fmt(r) for r in rows)]


def _summary(plan: MemoryPlan) -> list[str]:
    t = plan.tandem
    lines = [f"tandem: {_gib(t.kv_bytes_total)} of KV cache over {plan.parallel.world_size} rank(s), "
             f"{t.kv_tokens:,} tokens, {t.max_sequences(plan.max_model_len):,} sequence(s) of "
             f"{plan.max_model_len:,} tokens at once"]
    v = plan.vllm
    if v is None:
        lines.append("vLLM: no comparison on a CPU device (its CPU backend sizes the KV cache from "
                     "VLLM_CPU_KVCACHE_SPACE, not a memory fraction)")
    elif not v.fits:
        lines.append(f"vLLM with gpu_memory_utilization {v.memory_utilization:g}: the weights and its "
                     f"{v.max_num_batched_tokens}-token activation peak leave no room for a KV cache")
    else:
        ratio = t.kv_tokens / v.kv_tokens
        lines.append(f"vLLM, its defaults (gpu_memory_utilization {v.memory_utilization:g} of everything, "
                     f"{v.max_num_batched_tokens} tokens, {v.max_num_seqs} seqs): {_gib(v.kv_bytes_total)}, "
                     f"{v.kv_tokens:,} tokens; tandem's plan: {ratio:.2f}x the tokens")
    return lines


def plan_to_dict(plan: MemoryPlan) -> dict[str, Any]:
    """The plan as plain data for --json: every field, plus each engine's totals."""
    data = dataclasses.asdict(plan)
    data["devices"]["description"] = str(plan.devices)
    for key, engine in (("tandem", plan.tandem), ("vllm", plan.vllm)):
        if engine is not None:
            data[key].update(_totals(engine, plan.max_model_len))
    return data


def _totals(engine: EnginePlan, max_model_len: int) -> dict[str, Any]:
    return {"fits": engine.fits, "kv_tokens": engine.kv_tokens, "kv_bytes_total": engine.kv_bytes_total,
            "max_sequences_at_max_model_len": engine.max_sequences(max_model_len),
            "max_sequences": {str(n): engine.max_sequences(n) for n in sequence_lengths(max_model_len)}}


def _kv_left(stage: StagePlan) -> str:
    return _gib(stage.kv_bytes) if stage.kv_bytes > 0 else f"none ({_gib(stage.kv_bytes)})"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 10**8 else f"{n / 1e6:.2f}M"


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"
