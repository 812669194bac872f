"""The copy pipeline's helpers change only which pages are touched when, never the weights."""

from __future__ import annotations

import mmap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tandem.loader import page_cache
from tandem.loader.copy_pipeline import ReadAhead, SplitCopies
from tandem.loader.safetensors_mmap import SafetensorsFile

PAGE = mmap.PAGESIZE


def test_split_copies_copy_exactly() -> None:
    g = torch.Generator().manual_seed(0)
    whole = torch.randn(1024, 512, generator=g)
    cases = [
        (torch.empty(1024, 512), whole),  # 2 MiB: split
        (torch.empty(1024, 256), whole[:, 128:384]),  # a strided source (a column slice)
        (torch.empty(1024, 512, dtype=torch.bfloat16), whole),  # converted on the way
        (torch.empty(16, 8), whole[:16, :8]),  # small: not split
        (torch.empty(1024, 512), torch.tensor(1.5)),  # broadcast: not split
    ]
    with ThreadPoolExecutor(1) as helpers, SplitCopies(helpers):
        for dst, src in cases:
            assert dst.copy_(src) is dst
    for dst, src in cases:
        assert torch.equal(dst, src.expand_as(dst).to(dst.dtype))


def _wait_for(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def test_read_ahead_stays_within_its_lead(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    save_file({"a": torch.randn(16 << 20)}, str(path))  # 64 MiB
    left = page_cache.make_cold(path)
    if left is None or left > 2 * PAGE:
        pytest.skip("this file's page cache cannot be dropped or seen here")
    file = SafetensorsFile(path)
    info = file.tensors["a"]
    ahead = ReadAhead(file.address, info.start, info.end, lead=4 << 20, chunk=1 << 20)
    try:
        assert _wait_for(lambda: page_cache.resident_bytes(path) >= 4 << 20)
        time.sleep(0.2)
        # the lead and a chunk, plus what the kernel reads around a fault (read_ahead_kb)
        assert page_cache.resident_bytes(path) <= (5 << 20) + file._chunk + 64 * PAGE < info.nbytes
        ahead.advance(info.end)
        assert _wait_for(lambda: page_cache.resident_bytes(path) >= info.nbytes)
    finally:
        ahead.stop()
