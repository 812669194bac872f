"""The EAGLE-3 trainer: a few steps on a tiny random target end to end, and the training-time
test computing exactly what the head computes when it guesses over tandem's paged cache."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from tandem.batch.prepared import ScheduledChunk, prepare_batch
from tandem.kernels.base import kv_cache_shape
from tandem.kernels.torch_attention import TorchAttentionBackend
from tandem.loader.resolve import resolve_model
from tandem.spec.eagle3 import Eagle3Config, Eagle3Head
from tandem.train.eagle3 import (
    DraftVocab,
    Sample,
    SequenceFeatures,
    TrainableEagle3,
    TrainOptions,
    build_draft_vocab,
    collect_conversations,
    gather_samples,
    head_hf_config,
    make_batch,
    run,
    save_head,
    unroll,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A six-layer random Llama speaking the default model's tokenizer (its whole vocabulary,
    so chat-templated prompts are valid token ids)."""
    directory = tmp_path_factory.mktemp("tiny-target")
    source = resolve_model("smollm2-135m").hf_dir
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True, eos_token_id=2))
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, directory / name)
    return directory


def test_a_few_steps_on_a_tiny_target_write_a_head_that_loads_and_guesses(tiny_target: Path, tmp_path: Path) -> None:
    output, cache = tmp_path / "head", tmp_path / "samples.jsonl"
    opts = TrainOptions(model=str(tiny_target), output=output, max_prompts=6, max_new_tokens=10,
                        sampled_fraction=0.5, draft_vocab_size=300, minutes=0, steps=3, ttt_steps=2,
                        eval_steps=3, batch_tokens=256, heldout_fraction=0.34, progress=False, samples_cache=cache)
    report = run(opts)
    assert report["training"]["steps"] == 3
    # the cache holds every continuation; a second gathering generates nothing
    cached = cache.read_text().splitlines()
    assert len(cached) == report["data"]["continuations"]
    again = gather_samples(str(tiny_target), collect_conversations(opts), opts)
    assert [(s.prompt_ids, s.output_ids, s.sampled) for s in again] == \
        [(json.loads(line)["prompt_ids"], json.loads(line)["output_ids"], json.loads(line)["sampled"]) for line in cached]
    assert sorted({s.conversation for s in again}) == list(range(6))
    assert report["data"]["continuations"] >= 6 and report["data"]["heldout_sequences"] >= 1
    assert len(report["heldout"]["top1_per_step"]) == 3
    config = json.loads((output / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3]
    tensors = load_file(output / "model.safetensors")
    assert "embed_tokens.weight" not in tensors and tensors["t2d"].sum() == 300

    target = load_file(tiny_target / "model.safetensors")
    head = Eagle3Head(Eagle3Config.from_hf_dir(output), TorchAttentionBackend(), 64, torch.float32)
    head.load_weights(output, target["model.embed_tokens.weight"])
    kv_cache = torch.zeros(kv_cache_shape(2, 16, config["num_key_value_heads"], config["head_dim"]))
    batch = prepare_batch([ScheduledChunk("r", [5, 6, 7], 0, [0, 1], True)], 16)
    hidden = head(batch.input_ids, batch.positions, torch.randn(3, 3 * 32), kv_cache, batch.meta)
    logits = head.compute_logits(hidden)
    assert logits.shape == (3, config["vocab_size"]) and int(logits.isfinite().sum(-1)[0]) == 300


def test_the_draft_vocabulary_is_the_most_frequent_generated_tokens_then_low_ids() -> None:
    samples = [Sample([1, 2], [9, 9, 9, 7, 7, 5], 0, False), Sample([3], [7, 11], 1, True)]
    vocab = build_draft_vocab(samples, 3, 20)
    assert vocab.target_ids.tolist() == [5, 7, 9]
    assert torch.equal(torch.arange(3) + vocab.d2t, vocab.target_ids)
    assert vocab.t2d.nonzero().flatten().tolist() == [5, 7, 9] and vocab.to_draft[9] == 2 and vocab.to_draft[3] == -1
    assert build_draft_vocab(samples, 6, 20).target_ids.tolist() == [0, 1, 5, 7, 9, 11]


def test_the_training_time_test_computes_what_the_paged_head_guesses(tmp_path: Path) -> None:
    """Unrolled training steps at base row i == the head catching up to position i over the
    paged cache, then guessing (fed the true next tokens and its own hidden states)."""
    vocab_size, hidden_size, target_hidden, steps = 64, 32, 24, 3
    target_cfg = {"hidden_size": hidden_size, "intermediate_size": 48, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                  "max_position_embeddings": 128, "vocab_size": vocab_size}
    vocab = DraftVocab(torch.arange(0, vocab_size, 2), vocab_size)
    config = head_hf_config(target_cfg, vocab, (2, 3, 4))
    config["target_hidden_size"] = target_hidden
    torch.manual_seed(0)
    model = TrainableEagle3(Eagle3Config.from_hf(config)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() > 1 else 0.1) + (1.0 if p.dim() == 1 else 0.0))
    save_head(model, vocab, config, tmp_path, {})
    embedding = torch.randn(vocab_size, hidden_size)

    n, prompt_len = 14, 4
    ids = torch.randint(0, vocab_size, (n,))
    features = SequenceFeatures(ids, prompt_len, torch.randn(n, 3 * target_hidden).bfloat16(),
                                torch.zeros(n, 2, dtype=torch.long), torch.full((n, 2), 0.5).half(),
                                torch.zeros(n, dtype=torch.long), torch.randn(n, hidden_size).bfloat16())
    with torch.no_grad():
        results = unroll(model, embedding, make_batch([features], steps), steps)

    head = Eagle3Head(Eagle3Config.from_hf_dir(tmp_path), TorchAttentionBackend(), 128, torch.float32)
    head.load_weights(tmp_path, embedding)
    aux = features.aux.float()
    for base in (0, 5, n - 3 - steps):
        kv_cache = torch.zeros(kv_cache_shape(4, 8, 2, 8))
        blocks = [0, 1, 2, 3]
        # catch up: rows 0..base take (token j + 1, the target's hidden at j) at position j
        batch = prepare_batch([ScheduledChunk("r", ids[1 : base + 2].tolist(), 0, blocks, True)], 8)
        with torch.inference_mode():
            out = head(batch.input_ids, batch.positions, aux[: base + 1], kv_cache, batch.meta)[-1:]
            for step in range(steps):
                expected = model.logits(results[step].hidden[0, base])
                torch.testing.assert_close(head.compute_logits(out)[0, vocab.target_ids], expected,
                                           atol=1e-4, rtol=1e-4)
                position = base + 1 + step  # the next guess: token base + 2 + step, fed back hidden
                guess = prepare_batch([ScheduledChunk("r", [int(ids[position + 1])], position, blocks, True)], 8)
                out = head(guess.input_ids, guess.positions, out, kv_cache, guess.meta)
