"""What only a GPU can show: the Triton kernels compiled (not interpreted) in bf16, CUDA graphs
against eager steps, and pinned staging into device memory. Skipped without a GPU; on one,
run with TRITON_INTERPRET=0 (the conftests default it to 1): `bash scripts/gpu_check.sh`."""

from __future__ import annotations

import json

import pytest
import torch

from tandem.kernels.gpu import interpreted

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or interpreted(),
                                reason="needs a GPU and TRITON_INTERPRET=0 (scripts/gpu_check.sh)")

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 512, "intermediate_size": 1536,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
    "vocab_size": 4096, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "eos_token_id": 2,
}


@pytest.mark.parametrize("splits", [1, 4])
def test_bf16_decode_attention_matches_the_torch_backend(splits: int) -> None:
    from tandem.kernels.base import AttentionMetadata, kv_cache_shape
    from tandem.kernels.gpu.decode_attention import paged_decode_attention
    from tandem.kernels.torch_attention import TorchAttentionBackend

    torch.manual_seed(0)
    block_size, contexts = 16, [1, 17, 200, 513]
    blocks = sum(-(-c // block_size) for c in contexts)
    cache = torch.randn(kv_cache_shape(blocks, block_size, 8, 128), dtype=torch.bfloat16, device="cuda")
    tables = torch.randperm(blocks, device="cuda")
    rows, start = [], 0
    width = max(-(-c // block_size) for c in contexts)
    table = torch.zeros(len(contexts), width, dtype=torch.long, device="cuda")
    for i, c in enumerate(contexts):
        n = -(-c // block_size)
        table[i, :n] = tables[start:start + n]
        start += n
        rows.append(i)
    lens = torch.tensor(contexts, device="cuda")
    query = torch.randn(len(contexts), 32, 128, dtype=torch.bfloat16, device="cuda")
    got = paged_decode_attention(query, cache, table, lens, max(contexts), 128 ** -0.5, splits)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), len(contexts), table.cpu(), lens.cpu(),
                             max(contexts), [], block_size)
    want = TorchAttentionBackend()._decode(query.float().cpu(), cache.float().cpu(), meta, 128 ** -0.5)
    torch.testing.assert_close(got.float().cpu(), want, atol=2e-2, rtol=2e-2)


def _tokens(model_dir: str, eager: bool, dtype: str, kv_cache_dtype: str = "auto",
            async_scheduling: str = "auto", gemv_layers: list[int] | None = None) -> list[list[int]]:
    from tandem.llm import LLM
    from tandem.types import SamplingParams

    llm = LLM(model_dir, load_format="dummy", dtype=dtype, device="cuda", enforce_eager=eager,
              max_model_len=512, kv_cache_memory="1GiB", max_cudagraph_batch=16, kv_cache_dtype=kv_cache_dtype,
              async_scheduling=async_scheduling)
    try:
        prompts = [[(13 * i + 7 * j) % 4000 + 10 for j in range(5 + 9 * i)] for i in range(11)]
        outs = llm.generate(prompts[:3], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        outs += llm.generate(prompts, [SamplingParams(max_tokens=4 + i, temperature=0, ignore_eos=True)
                                       for i in range(11)])
        # Host-side sampling beside device-side greedy rows: seeded draws, penalties, log-probs.
        outs += llm.generate(prompts[:4], [SamplingParams(max_tokens=9, temperature=0.8, seed=5, ignore_eos=True),
                                           SamplingParams(max_tokens=9, temperature=0, repetition_penalty=1.3),
                                           SamplingParams(max_tokens=9, temperature=0, logprobs=2),
                                           SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)])
        runner = llm.engine.core.executor.worker.runner
        assert (runner.decode_graphs is None) == eager
        if gemv_layers is not None:  # how many matrices took the one-row GEMV
            gemv_layers.append(sum(getattr(m, "gpu_gemv", None) is not None for m in runner.model.modules()))
        assert runner.run_ahead == (async_scheduling != "off")  # auto: on, on a GPU
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()


def test_cuda_graphs_give_the_eager_tokens(tmp_path) -> None:
    """fp32 (no tf32), so a padded batch's GEMMs give each row the eager values: 3 rows run as
    the size-4 graph, 11 as 16, shrinking as requests finish."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    assert _tokens(str(tmp_path), False, "float32") == _tokens(str(tmp_path), True, "float32")


def test_asynchronous_scheduling_gives_the_tokens_of_one_step_at_a_time(tmp_path) -> None:
    """Steps launched before the last one's tokens reach the host (the default on a GPU): the
    decode inputs gathered from the last step's samples on the device, the tokens copied back
    through pinned memory and an event, with CUDA graphs and eagerly, the same tokens as steps
    run one at a time."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    one_at_a_time = _tokens(str(tmp_path), False, "float32", async_scheduling="off")
    assert _tokens(str(tmp_path), False, "float32") == one_at_a_time
    assert _tokens(str(tmp_path), True, "float32") == one_at_a_time


def test_the_fp8_write_compiled_stores_torchs_bytes() -> None:
    """The fp8 write kernel compiled for the device (CI runs it interpreted): bf16 keys and
    values times their multipliers, rounded in integer arithmetic, are the bytes of torch's
    clamp and cast on the GPU, every e4m3 code and the ties between them included."""
    from tandem.kernels.base import kv_cache_shape
    from tandem.kernels.gpu.cache_write import write_kv_fp8
    from tandem.kernels.kv_format import to_fp8

    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = codes[torch.isfinite(codes)].unique()
    values = torch.cat([finite, (finite[1:] + finite[:-1]) / 2, torch.randn(4096) * 300, torch.tensor([1e5, -1e5])])
    heads, dim = 8, 128
    tokens = -(-values.numel() // (heads * dim))
    flat = torch.zeros(tokens * heads * dim)
    flat[: values.numel()] = values
    key = flat.view(tokens, heads, dim).to(torch.bfloat16).cuda()
    value = (key.float() * 3).to(torch.bfloat16)
    cache = torch.zeros(kv_cache_shape(tokens, 16, heads, dim), dtype=torch.float8_e4m3fn, device="cuda")
    slots = torch.arange(tokens, device="cuda") * 16 + 5
    write_kv_fp8(key, value, cache, slots, 0.5, 0.125)
    stored = cache.view(torch.uint8)[:, :, :, 5]  # [2, heads, tokens, dim]
    assert torch.equal(stored[0].transpose(0, 1), to_fp8(key.float() * 0.5).view(torch.uint8))
    assert torch.equal(stored[1].transpose(0, 1), to_fp8(value.float() * 0.125).view(torch.uint8))


def test_cuda_graphs_over_an_int8_cache_give_the_eager_tokens(tmp_path) -> None:
    """--kv-cache-dtype int8 in the graphs: each step's rows rounded (the Hadamard rotation, the
    scale, the levels) and the kernels' widening captured, the same tokens as eager steps."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    assert _tokens(str(tmp_path), False, "float32", "int8") == _tokens(str(tmp_path), True, "float32", "int8")


@pytest.mark.parametrize("kv", ["auto", "fp8", "int8"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (32, 8, 128)])
def test_a_mixed_step_compiled_in_bf16_matches_the_torch_backend(kv: str, heads: int, kv_heads: int,
                                                                 dim: int) -> None:
    """The interpreted tests' mixed step (two decodes, a fresh prompt, a chunk after a cached
    prefix ending mid-block, a one-token chunk) with the kernels compiled, in bf16, each KV
    cache dtype, against the torch backend in fp32 on the CPU, the stored bytes the reference's
    (int8: to a level on a rounding boundary)."""
    from tests.support.attention_cases import assert_stored_as_the_reference, mixed_step

    step = mixed_step(torch.bfloat16, kv, heads, kv_heads, dim, 16, device="cuda")
    assert_stored_as_the_reference(step, kv, dim)
    torch.testing.assert_close(step.got.float().cpu(), step.want, atol=2e-2, rtol=2e-2)


def test_staged_copies_equal_a_plain_copy() -> None:
    from tandem.loader.device_copy import StagedDeviceCopies

    source = torch.randn(300 << 18)  # 300 MiB of fp32
    plain = torch.empty(source.shape, dtype=torch.bfloat16, device="cuda")
    plain.copy_(source)
    staged = torch.empty_like(plain)
    with StagedDeviceCopies(torch.device("cuda"), chunk_bytes=16 << 20) as mode:
        staged.copy_(source)
    assert mode.chunks > 4 and torch.equal(staged, plain)


def test_fp8_kv_cache_on_the_gpu(tmp_path) -> None:
    """--kv-cache-dtype fp8 in bf16 on a GPU: twice the blocks of a bf16 cache, CUDA graphs
    over it, and the same first tokens as the bf16 cache on random weights."""
    from tandem.llm import LLM
    from tandem.types import SamplingParams

    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    runs = {}
    for kv in ("auto", "fp8"):
        llm = LLM(str(tmp_path), load_format="dummy", dtype="bfloat16", device="cuda", kv_cache_dtype=kv,
                  max_model_len=512, kv_cache_memory="256MiB", max_cudagraph_batch=8)
        try:
            out = llm.generate([[11, 12, 13, 14]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
            runs[kv] = (llm.engine.core.num_blocks, out[0].outputs[0].token_ids)
        finally:
            llm.shutdown()
    assert 2 * runs["auto"][0] <= runs["fp8"][0] < 2 * (runs["auto"][0] + 1)
    assert runs["fp8"][1][:1] == runs["auto"][1][:1]


def test_int8_kv_cache_on_the_gpu(tmp_path) -> None:
    """--kv-cache-dtype int8 in bf16 on a GPU: rows of 64 int8 values and a 4-byte scale
    against bf16's 128 bytes, so the blocks a 256 MiB budget holds grow by 128 / 68; CUDA
    graphs over it, and the same first token as the bf16 cache on random weights."""
    from tandem.llm import LLM
    from tandem.types import SamplingParams

    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    runs = {}
    for kv in ("auto", "int8"):
        llm = LLM(str(tmp_path), load_format="dummy", dtype="bfloat16", device="cuda", kv_cache_dtype=kv,
                  max_model_len=512, kv_cache_memory="256MiB", max_cudagraph_batch=8)
        try:
            out = llm.generate([[11, 12, 13, 14]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
            runs[kv] = (llm.engine.core.num_blocks, out[0].outputs[0].token_ids)
        finally:
            llm.shutdown()
    (bf16_blocks, bf16_tokens), (int8_blocks, int8_tokens) = runs["auto"], runs["int8"]
    assert int8_blocks * 68 < (bf16_blocks + 1) * 128 and (int8_blocks + 1) * 68 > bf16_blocks * 128
    assert int8_tokens[:1] == bf16_tokens[:1]


def test_bf16_rotary_and_silu_mul_compiled() -> None:
    """The small-op kernels compiled, in bf16 (which the interpreter cannot check): the rotary
    embedding bit for bit torch's formula (FP fusion off: with it, an FMA skipped a rounding
    here), silu-and-mul within one bf16 unit in the last place (its exp may differ)."""
    from tandem.config import RopeConfig
    from tandem.kernels.gpu.rotary import TritonRotary
    from tandem.kernels.gpu.silu_mul import TritonSiluMul
    from tandem.layers.rotary import RotaryEmbedding

    torch.manual_seed(0)
    rotary = RotaryEmbedding(RopeConfig(theta=500000.0), 128, 4096, torch.bfloat16).cuda()
    projection = torch.randn(37, 48 * 128, dtype=torch.bfloat16, device="cuda")
    qk = projection[:, : 40 * 128].view(37, 40, 128)
    angles = rotary.angles(torch.randint(0, 4096, (37,), device="cuda"))
    want = rotary(angles, qk.clone())
    TritonRotary.rotary_(qk, *angles)
    assert torch.equal(qk, want)
    gate_up = torch.randn(37, 2 * 14336, dtype=torch.bfloat16, device="cuda") * 4
    gate, up = gate_up.split(14336, dim=-1)
    torch.testing.assert_close(TritonSiluMul.silu_mul(gate_up), torch.nn.functional.silu(gate) * up,
                               atol=1e-2, rtol=8e-3)


@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (4096, 14336), (1536 * 2, 512)])
def test_the_gemv_compiled_in_bf16_matches_cublas(n: int, k: int) -> None:
    """Every candidate block shape, each form the model calls, against cuBLAS's bf16 (both sum
    in fp32 and round once; the orders differ)."""
    from tandem.kernels.gpu.gemv import CANDIDATES, gemv
    from tandem.kernels.gpu.silu_mul import silu_mul

    torch.manual_seed(n + k)
    weight = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    row, pair = torch.randn(1, k, device="cuda").bfloat16(), torch.randn(1, 2 * k, device="cuda").bfloat16()
    residual = torch.randn(1, n, device="cuda").bfloat16()
    for config in CANDIDATES:
        for got, want in [
            (gemv(row, weight, config), row @ weight.t()),
            (gemv(row, weight, config, residual=residual), torch.addmm(residual, row, weight.t())),
            (gemv(pair, weight, config, residual=residual, silu_mul=True),
             torch.addmm(residual, silu_mul(pair), weight.t())),
        ]:
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("pdl", [False, True])
def test_the_engine_with_a_gemv_table_gives_the_eager_tokens(tmp_path, monkeypatch, pdl: bool) -> None:
    """A table for every matrix of the tiny model (fp32): one-row steps through the GEMV with
    CUDA graphs and asynchronous scheduling, the kernels launched as programmatic dependents or
    not, give the tokens of eager steps through the same GEMV launched plainly (the same sums;
    a launch that read its row before the kernel writing it finished would not)."""
    import tandem.kernels.gpu.gemv as gemv_module
    from tandem.kernels.gpu.gemv import GemvConfig, shape_key, table_entry, write_table

    hidden, heads, kv, dim = 512, 8, 2, 64
    shapes = [((heads + 2 * kv) * dim, hidden), (hidden, heads * dim), (2 * 1536, hidden), (hidden, 1536),
              (4096, hidden)]
    tables = tmp_path / "tables"
    tables.mkdir()

    def table(config: GemvConfig) -> None:
        write_table(gemv_module.table_path(torch.cuda.get_device_name(), tables), torch.cuda.get_device_name(),
                    torch.float32, {shape_key(n, k): table_entry(config, 1.0, 2.0) for n, k in shapes})

    monkeypatch.setattr(gemv_module, "TABLES", tables)
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    table(GemvConfig(8, 512))
    taken: list[int] = []
    eager = _tokens(str(tmp_path), True, "float32", gemv_layers=taken)
    table(GemvConfig(8, 512, pdl=pdl))
    assert _tokens(str(tmp_path), False, "float32", gemv_layers=taken) == eager
    assert taken == [4 * 4 + 1] * 2  # every layer's four matrices and the head
