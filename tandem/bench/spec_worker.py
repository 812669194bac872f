"""One target model, its configurations one after another: the child side of `tandem bench spec`.

    python -m tandem.bench.spec_worker --spec group.json

The parent writes the plan (the target model, engine keywords, the configurations, the
cells to measure, the requests of each kind) and reads back the JSON lines this process
appends to ``rows_path`` as it goes: ``{"event": "start", "config": ...}`` before each
configuration, then one row per measured cell (or an error row per cell when the
configuration did not start), so a crash loses only the configuration it happened in.

Each configuration is one `tandem.LLM`, started once and used for every cell (kind x batch);
the baseline (no speculation) comes first and, paired (the default), stays up: each later
configuration's generate calls alternate with the same calls on it, so both sides of a
speedup share whatever else the machine was doing at that moment. Before each cell the prefix cache is emptied and
the speculator starts over (a fresh proposer, so suffix decoding's cache of finished outputs
holds only that cell's requests, and a fresh acceptance history); the fitted step cost is
kept, it describes the machine. A cell's wall time, CPU time, engine steps, the speculation
counters' increase and the fitted step cost are recorded with every request's output tokens.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

logger = logging.getLogger("tandem.bench.spec_worker")


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


class Emitter:
    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()


def speculative_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """The `speculative_config` of a configuration ({"method": "baseline"} has none)."""
    if config["method"] == "baseline":
        return None
    spec: dict[str, Any] = {"method": config["method"], "num_speculative_tokens": config["k"],
                            "adaptive": bool(config["adaptive"])}
    if config.get("draft_model"):
        spec["model"] = config["draft_model"]
    if config.get("draft_weights"):
        spec["draft_decode_weights"] = config["draft_weights"]
    return spec


def _speculator(llm: Any) -> Any:
    return getattr(getattr(llm.engine, "core", None), "speculator", None)


def _counters(speculator: Any) -> dict[str, Any]:
    stats = getattr(speculator, "stats", None)
    if stats is None:
        return {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_position": []}
    return {"num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens,
            "accepted_per_position": list(stats.accepted_per_position)}


def counters_increase(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What a cell added to the cumulative counters."""
    per_position = list(after["accepted_per_position"])
    for i, value in enumerate(before["accepted_per_position"]):
        per_position[i] -= value
    return {"num_drafts": after["num_drafts"] - before["num_drafts"],
            "num_draft_tokens": after["num_draft_tokens"] - before["num_draft_tokens"],
            "num_accepted_tokens": after["num_accepted_tokens"] - before["num_accepted_tokens"],
            "accepted_per_position": per_position}


def _restart_speculation(speculator: Any) -> None:
    """A fresh proposer and acceptance history for the next cell (token proposers only; a
    proposer that runs a model keeps its state where it lives)."""
    if speculator is None:
        return
    try:
        from tandem.spec.factory import make_token_proposer

        speculator.proposer = make_token_proposer(speculator.config)
    except Exception:  # noqa: BLE001 - not a token proposer: nothing to restart here
        pass
    acceptance = getattr(speculator, "acceptance", None)
    if acceptance is not None:
        speculator.acceptance = type(acceptance)()


def _cost(speculator: Any) -> list[float] | None:
    cost = getattr(speculator, "cost", None)
    if cost is None or not getattr(cost, "observed", False):
        return None
    return list(cost.coefficients())


def _prompts(llm: Any, conversations: list[list[dict[str, str]]]) -> list[dict[str, Any]]:
    """Token ids by the model's own chat template, made before the clock starts."""
    from tandem.loader.tokenizer import render_chat

    tokenizer = llm.tokenizer
    prompts = []
    for conversation in conversations:
        text = render_chat(tokenizer, conversation)
        prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
    return prompts


class Engine:
    """One configuration's `tandem.LLM`, warmed up, with its engine steps counted."""

    def __init__(self, plan: dict[str, Any], config: dict[str, Any]) -> None:
        from tandem.llm import LLM
        from tandem.types import SamplingParams

        started = time.perf_counter()
        self.llm = LLM(config.get("model") or plan["model"], **engine_kwargs(plan),
                       speculative_config=speculative_config(config))
        self.ready_s = time.perf_counter() - started
        self.steps = 0
        self.first_token_at: dict[str, float] = {}  # request id -> when its first token came out
        engine = self.llm.engine
        step = engine.step

        def counted(*args: Any, **kwargs: Any) -> Any:  # LLM.generate drives engine.step
            self.steps += 1
            return step(*args, **kwargs)

        core_step = engine.core.step

        def first_tokens(*args: Any, **kwargs: Any) -> Any:  # the core's per-step token deltas
            deltas = core_step(*args, **kwargs)
            now = time.perf_counter()
            for delta in deltas:
                if delta.request_id not in self.first_token_at and any(s.token_ids for s in delta.sequences):
                    self.first_token_at[delta.request_id] = now
            return deltas

        engine.step = counted
        engine.core.step = first_tokens
        self.llm.generate(_prompts(self.llm, [plan["warmup"]]), SamplingParams(temperature=0.0, max_tokens=16))

    @property
    def speculator(self) -> Any:
        return _speculator(self.llm)

    def prepare(self) -> None:
        """Before a cell: an empty prefix cache, a fresh proposer and acceptance history."""
        self.llm.engine.core.reset_prefix_cache()
        _restart_speculation(self.speculator)

    def generate(self, prompts: list[dict[str, Any]], params: Any) -> tuple[list[Any], float, float, float]:
        """(completions, wall s, CPU s, s until every request of the call had its first
        token) of one generate call."""
        self.first_token_at = {}
        cpu_started, started = time.process_time(), time.perf_counter()
        outputs = self.llm.generate(prompts, params)
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        firsts = [self.first_token_at.get(o.request_id) for o in outputs]
        first = max(firsts) - started if firsts and None not in firsts else wall
        return [o.outputs[0] for o in outputs], wall, cpu, first

    def shutdown(self) -> None:
        self.llm.shutdown()


def measure_cell(engine: Engine, conversations: list[list[dict[str, str]]], batch: int, max_tokens: int,
                 reference: Engine | None = None, flip: bool = False) -> dict[str, Any]:
    """Generate the cell's requests: one at a time (batch 1) or all at once (batch B).

    With a `reference` (the baseline engine), every generate call of this engine is paired
    with the same call on the reference, in alternating order (`flip` starts with the
    reference), so both see the same share of a machine whose other load drifts; the
    reference's time and outputs are recorded as `base_*`."""
    from tandem.types import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    prompts = _prompts(engine.llm, conversations)
    calls = [[p] for p in prompts] if batch == 1 else [prompts]
    engines = [engine] if reference is None else [engine, reference]
    for e in engines:
        e.prepare()
    before = _counters(engine.speculator)
    engine.steps = 0
    load_start = _loadavg()
    completions: dict[int, list[Any]] = {id(e): [] for e in engines}
    wall = {id(e): 0.0 for e in engines}
    cpu = {id(e): 0.0 for e in engines}
    first = {id(e): 0.0 for e in engines}
    for i, call in enumerate(calls):
        order = engines if (i + flip) % 2 == 0 else engines[::-1]
        for e in order:
            done, seconds, cpu_seconds, first_seconds = e.generate(call, params)
            completions[id(e)] += done
            wall[id(e)] += seconds
            cpu[id(e)] += cpu_seconds
            first[id(e)] += first_seconds
    mine = completions[id(engine)]
    row = {
        "ok": True, "wall_s": wall[id(engine)], "cpu_s": cpu[id(engine)], "first_token_s": first[id(engine)],
        "steps": engine.steps,
        "requests": len(prompts), "prompt_tokens": sum(len(p["prompt_token_ids"]) for p in prompts),
        "output_tokens": sum(len(c.token_ids) for c in mine),
        "spec": counters_increase(before, _counters(engine.speculator)), "cost": _cost(engine.speculator),
        # a draft model's one-token guessing forward, as the proposer timed it (smoothed)
        "draft_forward_s": getattr(engine.speculator, "draft_forward_seconds", 0.0) or None,
        "prompt_token_ids": [p["prompt_token_ids"] for p in prompts],
        "outputs": [list(c.token_ids) for c in mine], "texts": [c.text for c in mine],
        "finish_reasons": [c.finish_reason for c in mine], "loadavg": [load_start, _loadavg()],
    }
    if reference is not None:
        row.update(base_wall_s=wall[id(reference)], base_cpu_s=cpu[id(reference)],
                   base_first_token_s=first[id(reference)],
                   base_outputs=[list(c.token_ids) for c in completions[id(reference)]])
    return row


def decode_step_seconds(llm: Any, short: int = 8, long: int = 40) -> float:
    """Seconds per plain decode step at batch 1: (t(long) - t(short)) / (long - short) tokens
    of one request, so the prefill cancels out; the better of two tries."""
    from tandem.types import SamplingParams

    prompt = list(range(1000, 1032))
    best = float("inf")
    for _ in range(2):
        times = []
        for n in (short, long):
            llm.engine.core.reset_prefix_cache()
            started = time.perf_counter()
            llm.generate([{"prompt_token_ids": prompt}],
                         SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, speculate=False))
            times.append(time.perf_counter() - started)
        best = min(best, (times[1] - times[0]) / (long - short))
    return best


def cells_for(config: dict[str, Any], cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cells a configuration measures: none for a step-time-only run; the adaptive-only
    cells (e.g. prose at batch 32) for the baseline and adaptive configurations alone."""
    if config.get("step_only"):
        return []
    return [c for c in cells if config["method"] == "baseline" or not c.get("adaptive_only") or config.get("adaptive")]


def engine_kwargs(plan: dict[str, Any]) -> dict[str, Any]:
    """`tandem.LLM` keywords from the parent's engine flag values (as `tandem generate`)."""
    from tandem.flags.engine import llm_kwargs

    kwargs = llm_kwargs(argparse.Namespace(**plan["engine_values"]))
    kwargs.pop("speculative_config", None)
    return kwargs


def _base(plan: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    return {"group": plan["group"], "model": plan["model"], "config": config["name"], "method": config["method"],
            "k": config.get("k"), "adaptive": bool(config.get("adaptive")), "draft_model": config.get("draft_model")}


def run_config(plan: dict[str, Any], config: dict[str, Any], emit: Emitter, reference: Engine | None = None,
               keep: bool = False) -> Engine | None:
    """Start the configuration, measure its cells (paired with `reference` when given), and
    shut it down, or return it still running with `keep` (the baseline, the reference of the
    configurations after it)."""
    base = _base(plan, config)
    cells = cells_for(config, plan["cells"])
    emit({"event": "start", "config": config["name"], "pid": os.getpid()})
    try:
        engine = Engine(plan, config)
    except Exception as exc:  # noqa: BLE001 - one configuration failing must not lose the others
        error = f"{type(exc).__name__}: {exc}"
        logger.error("%s did not start: %s\n%s", config["name"], error, traceback.format_exc())
        for cell in cells:
            emit({**base, "kind": cell["kind"], "batch": cell["batch"], "ok": False, "error": error})
        return None
    try:
        if config.get("measure_step"):
            emit({**base, "event": "step_time", "decode_step_s": decode_step_seconds(engine.llm),
                  "ready_s": engine.ready_s})
        for n, cell in enumerate(cells):
            kind, batch = cell["kind"], cell["batch"]
            conversations = plan["conversations"][kind][:cell["requests"]]
            try:
                row = measure_cell(engine, conversations, batch, plan["max_tokens"], reference, flip=n % 2 == 1)
            except Exception as exc:  # noqa: BLE001 - reported in the row
                logger.error("%s %s@%d failed:\n%s", config["name"], kind, batch, traceback.format_exc())
                row = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            emit({**base, "kind": kind, "batch": batch, "ready_s": engine.ready_s, **row})
            logger.info("%s %s@%d: %s", config["name"], kind, batch,
                        f"{row['wall_s']:.2f} s" if row.get("ok") else row.get("error"))
    except BaseException:
        engine.shutdown()
        raise
    if keep:
        return engine
    engine.shutdown()
    return None


def run_plan(plan: dict[str, Any], emit: Emitter) -> None:
    """Every configuration of the plan in order. Paired (the default), the baseline engine
    stays up and each speculative configuration's calls alternate with its calls; a plan
    that resumes after a crash (no baseline among its configurations) starts the baseline
    engine again for that, without measuring it on its own."""
    configs = plan["configs"]
    paired = plan.get("paired", True) and any(c["method"] != "baseline" for c in configs)
    reference: Engine | None = None
    if paired and not any(c["name"] == "baseline" for c in configs):
        try:
            reference = Engine(plan, {"name": "baseline", "method": "baseline"})
        except Exception:  # noqa: BLE001 - the configurations run unpaired, the log says why
            logger.error("the baseline did not start; unpaired:\n%s", traceback.format_exc())
    try:
        for config in configs:
            if config["name"] == "baseline":
                reference = run_config(plan, config, emit, keep=paired)
            else:
                run_config(plan, config, emit, reference)
    finally:
        if reference is not None:
            reference.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="child process of `tandem bench spec`")
    parser.add_argument("--spec", required=True, help="JSON plan written by the parent")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    plan = json.loads(Path(args.spec).read_text())
    if plan.get("threads"):
        import torch

        torch.set_num_threads(int(plan["threads"]))
    emit = Emitter(plan["rows_path"])
    run_plan(plan, emit)
    emit({"event": "done"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
