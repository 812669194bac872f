"""Loading the proposers that run a model (draft_model, eagle3) beside the target, on its worker.

The worker asks before it sizes its KV cache, because a proposer's KV shares the target's
block ids: one block then costs both models' bytes. It checks the proposer speaks the
target's vocabulary (a guess is a target token id), builds and loads it after the target,
and once the block count is agreed makes the proposer the model runner calls after each step.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from tandem.config import EngineConfig, ModelConfig
from tandem.kernels.base import AttentionBackend
from tandem.kernels.dense_gemv import load_dense_gemv_kernel
from tandem.kernels.q4_gemm import load_q4_kernel
from tandem.layers.linear import SmallStepWeights, attach_small_step_weights
from tandem.loader.model_loader import (
    build_model,
    init_dummy_weights,
    load_weights,
    read_model_config,
)
from tandem.loader.resolve import resolve_model
from tandem.spec.paged_draft import PagedDraftProposer

logger = logging.getLogger(__name__)

# The largest proposer forward that reads its compact weights: a decode's catch-up is the
# sampled token plus at most one guess whose KV was never written; the int4 kernel beats
# packed bf16 at one and two rows and loses from three on (tandem/kernels/q4_gemm.py).
DRAFT_SMALL_STEP_TOKENS = 2


class ModelProposerLoader:
    """One of draft_model / eagle3, from `--speculative-config` (`model` names its weights)."""

    def __init__(self, config: EngineConfig, target: ModelConfig, target_dir: Path, dtype: torch.dtype) -> None:
        self.config = config
        self.spec = config.speculative
        self.target = target
        self.dtype = dtype
        assert self.spec.model is not None
        self.dir = resolve_model(self.spec.model, config.load.dtype, config.load.cache_dir).hf_dir
        self.module: torch.nn.Module | None = None
        if self.spec.method == "eagle3":
            from tandem.spec.eagle3 import Eagle3Config

            self.eagle = Eagle3Config.from_hf_dir(self.dir)
            if self.eagle.vocab_size != target.vocab_size or self.eagle.target_hidden_size != target.hidden_size:
                raise ValueError(
                    f"EAGLE-3 head {self.spec.model!r} was made for a target with {self.eagle.vocab_size} tokens "
                    f"and hidden size {self.eagle.target_hidden_size}, not this one ({target.vocab_size}, "
                    f"{target.hidden_size})")
            self.eagle.aux_layers(target.num_hidden_layers)  # refuses layers the target lacks
        else:
            self.draft = read_model_config(self.dir)
            mismatch = vocabulary_mismatch(target_dir, self.dir)
            if self.draft.vocab_size > target.vocab_size or mismatch:
                raise ValueError(
                    f"draft model {self.spec.model!r} does not share the target's vocabulary "
                    f"({mismatch or f'{self.draft.vocab_size} ids against {target.vocab_size}'}); a draft must "
                    "use the target's tokenizer, e.g. a smaller model of the same family")

    def kv_bytes_per_block(self, block_size: int) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        if self.spec.method == "eagle3":
            return self.eagle.kv_spec.values_per_token(1) * block_size * element
        return self.draft.kv_spec.values_per_token(self.draft.num_hidden_layers) * block_size * element

    def load(self, backend: AttentionBackend, max_model_len: int, target_model: torch.nn.Module,
             kernel_dir: Path) -> None:
        """Build and load the proposer; `kernel_dir` is where compiled C kernels are kept."""
        started = time.perf_counter()
        load = self.config.load
        if self.spec.method == "eagle3":
            from tandem.spec.eagle3 import Eagle3Head

            head = Eagle3Head(self.eagle, backend, max_model_len, self.dtype)
            head.load_weights(self.dir, target_model.model.embed_tokens.weight)
            # The target keeps the residual streams the head reads.
            target_model.aux_hidden_layers = head.aux_layers(self.target.num_hidden_layers)
            self.module = head
        else:
            model = build_model(self.draft, backend, max_model_len, self.dtype)
            if load.load_format == "dummy":
                init_dummy_weights(model, load.seed + 1)
            else:
                load_weights(model, self.dir)
            self.module = model
        small_step = self.spec.draft_decode_weights
        if small_step != "none":
            # The proposer's own forwards are one or two tokens per request (a decode's
            # catch-up, each guess); a prompt's catch-up still reads the dense weights.
            q4_kernel = load_q4_kernel(kernel_dir) if small_step == "int4" else None
            dense_kernel = load_dense_gemv_kernel(kernel_dir) if small_step == "float32" else None
            added = attach_small_step_weights(self.module, SmallStepWeights(DRAFT_SMALL_STEP_TOKENS, small_step),
                                              q4_kernel, dense_kernel)
            logger.info("%s proposer: %s copy of its weights for forwards of <= %d tokens (+%.0f MiB)",
                        self.spec.method, small_step, DRAFT_SMALL_STEP_TOKENS, added / (1 << 20))
        # Counted before packing, which releases the dense copies it reorders.
        size = sum(p.numel() * p.element_size() for p in self.module.parameters())
        if load.pack_weights:
            from tandem.layers.linear import pack_weights_for_cpu

            pack_weights_for_cpu(self.module)
        logger.info("%s proposer %s: %.0f MiB of weights, loaded in %.1f s", self.spec.method, self.spec.model,
                    size / (1 << 20), time.perf_counter() - started)

    def proposer(self, num_blocks: int, block_size: int) -> PagedDraftProposer:
        assert self.module is not None, "load first"
        k = self.spec.num_speculative_tokens
        if self.spec.method == "eagle3":
            from tandem.spec.eagle3_proposer import Eagle3Proposer

            return Eagle3Proposer(self.module, num_blocks, block_size, self.dtype, k)  # type: ignore[arg-type]
        from tandem.spec.draft_model import DraftModelProposer

        return DraftModelProposer(self.module, self.draft, num_blocks, block_size, self.dtype, k)


def model_proposer_loader(config: EngineConfig, target: ModelConfig, target_dir: Path,
                          dtype: torch.dtype) -> ModelProposerLoader | None:
    """The loader when the config asks for a model-running proposer here (never on a prefill
    worker: it samples one token, there is nothing to guess)."""
    if config.speculative.method not in ("draft_model", "eagle3") or config.kv_transfer.role == "prefill":
        return None
    return ModelProposerLoader(config, target, target_dir, dtype)


def vocabulary_mismatch(target_dir: Path, draft_dir: Path) -> str | None:
    """How two models' tokenizers differ (None: same token -> id map, or no tokenizer to
    compare, as for bare random-weight configs)."""
    from tandem.loader.tokenizer import load_tokenizer

    try:
        target, draft = load_tokenizer(target_dir), load_tokenizer(draft_dir)
    except FileNotFoundError:
        return None
    target_vocab, draft_vocab = target.get_vocab(), draft.get_vocab()
    if target_vocab == draft_vocab:
        return None
    differing = sum(1 for token, index in draft_vocab.items() if target_vocab.get(token) != index)
    return f"{differing} of the draft's {len(draft_vocab)} tokens map to other ids or are missing"
