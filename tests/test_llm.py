"""End to end on the default model (SmolLM2-135M, fp32): correctness against transformers,
prefix caching, preemption, sampling options and bad input, through `LLM`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.kernels.q4_gemm import Q8Matrix
from tandem.layers.linear import onednn_bf16_available
from tandem.loader.resolve import _smollm2_gguf
from tandem.worker.model_builder import model_bytes

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three primary colors:",
    "In 1969, the first man to walk on the moon",
    "import numpy as np\nimport",
    "The weather today is",
    "Q: What is 7 times 8?\nA:",
    "Photosynthesis is the process by which",
    "SELECT name, age FROM users WHERE",
    "The quick brown fox",
    "Dear Sir or Madam, I am writing to",
    "<html>\n<head>\n<title>",
    "1, 2, 3, 5, 8, 13,",
    "Les chats sont",
    "To be or not to be,",
    "Water boils at",
    "The three laws of robotics are",
]
NEAR_TIE = 1e-4


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_memory="256MiB", max_num_batched_tokens=512)


@pytest.fixture(autouse=True)
def no_leaked_blocks(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "llm" in request.fixturenames:
        engine = request.getfixturevalue("llm").engine
        assert not engine.has_unfinished()
        assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


@pytest.fixture(scope="module")
def reference() -> torch.nn.Module:
    """transformers' own GGUF loader: independent of our dequantization and name mapping."""
    from transformers import AutoModelForCausalLM

    gguf = _smollm2_gguf()
    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()


def _assert_matches_reference(outputs: list, reference: torch.nn.Module) -> int:
    """Each generated token equals transformers' teacher-forced argmax or is an exact near-tie."""
    near_ties = 0
    for output in outputs:
        generated = output.outputs[0].token_ids
        history = output.prompt_token_ids + generated
        with torch.no_grad():
            logits = reference(torch.tensor([history])).logits[0]
        start = len(output.prompt_token_ids) - 1
        for offset, token in enumerate(generated):
            row = logits[start + offset]
            best = int(row.argmax())
            if best == token:
                continue
            gap = float(row[best] - row[token])
            assert gap <= NEAR_TIE * abs(float(row[best])), (
                f"{output.prompt!r}: token {offset} is {token}, transformers picks {best} by {gap:.3g}"
            )
            near_ties += 1
    return near_ties


def test_greedy_matches_transformers(llm: LLM, reference: torch.nn.Module) -> None:
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 64 for o in outputs)
    near_ties = _assert_matches_reference(outputs, reference)
    assert near_ties <= 2, f"{near_ties} near-ties is more than rounding explains"


def test_single_stream_matches_transformers(llm: LLM, reference: torch.nn.Module) -> None:
    """One sequence at a time: every step is a GEMV through the packed weights (tandem's
    packed GEMM's on AVX-512 without AMX, else oneDNN's)."""
    assert llm.engine.runner.model.lm_head.packed
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    outputs = [llm.generate([prompt], params)[0] for prompt in PROMPTS[:3]]
    assert _assert_matches_reference(outputs, reference) <= 1


def test_prefix_cache_hit_gives_cold_tokens(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    system = "You are a careful assistant. Answer briefly and cite the rule you used. " * 8
    block = llm.engine.core.block_size  # 64 tokens, a CPU's default
    first = llm.generate([system + "What is a prime number?"], params)[0]
    assert first.num_cached_tokens == 0
    again = llm.generate([system + "What is a prime number?"], params)[0]
    assert again.num_cached_tokens >= block * (len(again.prompt_token_ids) // block - 1)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    other = llm.generate([system + "What is an even number?"], params)[0]
    assert other.num_cached_tokens > 0
    llm.engine.block_pool.reset_prefix_cache()
    cold = llm.generate([system + "What is an even number?"], params)[0]
    assert cold.num_cached_tokens == 0
    assert cold.outputs[0].token_ids == other.outputs[0].token_ids


def test_load_counts_a_waiting_prompt_net_of_its_cached_prefix(llm: LLM) -> None:
    """A router balances prefill work by this figure: a queued agent turn whose history is
    cached must count only its new tokens."""
    engine = llm.engine
    history = "Tool output: the build passed, 41 tests ran, none failed. " * 12
    first = llm.generate([history], SamplingParams(max_tokens=1))[0]
    ids = first.prompt_token_ids + engine.tokenize(" Now run the linter and report back.")
    block = engine.core.block_size
    cached = len(first.prompt_token_ids) // block * block
    assert cached > 0
    request_id = engine.add_request(None, None, SamplingParams(max_tokens=1), prompt_token_ids=ids)
    try:
        assert engine.load().waiting_prefill_tokens == len(ids) - cached
    finally:
        engine.abort(request_id)


def test_preemption_gives_same_tokens() -> None:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = PROMPTS[:8]
    roomy = LLM(kv_cache_memory="64MiB").generate(prompts, params)
    # 24 blocks of 16 tokens cannot hold 8 sequences of ~50 tokens at once
    block_bytes = 2 * 30 * 3 * 64 * 4 * 16
    tight_llm = LLM(kv_cache_memory=24 * block_bytes, enable_prefix_caching=False, block_size=16)
    tight = tight_llm.generate(prompts, params)
    assert tight_llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]
    pool = tight_llm.engine.block_pool
    assert pool.num_free_blocks == pool.num_blocks


def test_chat_uses_template(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=8)
    output = llm.chat([{"role": "user", "content": "Say hello."}], params)[0]
    assert output.prompt.endswith("<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n")
    same = llm.generate([{"prompt_token_ids": output.prompt_token_ids}], params)[0].outputs[0]
    assert output.outputs[0].text == same.text and output.outputs[0].token_ids == same.token_ids
    assert output.outputs[0].text.strip() and len(output.outputs[0].token_ids) <= 8


def test_stop_string_is_not_emitted(llm: LLM) -> None:
    free = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=20))[0].outputs[0].text
    assert " 6" in free
    stopped = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=20, stop=[" 6"]))[0].outputs[0]
    assert stopped.text == free[: free.index(" 6")]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == " 6"


def test_stop_token_and_length(llm: LLM) -> None:
    free = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 6
    stop_at = free.token_ids[2]
    stopped = llm.generate(["The quick brown fox"],
                           SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop_at]))[0].outputs[0]
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(stop_at) + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_at


def test_min_tokens_holds_off_eos_on_the_greedy_path(llm: LLM) -> None:
    """Greedy steps take a plain argmax unless something must be banned: min_tokens must."""
    messages = [{"role": "user", "content": "What is 2+2? Answer with one number."}]
    short = llm.chat(messages, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 30  # it stops on EOS by itself
    forced = llm.chat(messages, SamplingParams(temperature=0, max_tokens=40, min_tokens=30))[0].outputs[0]
    assert len(forced.token_ids) >= 30
    assert not set(forced.token_ids[:30]) & set(llm.engine.eos_token_ids)
    assert forced.token_ids[: len(short.token_ids) - 1] == short.token_ids[:-1]  # the same text until the EOS


def test_seeded_sampling_is_reproducible_and_n_samples(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, n=3)
    first = llm.generate(["Tell me a story about"], params)[0]
    # the same seed in a different batch gives the same samples
    second = llm.generate(["Tell me a story about", "An unrelated prompt"], [params, SamplingParams(max_tokens=4)])[0]
    assert len(first.outputs) == 3
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in second.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1


def test_logprobs(llm: LLM) -> None:
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == 4
    for token, entries in zip(completion.token_ids, completion.logprobs, strict=True):
        assert entries[0].token_id == token and entries[0].rank == 1  # greedy picks rank 1
        assert len(entries) == 4
        assert entries[1].logprob >= entries[2].logprob >= entries[3].logprob
    assert completion.cumulative_logprob == pytest.approx(sum(e[0].logprob for e in completion.logprobs))


def test_multibyte_text_round_trips(llm: LLM) -> None:
    text = "Café 東京 — naïve 🙂"
    ids = llm.tokenizer.encode(text)
    out = llm.generate([[1]], SamplingParams(temperature=0, max_tokens=1))[0]  # warm path
    assert len(out.outputs[0].token_ids) == 1
    from tandem.engine.detokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(llm.tokenizer, [])
    pieces = "".join(detok.add(t) for t in ids) + detok.flush()
    assert pieces == text
    assert "\ufffd" not in pieces


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_bad_sampling_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_prompts_leave_engine_serving(llm: LLM) -> None:
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="context"):
        llm.generate([[1] * (llm.engine.max_model_len + 5)], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[10**9]], SamplingParams(max_tokens=2))
    # one bad prompt in a batch rejects the call before anything is queued
    with pytest.raises(ValueError):
        llm.generate(["fine prompt", ""], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()
    assert len(llm.generate(["Still serving?"], SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids) == 3


def test_unknown_model_is_clear() -> None:
    with pytest.raises(FileNotFoundError, match="not found"):
        LLM("/nonexistent/model/dir")


def test_abort_frees_blocks(llm: LLM) -> None:
    engine = llm.engine
    request_id = engine.add_request(None, "A long story begins", SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    assert engine.block_pool.num_free_blocks < engine.block_pool.num_blocks
    engine.abort(request_id)
    engine.step()
    assert not engine.has_unfinished()


def test_int4_decode_weights_copy_only_what_4_bits_hold() -> None:
    """--decode-weights int4 on the default model (a Q4_1 GGUF): every layer's matrices get a
    4-bit copy, the 8-bit LM head an 8-bit one (4 bits would spoil it), and greedy output
    stays close to exact."""
    params = SamplingParams(temperature=0, max_tokens=12)
    with LLM(kv_cache_memory="64MiB") as llm:
        exact = llm.generate(["The capital of France is"], params)[0].outputs[0].token_ids
    with LLM(kv_cache_memory="64MiB", decode_weights="int4") as llm:
        model = llm.engine.core.executor.worker.runner.model
        fast = llm.generate(["The capital of France is"], params)[0].outputs[0].token_ids
    layers = model.model.layers
    assert all(layer.mlp.gate_up_proj.small_quantized is not None for layer in layers)
    assert all(layer.self_attn.qkv_proj.small_quantized is not None for layer in layers)
    assert isinstance(model.lm_head.small_quantized, Q8Matrix) and model.lm_head.small_packed is None
    assert not isinstance(layers[0].mlp.down_proj.small_quantized, Q8Matrix)
    assert fast[:4] == exact[:4]


def test_float32_decode_weights_match_transformers(reference: torch.nn.Module) -> None:
    """--decode-weights float32: one-token steps go through tandem's fp32 GEMV on the plain
    rows (kept beside the packed ones), read from their lossless codes (the default model is
    a Q4_1 GGUF's weights), the layers in the fp32 decode stack, exact fp32 like the packed
    path."""
    with LLM(kv_cache_memory="64MiB", decode_weights="float32") as llm:
        model = llm.engine.core.executor.worker.runner.model
        layers = model.model.layers
        assert all(layer.mlp.down_proj.small_dense is not None and layer.mlp.down_proj.packed for layer in layers)
        assert all(layer.self_attn.qkv_proj.small_dense.codes is not None for layer in layers)
        # the tied head reads the embedding's own tensor: nothing held twice
        assert model.lm_head.small_dense.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        assert model.decode_stack is not None
        # the memory report counts the rows held beside the packed weights, the tied head's once
        held = [m for m in model.modules() if getattr(m, "small_dense", None) is not None]
        with_rows = model_bytes(model)
        kept = {m: m.small_dense for m in held}
        for m in held:
            m.small_dense = None
        # the layers' plain rows were let go where their codes stand for them; the tied head's
        # are the embedding's
        assert all(d.weight.device.type == "meta" for m, d in kept.items() if not getattr(m, "tied", False))
        assert with_rows - model_bytes(model) == sum(d.codes.numel() for d in kept.values())
        for m, rows in kept.items():
            m.small_dense = rows
        bounded = model.lm_head.bounded_greedy
        # the bench's own limits: a one-token step reads 1.25 bytes a layer weight (an int8
        # code, an fp16-exact scale and an offset a 32 weights, each fp32) and the head's bf16
        # copy (2 bytes a weight; without it the head's codes); a larger step every packed
        # fp32 weight
        reads = llm.engine.core.worker_info.step_reads
        weights = sum(layer.small_dense.weight.numel() for layer in held if layer is not model.lm_head)
        head = model.lm_head.small_dense.weight.numel()
        assert reads.bytes_for(1) == weights * 5 // 4 + (head * 2 if bounded is not None else head * 5 // 4)
        assert reads.bytes_for(3) == weights * 4 + (head * 2 if bounded is not None else head * 4)
        assert reads.gemm == "float32"
        calls = 0
        # The bf16 copy of the head needs oneDNN's bf16 GEMM: none on an AVX2-only CPU, where
        # greedy rows take the fp32 logits.
        assert (bounded is not None) == onednn_bf16_available()
        if bounded is not None:
            tokens = bounded.tokens

            def counted(*args, **kwargs):
                nonlocal calls
                calls += 1
                return tokens(*args, **kwargs)

            bounded.tokens = counted
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        outputs = [llm.generate([prompt], params)[0] for prompt in PROMPTS[3:6]]
    if bounded is not None:
        # greedy rows skip the fp32 logits: the head's bf16 copy, then its candidates' fp32
        # logits, at each step (the prompt's last row and 31 decode steps)
        assert calls == 3 * 32 and bounded.rows_seen == 3 * 32
        assert bounded.candidates_seen < 200 * bounded.rows_seen  # 7-8 a row on random hidden states
    assert _assert_matches_reference(outputs, reference) <= 1


def test_float32_decode_weights_need_an_fp32_model() -> None:
    with pytest.raises(ValueError, match="decode-weights float32"):
        LLM(kv_cache_memory="64MiB", dtype="bfloat16", decode_weights="float32")
