"""Fit an EAGLE-3 head for a target by self-distillation, on whatever CPU is at hand.

The head has to predict what *this* target says, so it learns from text the target writes
itself: built-in (or given) conversations, chat-templated, continued by the target through
tandem (greedy, plus some sampled continuations for variety). transformers then runs the target
over prompt + continuation once to record, per position, the three aux hidden states the head
reads (the inputs of layers 2, L // 2, L - 3) and the target's next-token distribution, kept as
its top-k over the draft vocabulary (the most frequent tokens of the generated text).

Training follows EAGLE-3's training-time test: each batch is unrolled `ttt_steps` times, the
first step fed the target's hidden states (teacher forcing), later steps the head's own
previous output, exactly as the head runs when it guesses several tokens ahead. Row i at step k
takes token i+1+k at rotary position i+k and attends to the step-0 keys of rows <= i plus its
own keys of steps 1..k -- the KV a proposer holds after catching up to position i and guessing
k tokens past it. The loss is the cross-entropy against the target's distribution restricted
to the draft vocabulary, on continuation tokens only, weighted 0.8^k per step.

The held-out report is the acceptance proxy: per step, top-1 agreement with the target's
argmax, and the mean number of leading guesses that all agree (what greedy verification keeps).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from tandem.layers.rotary import inverse_frequencies, rotary_magnitude
from tandem.spec.eagle3 import Eagle3Config
from tandem.train.eagle3_prompts import Conversation, builtin_conversations, read_prompt_file

logger = logging.getLogger(__name__)

LOSS_DECAY = 0.8  # weight of step k's loss: LOSS_DECAY ** k (SpecForge's choice)


@dataclass
class TrainOptions:
    model: str | None = None  # target: alias, HF directory or .gguf (default: the default model)
    output: Path = Path("eagle3-head")
    prompts_file: Path | None = None
    use_builtin_prompts: bool = True
    max_prompts: int | None = None
    max_new_tokens: int = 192
    sampled_fraction: float = 0.3  # conversations that also get one sampled continuation
    temperature: float = 0.8
    gen_batch: int = 32  # conversations per generation round
    gen_minutes: float | None = None  # start no new generation round after this
    samples_cache: Path | None = None  # JSONL of continuations: reused, extended, rewritten
    draft_vocab_size: int = 8192
    top_k: int = 16  # the target's distribution is kept as its top-k over the draft vocabulary
    ttt_steps: int = 4
    eval_steps: int = 5
    minutes: float = 45.0  # the training loop's budget (data comes before it)
    steps: int | None = None
    batch_tokens: int = 1024
    precision: str = "auto"  # training matmuls: bf16 (autocast), fp32, or auto (bf16 where the CPU has it)
    lr: float = 1e-3
    weight_decay: float = 0.01
    train_lm_head: bool = False  # False: the output side (final norm, LM head rows) stays the target's
    feature_loss: float = 0.0  # weight of a hidden-state regression (EAGLE-1's feature loss); 0: off
    warmup_steps: int = 20
    heldout_fraction: float = 0.1
    seed: int = 0
    threads: int | None = None
    progress: bool = True


@dataclass
class Sample:
    prompt_ids: list[int]
    output_ids: list[int]
    conversation: int  # index of the conversation it continues (held-out splits by conversation)
    sampled: bool


@dataclass
class DraftVocab:
    """The head's output tokens: the most frequent target tokens, in ascending target id."""

    target_ids: torch.Tensor  # int64 [draft]
    target_vocab_size: int

    @property
    def size(self) -> int:
        return self.target_ids.numel()

    @property
    def d2t(self) -> torch.Tensor:
        return self.target_ids - torch.arange(self.size)

    @property
    def t2d(self) -> torch.Tensor:
        mask = torch.zeros(self.target_vocab_size, dtype=torch.bool)
        mask[self.target_ids] = True
        return mask

    @property
    def to_draft(self) -> torch.Tensor:
        """int64 [target vocab]: the draft id of each target token, -1 outside."""
        index = torch.full((self.target_vocab_size,), -1, dtype=torch.long)
        index[self.target_ids] = torch.arange(self.size)
        return index


@dataclass
class SequenceFeatures:
    """One prompt + continuation, what the trainer needs of the target's forward over it.

    Target rows are indexed by position p: the target's distribution over token p+1, kept for
    p in [prompt_len - 1, n - 2] (the continuation tokens); -1 ids elsewhere."""

    ids: torch.Tensor  # int64 [n]
    prompt_len: int
    aux: torch.Tensor  # bfloat16 [n, 3 x target hidden]
    top_ids: torch.Tensor  # int64 [n, k]: draft ids
    top_probs: torch.Tensor  # float16 [n, k]
    argmax: torch.Tensor  # int64 [n]: draft id of the target's argmax, -1 outside the draft vocabulary
    final: torch.Tensor  # bfloat16 [n, hidden]: the target's last hidden state (after its final norm)
    conversation: int = 0
    sampled: bool = False

    @property
    def num_rows(self) -> int:
        return self.ids.numel() - 2


# ---- data --------------------------------------------------------------------------------------

def collect_conversations(opts: TrainOptions) -> list[Conversation]:
    conversations = builtin_conversations() if opts.use_builtin_prompts else []
    if opts.prompts_file is not None:
        conversations += read_prompt_file(opts.prompts_file)
    if opts.max_prompts is not None:
        conversations = conversations[: opts.max_prompts]
    if not conversations:
        raise ValueError("no prompts: give --prompts FILE or keep the built-in ones")
    return conversations


def generate_samples(model: str | None, conversations: list[Conversation], opts: TrainOptions,
                     indices: list[int] | None = None) -> list[Sample]:
    """The target's own continuations through tandem, in rounds of `gen_batch` conversations
    (greedy each, plus a sampled one for a `sampled_fraction` of them). With `gen_minutes`, a
    round that would end past the budget (judged by the longest round so far) is not started:
    a round runs to completion, so it is the unit the budget can cut. `indices`: the
    conversations to continue (default: all)."""
    from tandem.llm import LLM
    from tandem.types import SamplingParams

    indices = list(range(len(conversations))) if indices is None else indices
    if not indices:
        return []
    rng = random.Random(opts.seed)
    samples: list[Sample] = []
    started = time.monotonic()
    longest_round = 0.0
    with LLM(model, kv_cache_memory="1GiB", max_num_seqs=max(opts.gen_batch, 1) * 2) as llm:
        for first in range(0, len(indices), opts.gen_batch):
            round_started = time.monotonic()
            if opts.gen_minutes is not None and round_started - started + longest_round > opts.gen_minutes * 60:
                logger.info("generation budget reached after %d of %d conversations", first, len(indices))
                break
            jobs = []
            for index in indices[first : first + opts.gen_batch]:
                jobs.append((index, SamplingParams(temperature=0, max_tokens=opts.max_new_tokens), False))
                if rng.random() < opts.sampled_fraction:
                    params = SamplingParams(temperature=opts.temperature, top_p=0.95, seed=rng.randrange(1 << 30),
                                            max_tokens=opts.max_new_tokens)
                    jobs.append((index, params, True))
            outputs = llm.chat([conversations[i] for i, _, _ in jobs], [p for _, p, _ in jobs], use_tqdm=opts.progress)
            for (index, _, sampled), output in zip(jobs, outputs, strict=True):
                if len(output.outputs[0].token_ids) >= 2:
                    samples.append(Sample(list(output.prompt_token_ids), list(output.outputs[0].token_ids),
                                          index, sampled))
            longest_round = max(longest_round, time.monotonic() - round_started)
    return samples


def conversation_key(conversation: Conversation) -> str:
    return hashlib.sha1(json.dumps(conversation, sort_keys=True).encode()).hexdigest()[:16]


def read_samples(path: Path, keys: dict[str, int]) -> list[Sample]:
    """Cached continuations, indexed by conversation content through `keys` (key -> index); a
    cached conversation no longer given is added to `keys` under an index past the others."""
    samples = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            item = json.loads(line)
            index = keys.setdefault(item["conversation_key"], len(keys))
            samples.append(Sample(item["prompt_ids"], item["output_ids"], index, item["sampled"]))
    return samples


def write_samples(path: Path, samples: list[Sample], keys: dict[str, int]) -> None:
    key_of = {index: key for key, index in keys.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as out:
        for s in samples:
            out.write(json.dumps({"conversation_key": key_of[s.conversation], "sampled": s.sampled,
                                  "prompt_ids": s.prompt_ids, "output_ids": s.output_ids}) + "\n")


def gather_samples(model: str, conversations: list[Conversation], opts: TrainOptions) -> list[Sample]:
    """The cache's continuations (if any), plus new ones for the conversations it lacks: a run
    cut short by --gen-minutes can be resumed, and a re-run can skip generation."""
    keys = {conversation_key(c): i for i, c in enumerate(conversations)}
    cache = opts.samples_cache
    cached = read_samples(cache, keys) if cache is not None and Path(cache).is_file() else []
    covered = {s.conversation for s in cached}
    fresh = generate_samples(model, conversations, opts, [i for i in range(len(conversations)) if i not in covered])
    samples = cached + fresh
    if cache is not None:
        write_samples(Path(cache), samples, keys)
    logger.info("%d continuations: %d from the cache, %d generated", len(samples), len(cached), len(fresh))
    return samples


def build_draft_vocab(samples: list[Sample], size: int, target_vocab_size: int) -> DraftVocab:
    """The `size` tokens the target generated most often; when the data holds fewer distinct
    tokens, the lowest unseen ids fill up (BPE ids roughly follow merge order, so frequency)."""
    size = min(size, target_vocab_size)
    counts = Counter(token for sample in samples for token in sample.output_ids if token < target_vocab_size)
    chosen = [token for token, _ in counts.most_common(size)]
    if len(chosen) < size:
        seen = set(chosen)
        chosen += [t for t in range(target_vocab_size) if t not in seen][: size - len(chosen)]
    return DraftVocab(torch.tensor(sorted(chosen), dtype=torch.long), target_vocab_size)


@torch.inference_mode()
def extract_features(target: nn.Module, samples: list[Sample], aux_layers: tuple[int, ...], vocab: DraftVocab,
                     top_k: int, batch_tokens: int = 4096, progress: bool = True) -> list[SequenceFeatures]:
    """Run the transformers target over every sample (batched by length, right-padded) and keep
    the aux hidden states (hidden_states[i] is the input of layer i) and the target's top-k
    next-token probabilities over the draft vocabulary at the continuation positions."""
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].prompt_ids) + len(samples[i].output_ids))
    to_draft = vocab.to_draft
    features: list[SequenceFeatures | None] = [None] * len(samples)
    bar = tqdm(total=len(samples), desc="target features", unit="seq", disable=not progress)
    for batch in _length_batches(order, samples, batch_tokens):
        ids = [samples[i].prompt_ids + samples[i].output_ids for i in batch]
        width = max(map(len, ids))
        input_ids = torch.tensor([seq + [0] * (width - len(seq)) for seq in ids])
        mask = torch.tensor([[1] * len(seq) + [0] * (width - len(seq)) for seq in ids])
        out = target.model(input_ids=input_ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
        aux = torch.cat([out.hidden_states[layer] for layer in aux_layers], dim=-1)
        for row, index in enumerate(batch):
            n, prompt_len = len(ids[row]), len(samples[index].prompt_ids)
            logits = target.lm_head(out.last_hidden_state[row, prompt_len - 1 : n - 1]).float()
            features[index] = _sequence_features(ids[row], prompt_len, aux[row, :n], out.last_hidden_state[row, :n],
                                                 logits, to_draft, vocab, top_k, samples[index])
        bar.update(len(batch))
    bar.close()
    return [f for f in features if f is not None]


def _length_batches(order: list[int], samples: list[Sample], batch_tokens: int) -> Iterator[list[int]]:
    batch: list[int] = []
    for index in order:
        length = len(samples[index].prompt_ids) + len(samples[index].output_ids)
        if batch and length * (len(batch) + 1) > batch_tokens:
            yield batch
            batch = []
        batch.append(index)
    if batch:
        yield batch


def _sequence_features(ids: list[int], prompt_len: int, aux: torch.Tensor, final: torch.Tensor, logits: torch.Tensor,
                       to_draft: torch.Tensor, vocab: DraftVocab, top_k: int, sample: Sample) -> SequenceFeatures:
    n = len(ids)
    k = min(top_k, vocab.size)
    probs = torch.softmax(logits[:, vocab.target_ids], dim=-1)  # the target restricted to the draft vocabulary
    top_probs, top_ids = probs.topk(k, dim=-1)
    full_top_ids = torch.full((n, k), -1, dtype=torch.long)
    full_top_probs = torch.zeros(n, k, dtype=torch.float16)
    argmax = torch.full((n,), -1, dtype=torch.long)
    rows = slice(prompt_len - 1, n - 1)
    full_top_ids[rows] = top_ids
    full_top_probs[rows] = top_probs.half()
    argmax[rows] = to_draft[logits.argmax(-1)]
    return SequenceFeatures(torch.tensor(ids), prompt_len, aux.to(torch.bfloat16).clone(), full_top_ids,
                            full_top_probs, argmax, final.to(torch.bfloat16).clone(), sample.conversation,
                            sample.sampled)


# ---- the trainable head --------------------------------------------------------------------------

class TrainableEagle3(nn.Module):
    """The head in plain trainable torch, its parameter names the HF EAGLE-3 checkpoint's."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.config = cfg
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.fc = nn.Linear(cfg.fc_input_size, hidden, bias=False)
        self.midlayer = nn.Module()
        layer = self.midlayer
        layer.input_layernorm = nn.RMSNorm(hidden, eps)
        layer.hidden_norm = nn.RMSNorm(hidden, eps)
        layer.self_attn = nn.Module()
        for name, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            setattr(layer.self_attn, name, nn.Linear(2 * hidden, out, bias=False))
        layer.self_attn.o_proj = nn.Linear(q, hidden, bias=False)
        layer.post_attention_layernorm = nn.RMSNorm(hidden, eps)
        layer.mlp = nn.Module()
        layer.mlp.gate_proj = nn.Linear(hidden, cfg.intermediate_size, bias=False)
        layer.mlp.up_proj = nn.Linear(hidden, cfg.intermediate_size, bias=False)
        layer.mlp.down_proj = nn.Linear(cfg.intermediate_size, hidden, bias=False)
        self.norm = nn.RMSNorm(hidden, eps)
        self.lm_head = nn.Linear(hidden, cfg.draft_vocab_size, bias=False)
        self.register_buffer("inv_freq", inverse_frequencies(cfg.rope, cfg.head_dim), persistent=False)
        self.rotary_scale = rotary_magnitude(cfg.rope)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)

    def init_from_target(self, final_norm: torch.Tensor, lm_head: torch.Tensor, vocab: DraftVocab) -> None:
        """Start the output side from the target's: its final norm and its LM head's rows for the
        draft vocabulary, so the layer only has to learn to produce a target-like hidden state.
        The trainer keeps them frozen by default (EAGLE-1/2 reuse the target's head outright):
        the LM head is about half the parameters at 8192 tokens, and trained on the ~10k tokens
        a CPU run generates it fit the training text rather than the target."""
        with torch.no_grad():
            self.norm.weight.copy_(final_norm)
            self.lm_head.weight.copy_(lm_head[vocab.target_ids])

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, heads, T, dim] at rotary positions [T] (rotate-half, tandem's tables' formula)."""
        angles = positions.float()[:, None] * self.inv_freq
        cos, sin = angles.cos() * self.rotary_scale, angles.sin() * self.rotary_scale
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def layer(self, embeds: torch.Tensor, hidden: torch.Tensor, step: int,
              cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One unroll step over [B, T] rows; `cache` holds the keys/values of earlier steps."""
        cfg, layer = self.config, self.midlayer
        B, T, _ = hidden.shape
        normed = layer.hidden_norm(hidden)
        residual = normed if cfg.norm_before_residual else hidden
        x = torch.cat((layer.input_layernorm(embeds), normed), dim=-1)
        heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        positions = torch.arange(step, step + T)
        q = self.rotate(layer.self_attn.q_proj(x).view(B, T, heads, dim).transpose(1, 2), positions)
        k = self.rotate(layer.self_attn.k_proj(x).view(B, T, kv_heads, dim).transpose(1, 2), positions)
        v = layer.self_attn.v_proj(x).view(B, T, kv_heads, dim).transpose(1, 2)
        cache.append((k, v))
        if step == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            out = _unrolled_attention(q, cache, dim ** -0.5)
        hidden = residual + layer.self_attn.o_proj(out.transpose(1, 2).reshape(B, T, heads * dim))
        y = layer.post_attention_layernorm(hidden)
        return hidden + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(y)) * layer.mlp.up_proj(y))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


def _unrolled_attention(q: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]], scale: float) -> torch.Tensor:
    """Row i attends to the step-0 keys of rows <= i (the verified context) and to its own keys
    of steps 1..now (its chain of guesses): one causal block plus one diagonal per step."""
    B, heads, T, dim = q.shape
    kv_heads = cache[0][0].shape[1]
    grouped = q.view(B, kv_heads, heads // kv_heads, T, dim)
    k0, v0 = cache[0]
    scores0 = torch.einsum("bkgtd,bksd->bkgts", grouped, k0) * scale
    scores0 = scores0.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    diagonal = torch.stack([torch.einsum("bkgtd,bktd->bkgt", grouped, k) for k, _ in cache[1:]], dim=-1) * scale
    probs = torch.softmax(torch.cat((scores0, diagonal), dim=-1), dim=-1)
    out = torch.einsum("bkgts,bksd->bkgtd", probs[..., :T], v0)
    for s, (_, v) in enumerate(cache[1:]):
        out = out + probs[..., T + s, None] * v.unsqueeze(2)
    return out.reshape(B, heads, T, dim)


# ---- batches and the unroll ---------------------------------------------------------------------

@dataclass
class Batch:
    """Padded sequences; targets are indexed by row i + 1 + step (see SequenceFeatures)."""

    ids: torch.Tensor  # int64 [B, T + steps + 1]
    aux: torch.Tensor  # float32 [B, T, 3 x target hidden]
    top_ids: torch.Tensor  # int64 [B, T + steps + 1, k]
    top_probs: torch.Tensor  # float32 [B, T + steps + 1, k]
    argmax: torch.Tensor  # int64 [B, T + steps + 1] (-2: no target at that position)
    final: torch.Tensor  # float32 [B, T + steps + 1, hidden]: the target's normed last hidden state

    @property
    def rows(self) -> int:
        return self.aux.shape[1]


def make_batch(sequences: list[SequenceFeatures], steps: int) -> Batch:
    T = max(s.num_rows for s in sequences)
    width = T + steps + 1
    k = sequences[0].top_ids.shape[1]
    B = len(sequences)
    ids = torch.zeros(B, width, dtype=torch.long)
    aux = torch.zeros(B, T, sequences[0].aux.shape[1])
    top_ids = torch.zeros(B, width, k, dtype=torch.long)
    top_probs = torch.zeros(B, width, k)
    argmax = torch.full((B, width), -2, dtype=torch.long)
    final = torch.zeros(B, width, sequences[0].final.shape[1])
    for b, s in enumerate(sequences):
        n = s.ids.numel()
        ids[b, :n] = s.ids
        aux[b, : s.num_rows] = s.aux[: s.num_rows].float()
        has_target = s.top_ids[:, 0] >= 0
        top_ids[b, :n] = s.top_ids.clamp(min=0)
        top_probs[b, :n] = s.top_probs.float()
        argmax[b, :n] = torch.where(has_target, s.argmax, torch.full_like(s.argmax, -2))
        final[b, :n] = s.final.float()
    return Batch(ids, aux, top_ids, top_probs, argmax, final)


@dataclass
class StepResult:
    loss: torch.Tensor  # mean cross-entropy over the step's trainable rows
    feature_loss: torch.Tensor  # mean relative squared error of the normed hidden state vs the target's
    correct: torch.Tensor  # bool [B, T]: the head's argmax equals the target's
    valid: torch.Tensor  # bool [B, T]: the step has a target here
    hidden: torch.Tensor  # [B, T, hidden]: the step's output, the next step's hidden input


def unroll(model: TrainableEagle3, embedding: torch.Tensor, batch: Batch, steps: int) -> list[StepResult]:
    """The training-time test: `steps` forwards, each fed the previous one's output hidden."""
    T = batch.rows
    hidden = model.fc(batch.aux).float()  # the residual stream stays fp32 under bf16 autocast
    cache: list[tuple[torch.Tensor, torch.Tensor]] = []
    results = []
    for step in range(steps):
        window = slice(1 + step, 1 + step + T)  # token i + 1 + step, target at position i + 1 + step
        hidden = model.layer(F.embedding(batch.ids[:, window], embedding), hidden, step, cache)
        argmax = batch.argmax[:, window]
        valid = argmax >= -1
        trainable = argmax >= 0  # the target's choice is in the draft vocabulary
        normed = model.norm(hidden[valid])
        logits = model.lm_head(normed)
        target = batch.final[:, window][valid]
        feature_loss = ((normed.float() - target).square().sum(-1) / target.square().sum(-1).clamp(min=1e-6)).mean() \
            if target.numel() else normed.sum() * 0
        logp = torch.log_softmax(logits.float(), dim=-1)
        probs = batch.top_probs[:, window][valid]
        probs = probs / probs.sum(-1, keepdim=True).clamp(min=1e-9)
        ce = -(probs * logp.gather(-1, batch.top_ids[:, window][valid])).sum(-1)
        weight = trainable[valid].float()
        loss = (ce * weight).sum() / weight.sum().clamp(min=1)
        correct = torch.zeros_like(valid)
        correct[valid] = logits.argmax(-1) == argmax[valid]
        results.append(StepResult(loss, feature_loss, correct, valid, hidden))
    return results


# ---- training ---------------------------------------------------------------------------------

@dataclass
class Accuracy:
    """Per step: rows with a target, rows whose guess matches, and rows whose guesses so far all
    match (what greedy verification would keep)."""

    steps: int
    total: list[int] = field(default_factory=list)
    correct: list[int] = field(default_factory=list)
    chain_total: int = 0  # base rows with a target at every step
    chain_accepted: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.total = self.total or [0] * self.steps
        self.correct = self.correct or [0] * self.steps
        self.chain_accepted = self.chain_accepted or [0] * self.steps

    def add(self, results: list[StepResult]) -> None:
        full = torch.stack([r.valid for r in results]).all(0)
        alive = full.clone()
        for step, r in enumerate(results):
            self.total[step] += int(r.valid.sum())
            self.correct[step] += int(r.correct.sum())
            alive &= r.correct
            self.chain_accepted[step] += int(alive.sum())
        self.chain_total += int(full.sum())

    def top1(self) -> list[float]:
        return [c / t if t else 0.0 for c, t in zip(self.correct, self.total, strict=True)]

    def accepted_through(self) -> list[float]:
        """Per step k: the fraction of drafts whose first k+1 guesses all hold."""
        return [a / self.chain_total if self.chain_total else 0.0 for a in self.chain_accepted]

    def mean_accepted(self) -> float:
        return sum(self.accepted_through())


def batches(sequences: list[SequenceFeatures], batch_tokens: int, rng: random.Random) -> list[list[SequenceFeatures]]:
    """Similar lengths together (little padding), in a shuffled order."""
    order = sorted(sequences, key=lambda s: s.num_rows + rng.random())
    groups: list[list[SequenceFeatures]] = []
    for s in order:
        if groups and (len(groups[-1]) + 1) * max(s.num_rows, groups[-1][-1].num_rows) <= batch_tokens:
            groups[-1].append(s)
        else:
            groups.append([s])
    rng.shuffle(groups)
    return groups


def training_in_bf16(precision: str) -> bool:
    """Whether to autocast training matmuls to bfloat16: "auto" does where the CPU multiplies
    bf16 natively (AVX512-BF16 or AMX: about 4x fp32's GEMM rate on this project's 2-core VM);
    elsewhere bf16 is emulated and slower than fp32. Master weights stay fp32 either way."""
    if precision not in ("auto", "bf16", "fp32"):
        raise ValueError(f"precision must be auto, bf16 or fp32, not {precision!r}")
    if precision != "auto":
        return precision == "bf16"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def lr_factor(progress: float, step: int, warmup: int) -> float:
    """Linear warm-up, then cosine down to 10% over the budget (time or steps)."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def train(model: TrainableEagle3, embedding: torch.Tensor, train_set: list[SequenceFeatures],
          opts: TrainOptions) -> dict[str, Any]:
    if opts.minutes <= 0 and not opts.steps:
        raise ValueError("training needs a limit: --minutes above 0 or --steps")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=opts.lr, weight_decay=opts.weight_decay, betas=(0.9, 0.95))
    rng = random.Random(opts.seed)
    use_bf16 = training_in_bf16(opts.precision)
    budget = opts.minutes * 60
    started = time.monotonic()
    step, epoch, rows_seen = 0, 0, 0
    recent = Accuracy(opts.ttt_steps)
    bar = tqdm(total=opts.steps, desc="training", unit="step", disable=not opts.progress)
    while True:
        for group in batches(train_set, opts.batch_tokens, rng):
            elapsed = time.monotonic() - started
            progress = max(elapsed / budget if budget > 0 else 0.0, step / opts.steps if opts.steps else 0.0)
            if progress >= 1.0:
                bar.close()
                return {"steps": step, "epochs": epoch + rows_seen / max(1, sum(s.num_rows for s in train_set)),
                        "seconds": round(elapsed, 1), "rows_seen": rows_seen}
            for g in optimizer.param_groups:
                g["lr"] = opts.lr * lr_factor(progress, step, opts.warmup_steps)
            batch = make_batch(group, opts.ttt_steps)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
                results = unroll(model, embedding, batch, opts.ttt_steps)
            loss = sum(LOSS_DECAY**k * (r.loss + opts.feature_loss * r.feature_loss) for k, r in enumerate(results))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            step += 1
            rows_seen += batch.rows * len(group)
            if step % 20 == 1:
                recent = Accuracy(opts.ttt_steps)
            recent.add(results)
            bar.update(1)
            bar.set_postfix_str(f"loss={float(loss.detach()):.3f} acc={'/'.join(f'{a:.2f}' for a in recent.top1())}")
        epoch += 1
        rows_seen = 0


@torch.no_grad()
def evaluate(model: TrainableEagle3, embedding: torch.Tensor, sequences: list[SequenceFeatures], steps: int,
             batch_tokens: int) -> Accuracy:
    accuracy = Accuracy(steps)
    for group in batches(sequences, batch_tokens, random.Random(0)):
        accuracy.add(unroll(model, embedding, make_batch(group, steps), steps))
    return accuracy


def split_heldout(features: list[SequenceFeatures], fraction: float, seed: int) -> tuple[list, list]:
    """Held-out by conversation: a prompt's greedy and sampled continuations stay together."""
    conversations = sorted({f.conversation for f in features})
    random.Random(seed).shuffle(conversations)
    count = min(len(conversations) - 1, max(1, round(len(conversations) * fraction))) if fraction > 0 else 0
    heldout = set(conversations[:count])
    return ([f for f in features if f.conversation not in heldout], [f for f in features if f.conversation in heldout])


# ---- the head's config and checkpoint -----------------------------------------------------------

def head_hf_config(target: dict[str, Any], vocab: DraftVocab, aux_layers: tuple[int, ...]) -> dict[str, Any]:
    """The head's config.json: the target's layer shape, one layer, the draft vocabulary."""
    hidden = int(target["hidden_size"])
    heads = int(target["num_attention_heads"])
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(target["intermediate_size"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(target.get("num_key_value_heads") or heads),
        "head_dim": int(target.get("head_dim") or hidden // heads),
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": float(target.get("rms_norm_eps", 1e-6)),
        "max_position_embeddings": int(target.get("max_position_embeddings", 4096)),
        "vocab_size": vocab.target_vocab_size,
        "draft_vocab_size": vocab.size,
        "target_hidden_size": hidden,
        "tie_word_embeddings": False,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": list(aux_layers),
        "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": list(aux_layers)},
        "torch_dtype": "float32",
    }
    for key in ("rope_theta", "rope_scaling", "rope_parameters", "bos_token_id", "eos_token_id"):
        if target.get(key) is not None:
            config[key] = target[key]
    return config


def save_head(model: TrainableEagle3, vocab: DraftVocab, config: dict[str, Any], output: Path,
              report: dict[str, Any]) -> None:
    """HF EAGLE-3 layout: config.json, model.safetensors (no embedding: the target's is shared)."""
    from safetensors.torch import save_file

    output.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().float().contiguous() for name, t in model.state_dict().items()}
    tensors["d2t"] = vocab.d2t
    tensors["t2d"] = vocab.t2d
    save_file(tensors, str(output / "model.safetensors"), metadata={"format": "pt"})
    (output / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (output / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")


# ---- the whole run ----------------------------------------------------------------------------

def run(opts: TrainOptions) -> dict[str, Any]:
    """Generate, extract features, train, evaluate, save; returns the report it writes."""
    import transformers

    from tandem.loader.resolve import resolve_model

    if opts.threads:
        torch.set_num_threads(opts.threads)
    torch.manual_seed(opts.seed)
    hf_dir = resolve_model(opts.model).hf_dir
    target_hf = json.loads((hf_dir / "config.json").read_text())
    timings: dict[str, float] = {}

    started = time.monotonic()
    conversations = collect_conversations(opts)
    samples = gather_samples(str(hf_dir), conversations, opts)
    if not samples:
        raise ValueError("the target generated nothing to learn from")
    timings["generate_s"] = time.monotonic() - started
    logger.info("generated %d continuations (%d tokens) in %.0f s", len(samples),
                sum(len(s.output_ids) for s in samples), timings["generate_s"])

    started = time.monotonic()
    target = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    vocab = build_draft_vocab(samples, opts.draft_vocab_size, int(target_hf["vocab_size"]))
    # the default aux layers of a head with no layer ids in its config: (2, L // 2, L - 3)
    aux_layers = Eagle3Config.from_hf(head_hf_config(target_hf, vocab, ())).aux_layers(int(target_hf["num_hidden_layers"]))
    config = head_hf_config(target_hf, vocab, aux_layers)
    features = extract_features(target, samples, aux_layers, vocab, opts.top_k, progress=opts.progress)
    embedding = target.get_input_embeddings().weight.detach().clone()
    model = TrainableEagle3(Eagle3Config.from_hf(config))
    model.init_from_target(target.model.norm.weight.detach(), target.get_output_embeddings().weight.detach(), vocab)
    for param in (*model.norm.parameters(), *model.lm_head.parameters()):
        param.requires_grad_(opts.train_lm_head)
    del target
    timings["features_s"] = time.monotonic() - started

    train_set, heldout = split_heldout(features, opts.heldout_fraction, opts.seed)
    coverage = _coverage(features)
    logger.info("draft vocabulary %d tokens covers %.1f%% of the target's choices", vocab.size, 100 * coverage)
    fit = train(model, embedding, train_set, opts)
    timings["train_s"] = fit["seconds"]

    started = time.monotonic()
    evaluated = heldout or train_set
    accuracy = evaluate(model, embedding, evaluated, opts.eval_steps, opts.batch_tokens)
    greedy = [f for f in evaluated if not f.sampled]
    greedy_accuracy = evaluate(model, embedding, greedy, opts.eval_steps, opts.batch_tokens) if greedy else accuracy
    timings["eval_s"] = time.monotonic() - started
    report = {
        "target": str(opts.model or "smollm2-135m"),
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(opts).items()},
        "data": {"conversations": len({s.conversation for s in samples}), "continuations": len(samples),
                 "sampled_continuations": sum(s.sampled for s in samples),
                 "continuation_tokens": sum(len(s.output_ids) for s in samples),
                 "total_tokens": sum(len(s.prompt_ids) + len(s.output_ids) for s in samples),
                 "train_sequences": len(train_set), "heldout_sequences": len(heldout),
                 "heldout_targets": accuracy.total[0], "draft_vocab_size": vocab.size,
                 "draft_vocab_coverage": round(coverage, 4)},
        "training": fit,
        "heldout": {"top1_per_step": [round(a, 4) for a in accuracy.top1()],
                    "all_accepted_through_step": [round(a, 4) for a in accuracy.accepted_through()],
                    "draft_length": opts.eval_steps, "mean_accepted": round(accuracy.mean_accepted(), 3),
                    "greedy_only": {"positions": greedy_accuracy.total[0],
                                    "top1_per_step": [round(a, 4) for a in greedy_accuracy.top1()],
                                    "mean_accepted": round(greedy_accuracy.mean_accepted(), 3)},
                    "evaluated_on": "held-out conversations" if heldout else "training data (nothing held out)"},
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
        "aux_layers": list(aux_layers),
    }
    save_head(model, vocab, config, Path(opts.output), report)
    return report


def _coverage(features: list[SequenceFeatures]) -> float:
    """Share of the target's continuation choices the draft vocabulary holds."""
    targets = torch.cat([f.argmax[f.prompt_len - 1 : f.ids.numel() - 1] for f in features])
    return float((targets >= 0).float().mean()) if targets.numel() else 0.0


def format_report(report: dict[str, Any]) -> str:
    heldout, data = report["heldout"], report["data"]
    lines = [
        f"data: {data['continuations']} continuations of {data['conversations']} conversations "
        f"({data['sampled_continuations']} sampled), {data['continuation_tokens']} generated tokens, "
        f"{data['total_tokens']} with prompts; draft vocabulary {data['draft_vocab_size']} "
        f"(covers {100 * data['draft_vocab_coverage']:.1f}% of the target's choices)",
        f"training: {report['training']['steps']} steps, {report['training']['epochs']:.2f} epochs, "
        f"timings {report['timings_s']}",
        f"held-out ({heldout['evaluated_on']}, {data['heldout_targets']} positions):",
        "  step            " + " ".join(f"{k + 1:>6}" for k in range(len(heldout["top1_per_step"]))),
        "  top-1           " + " ".join(f"{a:6.3f}" for a in heldout["top1_per_step"]),
        "  all accepted to " + " ".join(f"{a:6.3f}" for a in heldout["all_accepted_through_step"]),
    ]
    lines.append(f"  mean accepted guesses per draft of {heldout['draft_length']}: {heldout['mean_accepted']:.2f}")
    greedy = heldout["greedy_only"]
    lines.append(f"  greedy continuations only ({greedy['positions']} positions): top-1 "
                 + " ".join(f"{a:.3f}" for a in greedy["top1_per_step"]) + f", mean accepted {greedy['mean_accepted']:.2f}")
    return "\n".join(lines)
