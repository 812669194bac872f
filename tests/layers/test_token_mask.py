"""Grammar masks on the logits: forbidden tokens become -inf, only in the masked requests'
rows (a request without a mask keeps its logits bit for bit), one mask row per logits row."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.layers.token_mask import allowed_tokens, apply_token_masks


def _mask(vocab: int, allowed: list[int], rows: int = 1) -> np.ndarray:
    words = np.zeros((rows, (vocab + 31) // 32), dtype=np.int32)
    for token in allowed:
        words[:, token // 32] |= np.int32(np.uint32(1 << (token % 32)).view(np.int32))
    return words


def test_bits_unpack_to_the_tokens_they_name() -> None:
    allowed = allowed_tokens(_mask(100, [0, 31, 32, 63, 99]), 100)
    assert allowed.shape == (1, 100)
    assert allowed[0].nonzero().flatten().tolist() == [0, 31, 32, 63, 99]
    # Logits wider than the mask (a model padded past its tokenizer): the extra columns are forbidden.
    wider = allowed_tokens(_mask(40, [39]), 70)
    assert wider[0].nonzero().flatten().tolist() == [39]


def test_only_masked_rows_change() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 70)
    before = logits.clone()
    # Rows: a (1 row, free), b (3 rows: two drafts, masked), c (1 row, masked).
    masks = {"b": _mask(70, [5, 6], rows=3), "c": _mask(70, [69])}
    apply_token_masks(logits, [("a", 1), ("b", 3), ("c", 1)], masks)
    assert torch.equal(logits[0], before[0])
    for row in (1, 2, 3):
        assert torch.isfinite(logits[row]).nonzero().flatten().tolist() == [5, 6]
        assert torch.equal(logits[row, 5:7], before[row, 5:7])
    assert logits[4].argmax().item() == 69


def test_a_batch_of_masked_rows_only_is_masked_whole() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 70)
    before = logits.clone()
    apply_token_masks(logits, [("a", 1), ("b", 1)], {"a": _mask(70, [3, 40]), "b": _mask(70, [64])})
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [3, 40]
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [64]
    assert logits[0, 3] == before[0, 3] and logits[0, 40] == before[0, 40] and logits[1, 64] == before[1, 64]


def test_a_mask_with_the_wrong_number_of_rows_is_refused() -> None:
    with pytest.raises(ValueError, match="mask rows"):
        apply_token_masks(torch.zeros(2, 10), [("a", 2)], {"a": _mask(10, [1])})
