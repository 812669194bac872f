"""The INT4 expert layer on its GPU path: the checkpoint's int32 words, run by the Triton
grouped GEMM (in the interpreter here), give the C kernel's and the dequantized experts' output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

from tandem.kernels.q4_gemm import Q4Kernel
from tandem.layers.int4_experts import Int4Experts, attach_int4_expert_kernel

HIDDEN, INTER, EXPERTS = 64, 64, 4


def _load(experts: Int4Experts, generator: torch.Generator) -> None:
    for e in range(EXPERTS):
        for projection, shape in (("gate", (INTER, HIDDEN)), ("up", (INTER, HIDDEN)), ("down", (HIDDEN, INTER))):
            q = torch.randint(-8, 8, shape, generator=generator, dtype=torch.int8)
            scales = (torch.rand(shape[0], shape[1] // 32, generator=generator) * 0.05 + 0.01).bfloat16()
            experts.load(e, projection, "weight_packed", pack_to_int32(q, 4))
            experts.load(e, projection, "weight_scale", scales)


def test_the_words_layout_runs_the_experts_as_the_c_kernel_does(tmp_path: Path) -> None:
    words, nibbles = Int4Experts(EXPERTS, HIDDEN, INTER), Int4Experts(EXPERTS, HIDDEN, INTER)
    words.use_packed_words(torch.device("cpu"))
    assert words.w13.dtype == torch.int32 and words.w13.shape == (EXPERTS, 2 * INTER, HIDDEN // 8)
    _load(words, torch.Generator().manual_seed(0))
    _load(nibbles, torch.Generator().manual_seed(0))
    attach_int4_expert_kernel(nibbles, Q4Kernel.build(tmp_path))
    for e in range(EXPERTS):  # the same checkpoint, two layouts
        assert all(torch.equal(a, b) for a, b in zip(words.dequantized(e), nibbles.dequantized(e), strict=True))
    counts = [3, 0, 1, 2]
    rows = torch.randn(sum(counts), HIDDEN, generator=torch.Generator().manual_seed(1))
    got = words(rows, counts)
    reference, start = torch.empty_like(rows), 0
    for e, count in enumerate(counts):
        w13, w2 = words.dequantized(e)
        gate, up = F.linear(rows[start : start + count], w13).split(INTER, dim=-1)
        reference[start : start + count] = F.linear(F.silu(gate) * up, w2)
        start += count
    torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got, nibbles(rows, counts), rtol=1e-3, atol=1e-3)


def test_dummy_levels_fill_the_words_layout_too() -> None:
    words = Int4Experts(EXPERTS, HIDDEN, INTER)
    words.use_packed_words(torch.device("cpu"))
    words.init_dummy_(torch.Generator().manual_seed(0))
    gate_up, down = words.dequantized(0)
    step = float(torch.tensor(0.0075).bfloat16())
    assert gate_up.abs().max() <= 8 * step and gate_up.std() > 0.01 and down.std() > 0.01


if __name__ == "__main__":
    pytest.main([__file__])
