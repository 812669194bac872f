"""fp32 rows stored as lossless int8 codes (kernels/lossless_rows.py) and read by the coded GEMV."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from tandem.kernels.dense_gemv import SOURCE, DenseGemvKernel, DenseRows
from tandem.kernels.lossless_rows import code_rows, coded_row_bytes, rebuild_rows

# the GGUF block formats whose dequantized weights the rules find (the K-quants are not found)
FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> DenseGemvKernel:
    return DenseGemvKernel.build(tmp_path_factory.mktemp("cache"))


def gguf_weights(kind: str, shape: tuple[int, int], seed: int) -> torch.Tensor:
    """A matrix as the loader gets it from a GGUF: quantized to `kind`'s blocks by the gguf
    package and dequantized by it to fp32."""
    values = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) / 8
    values[0, :32] = 0.0  # an all-zero block
    kind_id = GGMLQuantizationType[kind]
    return torch.from_numpy(np.ascontiguousarray(dequantize(quantize(values, kind_id), kind_id), dtype=np.float32))


def mixed_weights(shape: tuple[int, int]) -> torch.Tensor:
    """Every row from another format, as a fused qkv whose v is Q8_0 and q, k Q5_0 (Qwen's)."""
    parts = [gguf_weights(FORMATS[row % len(FORMATS)], (1, shape[1]), row) for row in range(shape[0])]
    return torch.cat(parts)


@pytest.mark.parametrize("kind", FORMATS)
def test_a_gguf_format_s_weights_come_back_bit_for_bit(kind: str) -> None:
    weight = gguf_weights(kind, (96, 576), seed=1)
    coded = code_rows(weight)
    assert coded is not None and coded.dtype == torch.uint8 and coded.shape == (96, coded_row_bytes(576))
    assert coded.numel() * 3 < weight.numel() * 4  # 1.25 bytes a weight against 4
    assert torch.equal(rebuild_rows(coded, 576), weight)


def test_a_matrix_no_rule_rebuilds_keeps_its_plain_rows() -> None:
    weight = gguf_weights("Q4_1", (128, 128), seed=2)
    assert code_rows(weight) is not None
    weight[100, 7] = torch.nextafter(weight[100, 7], torch.tensor(1.0))  # one weight one ulp off
    assert code_rows(weight) is None
    assert code_rows(torch.randn(64, 128)) is None  # plain fp32 weights
    assert code_rows(gguf_weights("Q4_1", (8, 96), seed=3)) is None  # rows not whole steps of 64
    assert code_rows(gguf_weights("Q4_1", (8, 128), seed=3).bfloat16()) is None


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
def test_the_coded_gemv_multiplies_the_fp32_weights_themselves(kernel: DenseGemvKernel, rows: int) -> None:
    """One-hot inputs give each weight back exactly (the kernel rebuilds it with the same two
    roundings, no fused multiply-add); real inputs agree with the plain rows' GEMV to fp32
    rounding, bias and residual included."""
    weight = mixed_weights((77, 576))
    coded = code_rows(weight)
    assert coded is not None
    columns = kernel.coded_gemv(coded, 77, 576, torch.eye(576))
    assert torch.equal(columns, weight.T)
    generator = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, 576, generator=generator), torch.randn(77, generator=generator)
    residual = torch.randn(rows, 77, generator=generator)
    got = kernel.coded_gemv(coded, 77, 576, x, bias, residual)
    torch.testing.assert_close(got, kernel.gemv(weight, x, bias, residual), rtol=1e-6, atol=1e-6)


def test_the_layer_s_rows_read_their_codes(kernel: DenseGemvKernel) -> None:
    weight = gguf_weights("Q5_0", (40, 128), seed=4)
    rows = DenseRows(weight, None, kernel)
    assert rows.codes is None and rows.with_codes() and rows.codes is not None
    assert rows.nbytes == weight.numel() * 4 + rows.codes.numel()
    x = torch.randn(2, 3, 128)
    torch.testing.assert_close(rows.matmul(x), x @ weight.T, rtol=1e-5, atol=1e-5)
    rows.codes[:] = 0  # the codes, not the plain rows, are what it reads
    assert torch.equal(rows.matmul(x), torch.zeros(2, 3, 40))
    assert not DenseRows(weight.bfloat16(), None, kernel).with_codes()


def test_codes_that_do_not_hold_the_shape_are_refused(kernel: DenseGemvKernel) -> None:
    coded = code_rows(gguf_weights("Q8_0", (8, 128), seed=5))
    with pytest.raises(ValueError, match="coded rows"):
        kernel.coded_gemv(coded, 8, 64, torch.randn(1, 64))


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
@pytest.mark.parametrize("march, isa", [("x86-64", "portable C"), ("haswell", "avx2")])
def test_every_instruction_set_path_rebuilds_the_weights(tmp_path: Path, march: str, isa: str) -> None:
    """The paths this CPU does not pick, built for an older target, with -ffast-math as the
    kernels are built (the rebuild must still not fuse its multiply and add)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    library = tmp_path / f"gemv-{march}.so"
    subprocess.run([compiler, "-O3", f"-march={march}", "-ffp-contract=fast", "-ffast-math", "-fopenmp", "-shared",
                    "-fPIC", "-std=c11", str(SOURCE), "-o", str(library), "-lm"], check=True, capture_output=True)
    other = DenseGemvKernel(library)
    assert other.isa == isa
    weight = mixed_weights((33, 128))
    coded = code_rows(weight)
    assert torch.equal(other.coded_gemv(coded, 33, 128, torch.eye(128)), weight.T)
    x = torch.randn(3, 128)
    torch.testing.assert_close(other.coded_gemv(coded, 33, 128, x), other.gemv(weight, x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", FORMATS)
def test_weights_divided_past_fp16_s_range_still_come_back(kind: str) -> None:
    """Key rows divided by a power of two after loading (models/key_divisors.py: Qwen's
    first layer by 16 and more) have their blocks' fp16 scales divided too, below fp16's
    normal range: the scales keep fp16's precision at any exponent, so they still code."""
    weight = gguf_weights(kind, (64, 576), seed=4) / 2**14
    assert bool((weight.abs().amax(-1) < 2**-14).all())  # every row past fp16's normal range
    coded = code_rows(weight)
    assert coded is not None and torch.equal(rebuild_rows(coded, 576), weight)
