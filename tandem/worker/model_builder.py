"""A rank's model, built and laid out for the kernels that will read it.

On the CPU: built in the run dtype, weights filled (or random under --load-format dummy), then
the layouts the CPU kernels read: the small-step weight copies (--decode-weights), the 8-bit
projections (--quantization int8), oneDNN-packed weights, the fused layer passes and the
one-call decode stack. On a GPU: built on the device, weights copied in through pinned staging
buffers, and the Triton passes for the norms, the rotation and silu-and-mul. The worker owns
the lifecycle; this module only builds.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.config import EngineConfig, ModelConfig
from tandem.distributed.expert_parallel import ExpertParallel
from tandem.distributed.pipeline_parallel import PipelineStage
from tandem.distributed.tensor_parallel import TensorParallel
from tandem.kernels.base import AttentionBackend
from tandem.kernels.dense_gemm import DenseGemmKernel, load_dense_gemm_kernel
from tandem.kernels.dense_gemv import load_dense_gemv_kernel
from tandem.kernels.int8_gemm import Int8GemmKernel, load_int8_gemm_kernel
from tandem.kernels.int8_rows import load_int8_rows_kernel
from tandem.kernels.layer_ops import LayerOpsKernel, load_layer_ops
from tandem.kernels.q4_gemm import load_q4_kernel
from tandem.layers.bounded_greedy import BoundedGreedyHead
from tandem.layers.fused_ops import attach_gpu_passes, attach_layer_ops
from tandem.layers.int4_experts import Int4Experts, attach_int4_expert_kernel
from tandem.layers.int4_linear import Int4Linear, attach_int4_linear_kernel
from tandem.layers.int8 import int8_available
from tandem.layers.linear import (
    GEMV_MAX_ROWS,
    SmallStepWeights,
    attach_bf16_gemv,
    attach_gpu_gemv,
    attach_small_step_weights,
    count_8bit_packed,
    onednn_bf16_available,
    pack_weights_for_cpu,
    quantize_int8,
    release_coded_rows,
    small_step_census,
)
from tandem.layers.moe import attach_expert_gemv
from tandem.loader.copy_pipeline import ReadShare
from tandem.loader.model_loader import build_model, init_dummy_weights, load_weights
from tandem.models.decode_stack import attach_decode_stack
from tandem.models.key_divisors import fold_key_divisors
from tandem.platform.cpu_modes import CpuFeatures
from tandem.worker.kv_sizing import check_weights_fit

logger = logging.getLogger(__name__)

# --decode-weights int4: the largest relative error of a matrix's 4-bit copy (else it gets an
# 8-bit one, or keeps its dense weights where that too is further). A Q4 GGUF's 4-bit tensors
# come back within fp16 rounding (< 1e-3); its 8-bit embedding / LM head would lose ~9% in 4
# bits (SmolLM2-135M: +6.9% perplexity), and an 8-bit copy holds it.
TARGET_INT4_MAX_ERROR = 0.01


@dataclass(frozen=True)
class ModelBuilder:
    """What a rank's model is built for: its device and dtype, and its share of the model."""

    config: EngineConfig
    rank: int
    device: torch.device
    dtype: torch.dtype
    tp: TensorParallel
    stage: PipelineStage
    ep: ExpertParallel | None
    world_size: int
    kernel_cache_dir: Path  # where compiled C kernels are kept

    def build(self, model_config: ModelConfig, hf_dir: Path, backend: AttentionBackend,
              max_model_len: int) -> torch.nn.Module:
        """Build the model, fill its weights, then lay them out for the kernels that read them."""
        load = self.config.load
        if load.quantization == "int8" and not int8_available():
            raise ValueError("--quantization int8 needs PyTorch's integer GEMM (torch._int_mm)")
        if self.device.type == "cuda":
            return self._build_gpu_model(model_config, hf_dir, backend, max_model_len)
        return self._build_cpu_model(model_config, hf_dir, backend, max_model_len)

    def read_share(self) -> ReadShare | None:
        """With every rank of the model on this host, the ranks together read every byte of
        the checkpoint, so they split one forward read of it (loader/copy_pipeline.py). Ranks
        on several hosts each read exactly their own bytes."""
        if self.config.parallel.nnodes != 1 or self.world_size < 2:
            return None
        return ReadShare(self.rank, self.world_size)

    def _build_cpu_model(self, model_config: ModelConfig, hf_dir: Path, backend: AttentionBackend,
                         max_model_len: int) -> torch.nn.Module:
        load = self.config.load
        check_weights_fit(self.config, hf_dir, self.stage, self.rank, self.world_size)
        if self.ep is not None and model_config.moe is None and self.rank == 0:
            logger.info("--enable-expert-parallel: %s has no experts; nothing to shard", model_config.architecture)
        model = build_model(model_config, backend, max_model_len, self.dtype, self.tp, self.stage, self.ep)
        if load.load_format == "dummy":
            init_dummy_weights(model, load.seed)
        else:
            load_weights(model, hf_dir, share=self.read_share())
        self._fold_key_divisors(model)
        dense_gemm = self._dense_gemm() if load.pack_weights else None
        small_step = self._small_step_weights(dense_gemm)
        q4_kernel = dense_kernel = None
        int4_linears = attach_int4_linear_kernel(model, None)
        if int4_linears:
            linear_kernel = load_q4_kernel(self.kernel_cache_dir)
            attach_int4_linear_kernel(model, linear_kernel)
            if self.rank == 0:
                logger.info("INT4 linears: %d projections keep the checkpoint's 4-bit levels, run by %s", int4_linears,
                            "the 4-bit C kernel" if linear_kernel is not None else "torch on dequantized weights")
        if model_config.int4_experts:
            expert_kernel = load_q4_kernel(self.kernel_cache_dir)
            layers = attach_int4_expert_kernel(model, expert_kernel)
            if self.rank == 0:
                logger.info("INT4 experts: %d MoE layers keep the checkpoint's 4-bit levels, run by %s", layers,
                            "the 4-bit C kernel" if expert_kernel is not None else "torch, one expert at a time")
        if small_step is not None:
            q4_kernel = load_q4_kernel(self.kernel_cache_dir) if small_step.format == "int4" else None
            own_rows = small_step.format == "float32" or (small_step.format == "bfloat16"
                                                          and self.dtype == torch.bfloat16)
            dense_kernel = load_dense_gemv_kernel(self.kernel_cache_dir) if own_rows else None
            added = attach_small_step_weights(model, small_step, q4_kernel, dense_kernel)
            if self.rank == 0:
                codes = " (or their lossless codes, below)" if small_step.format == "float32" else ""
                what = (f"the model's own plain {small_step.format} rows{codes} kept beside the packed weights, read "
                        "by the GEMV kernel" if own_rows and dense_kernel is not None
                        else f"{small_step.format} small-step weight copy")
                kinds = small_step_census(model) if small_step.format == "int4" else {}
                census = (": " + ", ".join(f"{count} {'matrix' if count == 1 else 'matrices'} {kind}" for kind, count in sorted(kinds.items()))
                          + (" (4 bits would be more than 1% off)" if set(kinds) - {"4-bit"} else "")) if kinds else ""
                logger.info("%s for steps of <= %d tokens (+%.0f MiB)%s", what,
                            small_step.max_tokens, added / (1 << 20), census)
        if load.quantization == "int8":
            gemm = self._int8_gemm()
            quantized = quantize_int8(model, load_int8_rows_kernel(self.kernel_cache_dir), gemm)
            if self.rank == 0:
                logger.info("--quantization int8: %d projections hold 8-bit weights for steps of more than %s tokens, "
                            "multiplied by %s", quantized, small_step.max_tokens if small_step is not None else 0,
                            "tandem's packed int8 GEMM (VNNI)" if gemm is not None else "torch._int_mm (oneDNN)")
        w8 = load.quantization == "w8a16"
        if load.pack_weights and pack_weights_for_cpu(model, dense_gemm, 8 if w8 else 16) and self.rank == 0:
            logger.info("linear weights packed for %s", "tandem's packed GEMM" if dense_gemm is not None else "oneDNN")
            if w8:
                held = count_8bit_packed(model)
                logger.info("--quantization w8a16: %d projections hold 8-bit weights (a scale per output row) "
                            "widened to bf16 on the AMX tiles for steps of more than %s tokens%s", held,
                            small_step.max_tokens if small_step is not None else 0,
                            "" if held else " (none: this CPU or build has no AMX bf16 tiles, or --no-weight-packing; "
                            "the dtype's weights run)")
        if self.dtype == torch.bfloat16 and not onednn_bf16_available():
            self._attach_bf16_gemv(model)
        ops = load_layer_ops(self.kernel_cache_dir)
        if small_step is not None and small_step.format == "float32":
            self._attach_bounded_greedy(model, ops)
            release_coded_rows(model)
            rows = [m.small_dense for m in model.modules() if getattr(m, "small_dense", None) is not None]
            if self.rank == 0 and any(d.codes is not None for d in rows):
                logger.info("%d of %d fp32 matrices read from lossless 8-bit codes (the same fp32 weights at 1.25 "
                            "bytes each; their plain rows not kept)", sum(d.codes is not None for d in rows), len(rows))
        if ops is not None:
            attach_layer_ops(model, ops)
        stack = attach_decode_stack(model, backend, self.kernel_cache_dir, q4_kernel, ops, dense_kernel)
        if stack is not None and self.rank == 0:
            logger.info("layer stack: steps of %s run every layer in one C call", stack.steps)
        return model

    def _build_gpu_model(self, model_config: ModelConfig, hf_dir: Path, backend: AttentionBackend,
                         max_model_len: int) -> torch.nn.Module:
        """The model on this rank's GPU: built there in the run dtype (no fp32 copy on the host
        or the device), its weights copied in through pinned staging buffers. The CPU-only
        layouts (oneDNN packing, 8-bit and small-step copies, the C passes) are not made."""
        load = self.config.load
        started = time.perf_counter()
        model = build_model(model_config, backend, max_model_len, self.dtype, self.tp, self.stage, self.ep,
                            device=self.device)
        if load.load_format == "dummy":
            init_dummy_weights(model, load.seed)
            staged = None
        else:
            staged = load_weights(model, hf_dir, device=self.device, share=self.read_share())
        self._fold_key_divisors(model)
        if backend.capabilities.gpu_layer_passes:
            from tandem.kernels.gpu.rms_norm import TritonNorm
            from tandem.kernels.gpu.rotary import TritonRotary
            from tandem.kernels.gpu.silu_mul import TritonSiluMul

            # One kernel each for the norms, the rotation and silu-and-mul instead of 8, 7
            # and 2 torch ops: at batch 1 those small launches were a fifth of the step.
            attach_gpu_passes(model, TritonNorm(), TritonRotary(), TritonSiluMul())
            self._attach_gpu_gemv(model)
        torch.cuda.synchronize(self.device)
        if self.rank == 0:
            seconds = time.perf_counter() - started
            moved = f", {staged / 1e9:.2f} GB through pinned staging at {staged / 1e9 / seconds:.2f} GB/s" if staged else ""
            logger.info("model on %s in %s: %.2f s%s", self.device, load.dtype, seconds, moved)
        return model

    def _attach_gpu_gemv(self, model: torch.nn.Module) -> None:
        """One-row steps through tandem's GEMV for the matrices this device's table says it
        wins (tandem/kernels/gpu/gemv.py, tuned by `tandem bench gpu --gemv`), cuBLAS for the rest."""
        from tandem.kernels.gpu.gemv import GpuGemv, load_table

        device = torch.cuda.get_device_name(self.device)
        table = load_table(device, self.dtype)
        taken = attach_gpu_gemv(model, {shape: GpuGemv(config) for shape, config in table.items()})
        if self.rank == 0:
            logger.info("one-row steps: %s", f"{taken} matrices through tandem's GEMV ({len(table)} shapes tuned for "
                        f"{device}), the rest cuBLAS" if taken else
                        f"cuBLAS (tandem's GEMV has no table for {device} in {self.dtype} and these shapes; "
                        "`tandem bench gpu --gemv` makes one)")

    def _fold_key_divisors(self, model: torch.nn.Module) -> None:
        """Power-of-two key divisors into the query and key rows (models/key_divisors.py),
        before anything copies the weights; their digest goes into the KV layout."""
        model.key_divisors = fold_key_divisors(model)
        if model.key_divisors and self.rank == 0:
            logger.info("key divisors folded into the query/key projections (exact; cached keys are k/s, digest %s)",
                        model.key_divisors)

    def _small_step_weights(self, dense_gemm: DenseGemmKernel | None) -> SmallStepWeights | None:
        """--decode-weights as the layers take it (its value is checked with the config,
        tandem/config_checks.py); `dense_gemm`: the packed GEMM the weights will pack for."""
        load = self.config.load
        choice = load.decode_weights
        if choice == "none" or load.decode_weights_max_tokens < 1:
            return None
        if not bf16_rows_pay(choice, self.dtype, dense_gemm is not None and dense_gemm.isa == "amx-bf16"):
            if self.rank == 0:
                logger.info("--decode-weights bfloat16: small steps read the packed bf16 weights on the AMX tiles "
                            "(faster than the plain rows' GEMV here), no copy kept")
            return None
        # The target's int4 copies only where they lose nothing (the checkpoint's own 4-bit
        # matrices); a draft model's guesses take any (tandem/spec/model_proposers.py).
        return SmallStepWeights(load.decode_weights_max_tokens, choice,
                                int4_max_error=TARGET_INT4_MAX_ERROR if choice == "int4" else None)

    def _dense_gemm(self) -> DenseGemmKernel | None:
        """tandem's packed fp32 / bf16 GEMM where the CPU has AVX-512 (bf16 on AMX's tiles where
        it has them, csrc/dense_gemm_amx.h), fp32 where it has AVX2 + FMA. The matrices it does
        not take (a dtype it has no path for, a width not a multiple of 16) stay oneDNN's."""
        features = CpuFeatures.detect()
        if not (features.avx512 or features.avx2_fma) or self.device.type != "cpu":
            return None
        return load_dense_gemm_kernel(self.kernel_cache_dir)

    def _int8_gemm(self) -> Int8GemmKernel | None:
        """tandem's packed int8 GEMM where it has a path here: AMX's int8 tiles, or VNNI's
        vpdpbusd (kernels/int8_gemm.py); elsewhere `torch._int_mm`."""
        if self.device.type != "cpu":
            return None
        return load_int8_gemm_kernel(self.kernel_cache_dir)

    def _attach_bf16_gemv(self, model: torch.nn.Module) -> None:
        """bf16 on a CPU whose oneDNN has no bf16 GEMM (AVX2): steps of up to 16 rows read the
        weights through the GEMV kernel, larger ones widen to fp32 (layers/linear.py)."""
        kernel = load_dense_gemv_kernel(self.kernel_cache_dir)
        layers = attach_bf16_gemv(model, kernel) + attach_expert_gemv(model, kernel) if kernel is not None else 0
        if self.rank == 0:
            logger.info("bf16 on a CPU without a bf16 GEMM: %s, larger steps multiply in fp32",
                        f"steps of <= {GEMV_MAX_ROWS} rows read {layers} matrices through the bf16 GEMV kernel"
                        if layers else "no GEMV kernel built")

    def _attach_bounded_greedy(self, model: torch.nn.Module, ops: LayerOpsKernel | None) -> None:
        """--decode-weights float32 (exact fp32, faster kernels): greedy rows read a bf16 copy
        of the LM head and compute only the candidates' fp32 logits (layers/bounded_greedy.py)."""
        head = getattr(model, "lm_head", None)
        if head is None or head.shard.tp.split or not onednn_bf16_available():
            return
        dense = getattr(head, "small_dense", None)
        rows = dense.weight if dense is not None else head.weight
        if rows.dtype != torch.float32 or rows.dim() != 2 or rows.numel() == 0:
            return
        head.bounded_greedy = BoundedGreedyHead(rows, ops)
        if self.rank == 0:
            logger.info("greedy rows read the LM head's bf16 copy and compute only their candidates' fp32 "
                        "logits (+%.0f MiB)", head.bounded_greedy.nbytes / (1 << 20))


def bf16_rows_pay(choice: str, dtype: torch.dtype, tiles: bool) -> bool:
    """Whether a bf16 model's `--decode-weights bfloat16` keeps its plain rows for the GEMV
    kernel. Not where the packed weights run on AMX's tiles (`tiles`: the packed GEMM as built
    and loaded multiplies bf16 there, which a CPU flag alone does not promise: the kernel asks
    the OS for the tiles): they read SmolLM2's layers at one and two rows at 23 GB/s against the
    GEMV's 17 on the 2-core AMX Xeon, and a bf16 single stream went from 56 to 83 tok/s without
    the rows (+202 MiB saved). Every other choice, dtype or CPU keeps them (AVX-512 without AMX:
    the GEMV is what beat oneDNN's one-row path)."""
    return not (choice == "bfloat16" and dtype == torch.bfloat16 and tiles)


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's weights take: parameters, their oneDNN-packed layouts and their
    small-step copies (each storage once: a tied head is the embedding)."""
    seen: set[int] = set()
    total = 0
    tensors: list[torch.Tensor] = list(model.parameters())
    for module in model.modules():
        for name in ("packed_weight", "small_weight", "small_bias", "small_packed"):
            extra = getattr(module, name, None)
            if isinstance(extra, torch.Tensor):
                tensors.append(extra)
        for name in ("dense_packed", "gated_packed"):  # tandem's packed GEMM's layouts
            packed = getattr(module, name, None)
            if packed is not None:
                tensors.append(packed.values)
        dense = getattr(module, "small_dense", None)  # --decode-weights float32: the plain rows kept
        if dense is not None:
            tensors += [dense.codes] if dense.codes is not None else []
            if dense.weight.device.type != "meta":  # released where the codes stand for it
                tensors.append(dense.weight)
        for compact in (getattr(module, "small_quantized", None), getattr(module, "int8", None),
                        getattr(module, "bounded_greedy", None)):
            if compact is not None:
                total += compact.nbytes
        tensors += list(getattr(module, "packed_halves", None) or ())
        if isinstance(module, Int4Experts):  # the packed experts are buffers, not parameters
            tensors += [module.w13, module.s13, module.w2, module.s2]
        if isinstance(module, Int4Linear):
            tensors += [module.packed, module.scales]
    for tensor in tensors:
        if tensor.is_mkldnn:
            total += tensor.element_size() * tensor.numel()
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total
