"""The CPU KV cache is committed at start by default, and left lazy under --lazy-kv-cache."""

from __future__ import annotations

import ctypes
import mmap

import pytest
import torch

from tandem.llm import LLM
from tandem.types import SamplingParams


def resident_share(tensor: torch.Tensor) -> float:
    """The share of the tensor's whole pages that are in memory now (mincore(2))."""
    page = mmap.PAGESIZE
    start = -(-tensor.data_ptr() // page) * page
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page * page
    pages = (end - start) // page
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(start), end - start, vector) == 0, ctypes.get_errno()
    return sum(byte & 1 for byte in vector) / pages


@pytest.mark.parametrize("lazy", [False, True], ids=["committed by default", "--lazy-kv-cache"])
def test_the_cache_is_resident_before_the_first_step_unless_lazy(lazy: bool) -> None:
    with LLM(kv_cache_memory="256MiB", lazy_kv_cache=lazy) as llm:
        cache = llm.engine.runner.kv_cache
        share = resident_share(cache)
        if lazy:
            assert share < 0.05, share
        else:
            assert share == 1.0, share
        assert not cache.any()  # committed pages are zero, as lazy ones read
        out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0))
        assert out[0].outputs[0].token_ids
