"""Which device an engine runs on, decided without importing torch.

`--device auto` means a GPU when there is one this torch can drive, else the CPU; `--dtype
auto` means bfloat16 on a GPU (what vLLM and SGLang serve in) and on the CPU the default mode's
dtype (platform/cpu_modes.py: bfloat16 where the CPU multiplies it natively, else float32;
float32 under --exact, whose greedy tokens equal transformers'). Both are settled when the config is made, in whichever
process parses the flags, and that may be the API process, which never imports torch
(docs/architecture.md). So the probe reads what torch was built for from its `version.py` (a CPU wheel
says `cuda = None`) and whether the NVIDIA driver's device nodes exist. The worker checks
`torch.cuda.is_available()` again and refuses with a clear message if the probe was wrong.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

from tandem.platform.cpu_modes import CpuFeatures, choose_cpu_mode, exact_requested

DEVICES = ("auto", "cpu", "cuda")
_NVIDIA_CONTROL = Path("/dev/nvidiactl")


def torch_cuda_version() -> str | None:
    """The CUDA version the installed torch was built against, or None (a CPU wheel, or no torch)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        version_file = Path(location) / "version.py"
        if version_file.is_file():
            found = re.search(r"^cuda\s*(?::\s*[^=]+)?=\s*['\"]([^'\"]+)['\"]", version_file.read_text(), re.MULTILINE)
            return found.group(1) if found else None
    return None


def cuda_visible() -> bool:
    """A CUDA build of torch and an NVIDIA driver with at least one device node."""
    if torch_cuda_version() is None or not _NVIDIA_CONTROL.exists():
        return False
    return any(Path("/dev").glob("nvidia[0-9]*"))


def gpu_ids() -> list[str]:
    """The GPUs this host shows a process: CUDA_VISIBLE_DEVICES's list where it is set, else
    one id per driver device node (/dev/nvidia0, /dev/nvidia1, ...)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [part.strip() for part in visible.split(",") if part.strip()]
    nodes = sorted(int(path.name[len("nvidia"):]) for path in Path("/dev").glob("nvidia[0-9]*")
                   if path.name[len("nvidia"):].isdigit())
    return [str(node) for node in nodes]


def resolve_device(choice: str) -> str:
    if choice not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, not {choice!r}")
    if choice == "auto":
        return "cuda" if cuda_visible() else "cpu"
    return choice


# Tokens per KV block when --block-size is not given. On a CPU a block of 16 tokens is 2 KiB a kv
# head at head size 64: a decode step's attention jumps to another place in the pool every 16
# keys, where the hardware prefetchers start again. Blocks of 64 made decode attention ~11%
# faster and a decode-heavy batch 3-12%, and an agent's turns no slower (docs/performance.md,
# "The KV block size as a CPU default"); vLLM's CPU backend defaults to 128. On a GPU, 16 as
# vLLM there: no GPU run here has measured longer blocks, and 16 keeps the prefix cache fine.
CPU_BLOCK_SIZE = 64
GPU_BLOCK_SIZE = 16
# Tokens per KV tier chunk when --kv-chunk-blocks is not given: 16 blocks of 16 tokens, kept in
# tokens whatever the block size, so a turn's tail that reaches the tiers does not grow with it.
TIER_CHUNK_TOKENS = 256


def resolve_block_size(choice: int | None, device: str) -> int:
    """`None` (no --block-size): CPU_BLOCK_SIZE on the CPU, GPU_BLOCK_SIZE on a GPU; else as given."""
    if choice is not None:
        return choice
    return GPU_BLOCK_SIZE if device == "cuda" else CPU_BLOCK_SIZE


def resolve_chunk_blocks(choice: int | None, block_size: int) -> int:
    """`None` (no --kv-chunk-blocks): the blocks that make TIER_CHUNK_TOKENS, at least one. (A
    block size out of range is refused after this, by config_checks.py.)"""
    if choice is not None:
        return choice
    valid = isinstance(block_size, int) and block_size >= 1
    return max(1, TIER_CHUNK_TOKENS // block_size) if valid else 1


def resolve_dtype(choice: str, device: str, exact: bool = False) -> str:
    """`auto`: bfloat16 on a GPU; on the CPU the default mode's dtype (platform/cpu_modes.py:
    bfloat16 where the CPU multiplies it natively), float32 when `exact` or when the process
    tree asked for the exact path; anything else as given."""
    if choice != "auto":
        return choice
    if device == "cuda":
        return "bfloat16"
    return choose_cpu_mode(CpuFeatures.detect(), False, exact=exact or exact_requested()).dtype
