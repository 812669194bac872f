"""DeepSeek-V3 and Kimi-K2 (same architecture): multi-head latent attention over a latent
cache (layers/mla.py), the first `first_k_dense_replace` layers with a dense MLP and the rest
with 256 (384 for K2) routed experts chosen by group-limited sigmoid routing plus a shared
expert (layers/moe.py). The decoder around them is the Llama one.

Checkpoint fix-ups on load: the rotary rows are de-interleaved (models/mla_weights.py) in the
loaded parameters, so a tensor-parallel rank reorders only the heads it holds, and the
multi-token-prediction layer some checkpoints carry after the last layer (used only for
speculative decoding) is skipped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from tandem.models.llama import LlamaForCausalLM
from tandem.models.mla_weights import deinterleave_rope_rows_, has_interleaved_rope_rows

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = super().load_weights(self._checked(weights))
        mla = self.config.mla
        assert mla is not None
        with torch.no_grad():
            for name in loaded:
                if has_interleaved_rope_rows(name, mla):
                    deinterleave_rope_rows_(name, self.get_parameter(name).data, mla)
        return loaded

    def _checked(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        cfg = self.config
        assert cfg.mla is not None
        for name, tensor in weights:
            layer = _LAYER.match(name)
            if layer and int(layer.group(1)) >= cfg.num_hidden_layers:
                continue  # the multi-token-prediction module
            if name.endswith("_scale_inv"):
                raise ValueError(
                    f"{name}: FP8 block-quantised checkpoints are not supported yet; "
                    "use a bf16 conversion or --load-format dummy"
                )
            yield name, tensor
