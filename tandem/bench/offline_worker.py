"""One engine, one workload, one process: the child side of `tandem bench offline`.

    python -m tandem.bench.offline_worker --spec run.json --out result.json

The parent writes the spec (engine, engine arguments, the workload's token ids, the warm-up
prompt, the parent's launch timestamp) and reads the result back. Start-to-ready is measured
from the parent's launch timestamp, so it includes interpreter start and imports; peak RSS is
this process's ``ru_maxrss`` (and its waited-for children's, if larger).

This file imports only the standard library at module level: for the vLLM peer the parent
copies it to a temporary file and runs it with the Python of the vLLM venv, where tandem is
not installed. Engine imports happen inside the engine functions.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import resource
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("tandem.bench.offline_worker")

Generate = Callable[[list[list[int]], int], list[list[int]]]


def peak_rss_mib() -> float:
    """This process's peak RSS, plus its live descendants' (an engine's rank processes) on
    Linux, or the largest waited-for child's where /proc is not there."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    live = sum(_peak_kib(pid) for pid in _descendants(os.getpid())) if os.path.isdir("/proc") else 0
    return (max(own, children) * scale + live * 1024) / (1 << 20)


def _descendants(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        kids = [pid for pid, ppid in parents.items() if ppid == parent]
        found += kids
        frontier += kids
    return found


def _peak_kib(pid: int) -> int:
    """VmHWM: the peak resident set of a live process, in KiB (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


# --- engines: each returns (generate function, info dict) -------------------------------------

def start_tandem(args: dict[str, Any]) -> tuple[Generate, dict[str, Any]]:
    import torch

    import tandem
    from tandem.flags.engine import llm_kwargs
    from tandem.llm import LLM
    from tandem.types import SamplingParams

    # The engine flags, exactly as `tandem generate` turns them into an LLM.
    namespace = argparse.Namespace(**args)
    llm = LLM(namespace.model, **llm_kwargs(namespace))

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [list(o.outputs[0].token_ids) for o in outputs]

    info = {"version": tandem.__version__, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "max_model_len": llm.engine.max_model_len, "kv_blocks": llm.engine.block_pool.num_blocks,
            "engine_startup_s": llm.engine.startup_seconds}
    core = llm.engine.core
    reads = _step_reads([worker.step_reads for worker in core.worker_infos])
    if reads is not None:
        info["step_reads"] = reads
    generate.reset_cache = core.reset_prefix_cache  # type: ignore[attr-defined]
    # --profile: the ranks record the named phases of each step (tandem/platform/profiling.py).
    # The pass starts from an empty prefix cache, so its prefills are computed as the timed ones were.
    generate.profile = (lambda: (core.reset_prefix_cache(), core.collective_rpc("start_profile")),  # type: ignore[attr-defined]
                        lambda: core.collective_rpc("stop_profile"))
    return generate, info


def start_transformers(args: dict[str, Any]) -> tuple[Generate, dict[str, Any]]:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    if args.get("threads"):
        torch.set_num_threads(int(args["threads"]))
    model = AutoModelForCausalLM.from_pretrained(args["hf_dir"], dtype=torch.float32)
    model.eval()
    batch_size = int(args.get("batch_size") or 16)
    config = model.config
    pad = config.pad_token_id
    if pad is None:
        eos = config.eos_token_id
        pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0

    # ignore_eos as tandem and vLLM do it: EOS neither stops a row nor is forbidden, so greedy
    # may pick it. min_new_tokens alone would ban EOS and change the greedy tokens; an EOS of
    # None is refilled from the model's config. An id past the vocabulary matches nothing.
    no_eos = [int(config.vocab_size)]

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        # Longest first, so each padded chunk holds prompts of similar length.
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        outputs: list[list[int]] = [[] for _ in prompts]
        for start in range(0, len(order), batch_size):
            chunk = order[start:start + batch_size]
            width = max(len(prompts[i]) for i in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, i in enumerate(chunk):  # left padding
                n = len(prompts[i])
                ids[row, width - n:] = torch.tensor(prompts[i], dtype=torch.long)
                mask[row, width - n:] = 1
            with torch.inference_mode():
                out = model.generate(
                    input_ids=ids, attention_mask=mask, do_sample=False, num_beams=1,
                    max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=pad,
                    eos_token_id=no_eos, temperature=None, top_p=None, top_k=None,
                )
            for row, i in enumerate(chunk):
                outputs[i] = out[row, width:].tolist()
        return outputs

    generate.reset_cache = lambda: None  # type: ignore[attr-defined]  # no cache outlives a call
    info = {"version": transformers.__version__, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "batch_size": batch_size,
            "attn_implementation": getattr(config, "_attn_implementation", None)}
    return generate, info


def start_vllm(args: dict[str, Any]) -> tuple[Generate, dict[str, Any]]:
    # The engine core in this process (as tandem's LLM does), so ru_maxrss covers all of it.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm
    from vllm import LLM, SamplingParams

    try:
        from vllm.inputs import TokensPrompt
    except ImportError:  # older layouts
        TokensPrompt = dict  # noqa: N806

    llm = LLM(**args)

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    generate.reset_cache = llm.reset_prefix_cache  # type: ignore[attr-defined]
    info: dict[str, Any] = {"version": vllm.__version__}
    try:
        import torch

        info.update(torch=torch.__version__, threads=torch.get_num_threads())
    except Exception:  # noqa: BLE001 - informational only
        pass
    return generate, info


def start_llamacpp(args: dict[str, Any]) -> tuple[Generate, dict[str, Any]]:
    import llama_cpp

    llm = llama_cpp.Llama(**args, logits_all=False, verbose=False)

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        outputs = []
        for prompt in prompts:  # one sequence at a time: the Python API has no batching
            tokens: list[int] = []
            # Greedy (temperature 0), no penalties; the loop, not an EOS, ends it (ignore_eos).
            for token in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                      repeat_penalty=1.0, reset=True):
                tokens.append(int(token))
                if len(tokens) == max_tokens:
                    break
            outputs.append(tokens)
        return outputs

    info = {"version": llama_cpp.__version__, "threads": args.get("n_threads"),
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace")[:300]}
    return generate, info


ENGINES: dict[str, Callable[[dict[str, Any]], tuple[Generate, dict[str, Any]]]] = {
    "tandem": start_tandem,
    "transformers": start_transformers,
    "vllm": start_vllm,
    "llamacpp": start_llamacpp,
}


# --- one run ------------------------------------------------------------------------------

def run(spec: dict[str, Any]) -> dict[str, Any]:
    workload = spec["workload"]
    result: dict[str, Any] = {
        "engine": spec["engine"], "workload": workload["name"], "ok": False, "error": None,
        "ready_s": None, "peak_rss_mib": None, "elapsed_s": None, "request_seconds": [],
        "prompt_tokens": 0, "output_tokens": 0, "output_token_ids": [], "engine_info": {},
        "python": platform.python_version(), "pid": os.getpid(), "loadavg_start": _loadavg(),
    }
    try:
        # "tandem@ep2": tandem in one parallel layout of several (the engine args say which).
        generate, info = ENGINES[spec["engine"].partition("@")[0]](spec.get("engine_args") or {})
        result["ready_s"] = time.time() - spec["launch_time"]
        result["engine_info"] = info
        logger.info("%s ready in %.1f s", spec["engine"], result["ready_s"])

        warm = spec.get("warmup_prompt")
        if warm:
            generate([warm], int(spec.get("warmup_tokens", 2)))

        prompts, max_tokens = workload["prompts"], workload["max_tokens"]
        if workload["mode"] == "batch" and len(set(max_tokens)) != 1:
            raise ValueError("a batch workload needs one max_tokens for all its requests")
        # --repeats: the timed pass again from an empty prefix cache; the pass of the median
        # time is the one reported (a loaded box stalls single passes), every pass's time kept.
        passes: list[tuple[float, list[float], list[list[int]]]] = []
        for index in range(int(spec.get("repeats", 1))):
            if index:
                empty_cache = getattr(generate, "reset_cache", None)
                if empty_cache is None:
                    raise ValueError(f"--repeats: {spec['engine']} has no prefix cache reset between passes")
                empty_cache()
            passes.append(_timed_pass(generate, workload["mode"], prompts, max_tokens))
        result["pass_seconds"] = [elapsed for elapsed, _, _ in passes]
        elapsed, seconds, outputs = sorted(passes, key=lambda p: p[0])[(len(passes) - 1) // 2]
        result["elapsed_s"], result["request_seconds"] = elapsed, seconds
        if spec.get("profile") and hasattr(generate, "profile"):
            result["profile"] = profile_pass(generate, workload)
        result["prompt_tokens"] = sum(len(p) for p in prompts)
        result["output_tokens"] = sum(len(o) for o in outputs)
        result["output_token_ids"] = outputs
        wrong = [i for i, (o, n) in enumerate(zip(outputs, max_tokens, strict=True)) if len(o) != n]
        if wrong:
            raise RuntimeError(
                f"{len(wrong)} requests did not generate max_tokens tokens (first: request {wrong[0]}, "
                f"{len(outputs[wrong[0]])} of {max_tokens[wrong[0]]})"
            )
        result["ok"] = True
    except Exception as exc:  # noqa: BLE001 - reported to the parent as an error row
        logger.error("%s failed: %s", spec["engine"], exc)
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-4000:]
    result["peak_rss_mib"] = peak_rss_mib()
    result["loadavg_end"] = _loadavg()
    return result


def _step_reads(ranks: list[Any]) -> dict[str, Any] | None:
    """The ranks' `StepReads` (worker/step_reads.py) summed, for the bench's own limits of
    this mode: {"up_to": [[tokens, bytes], ...], "gemm": arithmetic}; None where a rank did
    not report or the ranks switch copies at other sizes."""
    if not ranks or any(r is None for r in ranks) or len({tuple(t for t, _ in r.up_to) for r in ranks}) != 1:
        return None
    sizes = [tokens for tokens, _ in ranks[0].up_to]
    return {"up_to": [[tokens, sum(r.up_to[i][1] for r in ranks)] for i, tokens in enumerate(sizes)],
            "gemm": ranks[0].gemm}


def _timed_pass(generate: Generate, mode: str, prompts: list[list[int]],
                max_tokens: list[int]) -> tuple[float, list[float], list[list[int]]]:
    """One timed pass of the workload: (seconds, each request's seconds, the outputs); a batch
    is one request of all prompts, a sequential workload one request a prompt."""
    if mode == "batch":
        started = time.perf_counter()
        outputs = generate(prompts, max_tokens[0])
        elapsed = time.perf_counter() - started
        return elapsed, [elapsed], outputs
    outputs, seconds = [], []
    for prompt, n in zip(prompts, max_tokens, strict=True):
        started = time.perf_counter()
        outputs += generate([prompt], n)
        seconds.append(time.perf_counter() - started)
    return sum(seconds), seconds, outputs


def profile_pass(generate: Generate, workload: dict[str, Any]) -> list[dict[str, float]]:
    """The workload once more (untimed) with the ranks' profilers on: per rank, milliseconds
    per phase of the step. A separate pass, so the timed figures carry no profiler overhead."""
    start, stop = generate.profile  # type: ignore[attr-defined]
    start()
    prompts, max_tokens = workload["prompts"], workload["max_tokens"]
    if workload["mode"] == "batch":
        generate(prompts, max_tokens[0])
    else:
        for prompt, n in zip(prompts, max_tokens, strict=True):
            generate([prompt], n)
    return stop()


def _loadavg() -> list[float] | None:
    """1/5/15-minute load averages: other processes on the machine skew every timing."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="child process of `tandem bench offline`")
    parser.add_argument("--spec", required=True, help="JSON spec written by the parent")
    parser.add_argument("--out", required=True, help="where to write the JSON result")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    with open(args.spec) as f:
        spec = json.load(f)
    result = run(spec)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, args.out)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
