"""Steps through every layer in one C call: in bf16 the same tokens and the same
log-probabilities, bit for bit, as the layer-by-layer module path; in fp32 the same tokens and
log-probabilities equal to rounding (the stack's norm sums in another order than torch's);
small steps over the small-step copies, larger ones over the weights packed for tandem's
dense GEMM; decode steps, and steps with prefill chunks where the C prefill attention runs the
dtype; and only where every piece has its C kernel."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM
from tandem.models.decode_stack import DecodeStack
from tandem.platform.cpu_modes import CpuFeatures
from tandem.types import SamplingParams

PROMPTS = ["The three primary colors are", "def fibonacci(n):"]


def _generate(llm: LLM, prompts: list[str]) -> list[tuple[list[int], float | None]]:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in llm.generate(prompts, params)]


def _count_calls(stack: DecodeStack, prefills: list[tuple[int, int]] | None = None) -> list[int]:
    """Wrap the stack's C call: the list fills with each decode step's token count, and
    `prefills` (where given) with each prefill step's (tokens, chunks)."""
    calls: list[int] = []
    run = stack.kernel

    def counted(layers, step, hidden):
        if step.spans == 0:
            calls.append(hidden.shape[0])
        elif prefills is not None:
            prefills.append((hidden.shape[0], step.spans))
        return run(layers, step, hidden)

    stack.kernel = type("Counted", (), {"__call__": staticmethod(counted), "dtype": run.dtype,
                                        "prefills": run.prefills})()
    return calls


def _packed_for_tandems_gemm(llm: LLM) -> bool:
    """Whether larger steps read weights packed for tandem's dense GEMM (AVX-512 without AMX,
    bf16 also AVX-512-BF16) or its 8-bit one with gate/up pairs (VNNI without AMX, the
    vector row passes): where they do not, the stack has no records for them."""
    gate_up = llm.engine.runner.model.model.layers[0].mlp.gate_up_proj
    return gate_up.gated_packed is not None or (gate_up.int8 is not None and gate_up.int8.gate_up_pairs)


def _stacked_then_layered(llm: LLM, prompts: list[str], dtype: torch.dtype) -> tuple[list, list]:
    """The same greedy requests through the model's decode stack of `dtype` rows, every decode
    step going through it (the prompt's step does not: it is a prefill), then with the stack
    detached (the layer-by-layer module path). Steps past the small-step copies go through it
    where the layers are packed for tandem's GEMM, else through the module path both times."""
    model = llm.engine.runner.model
    stack = model.decode_stack
    assert isinstance(stack, DecodeStack) and stack.kernel.dtype == dtype
    calls = _count_calls(stack)
    stacked = _generate(llm, prompts)
    takes = len(prompts) <= stack.max_tokens or _packed_for_tandems_gemm(llm)
    assert calls == ([len(prompts)] * 23 if takes else [])
    model.decode_stack = None
    layered = _generate(llm, prompts)
    model.decode_stack = stack
    return stacked, layered


@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["one-token steps", "two-token steps"])
def test_the_stack_gives_the_module_paths_bits(prompts: list[str]) -> None:
    with LLM(dtype="bfloat16", decode_weights="int4", kv_cache_memory="64MiB", enable_prefix_caching=False) as llm:
        assert llm.engine.runner.model.decode_stack.max_tokens == 2
        stacked, layered = _stacked_then_layered(llm, prompts, torch.bfloat16)
    assert stacked == layered
    assert all(logprob is not None for _, logprob in stacked)


def test_a_long_context_s_spans_go_through_the_stack_with_the_module_paths_bits() -> None:
    """One stream past 128 cached tokens: the attention cuts each (sequence, kv head) pair's
    keys into spans and merges them (paged_decode_attention.c span_count), run by the stack's
    team where the attention runs as one (decode_stack.c team_layers): the module path's bits."""
    prompt = " ".join(["alpha beta gamma delta"] * 40)
    with LLM(dtype="bfloat16", decode_weights="int4", kv_cache_memory="64MiB", enable_prefix_caching=False) as llm:
        assert len(llm.tokenizer.encode(prompt)) >= 140
        stacked, layered = _stacked_then_layered(llm, [prompt], torch.bfloat16)
    assert stacked == layered


def test_steps_larger_than_the_small_step_copies_go_through_the_packed_weights() -> None:
    """Three sequences, past the 4-bit copies' two tokens: the stack's records of the packed
    bf16 matrices, with the module path's bits; where the layers are not packed for tandem's
    GEMM, the module path."""
    with LLM(dtype="bfloat16", decode_weights="int4", quantization="none", kv_cache_memory="64MiB",
             enable_prefix_caching=False) as llm:
        assert llm.engine.runner.model.decode_stack.max_tokens == 2
        stacked, layered = _stacked_then_layered(llm, PROMPTS + ["Once upon a time"], torch.bfloat16)
    assert stacked == layered


def test_steps_of_8_bit_weights_go_through_the_packed_8_bit_weights() -> None:
    """`--quantization int8` (the default mode where the CPU has VNNI): larger steps read the
    packed 8-bit matrices, the rows quantized and the products dequantized as the module path
    does, gate/up's middle from its pairs: the module path's bits."""
    with LLM(dtype="bfloat16", decode_weights="int4", quantization="int8", kv_cache_memory="64MiB",
             enable_prefix_caching=False) as llm:
        assert llm.engine.runner.model.model.layers[0].mlp.down_proj.int8 is not None
        stacked, layered = _stacked_then_layered(llm, PROMPTS * 2, torch.bfloat16)
    assert stacked == layered


@pytest.mark.skipif(not CpuFeatures.detect().amx, reason="8-bit weights for bf16 rows are widened on AMX tiles only")
def test_steps_of_8_bit_weights_for_bf16_rows_go_through_the_packed_8_bit_weights() -> None:
    """`--quantization w8a16`: larger steps read the projections' 8-bit packed weights (the LM
    head keeps bf16), widened to bf16 on the tiles by the same GEMM the module path calls: the
    module path's bits."""
    with LLM(dtype="bfloat16", decode_weights="int4", quantization="w8a16", kv_cache_memory="64MiB",
             enable_prefix_caching=False) as llm:
        model = llm.engine.runner.model
        layer = model.model.layers[0]
        assert layer.mlp.gate_up_proj.gated_packed.values.dtype == torch.int8
        assert layer.mlp.down_proj.dense_packed.values.dtype == torch.int8
        assert model.lm_head.dense_packed is None or model.lm_head.dense_packed.values.dtype == torch.bfloat16
        stacked, layered = _stacked_then_layered(llm, PROMPTS + ["Once upon a time"], torch.bfloat16)
    assert stacked == layered


def test_8_bit_weights_under_fp32_rows_keep_the_module_path_past_the_small_steps() -> None:
    """The stack's fp32 norm rounds otherwise than torch's, which 8-bit rows can turn into
    other tokens: fp32 rows over 8-bit weights keep the module path for larger steps."""
    with LLM(dtype="float32", decode_weights="float32", quantization="int8", kv_cache_memory="64MiB",
             enable_prefix_caching=False) as llm:
        stack = llm.engine.runner.model.decode_stack
        assert stack is not None and stack.max_tokens == 2
        calls = _count_calls(stack)
        outputs = _generate(llm, PROMPTS * 2)
    assert calls == [] and all(len(tokens) == 24 for tokens, _ in outputs)


@pytest.mark.parametrize("kwargs", [
    {"dtype": "bfloat16", "decode_weights": "none", "quantization": "none"},
    {"exact": True, "decode_weights": "none"},
], ids=["bf16", "fp32"])
def test_without_small_step_copies_every_decode_step_goes_through_the_packed_weights(kwargs: dict) -> None:
    with LLM(kv_cache_memory="64MiB", enable_prefix_caching=False, **kwargs) as llm:
        stack = llm.engine.runner.model.decode_stack
        if not _packed_for_tandems_gemm(llm):
            assert stack is None
            return
        assert stack is not None and stack.max_tokens == 0
        dtype = torch.float32 if kwargs.get("exact") else torch.bfloat16
        stacked, layered = _stacked_then_layered(llm, PROMPTS[:1], dtype)
    assert [tokens for tokens, _ in stacked] == [tokens for tokens, _ in layered]
    for (_, ours), (_, theirs) in zip(stacked, layered, strict=True):
        assert ours is not None and (ours == theirs if dtype == torch.bfloat16 else abs(ours - theirs) <= 1e-3)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_decode_steps_over_an_8_bit_cache_go_through_the_stack_with_the_module_paths_bits(
        kv_cache_dtype: str) -> None:
    """--kv-cache-dtype int8 or fp8 under bf16 rows: the stack rounds each step's keys and
    values into the cache as the backend's writer does (an fp8 layer's values divided by its
    measured scales, which fold into the softmax scale and the output), and reads it with the
    same decode kernel: the module path's bits."""
    with LLM(dtype="bfloat16", decode_weights="int4", kv_cache_memory="64MiB", enable_prefix_caching=False,
             kv_cache_dtype=kv_cache_dtype) as llm:
        if kv_cache_dtype == "fp8":  # the worker measured each layer's scales: not all 1
            layers = llm.engine.runner.model.model.layers
            assert any(layer.self_attn.attn.v_scale != 1.0 for layer in layers)
        stacked, layered = _stacked_then_layered(llm, PROMPTS, torch.bfloat16)
    assert stacked == layered


def test_decode_steps_over_a_bf16_cache_under_fp32_rows_go_through_the_stack() -> None:
    """--kv-cache-dtype bfloat16 under exact fp32: the stack narrows each step's keys and values
    into the bf16 cache as the backend's writer does; the module path's tokens."""
    with LLM(exact=True, kv_cache_memory="64MiB", enable_prefix_caching=False, kv_cache_dtype="bfloat16") as llm:
        stacked, layered = _stacked_then_layered(llm, PROMPTS, torch.float32)
    assert [tokens for tokens, _ in stacked] == [tokens for tokens, _ in layered]
    for (_, ours), (_, theirs) in zip(stacked, layered, strict=True):
        assert ours is not None and abs(ours - theirs) <= 1e-3


@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS, PROMPTS * 3],
                         ids=["one-token steps", "two-token steps", "six-token steps"])
def test_the_fp32_stack_gives_the_module_paths_tokens(prompts: list[str]) -> None:
    with LLM(decode_weights="float32", kv_cache_memory="64MiB", enable_prefix_caching=False) as llm:
        stacked, layered = _stacked_then_layered(llm, prompts, torch.float32)
    assert [tokens for tokens, _ in stacked] == [tokens for tokens, _ in layered]
    for (_, ours), (_, theirs) in zip(stacked, layered, strict=True):
        assert ours is not None and abs(ours - theirs) <= 1e-3


def test_a_bf16_model_s_own_rows_go_through_the_stack_with_the_module_paths_bits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`--dtype bfloat16 --decode-weights bfloat16`: the model's plain bf16 rows, read by the
    bf16 GEMV in the stack and on the module path alike, no rounding beyond bf16's. (On an AMX
    CPU the rows are not kept, so the test keeps them as a CPU without AMX does.)"""
    from tandem.worker import model_builder

    monkeypatch.setattr(model_builder, "bf16_rows_pay", lambda *args: True)
    with LLM(dtype="bfloat16", decode_weights="bfloat16", quantization="none", kv_cache_memory="64MiB",
             enable_prefix_caching=False) as llm:
        assert llm.engine.runner.model.model.layers[0].mlp.down_proj.small_dense.weight.dtype == torch.bfloat16
        small = _stacked_then_layered(llm, PROMPTS, torch.bfloat16)
        large = _stacked_then_layered(llm, PROMPTS * 3, torch.bfloat16)
    assert small[0] == small[1] and large[0] == large[1]


@pytest.mark.skipif(not CpuFeatures.detect().amx, reason="the packed weights run on AMX tiles only there")
def test_on_amx_a_bf16_model_s_small_steps_read_the_packed_weights() -> None:
    """`--decode-weights bfloat16` on an AMX CPU keeps no plain rows (the tiles read the packed
    blocks faster than the GEMV reads the rows): small and large steps take the packed GEMM,
    in the stack and on the module path alike."""
    with LLM(dtype="bfloat16", decode_weights="bfloat16", quantization="none", kv_cache_memory="64MiB",
             enable_prefix_caching=False) as llm:
        assert getattr(llm.engine.runner.model.model.layers[0].mlp.down_proj, "small_dense", None) is None
        small = _stacked_then_layered(llm, PROMPTS, torch.bfloat16)
    assert small[0] == small[1]


@pytest.mark.parametrize("kwargs", [
    {"dtype": "float32", "decode_weights": "int4"},  # the 4-bit stack runs bf16 rows
    {"dtype": "float32", "decode_weights": "bfloat16"},  # a rounded bf16 copy under fp32 rows
], ids=["fp32", "bf16 copy of fp32"])
def test_models_without_a_c_kernel_for_every_piece_keep_the_module_path(kwargs: dict) -> None:
    """Small steps of these keep the module path; larger ones go through the packed weights
    where the layers are packed for tandem's GEMM (fp32 here)."""
    with LLM(kv_cache_memory="64MiB", **kwargs) as llm:
        stack = llm.engine.runner.model.decode_stack
        assert (stack.max_tokens == 0) if _packed_for_tandems_gemm(llm) else (stack is None)
        calls = _count_calls(stack) if stack is not None else []
        tokens, _ = _generate(llm, PROMPTS[:1])[0]
    assert calls == [] and len(tokens) == 24


@pytest.mark.parametrize("kwargs", [
    {"dtype": "bfloat16", "quantization": "int8", "decode_weights": "int4"},  # the default mode with VNNI
    {"exact": True},
], ids=["default mode", "exact"])
def test_qwen2_s_qkv_biases_go_through_the_stack_as_the_module_path_adds_them(kwargs: dict) -> None:
    """Qwen2.5-Coder-0.5B (the agents' model): q/k/v carry biases, added after the 4/8-bit
    product on small steps (as torch's `out + bias`), by the GEMV on the exact mode's rows,
    and in the epilogue of the packed 8-bit or dense GEMM on larger steps, as the module path
    adds them: bf16's bits, fp32's tokens."""
    with LLM("qwen2.5-coder-0.5b", kv_cache_memory="256MiB", enable_prefix_caching=False, **kwargs) as llm:
        model = llm.engine.runner.model
        assert model.model.layers[0].self_attn.qkv_proj.bias is not None
        stack = model.decode_stack
        dtype = torch.float32 if kwargs.get("exact") else torch.bfloat16
        assert stack is not None and stack.max_tokens == 2 and stack.kernel.dtype == dtype
        small = _stacked_then_layered(llm, PROMPTS[:1], dtype)
        large = _stacked_then_layered(llm, PROMPTS * 2, dtype)
    for stacked, layered in (small, large):
        assert [tokens for tokens, _ in stacked] == [tokens for tokens, _ in layered]
        for (_, ours), (_, theirs) in zip(stacked, layered, strict=True):
            assert ours is not None and (ours == theirs if dtype == torch.bfloat16 else abs(ours - theirs) <= 1e-3)


# Prompts of several lengths, with chunks of at most 48 tokens a step: steps of one prompt's
# first chunk, of several prompts' chunks, of a later chunk over its cached first one, and of
# decode tokens beside another prompt's chunk.
MIXED_PROMPTS = ["The three primary colors are", "def fibonacci(n):\n    " * 12, "Once upon a time, " * 20,
                 "Q: what is 2 + 2?\nA:"]


def _prefills_stacked_then_layered(llm: LLM) -> tuple[list, list, list[tuple[int, int]]]:
    """MIXED_PROMPTS through the stack, prefill steps included, then through the module path;
    with the prefill steps the stack ran (tokens, chunks)."""
    model = llm.engine.runner.model
    stack = model.decode_stack
    assert isinstance(stack, DecodeStack)
    prefills: list[tuple[int, int]] = []
    _count_calls(stack, prefills)
    stacked = _generate(llm, MIXED_PROMPTS)
    model.decode_stack = None
    layered = _generate(llm, MIXED_PROMPTS)
    model.decode_stack = stack
    return stacked, layered, prefills


@pytest.mark.parametrize("kwargs", [
    {"dtype": "bfloat16", "quantization": "none", "decode_weights": "bfloat16"},
    {"dtype": "bfloat16", "quantization": "int8", "decode_weights": "int4"},  # the default mode with VNNI
    {"dtype": "bfloat16", "quantization": "w8a16", "decode_weights": "int4"},
    {"exact": True},
], ids=["bf16", "default mode", "w8a16", "exact"])
def test_prefill_chunks_go_through_the_stack_with_the_module_paths_bits(kwargs: dict) -> None:
    """Prompt chunks, alone, several to a step, after a cached chunk and beside decode tokens:
    the stack's prefill attention (decode rows, then each chunk over its context) gives the
    module path's tokens and log-probabilities, bit for bit in bf16 and the exact mode alike
    (both paths run the same C kernels in the same order)."""
    with LLM(kv_cache_memory="64MiB", enable_prefix_caching=False, max_num_batched_tokens=48, **kwargs) as llm:
        stack = llm.engine.runner.model.decode_stack
        # without records for larger steps (no AVX-512, or AMX) or a C prefill attention in the
        # dtype (bf16 on AMX), prompt chunks keep the module path
        takes = stack is not None and stack.kernel.prefills and _packed_for_tandems_gemm(llm)
        stacked, layered, prefills = _prefills_stacked_then_layered(llm) if stack is not None else ([], [], [])
    assert stacked == layered
    assert all(logprob is not None for _, logprob in stacked)
    if takes:
        assert len(prefills) >= 4 and max(chunks for _, chunks in prefills) >= 2
    else:
        assert prefills == []


def test_without_a_prefill_kernel_for_the_head_size_prefill_steps_keep_the_module_path(monkeypatch) -> None:
    """Where the C prefill attention does not tile the head size, the stack takes decode steps
    only: prompt chunks run layer by layer, and the outputs are the same."""
    from tandem.kernels.cpu_prefill import PrefillAttentionKernel

    monkeypatch.setattr(PrefillAttentionKernel, "takes_head_dim", staticmethod(lambda head_dim: False))
    with LLM(dtype="bfloat16", quantization="none", decode_weights="bfloat16", kv_cache_memory="64MiB",
             enable_prefix_caching=False, max_num_batched_tokens=48) as llm:
        stack = llm.engine.runner.model.decode_stack
        assert stack is not None and not stack.kernel.prefills
        prefills: list[tuple[int, int]] = []
        calls = _count_calls(stack, prefills)
        outputs = _generate(llm, MIXED_PROMPTS[:2])
    assert prefills == [] and calls and all(len(tokens) == 24 for tokens, _ in outputs)
