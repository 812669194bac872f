"""Choices the model builder makes per CPU."""

from __future__ import annotations

import pytest
import torch

from tandem.platform.cpu_modes import CpuFeatures
from tandem.worker.model_builder import bf16_rows_pay

AMX = CpuFeatures(avx2_fma=True, avx512=True, avx512_vnni=True, avx512_bf16=True, amx=True)
AVX512_BF16 = CpuFeatures(avx2_fma=True, avx512=True, avx512_vnni=True, avx512_bf16=True)


@pytest.mark.parametrize(("choice", "dtype", "packed", "features", "keeps"), [
    ("bfloat16", torch.bfloat16, True, AMX, False),  # the tiles read the packed blocks faster
    ("bfloat16", torch.bfloat16, False, AMX, True),  # nothing packed: the GEMV's rows
    ("bfloat16", torch.bfloat16, True, AVX512_BF16, True),  # no tiles: the GEMV beat oneDNN's one row
    ("bfloat16", torch.float32, True, AMX, True),  # an fp32 model's bf16 copy halves its bytes
    ("float32", torch.float32, True, AMX, True),
    ("int4", torch.bfloat16, True, AMX, True),
])
def test_a_bf16_model_keeps_its_plain_rows_only_where_they_beat_the_tiles(
        choice: str, dtype: torch.dtype, packed: bool, features: CpuFeatures, keeps: bool) -> None:
    assert bf16_rows_pay(choice, dtype, packed, features) is keeps
