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
from tandem.loader.copy_pipeline import (
    ReadAhead,
    ReadShare,
    SplitCopies,
    map_ahead,
    read_share_ahead,
)
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
    ahead = ReadAhead(map_ahead(file.address), info.start, info.end, lead=4 << 20, chunk=1 << 20)
    try:
        assert _wait_for(lambda: page_cache.resident_bytes(path) >= 4 << 20)
        time.sleep(0.2)
        # the lead and a chunk, plus what the kernel reads around a fault (read_ahead_kb)
        assert page_cache.resident_bytes(path) <= (5 << 20) + file._chunk + 64 * PAGE < info.nbytes
        ahead.advance(info.end)
        assert _wait_for(lambda: page_cache.resident_bytes(path) >= info.nbytes)
    finally:
        ahead.stop()


def test_a_read_share_deals_out_pieces_by_offset() -> None:
    shares = [ReadShare(index, 3, unit=1 << 20) for index in range(3)]
    for offset in (0, 1, (1 << 20) - 1, 1 << 20, 5 << 20, (7 << 20) + 12345):
        assert [share.owns(offset) for share in shares].count(True) == 1  # one owner a piece
        assert shares[offset // (1 << 20) % 3].owns(offset)
    for bad in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ValueError):
            ReadShare(*bad)
    with pytest.raises(ValueError):
        ReadShare(0, 2, unit=PAGE + 1)  # pieces of whole pages


def test_read_ahead_hands_out_chunks_that_end_on_chunk_boundaries() -> None:
    """What a `ReadShare` needs: no chunk straddles two pieces, whatever the span's start."""
    seen: list[tuple[int, int]] = []
    ahead = ReadAhead(lambda offset, length: seen.append((offset, length)) or True, 3 * PAGE + 5,
                      10 << 20, chunk=1 << 20)
    ahead.advance(10 << 20)
    assert _wait_for(lambda: seen and sum(seen[-1]) >= 10 << 20)
    ahead.stop()
    assert seen[0] == (3 * PAGE, (1 << 20) - 3 * PAGE)
    assert all(offset % (1 << 20) == 0 and length == 1 << 20 for offset, length in seen[1:])
    assert sum(length for _, length in seen) == (10 << 20) - 3 * PAGE


def test_read_share_ahead_asks_only_for_its_pieces() -> None:
    asked: list[tuple[int, int]] = []
    fetch = read_share_ahead(ReadShare(1, 2, unit=1 << 20), lambda start, end: asked.append((start, end)))
    for offset in range(0, 6 << 20, 1 << 20):
        assert fetch(offset, 1 << 20)
    assert asked == [(1 << 20, 2 << 20), (3 << 20, 4 << 20), (5 << 20, 6 << 20)]


def test_finish_hands_out_every_chunk_left_whatever_the_copy_s_position() -> None:
    """A share's pieces are asked for to the end when its stream closes: peers count on them."""
    seen: list[tuple[int, int]] = []
    ahead = ReadAhead(lambda offset, length: seen.append((offset, length)) or True, 0, 64 << 20,
                      lead=1 << 20, chunk=1 << 20)  # the copy never advances: the lead holds it back
    ahead.finish()
    assert sum(length for _, length in seen) == 64 << 20
