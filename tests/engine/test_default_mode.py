"""The CPU's default mode through the engine, with TANDEM_DEFAULT_MODE unset (the suite sets it
to exact): `LLM()` settles what `choose_cpu_mode` picks for this CPU and the default model (a
GGUF checkpoint), says so on its start-up line, and its greedy continuations, one prompt at a
time as an agent's turns run, agree with exact fp32's at least as often as docs/engine.md
says for that mode. `--exact` is the exact path whatever the CPU."""

from __future__ import annotations

import logging

import pytest

from tandem.bench.perplexity import long_text
from tandem.llm import LLM
from tandem.platform.cpu_modes import DEFAULT_MODE_ENV, CpuFeatures, choose_cpu_mode
from tandem.types import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS, PROMPT_TOKENS, TOKENS = 8, 192, 32
# (dtype, quantization, decode weights) -> the fewest of the 8 continuations identical to exact
# fp32's, and the lowest mean position of the first differing token (32 where none differs),
# as measured on the 2-core Xeon with AMX (docs/performance.md "The default mode"), less one
# continuation and about 4 tokens of slack. The modes other CPUs default to ran there by flag.
AGREEMENT_FLOOR = {
    ("bfloat16", "none", "int4"): (2, 14.0),  # measured 3/8, 18.1 (5/8, 28.1 before the AMX GEMM)
    ("bfloat16", "int8", "int4"): (0, 13.0),  # 1/8, 17.1
    ("float32", "int8", "int4"): (2, 15.0),  # 3/8, 19.8
    ("float32", "none", "int4"): (7, 28.0),  # 8/8, 32
    ("float32", "none", "none"): (8, 32.0),  # exact
}


def _continuations(llm: LLM) -> list[list[int]]:
    tokens = llm.tokenizer.encode(long_text())
    stride = (len(tokens) - PROMPT_TOKENS) // PROMPTS
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    return [list(llm.generate([{"prompt_token_ids": tokens[i * stride : i * stride + PROMPT_TOKENS]}], params,
                              use_tqdm=False)[0].outputs[0].token_ids) for i in range(PROMPTS)]


def test_the_default_mode_is_this_cpus_and_agrees_with_exact_fp32(monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    features = CpuFeatures.detect()
    with LLM(exact=True) as exact:
        rows = "float32" if features.avx2_fma or features.avx512 else "none"  # the GEMV kernel's plain rows
        assert (exact.engine.config.load.dtype, exact.engine.config.load.decode_weights) == ("float32", rows)
        want = _continuations(exact)
    with LLM(exact=True, decode_weights="none") as one_copy:  # oneDNN's packed weights at every step
        assert _continuations(one_copy) == want
    monkeypatch.delenv(DEFAULT_MODE_ENV, raising=False)
    mode = choose_cpu_mode(features, quantized_checkpoint=True)
    with caplog.at_level(logging.INFO, logger="tandem"), LLM() as fast:
        load = fast.engine.config.load
        got = _continuations(fast)
    settled = (load.dtype, load.quantization, load.decode_weights)
    assert settled == (mode.dtype, mode.quantization, mode.decode_weights)
    assert f"mode: {mode.note}" in caplog.text
    if load.quantization == "int8":  # VNNI without AMX: tandem's packed GEMM, not torch._int_mm
        assert ("tandem's packed int8 GEMM" in caplog.text) == features.int8_fastest
    if features.avx512:  # what int8 does not hold: tandem's fp32/bf16 GEMM (bf16 on AMX's tiles)
        assert "linear weights packed for tandem's packed GEMM" in caplog.text
    same = sum(a == b for a, b in zip(want, got, strict=True))
    first_miss = sum(next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), TOKENS)
                     for a, b in zip(want, got, strict=True)) / PROMPTS
    least_same, least_first = AGREEMENT_FLOOR[settled]
    assert same >= least_same and first_miss >= least_first, (settled, same, first_miss)
