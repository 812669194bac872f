"""Multi-head latent attention through the paged latent cache against transformers.

Chunked prefill over a cached prefix (decompressed), then absorbed decode steps, alone and
batched, must give transformers' DeepseekV3Attention outputs on the same weights, with YaRN
scaling and interleaved rotary pairs (which tandem undoes by permuting weight rows at load).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds

from tandem.batch.prepared import ScheduledChunk, prepare_batch
from tandem.config import MLAConfig, ModelConfig, RopeConfig
from tandem.kernels.base import AttentionBackend, AttentionCapabilities, kv_cache_shape
from tandem.kernels.kv_format import stored_row_width
from tandem.kernels.torch_attention import TorchAttentionBackend
from tandem.layers.mla import MultiLatentAttention
from tandem.layers.rotary import RotaryEmbedding, inverse_frequencies, rotary_magnitude
from tandem.models.mla_weights import deinterleave_rope_rows

BLOCK = 4
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 32}


def _hf_config(q_lora_rank: int | None, rope: dict) -> transformers.DeepseekV3Config:
    return transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=48, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10, max_position_embeddings=128,
        rope_parameters=rope, rope_interleave=True, attn_implementation="eager",
    )


def _pair(q_lora_rank: int | None, rope: dict,
          backend: AttentionBackend | None = None) -> tuple[torch.nn.Module, torch.nn.Module, MultiLatentAttention]:
    torch.manual_seed(0)
    hf_config = _hf_config(q_lora_rank, rope)
    reference = hf_ds.DeepseekV3Attention(hf_config, layer_idx=0).eval()
    hf_rotary = hf_ds.DeepseekV3RotaryEmbedding(hf_config)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if "norm" in name else 0.2 * torch.randn_like(param))
    mla = MLAConfig(q_lora_rank, 16, 8, 6, 10, rope_interleave=True)
    rope_config = RopeConfig.from_hf({"rope_parameters": rope, "max_position_embeddings": 128})
    rotary = RotaryEmbedding(rope_config, mla.qk_rope_head_dim, 128, torch.float32)
    ours = MultiLatentAttention(mla, 48, 4, hf_config.rms_norm_eps, rope_config, rotary,
                                backend or TorchAttentionBackend())
    with torch.no_grad():
        for name, tensor in reference.state_dict().items():
            tensor = deinterleave_rope_rows(name, tensor, mla, num_heads=4)
            ours.get_parameter(name).copy_(tensor)
    return reference, hf_rotary, ours


def _hf_forward(reference: torch.nn.Module, hf_rotary: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    n = hidden.shape[0]
    positions = torch.arange(n).unsqueeze(0)
    cos, sin = hf_rotary(hidden.unsqueeze(0), positions)
    mask = torch.full((n, n), float("-inf")).triu(1).view(1, 1, n, n)
    with torch.no_grad():
        out, _ = reference(hidden.unsqueeze(0), (cos, sin), mask)
    return out[0]


def _run(ours: MultiLatentAttention, hiddens: list[torch.Tensor], steps: list[dict[int, tuple[int, int]]],
         cache_dtype: torch.dtype = torch.float32) -> list[dict]:
    """Feed each sequence's hidden states through the paged path in the planned chunks
    (`cache_dtype` uint8: --kv-cache-dtype int8's rows, the latent and its scale; float8
    e4m3: fp8's values)."""
    blocks_each = -(-max(h.shape[0] for h in hiddens) // BLOCK)
    block_ids = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(len(hiddens))]
    width = stored_row_width(ours.mla.latent_dim, cache_dtype)
    cache = torch.zeros(kv_cache_shape(blocks_each * len(hiddens), BLOCK, 1, width, num_planes=1), dtype=cache_dtype)
    outputs: list[dict[int, torch.Tensor]] = [{} for _ in hiddens]
    for plan in steps:
        chunks = [ScheduledChunk(f"s{i}", [0] * count, start, block_ids[i], True) for i, (start, count) in plan.items()]
        batch = prepare_batch(chunks, BLOCK)
        # the runner's order: decodes first, by context length, then the prefill chunks
        decodes = sorted((c for c in chunks if c.num_tokens == 1 and c.start > 0), key=lambda c: c.start)
        ordered = decodes + [c for c in chunks if c not in decodes]
        rows = [(int(c.request_id[1:]), c.start + k) for c in ordered for k in range(c.num_tokens)]
        hidden = torch.stack([hiddens[i][p] for i, p in rows])
        angles = ours.rotary.angles(batch.positions)
        with torch.inference_mode():
            out = ours(angles, hidden, cache, batch.meta)
        for row, (i, p) in enumerate(rows):
            outputs[i][p] = out[row]
    return outputs


@pytest.mark.parametrize("q_lora_rank", [12, None])
@pytest.mark.parametrize("rope", [YARN, {"rope_type": "default", "rope_theta": 10000.0}], ids=["yarn", "default"])
def test_paged_latent_attention_matches_transformers(q_lora_rank: int | None, rope: dict) -> None:
    reference, hf_rotary, ours = _pair(q_lora_rank, rope)
    generator = torch.Generator().manual_seed(1)
    hiddens = [torch.randn(n, 48, generator=generator) for n in (14, 9)]
    steps = [
        {0: (0, 6), 1: (0, 5)},  # prefill chunks with no cached context
        {0: (6, 5), 1: (5, 3)},  # chunks over a cached prefix (read back from the latent cache)
        {0: (11, 1), 1: (8, 1)},  # two absorbed decodes in one batch (the padded path)
        {0: (12, 1)},  # a single absorbed decode
        {0: (13, 1)},
    ]
    outputs = _run(ours, hiddens, steps)
    for index, hidden in enumerate(hiddens):
        expected = _hf_forward(reference, hf_rotary, hidden)
        got = torch.stack([outputs[index][p] for p in range(hidden.shape[0])])
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_absorbed_decode_equals_decompressed_attention() -> None:
    """The same positions computed as decodes (absorbed) and as one prefill chunk (decompressed)."""
    _, _, ours = _pair(12, YARN)
    hidden = torch.randn(10, 48, generator=torch.Generator().manual_seed(2))
    as_decodes = _run(ours, [hidden], [{0: (0, 6)}] + [{0: (p, 1)} for p in range(6, 10)])[0]
    as_chunk = _run(ours, [hidden], [{0: (0, 6)}, {0: (6, 4)}])[0]
    for position in range(6, 10):
        torch.testing.assert_close(as_decodes[position], as_chunk[position], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("cache_dtype", "tolerance"), [(torch.uint8, 0.05), (torch.float8_e4m3fn, 0.1)],
                         ids=["int8", "fp8"])
def test_a_quantized_latent_cache_reads_alike_in_both_paths_and_near_the_exact_one(
        cache_dtype: torch.dtype, tolerance: float) -> None:
    """--kv-cache-dtype int8 (each latent row and its scale) or fp8 (float8 e4m3 values, scale
    1.0) on a latent cache. The absorbed decodes and the decompressed chunk read the same
    rounded rows (and a first chunk with no cached context attends to them too), so they agree
    as on an exact cache; the outputs stay within the rounding of 8 bits (three mantissa bits
    for fp8) of the exact cache's."""
    _, _, ours = _pair(12, YARN)
    hidden = torch.randn(10, 48, generator=torch.Generator().manual_seed(2))
    as_decodes = _run(ours, [hidden], [{0: (0, 6)}] + [{0: (p, 1)} for p in range(6, 10)], cache_dtype)[0]
    as_chunk = _run(ours, [hidden], [{0: (0, 6)}, {0: (6, 4)}], cache_dtype)[0]
    in_one = _run(ours, [hidden], [{0: (0, 10)}], cache_dtype)[0]
    exact = _run(ours, [hidden], [{0: (0, 10)}])[0]
    for position in range(10):
        if position >= 6:
            torch.testing.assert_close(as_decodes[position], as_chunk[position], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(in_one[position], as_chunk[position], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(in_one[position], exact[position], rtol=tolerance, atol=tolerance)
    assert any(not torch.equal(in_one[p], exact[p]) for p in range(10))  # the rounded rows were read


class CountingBackend(TorchAttentionBackend):
    def __init__(self, latent_decode: bool) -> None:
        self.capabilities = AttentionCapabilities(latent_decode=latent_decode)
        self.decodes = 0

    def decode(self, query, kv_cache, meta, scale) -> torch.Tensor:
        self.decodes += 1
        return super().decode(query, kv_cache, meta, scale)


@pytest.mark.parametrize("latent_decode", [True, False])
def test_the_absorbed_decode_runs_on_the_given_backend_when_it_can(latent_decode: bool) -> None:
    backend = CountingBackend(latent_decode)
    _, _, ours = _pair(12, YARN, backend)
    hidden = torch.randn(8, 48, generator=torch.Generator().manual_seed(3))
    _run(ours, [hidden], [{0: (0, 6)}, {0: (6, 1)}, {0: (7, 1)}])
    assert backend.decodes == (2 if latent_decode else 0)


def test_yarn_frequencies_and_magnitude_match_transformers() -> None:
    hf_config = _hf_config(12, YARN)
    inv_freq, magnitude = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
    rope = RopeConfig.from_hf({"rope_parameters": YARN, "max_position_embeddings": 128})
    torch.testing.assert_close(inverse_frequencies(rope, 6), inv_freq)
    assert rotary_magnitude(rope) == pytest.approx(magnitude)


def test_a_latent_cache_is_one_plane_of_latent_dim() -> None:
    hf = {**_hf_config(12, YARN).to_dict(), "architectures": ["LlamaForCausalLM"]}
    dense = ModelConfig.from_hf(hf)
    assert dense.kv_spec.num_planes == 2  # only an MLA architecture reads the latent fields
    spec = dataclasses.replace(dense, mla=MLAConfig.from_hf(hf)).kv_spec
    assert (spec.num_planes, spec.num_heads, spec.head_dim) == (1, 1, 16 + 6)
    assert spec.values_per_token(61) == 61 * 22
