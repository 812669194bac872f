"""Per-layer scales for an fp8 KV cache, measured at start.

float8 e4m3 holds magnitudes from 2^-9 (subnormal) to 448 with three mantissa bits. With a
scale of 1.0 (vLLM's default without a checkpoint's scales) a layer whose keys or values are
larger than 448 saturates and one whose values sit around 2^-7 keeps a bit or two; dividing
each layer's keys and values by a scale first places them where e4m3 is precise.

The worker runs a short built-in text (prose, code and a tool call: what an agent sends)
through the model once before serving, with every attention layer noting its largest key and
value, and gives each layer the power of two at or above `HEADROOM` times that largest
magnitude over 448: text the calibration did not see may be a few times larger before it
saturates, and the scale is exact to divide by (layers/attention.py folds it into the softmax
scale and the output, so the kernels are unchanged). The same checkpoint gives the same scales
on every host unless a largest magnitude sits at a power of two.

What it buys on the models this project measures: little. Neither SmolLM2 nor Qwen2.5-Coder
(with key divisors) has a layer outside e4m3's range; their fp8 loss is the three mantissa
bits (`tandem bench perplexity --kv-dtypes fp8`: +0.34% and +1.13% with these scales, +0.43%
and +1.19% at 1.0). It is there for checkpoints whose activations are not.

An fp8 cache's blocks leave their worker as its bytes, these scales in the KV layout a handoff
reply or tier chunk names (kvcache/codec.py converts for a reader of other scales or another
dtype). Pipeline stages
keep 1.0 (a stage cannot run the text alone); MLA's latent cache has its own
attention and keeps 1.0 too.
"""

from __future__ import annotations

import logging
import math

import torch

from tandem.batch.prepared import ScheduledChunk, prepare_batch
from tandem.kernels.kv_format import FP8_MAX
from tandem.layers.attention import PagedAttention

logger = logging.getLogger(__name__)

# Said at start whenever an fp8 cache is chosen: it is over the 8-bit quality bar
# (perplexity within 0.5% of the model's own cache) on both models measured, int8 is not
# (`tandem bench perplexity --kv-dtypes fp8 --kv-cache-dtypes fp8,int8`, docs/performance.md).
FP8_QUALITY = ("fp8 KV cache: over the 8-bit quality bar where measured (perplexity +1.6% on SmolLM2-135M and "
               "+2.5% on Qwen2.5-Coder-0.5B against the model's own cache; --kv-cache-dtype int8: +0.04% and "
               "+0.32% at about the same bytes); kept for parity with fp8 checkpoints and the peers' flag")

HEADROOM = 4.0  # how much larger than the calibration's largest a value may be before it saturates

# Prose, code and a tool call, written for this purpose.
CALIBRATION_TEXT = (
    "The harbour office opens at seven. Before then the clerks sort the night's manifests: "
    "grain from the north, timber from the coast, and a crate of instruments nobody ordered.\n\n"
    "def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:\n"
    "    \"\"\"Merge overlapping closed intervals, sorted by start.\"\"\"\n"
    "    merged: list[tuple[int, int]] = []\n"
    "    for start, end in sorted(intervals):\n"
    "        if merged and start <= merged[-1][1]:\n"
    "            merged[-1] = (merged[-1][0], max(merged[-1][1], end))\n"
    "        else:\n"
    "            merged.append((start, end))\n"
    "    return merged\n\n"
    "User: what is the weather in Lisbon tomorrow, in Celsius?\n"
    "Assistant: {\"name\": \"get_forecast\", \"arguments\": {\"city\": \"Lisbon\", \"days\": 1, "
    "\"units\": \"celsius\"}}\n"
    "Tool: {\"city\": \"Lisbon\", \"high\": 21.5, \"low\": 14.0, \"rain_mm\": 0.4}\n"
    "Assistant: Tomorrow in Lisbon: a high of 21.5 °C, a low of 14 °C and a little rain."
)


def power_of_two_scale(largest: float) -> float:
    """The scale a layer whose largest magnitude is `largest` divides by: the power of two at
    or above HEADROOM * largest / FP8_MAX (1.0 for nothing measured)."""
    if not math.isfinite(largest) or largest <= 0:
        return 1.0
    return 2.0 ** math.ceil(math.log2(HEADROOM * largest / FP8_MAX))


def attention_layers(model: torch.nn.Module) -> list[PagedAttention]:
    return [module for module in model.modules() if isinstance(module, PagedAttention)]


@torch.inference_mode()
def calibrate_kv_scales(model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                        device: torch.device, token_ids: list[int]) -> list[tuple[float, float]]:
    """Run `token_ids` through the model as one prefill into the cache's first blocks (nothing
    else holds them yet; they are zeroed after), then set each attention layer's (k_scale,
    v_scale) from what it saw; returns them in layer order."""
    layers = attention_layers(model)
    if not layers or not token_ids:
        return []
    blocks = -(-len(token_ids) // block_size)
    for layer in layers:
        layer.k_scale = layer.v_scale = 1.0
        layer.observed = []
    # The layers must run one by one to note what they see: a C layer stack (models/decode_stack.py)
    # that takes the step would skip their forward (it takes prefill chunks over a cache in
    # the model's dtype, as `tandem bench perplexity --kv-dtypes fp8` calibrates on).
    stack = getattr(model, "decode_stack", None)
    if stack is not None:
        model.decode_stack = None
    try:
        chunk = ScheduledChunk("kv-scale-calibration", list(token_ids), 0, list(range(blocks)), True)
        batch = prepare_batch([chunk], block_size, device)
        model(batch.input_ids, batch.positions, kv_caches, batch.meta, None)
        if any(not layer.observed for layer in layers):
            raise RuntimeError("an attention layer saw nothing of the calibration text")
        seen = [(max(k for k, _ in layer.observed), max(v for _, v in layer.observed)) for layer in layers]
    finally:
        if stack is not None:
            model.decode_stack = stack
        for layer in layers:
            layer.observed = None
        for cache in kv_caches:
            cache[:, :, :blocks].zero_()
    scales = []
    for layer, (key, value) in zip(layers, seen, strict=True):
        layer.k_scale, layer.v_scale = power_of_two_scale(key), power_of_two_scale(value)
        scales.append((layer.k_scale, layer.v_scale))
    return scales


def describe(scales: list[tuple[float, float]]) -> str:
    """The scales' exponents in one line: 'k 2^-3..2^1, v 2^-6..2^-2'."""
    def span(values: list[float]) -> str:
        exponents = [int(math.log2(v)) for v in values]
        return f"2^{min(exponents)}..2^{max(exponents)}"

    return f"k {span([k for k, _ in scales])}, v {span([v for _, v in scales])}"
