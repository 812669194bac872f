"""Architecture name (HF `architectures`) -> model class."""

from __future__ import annotations

from torch import nn

from tandem.models.deepseek_v3 import DeepseekV3ForCausalLM
from tandem.models.kimi_k25 import KimiK25ForConditionalGeneration
from tandem.models.llama import LlamaForCausalLM
from tandem.models.mistral import MistralForCausalLM
from tandem.models.mixtral import MixtralForCausalLM
from tandem.models.qwen2 import Qwen2ForCausalLM
from tandem.models.qwen3 import Qwen3ForCausalLM
from tandem.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "KimiK25ForConditionalGeneration": KimiK25ForConditionalGeneration,
}


def model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_CLASSES[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(MODEL_CLASSES)}"
        ) from None
