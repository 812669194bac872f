"""Staged copies give exactly what a plain `copy_` gives; run here with the CPU as the target
(no pinning, no stream), which drives the same chunking, alternation and conversion."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tandem.loader.device_copy import StagedDeviceCopies, _pieces

CPU = torch.device("cpu")
CHUNK = 4 << 10  # 1024 float32: the tensors below span many chunks


def _staged(chunk_bytes: int = CHUNK) -> StagedDeviceCopies:
    return StagedDeviceCopies(CPU, pin=False, chunk_bytes=chunk_bytes)


def _random(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_float32_in_many_chunks() -> None:
    src, dst = _random(100, 90), torch.empty(100, 90)
    with _staged() as mode:
        assert dst.copy_(src) is dst
    assert torch.equal(dst, src)
    assert mode.tensors == 1
    assert mode.chunks == -(-9000 // 1024)
    assert mode.bytes_staged == 9000 * 4


def test_converted_to_bfloat16_as_copy_does() -> None:
    src = _random(64, 300) * 1e3
    dst, expected = torch.empty(64, 300, dtype=torch.bfloat16), torch.empty(64, 300, dtype=torch.bfloat16)
    expected.copy_(src)
    with _staged() as mode:
        dst.copy_(src)
    assert torch.equal(dst, expected)
    assert mode.chunks == -(-64 * 300 // 2048)  # chunks counted in the destination's dtype
    assert mode.bytes_staged == 64 * 300 * 2


def test_narrowed_rows_of_a_larger_destination() -> None:
    whole = torch.full((300, 70), -7.0)
    src = _random(120, 70)
    with _staged() as mode:
        whole.narrow(0, 100, 120).copy_(src)
    assert mode.tensors == 1
    assert torch.equal(whole[100:220], src)
    assert bool((whole[:100] == -7.0).all()) and bool((whole[220:] == -7.0).all())


@pytest.mark.parametrize("shape", [(200, 50), (50, 2000), (3, 7)])  # rows packed, rows split, small
def test_strided_source(shape: tuple[int, int]) -> None:
    base = _random(shape[1], shape[0])
    src = base.t()  # a transposed view: not contiguous
    assert not src.is_contiguous()
    dst = torch.empty(shape, dtype=torch.bfloat16)
    with _staged() as mode:
        dst.copy_(src)
    assert mode.tensors == 1
    assert torch.equal(dst, src.to(torch.bfloat16))


def test_strided_destination_falls_back() -> None:
    dst_base, src = torch.zeros(80, 60), _random(60, 80)
    with _staged() as mode:
        dst_base.t().copy_(src)
    assert mode.tensors == mode.chunks == 0
    assert torch.equal(dst_base.t(), src)


def test_smaller_than_a_chunk_and_scalars() -> None:
    src, dst = _random(5, 3), torch.empty(5, 3, dtype=torch.float64)
    scalar = torch.empty((), dtype=torch.float16)
    with _staged() as mode:
        dst.copy_(src)
        scalar.copy_(torch.tensor(2.5))
    assert torch.equal(dst, src.double()) and scalar.item() == 2.5
    assert mode.tensors == mode.chunks == 2
    assert mode.bytes_staged == 15 * 8 + 2


def test_zero_elements() -> None:
    dst = torch.empty(0, 16)
    with _staged() as mode:
        assert dst.copy_(torch.empty(0, 16)) is dst
    assert mode.tensors == mode.chunks == mode.bytes_staged == 0


def test_other_copies_are_left_alone() -> None:
    dst = torch.empty(40, 40)
    src = _random(40, 40)
    # Not the target device: a mode for the meta device leaves CPU copies to torch.
    with StagedDeviceCopies(torch.device("meta"), pin=False, chunk_bytes=CHUNK) as mode:
        dst.copy_(src)
    assert mode.tensors == 0 and torch.equal(dst, src)
    row = _random(40)
    with _staged() as mode:
        dst.copy_(row)  # a broadcast: another shape
        assert torch.equal(dst, row.expand(40, 40))
        dst[1:].copy_(dst[:-1].clone()[:39])  # shapes match, storage differs: taken
        with pytest.raises(RuntimeError, match="single memory location"):
            dst[1:].copy_(dst[:-1])  # the same storage: left to torch, which refuses the overlap
        with pytest.raises(RuntimeError):
            dst.copy_(_random(4, 400))  # the error stays torch's
    assert mode.tensors == 1


def test_own_copies_reach_modes_entered_before_only() -> None:
    class CountCopies(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.copies = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.copies += func is torch.Tensor.copy_
            return func(*args, **(kwargs or {}))

    src, dst = _random(100, 90), torch.empty(100, 90)
    with CountCopies() as outer, _staged() as mode:
        dst.copy_(src)
    assert torch.equal(dst, src)
    assert outer.copies == 2 * mode.chunks  # a staging copy and a transfer per chunk


def test_pieces_cover_the_source_in_order() -> None:
    src = _random(6, 5, 9).permute(2, 0, 1)
    for limit in (1, 4, 30, 45, 1000):
        pieces = list(_pieces(src, limit))
        assert all(0 < piece.numel() <= limit for piece in pieces)
        assert torch.equal(torch.cat([piece.reshape(-1) for piece in pieces]), src.reshape(-1))


def test_a_mode_per_thread() -> None:
    dsts = [torch.empty(130, 70, dtype=torch.bfloat16) for _ in range(8)]
    srcs = [_random(130, 70, seed=i) for i in range(8)]
    modes: list[StagedDeviceCopies] = []
    barrier = threading.Barrier(4)

    def load(indices: range) -> None:
        with _staged() as mode:
            barrier.wait()  # every thread inside its own mode at once
            for i in indices:
                dsts[i].copy_(srcs[i])
        modes.append(mode)

    threads = [threading.Thread(target=load, args=(range(i, 8, 4),)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for dst, src in zip(dsts, srcs, strict=True):
        assert torch.equal(dst, src.to(torch.bfloat16))
    assert sorted(mode.tensors for mode in modes) == [2, 2, 2, 2]
    assert sum(mode.bytes_staged for mode in modes) == 8 * 130 * 70 * 2
    plain = torch.empty(3)
    plain.copy_(torch.ones(3))  # no mode left active in this thread
    assert all(mode.tensors == 2 for mode in modes)


def test_chunk_too_small_is_refused() -> None:
    with pytest.raises(ValueError):
        StagedDeviceCopies(CPU, pin=False, chunk_bytes=8)
