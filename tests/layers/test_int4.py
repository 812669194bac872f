"""4-bit weight-only matrices: the grid, the kernel's layout and what the kernel computes."""

from __future__ import annotations

import pytest
import torch

from tandem.layers.int4 import Int4Weight, int4_available, int4_fits

pytestmark = pytest.mark.skipif(not int4_available(), reason="this torch build has no CPU int4 kernel")


def test_every_weight_lands_within_half_a_step_of_its_groups_grid() -> None:
    torch.manual_seed(0)
    weight = torch.randn(48, 128)
    quantized = Int4Weight.quantize(weight, group_size=32)
    dense = quantized.dequantize()
    groups = weight.reshape(48, 4, 32)
    step = (groups.amax(-1) - groups.amin(-1)) / 15  # per row and group
    error = (dense - weight).abs().reshape(48, 4, 32)
    assert (error <= step.unsqueeze(-1) / 2 + 1e-5).all()
    # Each group's extremes are grid points: the range is used whole.
    torch.testing.assert_close(dense.reshape(48, 4, 32).amax(-1), groups.amax(-1), rtol=0, atol=1e-5)
    torch.testing.assert_close(dense.reshape(48, 4, 32).amin(-1), groups.amin(-1), rtol=0, atol=1e-5)


def test_a_matrix_already_on_a_4_bit_grid_comes_back_exactly() -> None:
    """Q4_K-style weights (16 levels of scale and minimum per 32 columns) survive unchanged."""
    torch.manual_seed(1)
    levels = torch.randint(0, 16, (32, 64)).float()
    levels[:, 0::32] = 0
    levels[:, 1::32] = 15  # every group spans the whole range
    scale = (torch.rand(32, 2) + 0.5).repeat_interleave(32, dim=1) / 64
    low = torch.randn(32, 2).repeat_interleave(32, dim=1) / 8
    weight = levels * scale + low
    torch.testing.assert_close(Int4Weight.quantize(weight).dequantize(), weight, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_matmul_is_x_times_the_dequantized_matrix(dtype: torch.dtype, tolerance: float) -> None:
    torch.manual_seed(2)
    weight = torch.randn(64, 96).to(dtype)
    quantized = Int4Weight.quantize(weight, group_size=32)
    assert quantized.scales_and_zeros.dtype == dtype
    assert quantized.nbytes == 64 * 96 // 2 + 3 * 64 * 2 * torch.empty((), dtype=dtype).element_size()
    dense = quantized.dequantize().float()
    for rows in (1, 2, 7):
        x = torch.randn(2, rows, 96).to(dtype)  # leading dimensions pass through
        out = quantized.matmul(x)
        assert out.shape == (2, rows, 64) and out.dtype == dtype
        torch.testing.assert_close(out.float(), x.float() @ dense.T, rtol=tolerance, atol=tolerance * 10)


def test_shapes_the_kernel_cannot_take_are_refused() -> None:
    assert int4_fits(torch.empty(32, 64), 32)
    assert not int4_fits(torch.empty(24, 64), 32)  # rows: multiples of 16
    assert not int4_fits(torch.empty(32, 48), 32)  # columns: whole groups
    with pytest.raises(ValueError, match="out % 16"):
        Int4Weight.quantize(torch.empty(24, 64))
    with pytest.raises(ValueError, match="group size"):
        Int4Weight.quantize(torch.empty(32, 64), group_size=16)
