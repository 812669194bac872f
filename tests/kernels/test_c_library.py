"""Building the C kernels: once per source and machine, atomically, with clear failures."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.kernels import c_library, cpu_attention, cpu_prefill
from tandem.kernels.c_library import KernelBuildError, build_kernel_library


def test_library_is_built_once_and_reused(tmp_path: Path) -> None:
    first = build_kernel_library(tmp_path, cpu_attention.SOURCE)
    stamp = first.stat().st_mtime_ns
    assert build_kernel_library(tmp_path, cpu_attention.SOURCE) == first
    assert first.stat().st_mtime_ns == stamp
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary left behind
    second = build_kernel_library(tmp_path, cpu_prefill.SOURCE)
    assert second != first and second.name.startswith("prefill_attention-")


def test_a_library_is_keyed_by_the_cpu_it_was_built_for(monkeypatch, tmp_path: Path) -> None:
    """-march=native code may not run on another CPU sharing the cache directory."""
    here = build_kernel_library(tmp_path, cpu_attention.SOURCE)
    monkeypatch.setattr(c_library, "_cpu_flags", lambda: "flags: fpu sse2 avx2")
    assert build_kernel_library(tmp_path, cpu_attention.SOURCE) != here


def test_editing_an_included_header_rebuilds_the_library(tmp_path: Path) -> None:
    """A library is keyed on the headers its source includes too: one built from a header's
    old text must not be loaded after the header changed (csrc/avx512_math.h is shared)."""
    source, header = tmp_path / "src" / "uses.c", tmp_path / "src" / "part.h"
    source.parent.mkdir()
    source.write_text('#include "part.h"\nint tandem_value(void) { return VALUE; }\n')
    header.write_text("#define VALUE 1\n")
    first = build_kernel_library(tmp_path / "cache", source)
    assert build_kernel_library(tmp_path / "cache", source) == first
    header.write_text("#define VALUE 2\n")
    second = build_kernel_library(tmp_path / "cache", source)
    assert second != first
    import ctypes

    assert ctypes.CDLL(str(second)).tandem_value() == 2


def test_a_failed_compile_says_what_ran_and_leaves_nothing(tmp_path: Path) -> None:
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C;\n")
    with pytest.raises(KernelBuildError, match="broken.c"):
        build_kernel_library(tmp_path / "cache", broken)
    assert list((tmp_path / "cache" / "kernels").iterdir()) == []


def test_a_kernel_that_cannot_build_is_none_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from tandem.kernels.c_library import build_or_none

    broken = tmp_path / "broken.c"
    broken.write_text("this is not C;\n")
    with caplog.at_level("WARNING"):
        got = build_or_none(lambda cache: build_kernel_library(cache, broken), tmp_path, "the test kernel",
                            "the caller keeps torch")
    assert got is None
    assert "the test kernel unavailable" in caplog.text and "broken.c" in caplog.text
    assert "the caller keeps torch" in caplog.text
