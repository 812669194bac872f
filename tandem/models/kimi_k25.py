"""Kimi K2.5: a multimodal checkpoint whose language model is Kimi-K2's DeepSeek-V3 decoder.

The checkpoint (`KimiK25ForConditionalGeneration`) nests the text model's config under
`text_config` (read by ModelConfig) and stores its tensors under `language_model.`
(`language_model.model.layers.*`, `language_model.lm_head.weight`) beside a MoonViT vision
tower (`vision_tower.*`) and its projector (`mm_projector.*`). tandem runs the language model:
the wrapper's tensors are renamed to the decoder's names as they stream past, and the vision
tower's are skipped unread (requests with images are refused at the API edge). Its routed
experts are INT4 (compressed-tensors), kept packed by the MoE layers (layers/int4_experts.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from tandem.models.deepseek_v3 import DeepseekV3ForCausalLM

VISION_PREFIXES = ("vision_tower.", "mm_projector.")


class KimiK25ForConditionalGeneration(DeepseekV3ForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._text_weights(weights))

    def _text_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        prefix = self.config.weight_prefix
        for name, tensor in weights:
            if name.startswith(VISION_PREFIXES):
                continue
            if not name.startswith(prefix):
                raise ValueError(f"{name}: a {self.config.architecture} checkpoint keeps its language model "
                                 f"under {prefix!r}")
            yield name[len(prefix):], tensor
