"""Small decode steps through every layer in one C call: in bf16 the same tokens and the same
log-probabilities, bit for bit, as the layer-by-layer module path; in fp32 the same tokens and
log-probabilities equal to rounding (the stack's norm sums in another order than torch's);
and only where every piece has its C kernel."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM
from tandem.models.decode_stack import DecodeStack
from tandem.types import SamplingParams

PROMPTS = ["The three primary colors are", "def fibonacci(n):"]


def _generate(llm: LLM, prompts: list[str]) -> list[tuple[list[int], float | None]]:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in llm.generate(prompts, params)]


def _count_calls(stack: DecodeStack) -> list[int]:
    """Wrap the stack's C call: the list fills with each call's token count."""
    calls: list[int] = []
    run = stack.kernel

    def counted(layers, step, hidden):
        calls.append(hidden.shape[0])
        return run(layers, step, hidden)

    stack.kernel = type("Counted", (), {"__call__": staticmethod(counted), "dtype": run.dtype})()
    return calls


def _stacked_then_layered(llm: LLM, prompts: list[str], dtype: torch.dtype) -> tuple[list, list]:
    """The same greedy requests through the model's decode stack of `dtype` rows, every decode
    step going through it (the prompt's step does not: it is a prefill), then with the stack
    detached (the layer-by-layer module path)."""
    model = llm.engine.runner.model
    stack = model.decode_stack
    assert isinstance(stack, DecodeStack) and stack.kernel.dtype == dtype
    calls = _count_calls(stack)
    stacked = _generate(llm, prompts)
    assert calls == [len(prompts)] * 23
    model.decode_stack = None
    return stacked, _generate(llm, prompts)


@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["one-token steps", "two-token steps"])
def test_the_stack_gives_the_module_paths_bits(prompts: list[str]) -> None:
    with LLM(dtype="bfloat16", decode_weights="int4", kv_cache_memory="64MiB", enable_prefix_caching=False) as llm:
        assert llm.engine.runner.model.decode_stack.max_tokens == 2
        stacked, layered = _stacked_then_layered(llm, prompts, torch.bfloat16)
    assert stacked == layered
    assert all(logprob is not None for _, logprob in stacked)


def test_steps_larger_than_the_small_step_copies_take_the_module_path() -> None:
    with LLM(dtype="bfloat16", decode_weights="int4", kv_cache_memory="64MiB", enable_prefix_caching=False) as llm:
        stack = llm.engine.runner.model.decode_stack
        assert stack is not None
        calls = _count_calls(stack)
        outputs = _generate(llm, PROMPTS + ["Once upon a time"])
    assert calls == [] and all(len(tokens) == 24 for tokens, _ in outputs)


@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["one-token steps", "two-token steps"])
def test_the_fp32_stack_gives_the_module_paths_tokens(prompts: list[str]) -> None:
    with LLM(decode_weights="float32", kv_cache_memory="64MiB", enable_prefix_caching=False) as llm:
        stacked, layered = _stacked_then_layered(llm, prompts, torch.float32)
    assert [tokens for tokens, _ in stacked] == [tokens for tokens, _ in layered]
    for (_, ours), (_, theirs) in zip(stacked, layered, strict=True):
        assert ours is not None and abs(ours - theirs) <= 1e-3


def test_a_bf16_model_s_own_rows_go_through_the_stack_with_the_module_paths_bits() -> None:
    """`--dtype bfloat16 --decode-weights bfloat16`: the model's plain bf16 rows, read by the
    bf16 GEMV in the stack and on the module path alike, no rounding beyond bf16's."""
    with LLM(dtype="bfloat16", decode_weights="bfloat16", quantization="none", kv_cache_memory="64MiB",
             enable_prefix_caching=False) as llm:
        assert llm.engine.runner.model.model.layers[0].mlp.down_proj.small_dense.weight.dtype == torch.bfloat16
        stacked, layered = _stacked_then_layered(llm, PROMPTS, torch.bfloat16)
    assert stacked == layered


@pytest.mark.parametrize("kwargs", [
    {"dtype": "float32", "decode_weights": "int4"},  # the 4-bit stack runs bf16 rows
    {"dtype": "bfloat16", "decode_weights": "none"},  # no 4-bit copies to read
    {"dtype": "float32", "decode_weights": "bfloat16"},  # a rounded bf16 copy under fp32 rows
], ids=["fp32", "no copies", "bf16 copy of fp32"])
def test_models_without_a_c_kernel_for_every_piece_keep_the_module_path(kwargs: dict) -> None:
    with LLM(kv_cache_memory="64MiB", **kwargs) as llm:
        assert llm.engine.runner.model.decode_stack is None
        tokens, _ = _generate(llm, PROMPTS[:1])[0]
    assert len(tokens) == 24
