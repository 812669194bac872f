"""The EAGLE-3 head on random weights: paged tandem path vs a dense pure-torch reference.

The reference below is written from the EAGLE-3 formulas alone (dense causal attention over
the whole sequence, recomputed each step), and the head runs over tandem's paged cache the way
a proposer would: a chunked prefill fed the target's aux hidden states, then single-token steps
that feed the head's own output back. Every row's output and logits must agree.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from tandem.batch.prepared import ScheduledChunk, prepare_batch
from tandem.kernels.base import kv_cache_shape
from tandem.kernels.torch_attention import TorchAttentionBackend
from tandem.spec.eagle3 import Eagle3Config, Eagle3Head

BLOCK = 4
VOCAB, DRAFT_VOCAB, HIDDEN, TARGET_HIDDEN = 96, 40, 64, 48
HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 4, 2, 16, 96
THETA, EPS = 10000.0, 1e-5


def hf_config(**overrides: object) -> dict:
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "num_hidden_layers": 1, "rms_norm_eps": EPS, "rope_theta": THETA,
        "max_position_embeddings": 256, "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB,
        "target_hidden_size": TARGET_HIDDEN, "tie_word_embeddings": False,
    }
    config.update(overrides)
    return config


def random_weights(seed: int = 0, with_embedding: bool = False) -> dict[str, torch.Tensor]:
    """HF EAGLE-3 names -> random tensors; d2t maps the draft ids to scattered target ids."""
    g = torch.Generator().manual_seed(seed)

    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) * 0.15

    def norm(size: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(size, generator=g)

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    weights = {
        "fc.weight": mat(HIDDEN, 3 * TARGET_HIDDEN),
        "midlayer.input_layernorm.weight": norm(HIDDEN),
        "midlayer.hidden_norm.weight": norm(HIDDEN),
        "midlayer.self_attn.q_proj.weight": mat(q, 2 * HIDDEN),
        "midlayer.self_attn.k_proj.weight": mat(kv, 2 * HIDDEN),
        "midlayer.self_attn.v_proj.weight": mat(kv, 2 * HIDDEN),
        "midlayer.self_attn.o_proj.weight": mat(HIDDEN, q),
        "midlayer.post_attention_layernorm.weight": norm(HIDDEN),
        "midlayer.mlp.gate_proj.weight": mat(INTERMEDIATE, HIDDEN),
        "midlayer.mlp.up_proj.weight": mat(INTERMEDIATE, HIDDEN),
        "midlayer.mlp.down_proj.weight": mat(HIDDEN, INTERMEDIATE),
        "norm.weight": norm(HIDDEN),
        "lm_head.weight": mat(DRAFT_VOCAB, HIDDEN) * 4,
    }
    targets = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values
    weights["d2t"] = targets - torch.arange(DRAFT_VOCAB)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[targets] = True
    weights["t2d"] = t2d
    if with_embedding:
        weights["embed_tokens.weight"] = mat(VOCAB, HIDDEN) * 5
    return weights


def save_head(directory: Path, weights: dict[str, torch.Tensor], **config: object) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config(**config)))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / "model.safetensors"))
    return directory


# ---- the dense reference -------------------------------------------------------------------------

def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS))


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [T, heads, dim] rotated by position (pairs (d, d + dim/2))."""
    half = x.shape[-1] // 2
    freq = THETA ** (-torch.arange(half, dtype=torch.float32) * 2 / x.shape[-1])
    angle = positions.float()[:, None, None] * freq
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()), dim=-1)


def reference_layer(w: dict[str, torch.Tensor], embeds: torch.Tensor, hidden: torch.Tensor,
                    norm_before_residual: bool = False) -> torch.Tensor:
    """The midlayer over one whole sequence (positions 0..T-1), dense causal attention."""
    T = embeds.shape[0]
    h = rms(hidden, w["midlayer.hidden_norm.weight"])
    x = torch.cat((rms(embeds, w["midlayer.input_layernorm.weight"]), h), dim=-1)
    positions = torch.arange(T)
    q = rope((x @ w["midlayer.self_attn.q_proj.weight"].T).view(T, HEADS, HEAD_DIM), positions)
    k = rope((x @ w["midlayer.self_attn.k_proj.weight"].T).view(T, KV_HEADS, HEAD_DIM), positions)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(T, KV_HEADS, HEAD_DIM)
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEAD_DIM)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, HEADS * HEAD_DIM)
    after_attn = (h if norm_before_residual else hidden) + attn @ w["midlayer.self_attn.o_proj.weight"].T
    y = rms(after_attn, w["midlayer.post_attention_layernorm.weight"])
    mlp = (F.silu(y @ w["midlayer.mlp.gate_proj.weight"].T) * (y @ w["midlayer.mlp.up_proj.weight"].T))
    return after_attn + mlp @ w["midlayer.mlp.down_proj.weight"].T


def reference_logits(w: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    draft = rms(out, w["norm.weight"]) @ w["lm_head.weight"].T
    full = torch.full((out.shape[0], VOCAB), float("-inf"))
    for draft_id in range(DRAFT_VOCAB):
        full[:, draft_id + int(w["d2t"][draft_id])] = draft[:, draft_id]
    return full


class ReferenceSequence:
    """One sequence's inputs so far; every call recomputes the whole sequence densely."""

    def __init__(self, w: dict[str, torch.Tensor], embedding: torch.Tensor, norm_before_residual: bool) -> None:
        self.w, self.embedding, self.nbr = w, embedding, norm_before_residual
        self.ids: list[int] = []
        self.hidden: list[torch.Tensor] = []  # per row, already hidden-wide

    def feed(self, ids: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append rows; returns (outputs, logits) of the appended rows."""
        if hidden.shape[-1] == 3 * TARGET_HIDDEN:
            hidden = hidden @ self.w["fc.weight"].T
        self.ids += ids
        self.hidden += list(hidden)
        out = reference_layer(self.w, self.embedding[torch.tensor(self.ids)], torch.stack(self.hidden), self.nbr)
        new = out[-len(ids):]
        return new, reference_logits(self.w, new)


# ---- the paged run ------------------------------------------------------------------------------

class PagedRun:
    """Sequences through Eagle3Head over one paged cache: chunks scheduled like the runner's."""

    def __init__(self, head: Eagle3Head, lengths: list[int]) -> None:
        self.head = head
        blocks_each = -(-max(lengths) // BLOCK)
        self.block_ids = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(len(lengths))]
        self.kv_cache = torch.zeros(kv_cache_shape(blocks_each * len(lengths), BLOCK, KV_HEADS, HEAD_DIM))

    def step(self, plan: dict[int, tuple[int, list[int], torch.Tensor]]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """plan: sequence -> (start, token ids, hidden rows); returns sequence -> (outputs, logits)."""
        chunks = {seq: ScheduledChunk(f"s{seq}", ids, start, self.block_ids[seq], True)
                  for seq, (start, ids, _) in plan.items()}
        batch = prepare_batch(list(chunks.values()), BLOCK)
        decodes = sorted((s for s, c in chunks.items() if c.num_tokens == 1 and c.start > 0), key=lambda s: chunks[s].start)
        order = decodes + [s for s, c in chunks.items() if s not in decodes]  # prepare_batch's row order
        hidden = torch.cat([plan[s][2] for s in order])
        with torch.inference_mode():
            out = self.head(batch.input_ids, batch.positions, hidden, self.kv_cache, batch.meta)
            logits = self.head.compute_logits(out)
        results, row = {}, 0
        for seq in order:
            n = chunks[seq].num_tokens
            results[seq] = (out[row : row + n], logits[row : row + n])
            row += n
        return results


def load_head(directory: Path, embedding: torch.Tensor | None) -> Eagle3Head:
    head = Eagle3Head(Eagle3Config.from_hf_dir(directory), TorchAttentionBackend(), 256, torch.float32)
    head.load_weights(directory, embedding)
    return head


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_paged_head_matches_dense_reference_through_prefill_and_fed_back_steps(
        tmp_path: Path, norm_before_residual: bool) -> None:
    weights = random_weights()
    embedding = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(5)) * 0.8
    head = load_head(save_head(tmp_path, weights, norm_before_residual=norm_before_residual), embedding)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (9,), generator=g).tolist(), torch.randint(0, VOCAB, (5,), generator=g).tolist()]
    aux = [torch.randn(len(p), 3 * TARGET_HIDDEN, generator=g) for p in prompts]
    steps = 5
    run = PagedRun(head, [len(p) + steps for p in prompts])
    refs = [ReferenceSequence(weights, embedding, norm_before_residual) for _ in prompts]

    def check(results: dict[int, tuple[torch.Tensor, torch.Tensor]], expected: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        for seq, (out, logits) in results.items():
            ref_out, ref_logits = expected[seq]
            torch.testing.assert_close(out, ref_out, atol=2e-4, rtol=1e-4)
            finite = ref_logits.isfinite()
            assert torch.equal(logits.isfinite(), finite)
            torch.testing.assert_close(logits[finite], ref_logits[finite], atol=2e-4, rtol=1e-4)

    # chunked prefill: sequence 0 in two chunks (the second attends to cached KV), sequence 1 whole
    first = run.step({0: (0, prompts[0][:6], aux[0][:6]), 1: (0, prompts[1], aux[1])})
    check(first, {0: refs[0].feed(prompts[0][:6], aux[0][:6]), 1: refs[1].feed(prompts[1], aux[1])})
    last = run.step({0: (6, prompts[0][6:], aux[0][6:])})
    check(last, {0: refs[0].feed(prompts[0][6:], aux[0][6:])})
    state = {0: last[0], 1: first[1]}
    positions = {0: len(prompts[0]), 1: len(prompts[1])}
    targets = set((torch.arange(DRAFT_VOCAB) + weights["d2t"]).tolist())
    # guesses: each step's argmax (a target id) and output hidden state go back in, one token each
    for _ in range(steps):
        plan, expected = {}, {}
        for seq, (out, logits) in state.items():
            token = int(logits[-1].argmax())
            assert token in targets  # a target id from the draft vocabulary
            plan[seq] = (positions[seq], [token], out[-1:].clone())
            expected[seq] = refs[seq].feed([token], out[-1:].clone())
        state = run.step(plan)
        check(state, expected)
        positions = {seq: p + 1 for seq, p in positions.items()}


def test_logits_live_on_the_d2t_targets_only(tmp_path: Path) -> None:
    weights = random_weights(seed=3)
    head = load_head(save_head(tmp_path, weights), torch.randn(VOCAB, HIDDEN))
    logits = head.compute_logits(torch.randn(6, HIDDEN))
    targets = torch.arange(DRAFT_VOCAB) + weights["d2t"]
    assert torch.equal(torch.nonzero(logits[0].isfinite()).flatten(), targets)
    hidden = torch.randn(3, HIDDEN)
    draft = rms(hidden, weights["norm.weight"]) @ weights["lm_head.weight"].T
    torch.testing.assert_close(head.compute_logits(hidden)[:, targets], draft, atol=1e-5, rtol=1e-5)
    picked = head.compute_logits(hidden).argmax(-1)
    assert torch.equal(picked, targets[draft.argmax(-1)])


def test_load_round_trips_hf_names_and_a_model_prefix(tmp_path: Path) -> None:
    weights = random_weights(seed=7, with_embedding=True)
    plain = load_head(save_head(tmp_path / "plain", weights), None)  # the checkpoint's own embedding
    prefixed = load_head(save_head(tmp_path / "prefixed", {
        (k if k in ("d2t", "t2d", "lm_head.weight") else f"model.{k}"): v for k, v in weights.items()}), None)
    for head in (plain, prefixed):
        torch.testing.assert_close(head.embed_tokens.weight, weights["embed_tokens.weight"])
        torch.testing.assert_close(head.fc.weight, weights["fc.weight"])
        qkv = head.midlayer.self_attn.qkv_proj.weight
        q = weights["midlayer.self_attn.q_proj.weight"]
        torch.testing.assert_close(qkv[: q.shape[0]], q)
        torch.testing.assert_close(qkv[-KV_HEADS * HEAD_DIM :], weights["midlayer.self_attn.v_proj.weight"])
        gate_up = head.midlayer.mlp.gate_up_proj.weight
        torch.testing.assert_close(gate_up[INTERMEDIATE:], weights["midlayer.mlp.up_proj.weight"])
        torch.testing.assert_close(head.midlayer.hidden_norm.weight, weights["midlayer.hidden_norm.weight"])
        assert torch.equal(head.draft_to_target, torch.arange(DRAFT_VOCAB) + weights["d2t"])


def test_missing_embedding_shares_the_targets(tmp_path: Path) -> None:
    directory = save_head(tmp_path, random_weights())
    target_embedding = torch.randn(VOCAB, HIDDEN)
    head = load_head(directory, target_embedding)
    torch.testing.assert_close(head.embed_tokens.weight, target_embedding)
    with pytest.raises(ValueError, match="no embed_tokens.weight.*target_embedding"):
        load_head(directory, None)
    with pytest.raises(ValueError, match="embedding.*shape mismatch"):
        load_head(directory, torch.randn(VOCAB, HIDDEN + 1))


def test_pytorch_bin_checkpoints_load(tmp_path: Path) -> None:
    weights = random_weights()
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(hf_config()))
    torch.save(weights, tmp_path / "pytorch_model.bin")
    head = load_head(tmp_path, torch.randn(VOCAB, HIDDEN))
    torch.testing.assert_close(head.lm_head.weight, weights["lm_head.weight"])


@pytest.mark.parametrize(("change", "message"), [
    (lambda w: w.pop("midlayer.mlp.down_proj.weight"), "lacks 1 weights.*down_proj"),
    (lambda w: w.pop("d2t"), "no d2t"),
    (lambda w: w.update({"midlayer.self_attn.q_proj.weight": torch.zeros(HEADS * HEAD_DIM, HIDDEN)}),
     "q_proj.*shape mismatch"),
    (lambda w: w.update({"fc.weight": torch.zeros(HIDDEN, 3 * HIDDEN)}), "fc.weight.*shape mismatch"),
    (lambda w: w.update({"midlayer.extra.weight": torch.zeros(3)}), "does not know.*midlayer.extra"),
    (lambda w: w.update({"d2t": torch.full((DRAFT_VOCAB,), VOCAB)}), "d2t does not map"),
    (lambda w: w.update({"d2t": torch.zeros(DRAFT_VOCAB + 1, dtype=torch.long)}), "d2t must be"),
])
def test_bad_checkpoints_are_refused_clearly(tmp_path: Path, change, message: str) -> None:
    weights = random_weights()
    change(weights)
    directory = save_head(tmp_path, weights)
    with pytest.raises(ValueError, match=message):
        load_head(directory, torch.randn(VOCAB, HIDDEN))


def test_config_reads_aux_layers_and_refuses_other_architectures(tmp_path: Path) -> None:
    cfg = Eagle3Config.from_hf(hf_config())
    assert cfg.aux_layers(30) == (2, 15, 27)
    assert (cfg.kv_spec.num_heads, cfg.kv_spec.head_dim, cfg.num_layers) == (KV_HEADS, HEAD_DIM, 1)
    assert Eagle3Config.from_hf(hf_config(eagle_aux_hidden_state_layer_ids=[1, 4, 7])).aux_layers(30) == (1, 4, 7)
    with pytest.raises(ValueError, match="outside"):
        Eagle3Config.from_hf(hf_config(eagle_aux_hidden_state_layer_ids=[1, 4, 30])).aux_layers(30)
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        Eagle3Config.from_hf(hf_config(architectures=["LlamaForCausalLM"]))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        Eagle3Config.from_hf_dir(tmp_path)
    head = Eagle3Head(cfg, TorchAttentionBackend(), 64, torch.float32)
    assert head.project_hidden(torch.zeros(2, 3 * TARGET_HIDDEN)).shape == (2, HIDDEN)
    assert head.project_hidden(torch.ones(2, HIDDEN)).equal(torch.ones(2, HIDDEN))
    with pytest.raises(ValueError, match="hidden states 50 wide"):
        head.project_hidden(torch.zeros(1, 50))
