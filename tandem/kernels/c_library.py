"""Compiling tandem's C kernels (csrc/*.c) on first use, for the machine they run on.

Each source is compiled with the system C compiler (`cc -O3 -march=native -fopenmp`, about a
second) into the tandem cache directory, keyed by a hash of the source (and the headers it
includes from csrc/), flags, compiler and machine, and loaded with ctypes: no torch headers,
no build step at install. `-march=native` is what lets one source use AVX-512, AVX-512-BF16
or VNNI where the CPU has them and AVX2 or plain C where it does not. The libraries link libgomp.so.1, the soname torch's own OpenMP
runtime already loaded carries, so they share torch's thread pool.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import xxhash

logger = logging.getLogger(__name__)

_FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only", "-shared", "-fPIC", "-std=c11")


class KernelBuildError(RuntimeError):
    """The C kernel could not be compiled or loaded; the message says what was tried."""


Kernel = TypeVar("Kernel")


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _compiler_version(compiler: str) -> str:
    result = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    return result.stdout.splitlines()[0] if result.stdout else compiler


def _cpu_flags() -> str:
    """The CPU's feature flags: a -march=native library is only valid on a CPU that has them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


_LOCAL_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"', re.MULTILINE)


def _included_headers(source_path: Path, source: bytes) -> list[bytes]:
    """Name and bytes of every header a source includes with quotes (from its own folder,
    and what those include in turn), so editing a shared header rebuilds each library that
    reads it rather than loading one compiled from the old text."""
    found: list[bytes] = []
    seen: set[Path] = set()
    pending = [(source_path.parent, source)]
    while pending:
        folder, text = pending.pop()
        for name in _LOCAL_INCLUDE.findall(text):
            header = (folder / name.decode()).resolve()
            if header in seen or not header.is_file():
                continue
            seen.add(header)
            content = header.read_bytes()
            found += [name, content]
            pending.append((header.parent, content))
    return found


def build_kernel_library(cache_dir: Path, source_path: Path) -> Path:
    """Compile a C kernel once per (source, flags, compiler, machine) and return the .so path.

    Concurrent workers may build at once: each writes a private temporary file and renames
    it into place, so a reader never sees half a library.
    """
    compiler = _compiler()
    if compiler is None:
        raise KernelBuildError("no C compiler found (looked for $CC, cc, gcc, clang)")
    source = source_path.read_bytes()
    key = xxhash.xxh64(
        b"\0".join([source, *_included_headers(source_path, source), " ".join(_FLAGS).encode(),
                    _compiler_version(compiler).encode(), platform.machine().encode(), _cpu_flags().encode()])
    ).hexdigest()
    target = cache_dir / "kernels" / f"{source_path.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        command = [compiler, *_FLAGS, str(source_path), "-o", temporary, "-lm"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise KernelBuildError(f"`{' '.join(command)}` failed: {result.stderr.strip()[-2000:]}")
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    logger.info("compiled the CPU kernel %s into %s", source_path.name, target)
    return target


def bind(library: Path, signatures: dict[str, tuple[Any, list[Any]]]) -> dict[str, Any]:
    """Load a compiled library and declare each named function's ctypes result and argument
    types: {name: (restype, argtypes)} -> {name: function}. A missing library or symbol is a
    KernelBuildError, so callers fall back as they do for a failed build."""
    try:
        loaded = ctypes.CDLL(str(library))
        functions = {name: getattr(loaded, name) for name in signatures}
    except (OSError, AttributeError) as error:
        raise KernelBuildError(f"cannot load {library}: {error}") from error
    for name, (restype, argtypes) in signatures.items():
        functions[name].restype = restype
        functions[name].argtypes = argtypes
    return functions


def build_or_none(build: Callable[[Path], Kernel], cache_dir: Path, what: str, fallback: str) -> Kernel | None:
    """`build(cache_dir)`, or None where the kernel cannot be built here, with a warning naming
    `what` is unavailable, why, and the `fallback` the caller takes instead."""
    try:
        return build(cache_dir)
    except KernelBuildError as error:
        logger.warning("%s unavailable (%s); %s", what, error, fallback)
        return None
