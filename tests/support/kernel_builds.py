"""A kernel source built for an older target than this CPU, so a test can run the paths other
machines take (an AVX2-only EPYC, a CPU without VNNI)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def build_for(source: Path, march: str, directory: Path) -> Path:
    """The library `source` compiled with -march=`march` (skips the test without a compiler)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    library = directory / f"{source.stem}-{march}.so"
    subprocess.run([compiler, "-O3", f"-march={march}", "-fopenmp", "-shared", "-fPIC", "-std=c11", str(source),
                    "-o", str(library)], check=True, capture_output=True)
    return library
