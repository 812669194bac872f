"""INT4 experts: compressed-tensors' packing read back exactly, into the 4-bit kernel's layout."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

from tandem.distributed.tensor_parallel import TensorParallel
from tandem.layers.int4_experts import (
    Int4Experts,
    kernel_levels,
    kernel_nibbles,
    pack_int32_levels,
    unpack_int32_levels,
)


def _signed(rows: int, inputs: int, seed: int) -> torch.Tensor:
    return torch.randint(-8, 8, (rows, inputs), generator=torch.Generator().manual_seed(seed), dtype=torch.int8)


def test_levels_unpack_as_compressed_tensors_packs_them() -> None:
    q = _signed(6, 128, 0)
    packed = pack_to_int32(q, 4)  # the package's own packer, as the checkpoints are written
    assert packed.shape == (6, 16) and packed.dtype == torch.int32
    assert torch.equal(unpack_int32_levels(packed).to(torch.int16) - 8, q.to(torch.int16))
    assert torch.equal(unpack_from_int32(packed, 4, q.shape), q)
    assert torch.equal(pack_int32_levels(unpack_int32_levels(packed)), packed)


def test_kernel_layout_pairs_input_j_with_input_j_plus_32() -> None:
    levels = torch.arange(64, dtype=torch.uint8).remainder(16).reshape(1, 64)
    nibbles = kernel_nibbles(levels)
    assert nibbles.shape == (1, 32)
    assert int(nibbles[0, 5]) & 0xF == int(levels[0, 5]) and int(nibbles[0, 5]) >> 4 == int(levels[0, 37])
    assert torch.equal(kernel_levels(nibbles), levels)
    with pytest.raises(ValueError, match="multiple of 64"):
        kernel_nibbles(torch.zeros(2, 96, dtype=torch.uint8))


def _checkpoint(inter: int, hidden: int, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """projection -> (packed, bf16 scales, the dense matrix they stand for)."""
    out = {}
    for i, (name, shape) in enumerate({"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}.items()):
        q = _signed(*shape, seed + i)
        scales = (torch.rand(shape[0], shape[1] // 32, generator=torch.Generator().manual_seed(i)) + 0.5).bfloat16()
        out[name] = (pack_to_int32(q, 4), scales, q.float() * scales.float().repeat_interleave(32, dim=1))
    return out


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_each_rank_keeps_its_slice_of_every_projection(ranks: int) -> None:
    inter, hidden = 256, 128
    tensors = _checkpoint(inter, hidden, 7)
    for rank in range(ranks):
        experts = Int4Experts(2, hidden, inter // ranks, TensorParallel(rank, ranks))
        for projection, (packed, scales, _) in tensors.items():
            experts.load(1, projection, "weight_packed", packed)
            experts.load(1, projection, "weight_scale", scales)
            shape = [hidden, inter] if projection == "down" else [inter, hidden]
            experts.load(1, projection, "weight_shape", torch.tensor(shape, dtype=torch.int32))
        gate_up, down = experts.dequantized(1)
        share = inter // ranks
        rows = slice(rank * share, (rank + 1) * share)
        assert torch.equal(gate_up, torch.cat([tensors["gate"][2][rows], tensors["up"][2][rows]]))
        assert torch.equal(down, tensors["down"][2][:, rows])


def test_tensors_of_the_wrong_shape_or_kind_are_refused() -> None:
    experts = Int4Experts(1, 64, 64)
    with pytest.raises(ValueError, match="weight_shape is"):
        experts.load(0, "gate", "weight_shape", torch.tensor([64, 128], dtype=torch.int32))
    with pytest.raises(ValueError, match="expected"):
        experts.load(0, "down", "weight_packed", torch.zeros(64, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="bf16 scales"):
        experts.load(0, "up", "weight_scale", torch.zeros(64, 2, dtype=torch.float16))
    with pytest.raises(ValueError, match="divisible by 64"):
        Int4Experts(1, 64, 96)
