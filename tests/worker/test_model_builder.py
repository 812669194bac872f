"""Choices the model builder makes per CPU."""

from __future__ import annotations

import pytest
import torch

from tandem.worker.model_builder import bf16_rows_pay


@pytest.mark.parametrize(("choice", "dtype", "tiles", "keeps"), [
    ("bfloat16", torch.bfloat16, True, False),  # the tiles read the packed blocks faster
    ("bfloat16", torch.bfloat16, False, True),  # no tiles (none packed, no AMX, the OS refused them)
    ("bfloat16", torch.float32, True, True),  # an fp32 model's bf16 copy halves its bytes
    ("float32", torch.float32, True, True),
    ("int4", torch.bfloat16, True, True),
])
def test_a_bf16_model_keeps_its_plain_rows_only_where_they_beat_the_tiles(
        choice: str, dtype: torch.dtype, tiles: bool, keeps: bool) -> None:
    assert bf16_rows_pay(choice, dtype, tiles) is keeps
