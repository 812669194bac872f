"""Zero-copy safetensors views against the safetensors library, and page-cache residency."""

from __future__ import annotations

import gc
import json
import mmap
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.loader import page_cache
from tandem.loader.safetensors_mmap import PrefetchReads, SafetensorsFile, page_runs

PAGE = mmap.PAGESIZE


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(3, 5, generator=g),
        "f16": torch.randn(7, generator=g).half(),
        "bf16": torch.randn(2, 3, 4, generator=g).bfloat16(),
        "f64": torch.randn(2, generator=g).double(),
        "i64": torch.arange(-5, 6),
        "i32": torch.arange(9, dtype=torch.int32).view(3, 3),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "u8": torch.tensor([0, 7, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "odd": torch.randn(1, 3, generator=g).half(),  # 6 bytes: the next tensor starts unaligned
        "after_odd": torch.randn(5, generator=g),
    }


def test_views_match_the_safetensors_library(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    save_file(_tensors(), str(path), metadata={"format": "pt"})
    file = SafetensorsFile(path)
    assert file.metadata == {"format": "pt"}
    with safe_open(str(path), framework="pt") as reference:
        assert sorted(file.names()) == sorted(reference.keys())
        for name, view in file.items():
            expected = reference.get_tensor(name)
            assert view.dtype == expected.dtype and view.shape == expected.shape, name
            assert torch.equal(view, expected), name
    offsets = [info.start for info in file.tensors.values()]
    assert offsets == sorted(offsets)  # file order: reading them in turn reads the file forward


def test_views_are_zero_copy_and_outlive_the_file_object(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    save_file({"a": torch.arange(1000.0), "b": torch.arange(64.0)}, str(path))
    file = SafetensorsFile(path)
    a, b = file.tensor("a"), file.tensor("b")
    distance = file.tensors["b"].start - file.tensors["a"].start
    assert b.data_ptr() - a.data_ptr() == distance  # both point into the one mapping
    narrowed = a.narrow(0, 500, 100)
    assert narrowed.data_ptr() == a.data_ptr() + 500 * 4  # a slice is still a view
    del file, a, b
    gc.collect()
    assert torch.equal(narrowed, torch.arange(500.0, 600.0))  # the mapping lives with its views


def test_a_write_to_a_view_never_reaches_the_file(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    save_file({"a": torch.zeros(4096)}, str(path))
    view = SafetensorsFile(path).tensor("a")
    view.fill_(1.0)  # a private mapping: the page is copied
    assert torch.equal(SafetensorsFile(path).tensor("a"), torch.zeros(4096))


def test_malformed_files_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="not a safetensors file"):
        SafetensorsFile(path)
    header = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    with pytest.raises(ValueError, match="bad data offsets"):
        SafetensorsFile(path)
    header = json.dumps({"x": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 4]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    with pytest.raises(ValueError, match="dtype Q4"):
        SafetensorsFile(path)


def cold(path: Path) -> None:
    """Drop `path` from the page cache, or skip the test where that cannot be done or seen."""
    page_cache.drop(path)
    resident = page_cache.resident_bytes(path)
    if resident is None:
        pytest.skip("mincore cannot see this file's page cache")
    if resident > 0.02 * path.stat().st_size:
        pytest.skip(f"{path.parent} keeps its pages cached after POSIX_FADV_DONTNEED (tmpfs?)")


def test_opening_and_viewing_reads_nothing(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    save_file({f"t{i}": torch.randn(256, 1024) for i in range(8)}, str(path))  # 8 MiB
    cold(path)
    file = SafetensorsFile(path)
    views = [view.narrow(0, 0, 128) for _, view in file.items()]
    assert page_cache.resident_bytes(path) <= 64 << 10  # the header and what its read() read ahead
    assert views[3].sum() != 0
    assert page_cache.resident_bytes(path) >= 512 << 10  # now the kernel has read that slice


def test_prefetched_reads_read_exactly_the_slice(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    save_file({"rows": torch.randn(512, 1024), "cols": torch.randn(64, 4096), "rest": torch.randn(1 << 20)}, str(path))
    cold(path)
    file = SafetensorsFile(path)
    before = page_cache.resident_bytes(path)
    with PrefetchReads(file) as reads:
        rows = torch.empty(128, 1024).copy_(file.tensor("rows").narrow(0, 256, 128))  # 512 KiB
    assert torch.equal(rows, file.tensor("rows")[256:384])
    assert reads.prefetched <= (512 << 10) + 2 * PAGE
    assert (512 << 10) <= page_cache.resident_bytes(path) - before <= (512 << 10) + 2 * PAGE
    before = page_cache.resident_bytes(path)
    with PrefetchReads(file):
        cols = torch.empty(64, 2048).copy_(file.tensor("cols").narrow(1, 0, 2048))  # half of every 16 KiB row
    assert torch.equal(cols, file.tensor("cols")[:, :2048])
    added = page_cache.resident_bytes(path) - before
    assert (512 << 10) <= added <= 64 * 3 * PAGE  # 2 pages of each row, 3 where it straddles one more


def test_page_runs_of_strided_views() -> None:
    buffer = mmap.mmap(-1, 8 * PAGE)  # page-aligned
    whole = torch.frombuffer(buffer, dtype=torch.uint8).view(4, 2 * PAGE)
    base = whole.data_ptr()
    every_other = [(0, PAGE), (2 * PAGE, 3 * PAGE), (4 * PAGE, 5 * PAGE), (6 * PAGE, 7 * PAGE)]
    assert page_runs(whole, base) == [(0, 8 * PAGE)]
    assert page_runs(whole[:, :PAGE], base) == every_other  # a column slice: a run per row
    assert page_runs(whole[:, 10:20], base) == every_other
    assert page_runs(whole[:, PAGE - 1 : PAGE + 1], base) == [(0, 8 * PAGE)]  # straddles: merged
    assert page_runs(whole[1:3], base) == [(2 * PAGE, 6 * PAGE)]
    assert page_runs(whole.t()[:5], base) == every_other  # transposed: a run per element, merged by page
    assert page_runs(whole[:0], base) == []
    assert page_runs(whole.view(-1)[:1], base) == [(0, PAGE)]
