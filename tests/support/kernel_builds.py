"""A kernel source built for an older target than this CPU, so a test can run the paths other
machines take (an AVX2-only EPYC, a CPU without VNNI)."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from tandem.kernels import cpu_attention
from tandem.kernels.cpu_attention import PagedDecodeKernel

# The decode kernel built for other x86 targets, and the path each takes.
OTHER_DECODE_BUILDS = {"haswell": "AVX2 fp32 FMA (bf16 widened)", "x86-64": "portable C"}


def build_for(source: Path, march: str, directory: Path) -> Path:
    """The library `source` compiled with -march=`march` (skips the test without a compiler)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    library = directory / f"{source.stem}-{march}.so"
    subprocess.run([compiler, "-O3", f"-march={march}", "-fopenmp", "-shared", "-fPIC", "-std=c11", str(source),
                    "-o", str(library)], check=True, capture_output=True)
    return library


def decode_kernel_for(march: str, directory: Path) -> PagedDecodeKernel:
    """The paged decode kernel built for an AVX2 CPU (`haswell`: the 8-lane vector path) or a
    plain x86-64 (the portable loops), with the flags c_library.py builds it with, so every
    path reads a cache under test on one box (skips where this machine cannot build or run it)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if platform.machine() not in ("x86_64", "AMD64") or compiler is None:
        pytest.skip("an x86 C compiler builds the other variants")
    source = cpu_attention.SOURCE
    library = directory / f"decode-{march}.so"
    subprocess.run([compiler, "-O3", f"-march={march}", "-fopenmp", "-ffast-math", "-fno-finite-math-only",
                    "-shared", "-fPIC", "-std=c11", f"-I{source.parent}", str(source), "-o", str(library), "-lm"],
                   check=True, capture_output=True)
    built = PagedDecodeKernel(library)
    assert built.isa == OTHER_DECODE_BUILDS[march]
    if march == "haswell" and "avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU cannot run AVX2 code")
    return built
