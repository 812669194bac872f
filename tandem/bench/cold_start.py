"""`tandem bench cold-start`: cold start (building the model and reading its weights) against the
disk's own read speed.

After a warm-up round that is not kept, each repeat, for MODEL's safetensors files:

1. the files are dropped from the page cache (POSIX_FADV_DONTNEED, no root needed) and
   mincore checks that they left it;
2. `dd if=FILE of=/dev/null bs=16M` reads every file, one after another: the disk's own
   sequential read speed, the goal's yardstick (started, like the loads, from a fresh
   process that has imported torch; twice, the page cache dropped between, the faster
   counting);
3. the files are dropped again and fresh processes, their imports done, build the model and
   load its weights the engine's way (`build_model` + `load_weights`, after what a worker's
   own process sets first: malloc's thresholds, the cycle collector's start-up objects
   frozen), timed from the moment they are told to start: one process, or with
   `--tensor-parallel-size N` N at once, each building and filling its share, the N splitting
   one forward read of the files as the ranks of one host do (each rank's bytes read and
   time; the union's GB/s);
4. the same again with the page cache warm (what a restart on a warm machine pays).

Reported: seconds and GB/s (checkpoint bytes over seconds) of each, the cold load's ratio to
dd (median over repeats of each repeat's pair) against the goal, >= 80% of dd. Weight
packing for oneDNN happens after loading, in the worker, and is not part of it here.
Writes JSON, a table and a PNG to `<output-dir>/load-<timestamp>/`.

dd runs in the same kind of process as a load, and twice: on a virtual machine that hands
freed memory back to its host (free page reporting), what ran just before changes how fast new
memory, the page cache's included, comes; a dd started right after load processes exit can
take twice as long as the next one.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tandem.flags.table import Command, Flag, FlagTable

GOAL = 0.8  # the cold load's GB/s over dd's
_DD_BLOCK = 16 << 20

# The model, how it is built, and the repeats: one group.
LOAD_FLAGS = FlagTable(None, (
    Flag("model", nargs="?", help="model: alias, HF directory or .gguf (default: smollm2-135m)"),
    Flag(
        "--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
        help="the engine's dtype, which the model is built in (default: float32)",
    ),
    Flag(
        "--repeats", default=5, type=int, metavar="N",
        help="cold (and warm) loads, each paired with a dd run (default: 5)",
    ),
    Flag(
        "--warmup", default=1, type=int, metavar="N",
        help="rounds run first and not kept: the first reads after start-up are often slow (default: 1)",
    ),
    Flag(
        "--tensor-parallel-size", default=1, type=int, metavar="N",
        help="N processes at once, each loading its share, as the ranks of one machine do (default: 1)",
    ),
    Flag(
        "--workers", type=int, metavar="N",
        help="loader threads per process (default: the loader's, two per core, 4 to 16)",
    ),
    Flag("--no-warm", switch=True, help="skip the loads with the page cache warm"),
    Flag(
        "--device", default="cpu", choices=("cpu", "cuda"),
        help="where the model is built and filled: cuda copies through pinned staging buffers, "
        "rank r to GPU r (default: cpu)",
    ),
    Flag("--output-dir", default=Path("bench-results"), type=Path),
))


def add_cold_start_parser(subparsers: argparse._SubParsersAction) -> None:
    # "load" was this command's first name; it stays as an alias so existing scripts keep working,
    # but "load" also names traffic, engine load and KV loads, so the command is cold-start.
    parser = subparsers.add_parser(
        "cold-start", aliases=["load"],
        help="building the model and reading its weights, against dd of the same files",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    LOAD_FLAGS.add_to(parser)
    Command(cmd_load, check_load).install(parser)


def check_load(args: argparse.Namespace) -> None:
    """Counts that could not make a run fail at parse time, before any model is resolved."""
    if args.repeats < 1 or args.tensor_parallel_size < 1 or args.warmup < 0:
        raise ValueError("--repeats and --tensor-parallel-size must be at least 1, --warmup at least 0")


# --- the measuring process -------------------------------------------------------------


def _io_read_bytes() -> int | None:
    """Bytes this process made the kernel fetch from storage (/proc/self/io)."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def measure(hf_dir: Path, dtype: str, rank: int, size: int, workers: int | None,
            device_type: str = "cpu") -> dict[str, Any]:
    """Build this rank's model and load its weights, once the parent says go (stdin)."""
    import resource

    import torch

    from tandem.distributed.tensor_parallel import TensorParallel
    from tandem.kernels.torch_attention import TorchAttentionBackend
    from tandem.loader.copy_pipeline import ReadShare
    from tandem.loader.model_loader import build_model, load_weights, read_model_config
    from tandem.platform.allocator import keep_freed_memory
    from tandem.platform.collector import freeze_start_up_objects

    config = read_model_config(hf_dir)
    tp = TensorParallel(rank, size)
    positions = min(config.max_position_embeddings, 8192)
    device = torch.device("cuda", rank) if device_type == "cuda" else None
    if device is not None:
        torch.cuda.set_device(device)
        torch.empty(1, device=device)  # the CUDA context, before the clock starts
    else:
        keep_freed_memory()  # what a CPU worker's process sets before it builds its model
    freeze_start_up_objects()  # as a worker in a process of its own does
    share = ReadShare(rank, size) if size > 1 else None  # the ranks of one host, as the worker's
    print("ready", flush=True)
    sys.stdin.readline()
    read0, usage0 = _io_read_bytes(), resource.getrusage(resource.RUSAGE_SELF)
    start = time.monotonic()  # system-wide: the ranks' clocks agree
    model = build_model(config, TorchAttentionBackend(), positions, getattr(torch, dtype), tp, device=device)
    built = time.monotonic()
    load_weights(model, hf_dir, workers, device=device, share=share)
    if device is not None:
        torch.cuda.synchronize(device)
    end = time.monotonic()
    read1, usage = _io_read_bytes(), resource.getrusage(resource.RUSAGE_SELF)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "rank": rank, "start": start, "end": end, "build_s": built - start, "load_s": end - built,
        "seconds": end - start, "read_bytes": None if read0 is None or read1 is None else read1 - read0,
        "held_bytes": held, "user_s": usage.ru_utime - usage0.ru_utime, "sys_s": usage.ru_stime - usage0.ru_stime,
        "minor_faults": usage.ru_minflt - usage0.ru_minflt, "major_faults": usage.ru_majflt - usage0.ru_majflt,
    }


def write_random_checkpoint(config_file: Path, out_dir: Path, shard_bytes: int = 5 << 30,
                            dtype: str = "bfloat16", seed: int = 0, device: str = "cpu") -> list[Path]:
    """A checkpoint of random weights for `config_file` (a Llama-shaped config.json), in
    safetensors shards of about `shard_bytes` named as transformers names them, so a cold
    start can be measured on a model whose weights are not on the machine. The tensors' names
    and shapes come from transformers' model built on the meta device (nothing allocated).
    `device="cuda"` draws the numbers on the GPU, seconds instead of minutes for an 8B model."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(config_file, out_dir / "config.json")
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(str(out_dir))).state_dict().items() if "rotary_emb" not in name}
    generator = torch.Generator(device).manual_seed(seed)
    run_dtype = getattr(torch, dtype)
    element = torch.empty((), dtype=run_dtype).element_size()
    written: list[Path] = []
    shard: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:  # each shard is written as it fills: one in memory at a time
        path = out_dir / f"shard-{len(written) + 1:05d}.safetensors"
        save_file(shard, str(path), metadata={"format": "pt"})
        written.append(path)
        shard.clear()

    for name, shape in shapes.items():
        nbytes = element * math.prod(shape)
        if shard and size + nbytes > shard_bytes:
            flush()
            size = 0
        shard[name] = (torch.randn(shape, generator=generator, device=device) * 0.02).to(run_dtype).cpu()
        size += nbytes
    if shard:
        flush()
    paths = [out_dir / f"model-{i:05d}-of-{len(written):05d}.safetensors" for i in range(1, len(written) + 1)]
    for old, new in zip(written, paths, strict=True):
        old.rename(new)
    return paths


# --- the parent --------------------------------------------------------------------------


def _drop(files: list[Path]) -> int | None:
    """Drop every file from the page cache; the bytes left cached (None: cannot tell)."""
    from tandem.loader.page_cache import make_cold

    left = [make_cold(path) for path in files]
    return None if any(x is None for x in left) else sum(x for x in left if x is not None)


def _cached(files: list[Path]) -> int | None:
    from tandem.loader.page_cache import resident_bytes

    cached = [resident_bytes(path) for path in files]
    return None if any(x is None for x in cached) else sum(x for x in cached if x is not None)


def _cpu_by_process() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds so far) of every process (/proc; empty elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    table = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
            table[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
        except (OSError, ValueError, IndexError):
            continue
    return table


def _others_cpu(before: dict[int, tuple[int, float]], after: dict[int, tuple[int, float]], ours: set[int]) -> float:
    """CPU seconds spent between the snapshots by processes that are not this bench's (ours,
    their children) and did not start or end meanwhile (a noisy neighbour)."""
    mine = set(ours) | {pid for pid, (parent, _) in after.items() if parent in ours}
    return sum(cpu - before[pid][1] for pid, (_, cpu) in after.items() if pid in before and pid not in mine)


def _dd(files: list[Path]) -> float:
    """Seconds to read every file once, in order, with dd (or a 16 MiB read loop without dd)."""
    dd = shutil.which("dd")
    started = time.monotonic()
    for path in files:
        if dd:
            subprocess.run([dd, f"if={path}", "of=/dev/null", f"bs={_DD_BLOCK >> 20}M"], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        else:
            buffer = bytearray(_DD_BLOCK)
            with path.open("rb", buffering=0) as handle:
                while handle.readinto(buffer):
                    pass
    return time.monotonic() - started


def _timed(kind: str, hf_dir: Path, args: argparse.Namespace, files: list[Path]) -> dict[str, Any]:
    """One timed run of `kind` (dd, cold, warm) in fresh processes, started together once their
    imports are done; the page cache is dropped first for dd and cold."""
    import tandem

    env = dict(os.environ)
    root = str(Path(tandem.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    size = 1 if kind == "dd" else args.tensor_parallel_size
    command = [sys.executable, "-m", "tandem.bench.cold_start", "--measure", str(hf_dir), "--dtype", args.dtype,
               "--tensor-parallel-size", str(size)]
    if args.workers:
        command += ["--workers", str(args.workers)]
    if args.device != "cpu":
        command += ["--device", args.device]
    if kind == "dd":
        command.append("--dd")
    ranks = [subprocess.Popen([*command, "--rank", str(rank)], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(size)]
    try:
        for process in ranks:
            assert process.stdout is not None
            if process.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a loading process failed before loading:\n{process.stderr.read()[-3000:]}")
        left = _drop(files) if kind != "warm" else None
        before = _cpu_by_process()
        for process in ranks:
            assert process.stdin is not None
            process.stdin.write("go\n")
            process.stdin.flush()
        results = []
        for process in ranks:
            out, err = process.communicate(timeout=3600)
            if process.returncode != 0:
                raise RuntimeError(f"a loading process failed:\n{err[-3000:]}")
            results.append(json.loads(out.strip().splitlines()[-1]))
        others = _others_cpu(before, _cpu_by_process(), {os.getpid(), *(p.pid for p in ranks)})
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
    if kind == "dd":
        seconds = results[0]["seconds"]
    else:  # from the first rank's start to the last one's end
        seconds = max(r["end"] for r in results) - min(r["start"] for r in results)
    return {"seconds": seconds, "ranks": results, "left_cached": left, "cached_after": _cached(files),
            "others_cpu_s": others}


def cmd_load(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from tandem.loader.model_loader import weight_files
    from tandem.loader.resolve import resolve_model

    check_load(args)
    resolved = resolve_model(args.model, args.dtype)
    files = weight_files(resolved.hf_dir)
    total = sum(path.stat().st_size for path in files)
    out_dir = args.output_dir / f"load-{dt.datetime.now():%Y%m%d-%H%M%S}"
    out_dir.mkdir(parents=True, exist_ok=True)
    kinds = ["dd", "cold"] + ([] if args.no_warm else ["warm"])
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    plan = [(r, k) for r in range(-args.warmup, args.repeats) for k in kinds]
    for repeat, kind in tqdm(plan, desc="cold start", unit="run"):
        result = _timed(kind, resolved.hf_dir, args, files)
        if repeat >= 0:  # the warm-up rounds are not kept
            runs[kind].append(result)
    summary = summarize(runs, total, args.tensor_parallel_size)
    table = report(summary, resolved.name, files, total, args)
    print(table)
    data = {"args": {k: str(v) for k, v in vars(args).items() if k != "handler"}, "model": resolved.name,
            "hf_dir": str(resolved.hf_dir), "files": [str(p) for p in files], "bytes": total,
            "disk": disk_info(files[0]), "runs": runs, "summary": summary}
    (out_dir / "results.json").write_text(json.dumps(data, indent=2))
    (out_dir / "table.txt").write_text(table + "\n")
    with contextlib.suppress(ImportError):  # no matplotlib: no plot
        plot(summary, out_dir / "load.png", f"cold start of {resolved.name} ({total / 1e9:.2f} GB)")
    print(f"\nresults: {out_dir}")
    return 0


def summarize(runs: dict[str, list[dict[str, Any]]], total: int, size: int) -> dict[str, Any]:
    """Medians over repeats; the cold load's ratio to dd is the median of each repeat's pair."""
    summary: dict[str, Any] = {}
    dd = [r["seconds"] for r in runs["dd"]]
    summary["dd"] = {"seconds": statistics.median(dd), "gbps": total / statistics.median(dd) / 1e9,
                     "best_seconds": min(dd), "all_seconds": dd}
    for kind in ("cold", "warm"):
        if kind not in runs:
            continue
        seconds = [r["seconds"] for r in runs[kind]]
        entry: dict[str, Any] = {"seconds": statistics.median(seconds), "gbps": total / statistics.median(seconds) / 1e9,
                                 "best_seconds": min(seconds), "all_seconds": seconds}
        if kind == "cold":
            entry["ratios_to_dd"] = [d / s for d, s in zip(dd, seconds, strict=True)]
            entry["ratio_to_dd"] = statistics.median(entry["ratios_to_dd"])
        entry["ranks"] = [
            {key: _median([r["ranks"][rank][key] for r in runs[kind]])
             for key in ("seconds", "build_s", "load_s", "read_bytes", "held_bytes", "user_s", "sys_s", "minor_faults")}
            for rank in range(size)
        ]
        entry["cached_after"] = _median([r["cached_after"] for r in runs[kind]])
        summary[kind] = entry
    timed = [r for kind_runs in runs.values() for r in kind_runs]
    summary["others_cpu_share"] = (sum(r["others_cpu_s"] for r in timed)
                                   / max(1e-9, sum(r["seconds"] for r in timed) * (os.cpu_count() or 1)))
    lefts = [r["left_cached"] for kind in ("dd", "cold") for r in runs.get(kind, [])]
    summary["cache_drop"] = ("unverified" if any(x is None for x in lefts)
                             else "ok" if max(lefts) <= 0.01 * total else f"failed: up to {max(lefts)} bytes stayed cached")
    return summary


def _median(values: list[Any]) -> Any:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def report(summary: dict[str, Any], name: str, files: list[Path], total: int, args: argparse.Namespace) -> str:
    size = args.tensor_parallel_size
    where = "" if args.device == "cpu" else f" on {args.device} (pinned staging)"
    lines = [f"cold start of {name}: {len(files)} file(s), {total / 1e9:.3f} GB, built in {args.dtype}{where}, "
             f"{size} rank(s), median of {args.repeats}"]
    lines.append(f"{'':<22} {'seconds':>8} {'GB/s':>7} {'vs dd':>7} {'best s':>8}")
    dd = summary["dd"]
    lines.append(f"{'dd bs=16M, best of 2':<22} {dd['seconds']:8.3f} {dd['gbps']:7.2f} {'100%':>7} {dd['best_seconds']:8.3f}")
    for kind, label in (("cold", "load, cold cache"), ("warm", "load, warm cache")):
        if kind in summary:
            entry = summary[kind]
            ratio = entry.get("ratio_to_dd", dd["seconds"] / entry["seconds"])
            lines.append(f"{label:<22} {entry['seconds']:8.3f} {entry['gbps']:7.2f} {ratio:7.0%} "
                         f"{entry['best_seconds']:8.3f}")
    cold = summary["cold"]
    for index, rank in enumerate(cold["ranks"]):
        read = rank["read_bytes"]
        lines.append(
            f"  {f'rank {index}' if size > 1 else 'cold load'}: build {rank['build_s']:.3f} s "
            f"+ weights {rank['load_s']:.3f} s; read {'?' if read is None else f'{read / 1e9:.3f}'} GB from disk, "
            f"holds {rank['held_bytes'] / 1e9:.3f} GB; cpu {rank['user_s']:.2f} s user + {rank['sys_s']:.2f} s sys, "
            f"{rank['minor_faults']:.0f} minor faults")
    if size > 1 and cold["cached_after"] is not None:
        lines.append(f"  the ranks together read {cold['cached_after'] / 1e9:.3f} GB of {total / 1e9:.3f} GB")
    lines.append(f"page cache drop: {summary['cache_drop']}")
    share = summary["others_cpu_share"]
    lines.append(f"other processes used {share:.0%} of the CPUs during the timed runs"
                 + (": a busy machine, figures noisy" if share > 0.05 else " (a quiet machine)"))
    verdict = "met" if cold["ratio_to_dd"] >= GOAL else "not met"
    each = ", ".join(f"{r:.0%}" for r in cold["ratios_to_dd"])
    lines.append(f"goal: cold load >= {GOAL:.0%} of dd's GB/s: {cold['ratio_to_dd']:.0%} (median of {each}), {verdict}")
    return "\n".join(lines)


def disk_info(path: Path) -> dict[str, Any]:
    """The block device under `path` and its readahead, as far as sysfs tells."""
    info: dict[str, Any] = {}
    try:
        dev = path.stat().st_dev
        node = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve()
        queue = node / "queue" if (node / "queue").is_dir() else node.parent / "queue"
        info["device"] = queue.parent.name
        for name in ("read_ahead_kb", "max_sectors_kb", "rotational"):
            info[name] = (queue / name).read_text().strip()
    except OSError:
        pass
    return info


def plot(summary: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [("dd (disk)", summary["dd"]["gbps"], "#888")]
    bars += [(label, summary[kind]["gbps"], color) for kind, label, color in
             (("cold", "load, cold", "#3a7"), ("warm", "load, warm", "#7bd")) if kind in summary]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([b[0] for b in bars], [b[1] for b in bars], color=[b[2] for b in bars])
    ax.axhline(GOAL * summary["dd"]["gbps"], color="#c33", linestyle="--", linewidth=1, label=f"goal: {GOAL:.0%} of dd")
    ax.set_ylabel("GB/s (checkpoint bytes / seconds)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def measure_dd(hf_dir: Path, runs: int = 2) -> dict[str, Any]:
    """dd of the weight files, once the parent says go, `runs` times back to back (dropping
    the files from the page cache between); the fastest counts. It runs in the same kind of
    process as a load (torch imported, then told to start), and the best of two is the
    disk at its best: the first read after other processes exit can take twice as long on
    this VM (free page reporting), and the goal should not get easier for it."""
    import torch  # noqa: F401 - imported as a load's process does, for the same memory state

    from tandem.loader.model_loader import weight_files
    from tandem.loader.page_cache import make_cold

    files = weight_files(hf_dir)
    print("ready", flush=True)
    sys.stdin.readline()
    times = []
    for run in range(runs):
        if run:
            for path in files:
                make_cold(path)
        started = time.monotonic()
        _dd(files)
        times.append(time.monotonic() - started)
    return {"seconds": min(times), "runs": times}


def _main() -> int:
    parser = argparse.ArgumentParser(description="one rank's timed load; prints JSON")
    parser.add_argument("--measure", type=Path, required=True, metavar="HF_DIR")
    parser.add_argument("--dd", action="store_true", help="time dd of the files instead")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.dd:
        print(json.dumps(measure_dd(args.measure)))
    else:
        print(json.dumps(measure(args.measure, args.dtype, args.rank, args.tensor_parallel_size, args.workers,
                                 args.device)))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
