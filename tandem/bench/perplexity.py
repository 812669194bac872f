"""Perplexity of a fixed text through the engine's own paged model path.

Used to show that a fast weight format does not hurt quality: the text is fed in steps of
`step_tokens` tokens, exactly as the engine would run it (steps of one token take the decode
path, and with `--decode-weights` the half-precision weight copy), and each position's next-token
log-likelihood is accumulated. The command, `tandem bench perplexity`, is in perplexity_cli.py:
this module imports torch and the engine, which building the CLI parser must not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tandem.batch.prepared import ScheduledChunk, prepare_batch
from tandem.engine.llm_engine import LLMEngine
from tandem.kernels.kv_format import to_fp8
from tandem.kvcache.codec import KVCodec
from tandem.types import Request, SamplingParams

# A fixed English passage (public-domain style prose written for this benchmark).
REFERENCE_TEXT = (
    "The river rose slowly through the spring, and by the first week of May the lower fields "
    "were under a hand's depth of brown water. The farmers moved their cattle to the ridge, "
    "where the grass was thin but dry, and waited. Nobody in the valley could remember a year "
    "like it. The old mill, which had stood beside the ford for more than a century, lost its "
    "wheel on a Tuesday night; in the morning the children found pieces of it caught in the "
    "willows a mile downstream. The schoolteacher, a patient woman who had come from the city "
    "ten years before, used the flood to teach arithmetic: how many buckets in a field, how many "
    "fields in a valley, how long until the water went down if it fell an inch a day. When the "
    "river finally returned to its bed, it left behind a layer of fine silt that made the next "
    "harvest the best anyone had seen. People still argue about whether the flood was a disaster "
    "or a gift. Most agree that it was both, and that the valley was never quite the same again. "
    "In the years that followed, the town built a stone embankment along the eastern bank, "
    "planted poplars to hold the soil, and wrote down the height of every spring flood on the "
    "wall of the new mill, so that their grandchildren would know what the river could do."
)


# A longer text for the prefill path: the module docstrings of a few standard-library modules
# of the running Python (~3,700 tokens on 3.11), fed in 64-token chunks. The 272-token passage
# is too short to resolve 1% for modes whose rounding is coarse: 8-bit activations moved its
# perplexity by -3% to +3% with changes to unrelated last bits.
LONG_TEXT_MODULES = ("argparse", "collections", "json", "logging", "pathlib", "subprocess", "threading",
                     "unittest", "email", "http.client", "csv", "shutil")


def long_text() -> str:
    import importlib
    import inspect

    return "\n\n".join(inspect.getdoc(importlib.import_module(name)) or "" for name in LONG_TEXT_MODULES)


@dataclass(frozen=True)
class Fp8Rounding:
    """What an fp8 cache (--kv-cache-dtype fp8) holds of each value, on a model's-dtype cache:
    each layer's keys and values divided by its scales (worker/kv_scales.py, measured on this
    engine's model), rounded to float8 e4m3 (clamped to +-448, as every backend's write is) and
    multiplied back. Exact for what the fp8 kernels see, since they widen each value and the
    layer folds the scales out (layers/attention.py)."""

    scales: tuple[tuple[float, float], ...]  # (k_scale, v_scale) per layer
    name: str = "fp8"

    def payload_bytes(self, shape: tuple[int, ...], cache_dtype: torch.dtype) -> int:
        return math.prod(shape)  # a byte a value

    def roundtrip(self, blocks: torch.Tensor) -> torch.Tensor:
        """blocks [layers, 2, kv heads, blocks, block size, head dim] as an fp8 cache keeps them."""
        scales = torch.tensor(self.scales, dtype=torch.float32).view(-1, 2, 1, 1, 1, 1)
        return (to_fp8(blocks.float() / scales).float() * scales).to(blocks.dtype)


def requantize(engine: LLMEngine, block_ids: list[int], codec: KVCodec | Fp8Rounding) -> None:
    """Replace KV blocks by what `codec` brings back of them: what a decode worker fetching
    them in that codec, a tier holding them so, or a cache of that dtype would attend to."""
    blocks = engine.runner.read_blocks(block_ids)
    if isinstance(codec, Fp8Rounding):
        restored = codec.roundtrip(blocks)
    else:
        restored = codec.decode(codec.encode(blocks), tuple(blocks.shape), blocks.dtype, blocks.dtype)
    engine.runner.write_blocks(block_ids, restored)


def measured_fp8_scales(engine: LLMEngine, token_ids: list[int]) -> Fp8Rounding:
    """The per-layer scales an fp8 cache of this model would take (the worker's calibration
    on this engine's model and cache, then the layers set back to 1.0 for the float cache)."""
    from tandem.worker.kv_scales import CALIBRATION_TEXT, attention_layers, calibrate_kv_scales

    runner = engine.runner
    ids = list(token_ids) or engine.tokenizer.encode(CALIBRATION_TEXT)
    scales = calibrate_kv_scales(runner.model, runner.kv_caches, runner.block_size, runner.device, ids)
    for layer in attention_layers(runner.model):
        layer.k_scale = layer.v_scale = 1.0
    return Fp8Rounding(tuple(scales))


def _touched(block_ids: list[int], start: int, count: int, block_size: int) -> list[int]:
    return block_ids[start // block_size : (start + count - 1) // block_size + 1]


@torch.inference_mode()
def perplexity(engine: LLMEngine, token_ids: list[int], step_tokens: int,
               kv_codec: KVCodec | Fp8Rounding | None = None) -> float:
    """exp(mean NLL) of token_ids[1:] given their prefixes, computed `step_tokens` at a time;
    with `kv_codec`, every step's new KV goes through it before later steps read it."""
    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    request = Request("perplexity", list(token_ids), SamplingParams(max_tokens=1))
    kv = engine.kv_manager
    if not kv.allocate_slots(request, len(token_ids)):
        raise ValueError("the KV cache is too small for the perplexity text")
    try:
        block_ids = kv.block_ids_of(request.request_id)
        total_nll = 0.0
        for start in range(0, len(token_ids) - 1, step_tokens):
            count = min(step_tokens, len(token_ids) - 1 - start)
            chunk = ScheduledChunk(request.request_id, token_ids[start : start + count], start, block_ids, True)
            batch = prepare_batch([chunk], kv.block_size)
            hidden = engine.runner.model(batch.input_ids, batch.positions, engine.runner.kv_caches, batch.meta)
            if kv_codec is not None:
                requantize(engine, _touched(block_ids, start, count, kv.block_size), kv_codec)
            logprobs = torch.log_softmax(engine.runner.model.compute_logits(hidden), dim=-1)
            targets = torch.tensor(token_ids[start + 1 : start + 1 + count])
            total_nll -= float(logprobs.gather(1, targets.unsqueeze(1)).sum())
        return math.exp(total_nll / (len(token_ids) - 1))
    finally:
        kv.free(request)



@torch.inference_mode()
def greedy_tokens(engine: LLMEngine, prompt_ids: list[int], max_tokens: int,
                  kv_codec: KVCodec | Fp8Rounding | None = None,
                  prompt_only: bool = False, chunk_tokens: int = 64) -> list[int]:
    """The greedy continuation of a prompt through the engine's paged model path, the prompt in
    `chunk_tokens` steps, then a token a step. With `kv_codec` the KV goes through it as it is
    written: all of it (a cache of that dtype), or (`prompt_only`) the prompt's full blocks once
    the prompt is computed, the rest exact: a prompt handed to a decode worker, or loaded from a
    tier, in that codec (only full blocks travel; the partial last one is recomputed)."""
    request = Request("greedy-agreement", list(prompt_ids), SamplingParams(max_tokens=max_tokens))
    kv = engine.kv_manager
    if not kv.allocate_slots(request, len(prompt_ids) + max_tokens):
        raise ValueError("the KV cache is too small for the agreement prompt")
    try:
        block_ids = kv.block_ids_of(request.request_id)
        tokens, out, start = list(prompt_ids), [], 0
        while len(out) < max_tokens:
            count = min(chunk_tokens, len(tokens) - start)
            chunk = ScheduledChunk(request.request_id, tokens[start : start + count], start, block_ids, True)
            batch = prepare_batch([chunk], kv.block_size)
            hidden = engine.runner.model(batch.input_ids, batch.positions, engine.runner.kv_caches, batch.meta)
            if kv_codec is not None and not prompt_only:
                requantize(engine, _touched(block_ids, start, count, kv.block_size), kv_codec)
            elif kv_codec is not None and start < len(prompt_ids) <= start + count:
                full = len(prompt_ids) // kv.block_size
                if full:
                    requantize(engine, block_ids[:full], kv_codec)
            start += count
            if start == len(tokens):
                token = int(engine.runner.model.compute_logits(hidden)[-1].argmax())
                out.append(token)
                tokens.append(token)
        return out
    finally:
        kv.free(request)
