"""`tandem bench overhead`: what an engine step costs beyond the model's own arithmetic.

A step at batch 1 is mostly the model forward (weights streamed once per token); everything
else the engine does around it (scheduling, building the batch, bookkeeping, outputs, text)
is overhead that caps single-stream speed and grows with every feature bolted on. This bench
times `LLMEngine.step()` and, inside it, the model's forward and its LM head (wrapped with
timers), so overhead = step - (forward + LM head): scheduling, batch building, sampling,
state updates, outputs and text. The hardware's limit for overhead is zero; the report
gives it per step and as a share of the step.

`--baseline PATH` measures another tandem checkout (e.g. a git worktree of an older commit)
in the same run, in a subprocess that runs this very file with PATH first on `sys.path`.
So this module must only use what every tandem version has: `tandem.llm.LLM`,
`tandem.types.SamplingParams`, `llm.engine.add_request/step/has_unfinished` and
`llm.engine.runner.model` (its `greedy_tokens`, the head without logits, where it has one). Runs alternate (ours, baseline, ours, ...) so a machine
that drifts affects both alike; the medians of the repeats are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_PROMPT = list(range(1000, 1064))  # 64 token ids, the same for every run


def measure(model: str | None, batch: int, steps: int, threads: int | None) -> dict[str, float]:
    """Time `steps` decode steps at `batch` sequences; returns seconds per step, split."""
    import torch

    from tandem.llm import LLM
    from tandem.types import SamplingParams

    if threads:
        torch.set_num_threads(threads)
    llm = LLM(model, kv_cache_memory="256MiB", num_threads=threads)
    engine = llm.engine
    runner = engine.runner
    spent = {"model": 0.0, "head": 0.0}

    def timed(fn: Any, head: bool = False) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - started
                spent["model"] += seconds
                if head:
                    spent["head"] += seconds
        return wrapper

    model = runner.model
    model.forward = timed(model.forward)
    model.compute_logits = timed(model.compute_logits, head=True)
    # Greedy rows take the head's tokens without logits where the model can (greedy_tokens);
    # that is the LM head's arithmetic too, so it counts as the model's time.
    if hasattr(model, "greedy_tokens"):
        model.greedy_tokens = timed(model.greedy_tokens, head=True)
    params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(None, None, params, prompt_token_ids=list(_PROMPT))
    engine.step()  # the prefill, untimed
    engine.step()
    step_times, model_times, head_times = [], [], []
    while engine.has_unfinished() and len(step_times) < steps:
        spent["model"] = spent["head"] = 0.0
        started = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - started)
        model_times.append(spent["model"])
        head_times.append(spent["head"])
    while engine.has_unfinished():
        engine.step()
    step = statistics.median(step_times)
    forward = statistics.median(model_times)
    overheads = sorted(s - m for s, m in zip(step_times, model_times, strict=True))
    return {"step_s": step, "model_s": forward, "head_s": statistics.median(head_times),
            "overhead_s": statistics.median(overheads),
            "overhead_p90_s": overheads[int(0.9 * (len(overheads) - 1))], "steps": len(step_times)}


def _run(path: Path | None, args: argparse.Namespace) -> dict[str, float]:
    """One measurement in a fresh interpreter, with `path` (a tandem checkout) first if given."""
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(path), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    command = [sys.executable, str(Path(__file__).resolve()), "--measure", "--batch", str(args.batch),
               "--steps", str(args.steps)]
    if args.model:
        command += ["--model", args.model]
    if args.threads:
        command += ["--threads", str(args.threads)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"measurement of {path or 'this tree'} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def _baseline(args: argparse.Namespace) -> Path | None:
    if not args.baseline:
        return None
    baseline = Path(args.baseline).resolve()
    if not (baseline / "tandem" / "llm.py").is_file():
        raise ValueError(f"--baseline {args.baseline}: not a tandem checkout (no tandem/llm.py there)")
    return baseline


def check_overhead(args: argparse.Namespace) -> None:
    """A --baseline that is no tandem checkout, or a count below 1, fails before any run."""
    _baseline(args)
    if args.repeats < 1 or args.steps < 1 or args.batch < 1:
        raise ValueError("--repeats, --steps and --batch must be at least 1")


def run_overhead(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    check_overhead(args)
    engines: dict[str, Path | None] = {"tandem": None}
    baseline = _baseline(args)
    if baseline is not None:
        engines["baseline"] = baseline
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    order = [name for _ in range(args.repeats) for name in engines]
    for name in tqdm(order, desc="measuring", unit="run"):
        runs[name].append(_run(engines[name], args))
    results = {name: _median(r) for name, r in runs.items()}
    print(f"engine step at batch {args.batch}, {args.steps} decode steps, median of {args.repeats} runs each")
    print(f"{'':<10} {'step ms':>9} {'model ms':>9} {'overhead us':>12} {'p90 us':>8} {'share':>7}")
    for name, r in results.items():
        print(f"{name:<10} {r['step_s'] * 1e3:9.2f} {r['model_s'] * 1e3:9.2f} {r['overhead_s'] * 1e6:12.0f} "
              f"{r['overhead_p90_s'] * 1e6:8.0f} {r['overhead_s'] / r['step_s']:7.1%}")
    if "baseline" in results:
        ratio = results["baseline"]["overhead_s"] / max(results["tandem"]["overhead_s"], 1e-9)
        print(f"overhead: baseline / tandem = {ratio:.2f}x (the hardware's limit is 0 us)")
    if args.output:
        shown = {key: value for key, value in vars(args).items() if key != "check"}
        Path(args.output).write_text(json.dumps({"args": shown | {"handler": None}, "runs": runs,
                                                 "results": results}, indent=2, default=str))
    return 0


def measure_parser() -> argparse.ArgumentParser:
    """The measuring process's parser. Plain argparse on purpose: this file also runs inside a
    baseline checkout, which may predate the flag tables (`tandem.bench.overhead_cli` holds the
    command's, and a test keeps the two alike)."""
    parser = argparse.ArgumentParser(description="one overhead measurement; prints JSON")
    parser.add_argument("--measure", action="store_true", required=True)
    parser.add_argument("--model", default=None, help="model (default: smollm2-135m)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step (default: 1)")
    parser.add_argument("--steps", type=int, default=200, help="decode steps timed (default: 200)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    return parser


def _main() -> int:
    args = measure_parser().parse_args()
    print(json.dumps(measure(args.model, args.batch, args.steps, args.threads)))
    return 0


if __name__ == "__main__":
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)  # run as a file: this folder's modules must not shadow top-level names
    sys.exit(_main())
