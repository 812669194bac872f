"""Pages faulted in ahead of their use: contents kept, memory resident, a shortfall named."""

from __future__ import annotations

import mmap
from pathlib import Path

import psutil
import pytest
import torch

from tandem.platform.lazy_memory import lazily_zeroed, shared_zeroed
from tandem.platform.pages import CommitError, commit_for_write, populate_for_write


def test_populating_keeps_what_is_written() -> None:
    tensor = torch.arange(1 << 20, dtype=torch.float32)
    assert populate_for_write(tensor[1000:])
    assert torch.equal(tensor, torch.arange(1 << 20, dtype=torch.float32))


def test_a_committed_zero_mapping_is_resident_and_still_zero() -> None:
    process = psutil.Process()
    tensor = lazily_zeroed((64, 1 << 20), torch.float32)  # 256 MiB, nothing resident yet
    before = process.memory_info().rss
    assert commit_for_write(tensor, "a test budget")
    assert process.memory_info().rss - before >= 250 << 20
    assert not tensor.any()


def test_a_shared_file_is_committed_too(tmp_path: Path) -> None:
    tensor = shared_zeroed(str(tmp_path / "kv"), (16, 1 << 20), torch.float32)  # 64 MiB sparse
    assert commit_for_write(tensor, "a shared budget")
    assert (tmp_path / "kv").stat().st_blocks * 512 >= 64 << 20  # the file's blocks are allocated
    assert not tensor.any()


def test_memory_that_is_not_there_fails_by_name(tmp_path: Path) -> None:
    """A shared mapping past its file's end: the kernel cannot back those pages (as when
    /dev/shm is full), and the commit says what could not be held instead of a SIGBUS later."""
    path = tmp_path / "kv"
    tensor = shared_zeroed(str(path), (2, 1 << 20), torch.float32)  # 8 MiB
    with open(path, "r+b") as file:
        file.truncate(mmap.PAGESIZE)
    with pytest.raises(CommitError, match="the KV cache of the test"):
        commit_for_write(tensor, "the KV cache of the test")
