"""Linear layers that know how to load their checkpoint shards.

Projections that read the same input are merged into one matrix (q/k/v, gate/up) so a step
issues one GEMM instead of three; each checkpoint tensor is copied into its row range.
Tensor-parallel variants will shard these along the same row ranges.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tandem.config import DECODE_WEIGHT_FORMATS
from tandem.distributed.tensor_parallel import SINGLE_RANK, TensorParallel
from tandem.kernels.dense_gemm import BLOCK_COLUMNS, DenseGemmKernel, PackedDense
from tandem.kernels.dense_gemv import DenseGemvKernel, DenseRows
from tandem.kernels.int8_gemm import Int8GemmKernel
from tandem.kernels.int8_rows import Int8RowsKernel
from tandem.kernels.q4_gemm import Q4Kernel, Q4Matrix, Q5Matrix, Q8Matrix, q4_fits
from tandem.layers.int4 import Int4Weight, int4_available, int4_fits
from tandem.layers.int4_linear import INT4_FIELDS, Int4Linear
from tandem.layers.int8 import Int8Weight, gated_mlp, int8_fits


@dataclass(frozen=True)
class SmallStepWeights:
    """A compact copy of every weight matrix, read by steps of at most `max_tokens`.

    A step of one or two tokens is a GEMV bound by weight bandwidth, not a GEMM. Measured on
    this 2-core AVX-512 CPU over the default model's matrices, per one-token step: fp32
    43 ms with F.linear, 25 ms with oneDNN-packed fp32, bf16 19 ms, fp16 10 ms; at 64 tokens:
    packed fp32 92 ms, bf16 71 ms, fp16 435 ms (no native fp16 GEMM). So fp16 is the fast
    mode for single streams only. `int4` (4 bits per weight plus a scale and a minimum per 32
    inputs) reads a quarter of bf16's bytes and is the fastest at one and two tokens: tandem's
    integer GEMM (tandem/kernels/q4_gemm.py) where it builds and the matrix has whole blocks
    of 64 inputs, else PyTorch's int4 kernel (tandem/layers/int4.py), else the dense weights.
    With `int4_max_error` set, a matrix whose 4-bit copy is further than that from it gets a
    5-bit copy for the same kernel (a GGUF's Q5_0 matrix), or an 8-bit one (an LM head kept in
    8 bits by its GGUF), else bf16.
    Activations and the KV cache stay in the run dtype, so a step can switch copies without
    touching the cache. `float32` (an fp32 model only) is no copy at all: the checkpoint's
    plain row-major matrices stay beside oneDNN's packed ones, and tandem's GEMV kernel
    (tandem/kernels/dense_gemv.py) streams them at 1.3-1.9x oneDNN's one-row rate. Exact fp32
    arithmetic like the packed path, at the cost of holding the layers' weights twice.
    `bfloat16` in a bf16 model is the same: its own bf16 rows, no rounding beyond the dtype's
    (in an fp32 model it is a rounded copy).
    """

    max_tokens: int
    format: str  # float16 | bfloat16 | int4 | float32
    group_size: int = 32  # int4: input columns sharing a scale and zero point
    # int4: a matrix whose 4-bit copy is further than this from it (relative Frobenius norm)
    # keeps its dense weights; None: every matrix goes to 4 bits. A GGUF's own 4-bit tensors
    # come back exactly; its 6- and 8-bit ones (often the LM head) would not.
    int4_max_error: float | None = None

    def __post_init__(self) -> None:
        if self.format not in DECODE_WEIGHT_FORMATS:
            raise ValueError(f"small-step weights must be one of {', '.join(DECODE_WEIGHT_FORMATS)}, not {self.format!r}")
        if self.format == "int4" and not int4_available():
            raise ValueError("int4 small-step weights need PyTorch's CPU int4 kernel (torch>=2.6)")

    @property
    def dtype(self) -> torch.dtype | None:
        """The half-precision dtype of the copy (None for int4)."""
        return None if self.format == "int4" else getattr(torch, self.format)


ERROR_ROWS = 64  # output rows judged together by _relative_error


def _relative_error(compact: Q4Matrix | Int4Weight, weight: torch.Tensor) -> float:
    """How far a compact copy is from the weights: the relative Frobenius error of its worst
    block of 64 output rows. Over the whole matrix, a fused matrix's small part could hide
    behind the rest: Qwen2.5-Coder-0.5B's qkv holds its v rows (128 of 1,152) in Q8_0 and q,
    k in Q5_0 in some layers, where 5 bits came within 0.65% of the whole matrix but ~4.5%
    of v; the parts' row counts are multiples of 64."""
    dense = weight.float()
    error = (compact.dequantize().float() - dense).square().sum(dim=1)
    norm = dense.square().sum(dim=1)
    pad = -error.numel() % ERROR_ROWS
    blocks = torch.nn.functional.pad(error, (0, pad)).reshape(-1, ERROR_ROWS).sum(dim=1)
    norms = torch.nn.functional.pad(norm, (0, pad)).reshape(-1, ERROR_ROWS).sum(dim=1)
    return float((blocks / norms.clamp_min(1e-30)).sqrt().max())


def _compact_within(scheme: type[Q4Matrix], weight: torch.Tensor, kernel: Q4Kernel,
                    max_error: float | None) -> Q4Matrix | None:
    """`scheme`'s copy of `weight` where it is within `max_error` (any, where None), else None.
    A copy is tried first on every 8th block of 64 rows: where one of those is already too far
    the whole matrix is (its worst block is at least as far), and only the copies that pass
    are made whole. Start-up made three copies of Qwen2.5-Coder-0.5B's 136M-weight LM head
    before taking the third."""
    if max_error is not None:
        blocks = weight.shape[0] // ERROR_ROWS  # whole ones
        if blocks >= 16:
            rows = torch.arange(0, blocks, 8).mul_(ERROR_ROWS).unsqueeze(1) + torch.arange(ERROR_ROWS)
            sample = weight[rows.flatten()]
            if _relative_error(scheme.quantize(sample, kernel), sample) > max_error:
                return None
    copy = scheme.quantize(weight, kernel)
    return copy if max_error is None or _relative_error(copy, weight) <= max_error else None


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@functools.cache
def onednn_bf16_available() -> bool:
    """Whether oneDNN has a bf16 GEMM for this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT): an
    AVX2-only EPYC has neither, and packing a bf16 matrix there raises."""
    return onednn_available() and _onednn_bf16()


# From this many rows a bf16 matmul on a CPU without a bf16 GEMM is computed in fp32.
_WIDEN_MIN_ROWS = 4
# Up to this many rows such a matmul reads the bf16 weights through the GEMV kernel instead
# (SmolLM2's 1536 x 576 on the 2-core AVX2 EPYC, one thread: 0.20 / 0.34 / 0.67 / 1.32 ms at
# 1 / 4 / 8 / 16 rows against 0.38 / 1.47 / 1.75 / 2.15 widened and 0.37 / 1.40 / 2.81 / 5.79
# through torch's bf16 loop).
GEMV_MAX_ROWS = 16


def attach_bf16_gemv(model: nn.Module, kernel: DenseGemvKernel) -> int:
    """Give every bf16 linear layer (and the LM head) the GEMV kernel for steps of up to
    `GEMV_MAX_ROWS` rows, reading the layer's own weights (no copy); for a CPU whose oneDNN
    has no bf16 GEMM. Returns the layers given it."""
    count = 0
    for layer in model.modules():
        if not isinstance(layer, LinearWeights) or layer.int4 is not None or layer.int8 is not None:
            continue
        weight = layer.weight.detach()
        if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.numel() == 0 or weight.device.type != "cpu":
            continue
        bias = getattr(layer, "bias", None)
        layer.gemv_rows = DenseRows(weight.contiguous(), None if bias is None else bias.detach().float(), kernel)
        count += 1
    return count


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except bf16 on a CPU whose oneDNN has no bf16 GEMM (an AVX2-only EPYC): there
    torch's bf16 GEMM is a slow generic loop (SmolLM2's 1536 x 576 gate/up at 64 rows: 35 ms,
    against 5 ms widening both to fp32 for the call, weights included), so from
    `_WIDEN_MIN_ROWS` rows the operands are widened (exactly: bf16 values are fp32 values),
    multiplied in fp32 and the result rounded to bf16 once, as a bf16 GEMM's fp32
    accumulators are."""
    if (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.device.type == "cpu"
            and x.numel() >= _WIDEN_MIN_ROWS * x.shape[-1] and not onednn_bf16_available()):
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(torch.bfloat16)
    return F.linear(x, weight, bias)


def dense_einsum(equation: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """torch.einsum of activations and a weight, except bf16 on a CPU whose oneDNN has no bf16
    GEMM: there the batched per-head products of MLA's absorbed attention (64 heads of 128 x
    512) run torch's generic bf16 loop (16 rows: 85 ms a layer on the 2-core AVX2 EPYC), so
    both operands are widened (exactly), multiplied in fp32 and rounded to bf16 once (11 ms;
    one row: 7.2 -> 6.0 ms)."""
    if (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.device.type == "cpu"
            and not onednn_bf16_available()):
        return torch.einsum(equation, x.float(), weight.float()).to(torch.bfloat16)
    return torch.einsum(equation, x, weight.to(x.dtype))


def _packable(weight: torch.Tensor) -> bool:
    """fp32 always; bf16 where oneDNN has a bf16 GEMM for this CPU."""
    if weight.device.type != "cpu":
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and onednn_bf16_available())


@functools.cache
def _onednn_bf16() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _tensor_nbytes(tensor: torch.Tensor) -> int:
    """A tensor's bytes, oneDNN's packed (mkldnn) tensors too, which have no plain storage."""
    return tensor.numel() * tensor.element_size()


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked layout for `weight`, tuned for a batch around 64 tokens."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 64)


# oneDNN's packed GEMM streams the weights at full speed from 3 to 6 rows, but its 1- and
# 2-row paths are slower than 4 rows. Measured on the 2-core AVX-512 EPYC, one thread, every
# matrix of a model streamed from memory: SmolLM2-135M fp32 29.3 / 34.3 / 22.6 ms at 1 / 2 /
# 4 rows, Qwen2.5-Coder-0.5B bf16 45.8 / 54.4 / 38.7, Qwen2.5-Coder-1.5B bf16 173 / 216 / 137;
# a whole decode step of the first two 9% and 10% faster. So fewer rows are padded to 4
# with zeros and the extra rows dropped: each output row is computed as before, from its own
# input row.
_ONEDNN_MIN_ROWS = 4


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    if x.dim() != 2 or x.shape[0] >= _ONEDNN_MIN_ROWS:
        return x
    return torch.cat([x, x.new_zeros(_ONEDNN_MIN_ROWS - x.shape[0], x.shape[1])])


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, unary: str = "none") -> torch.Tensor:
    out = torch.ops.mkldnn._linear_pointwise(_pad_rows(x), packed, bias, unary, [], "")
    return out if out.shape[0] == x.shape[0] else out[: x.shape[0]]


def _onednn_linear_binary(
    x: torch.Tensor, other: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, op: str
) -> torch.Tensor:
    """`(x @ W.T + b) op other` in one oneDNN call: the elementwise op runs as a GEMM post-op
    on each output tile while it is in cache, instead of a second pass over memory."""
    out = torch.ops.mkldnn._linear_pointwise.binary(_pad_rows(x), _pad_rows(other), packed, bias, op)
    return out if out.shape[0] == x.shape[0] else out[: x.shape[0]]


class LinearWeights:
    """Mixin for layers with `weight` (and `bias`): how the weights are stored and read.

    By default the dense weight goes through F.linear (MKL). On CPU, `pack_for_cpu` reorders
    fp32/bf16 weights into oneDNN's blocked layout once, which runs the same arithmetic
    1.7x faster than F.linear at 1 token and 64 tokens alike (the approach vLLM's CPU
    backend takes through oneDNN as well); `attach_small_step_weights` adds the fast mode.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    small_step: SmallStepWeights | None = None
    small_quantized: Q4Matrix | Int4Weight | None = None  # int4 plan: 4 bits (5 or 8 where 4 would spoil it)
    small_packed: torch.Tensor | None = None  # int4 plan, a matrix 4 bits would spoil: packed bf16
    small_dense: DenseRows | None = None  # float32 plan: the plain fp32 rows for the GEMV kernel
    packed_weight: torch.Tensor | None = None
    dense_packed: PackedDense | None = None  # tandem's packed GEMM's layout, instead of oneDNN's
    dense_gemm: DenseGemmKernel | None = None
    int8: Int8Weight | None = None  # --quantization int8: what steps beyond the small copy read
    gemv_rows: DenseRows | None = None  # a bf16 matrix on a CPU without a bf16 GEMM: small steps' GEMV
    gpu_gemv: OneRowGemv | None = None  # on a GPU: one-row steps through tandem's tuned GEMV, not cuBLAS

    @property
    def int4(self) -> Int4Linear | None:
        """A W4A16 checkpoint's matrix, kept in 4 bits (every step reads it): a submodule, so
        its buffers move and count with the model's."""
        return self._modules.get("int4_weights")  # type: ignore[attr-defined, return-value]

    def _int4_weights(self) -> Int4Linear:
        """The 4-bit weights, made when the first INT4 tensor of this layer arrives; the dense
        weight (never written: torch.empty pages) is released. The loader's threads may bring
        two tensors of one layer at once (q_proj's and k_proj's): one lock per layer (dict
        setdefault is atomic) makes it once, or the second would drop the first's rows."""
        with self.__dict__.setdefault("_int4_lock", threading.Lock()):
            if self.int4 is None:
                out_features, in_features = self.weight.shape
                self.int4_weights = Int4Linear(out_features, in_features, self.weight.device)
                self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)
        assert self.int4 is not None
        return self.int4

    def quantize_int8(self, kernel: Int8RowsKernel | None = None, gemm: Int8GemmKernel | None = None) -> bool:
        """Replace the weights that large steps read by an 8-bit copy (W8A8), packed for
        tandem's int8 GEMM where `gemm` is given; False where the matrix's shape does not fit
        the integer GEMM, which then keeps its weights."""
        weight = self.weight.detach()
        if self.int4 is not None or not int8_fits(weight):
            return False
        self.int8 = Int8Weight.quantize(weight, kernel, gemm=gemm, gate_up=self._int8_gate_up_pairs())
        return True

    def _int8_gate_up_pairs(self) -> bool:
        """Whether the 8-bit copy packs as a gated MLP's gate/up pairs (GateUpLinear)."""
        return False

    def attach_small_step_weights(self, plan: SmallStepWeights, q4_kernel: Q4Kernel | None = None,
                                  dense_kernel: DenseGemvKernel | None = None) -> int:
        """Make the copy; returns the bytes it adds (0: this matrix keeps its dense weights).
        int4 uses tandem's 4-bit GEMM (`q4_kernel`) where given, else PyTorch's; float32
        needs the GEMV kernel (`dense_kernel`) and fp32 weights, else adds nothing."""
        weight = self.weight.detach()
        if self.int4 is not None:  # already 4 bits for every step
            return 0
        if plan.format == "float32" or (plan.format == "bfloat16" and weight.dtype == torch.bfloat16
                                        and dense_kernel is not None):
            return self._attach_dense_rows(plan, dense_kernel)
        if plan.format == "int4":
            int4: Q4Matrix | Int4Weight | None
            if q4_kernel is not None and q4_fits(weight):
                # the fewest bits that hold the matrix within the bar: 4 (a Q4 GGUF's tensor),
                # 5 (a Q5_0 one), 8 (a Q8_0 one), else bf16
                int4 = next((copy for scheme in (Q4Matrix, Q5Matrix, Q8Matrix)
                             if (copy := _compact_within(scheme, weight, q4_kernel, plan.int4_max_error))
                             is not None), None)
            elif int4_fits(weight, plan.group_size):
                int4 = Int4Weight.quantize(weight, plan.group_size)
                if plan.int4_max_error is not None and _relative_error(int4, weight) > plan.int4_max_error:
                    int4 = None
            else:
                int4 = None
            if int4 is None:
                return self._attach_bf16_fallback(plan)
            self.small_quantized = int4
            self.small_step = plan
            return int4.nbytes
        self.small_weight = weight.to(plan.dtype).contiguous()
        bias = getattr(self, "bias", None)
        self.small_bias = None if bias is None else bias.detach().to(plan.dtype)
        self.small_step = plan
        return self.small_weight.numel() * self.small_weight.element_size()

    def _attach_dense_rows(self, plan: SmallStepWeights, kernel: DenseGemvKernel | None) -> int:
        """Keep the model's own plain rows (fp32 under `float32`, bf16 under `bfloat16` in a
        bf16 model) for the GEMV kernel, and an fp32 matrix's lossless codes where it has them
        (kernels/lossless_rows.py), which its small steps then read. The bytes added are those
        packing would otherwise release, and the codes; a tied head keeps its rows anyway (the
        embedding reads them)."""
        weight = self.weight.detach()
        if kernel is None or weight.dtype != plan.dtype or weight.dim() != 2 or weight.device.type != "cpu":
            return 0
        bias = getattr(self, "bias", None)
        self.small_dense = DenseRows(weight.contiguous(), None if bias is None else bias.detach().float(), kernel)
        self.small_step = plan
        if self.small_dense.with_codes():  # fp32 only; packing lets go of the plain rows then
            return self.small_dense.codes.numel()
        return 0 if getattr(self, "tied", False) else weight.numel() * weight.element_size()

    def _attach_bf16_fallback(self, plan: SmallStepWeights) -> int:
        """A matrix that 4 bits would spoil (an 8-bit LM head) or that the 4-bit kernels
        cannot read: small steps read a oneDNN-packed bf16 copy instead, half an fp32
        matrix's bytes (SmolLM2's tied LM head: 57 MB instead of 113 MB a token). Without
        oneDNN's bf16 GEMM it keeps its dense weights (0 bytes added)."""
        weight = self.weight.detach()
        if not onednn_bf16_available() or weight.dtype != torch.float32 or weight.device.type != "cpu":
            return 0
        self.small_packed = _pack(weight.to(torch.bfloat16))
        bias = getattr(self, "bias", None)
        self.small_bias = None if bias is None else bias.detach().to(torch.bfloat16)
        self.small_step = plan
        return weight.numel() * 2

    def pack_for_cpu(self, drop_dense: bool, dense_gemm: DenseGemmKernel | None = None, weight_bits: int = 16) -> int:
        """Reorder the weight for tandem's packed GEMM where `dense_gemm` takes it, else for
        oneDNN; returns the bytes of dense weight released. An int8 layer has nothing to pack:
        it only drops its dense weight. `weight_bits` 8: 8-bit weights for bf16 rows
        (`--quantization w8a16`) where the GEMM takes them, else the dtype's."""
        weight = self.weight.detach()
        if self.int8 is not None:
            return self._release_dense() if drop_dense else 0
        if self.int4 is not None:
            return 0
        bits = weight_bits if dense_gemm is not None and dense_gemm.fits(weight, weight_bits) else 16
        if dense_gemm is not None and dense_gemm.fits(weight, bits):
            self.dense_packed, self.dense_gemm = dense_gemm.pack(weight, bits), dense_gemm
        elif _packable(weight):
            self.packed_weight = _pack(weight)
        else:
            return 0
        return self._release_dense() if drop_dense else 0

    @property
    def packed(self) -> bool:
        """Whether larger steps read a packed copy (tandem's GEMM's or oneDNN's)."""
        return self.dense_packed is not None or self.packed_weight is not None

    def _dense_matmul(self, x: torch.Tensor, bias: torch.Tensor | None,
                      residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] through tandem's packed GEMM (+ bias) (+ residual), one rounding."""
        assert self.dense_gemm is not None and self.dense_packed is not None
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        flat_residual = None if residual is None else residual.reshape(rows.shape[0], -1)
        out = self.dense_gemm.matmul(rows, self.dense_packed, bias, flat_residual)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def _release_dense(self) -> int:
        weight = self.weight.detach()
        self.weight.data = torch.empty(0, dtype=weight.dtype)
        return weight.numel() * weight.element_size()

    def uses_small_step(self, x: torch.Tensor) -> bool:
        return self.small_step is not None and x.shape[0] <= self.small_step.max_tokens

    def _small_step_takes(self, tokens: int) -> bool:
        return self.small_step is not None and tokens <= self.small_step.max_tokens

    def step_read_bytes(self, tokens: int) -> int:
        """The weight bytes `linear` reads for a CPU step of `tokens` rows: those of the copy
        its dispatch picks, kept beside it so the two choose alike (biases left out). A mode's
        limit in `tandem bench offline` counts these, not the dtype's bytes: a one-token step
        of the default mode reads 4- and 8-bit copies, of exact fp32 its lossless codes."""
        if self.int4 is not None:
            return self.int4.nbytes
        if self._small_step_takes(tokens):
            if self.small_dense is not None:
                return self.small_dense.read_nbytes
            if self.small_quantized is not None:
                return self.small_quantized.nbytes
            return _tensor_nbytes(self.small_packed if self.small_packed is not None else self.small_weight)
        if self.gemv_rows is not None and tokens <= GEMV_MAX_ROWS:
            return self.gemv_rows.read_nbytes
        if self.int8 is not None:
            return self.int8.read_nbytes
        if self.dense_packed is not None:
            return _tensor_nbytes(self.dense_packed.values)
        return _tensor_nbytes(self.packed_weight if self.packed_weight is not None else self.weight)

    def _reads_dense_packed(self, x: torch.Tensor) -> bool:
        """Whether `linear(x)` runs tandem's packed GEMM: nothing it tries first takes x (a
        4-bit checkpoint matrix, the GPU GEMV, a small-step copy, the bf16 GEMV, 8 bits)."""
        return (self.dense_packed is not None and self.int4 is None and self.int8 is None
                and not (self.gpu_gemv is not None and self.gpu_gemv.takes(x, self.weight))
                and not self.uses_small_step(x)
                and not (self.gemv_rows is not None and x.numel() <= GEMV_MAX_ROWS * x.shape[-1]))

    def dense_argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """Each row of x [rows, in]: the argmax of its `linear` product, where that product is
        tandem's packed GEMM's and the kernel finds the argmax without writing the product
        (DenseGemmKernel.argmax: bf16 on AMX); None elsewhere, or with a bias."""
        if getattr(self, "bias", None) is not None or x.dim() != 2 or not self._reads_dense_packed(x):
            return None
        assert self.dense_gemm is not None and self.dense_packed is not None
        return self.dense_gemm.argmax(x if x.stride(-1) == 1 else x.contiguous(), self.dense_packed)

    def linear(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        bias = getattr(self, "bias", None) if with_bias else None
        if self.int4 is not None:
            out = self.int4.matmul(x)
            return out if bias is None else out + bias
        if self.gpu_gemv is not None and self.gpu_gemv.takes(x, self.weight):
            return self.gpu_gemv.matmul(x, self.weight, bias)
        if self.uses_small_step(x):
            if self.small_dense is not None:
                return self.small_dense.matmul(x, with_bias)
            if self.small_quantized is not None:
                out = self.small_quantized.matmul(x)
                return out if bias is None else out + bias
            if self.small_packed is not None:
                small_bias = self.small_bias if with_bias else None
                return _onednn_linear(x.to(torch.bfloat16), self.small_packed, small_bias).to(x.dtype)
            small_bias = self.small_bias if with_bias else None
            return F.linear(x.to(self.small_step.dtype), self.small_weight, small_bias).to(x.dtype)
        if self.gemv_rows is not None and x.numel() <= GEMV_MAX_ROWS * x.shape[-1]:
            return self.gemv_rows.matmul(x, with_bias)
        if self.int8 is not None:
            return self.int8.matmul(x, bias)
        if self.dense_packed is not None:
            return self._dense_matmul(x, bias)
        if self.packed_weight is not None:
            return _onednn_linear(x, self.packed_weight, bias)
        return dense_linear(x, self.weight, bias)

    def linear_plus(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual + linear(x)`, the residual add fused into the GEMM where weights are packed
        and into tandem's 4-bit GEMM."""
        if self.gpu_gemv is not None and self.gpu_gemv.takes(x, self.weight):
            return self.gpu_gemv.matmul(x, self.weight, getattr(self, "bias", None), residual)
        if self.uses_small_step(x):
            if self.small_dense is not None:
                return self.small_dense.matmul(x, residual=residual)
            if isinstance(self.small_quantized, Q4Matrix) and getattr(self, "bias", None) is None:
                fused = self.small_quantized.matmul_plus(x, residual)
                if fused is not None:
                    return fused
        else:
            if self.gemv_rows is not None and x.numel() <= GEMV_MAX_ROWS * x.shape[-1]:
                return self.gemv_rows.matmul(x, residual=residual)
            if self.int8 is not None:
                return self.int8.matmul(x, getattr(self, "bias", None), residual)
            if self.dense_packed is not None:
                return self._dense_matmul(x, getattr(self, "bias", None), residual)
            if self.packed_weight is not None:
                return _onednn_linear_binary(x, residual, self.packed_weight, getattr(self, "bias", None), "add")
        if x.device.type == "cuda" and x.dim() == 2 and getattr(self, "bias", None) is None and self.int4 is None:
            # One cuBLAS call with the add in its epilogue (beta = 1) instead of a GEMM and an
            # add kernel: on a GPU, decode's small kernels cost launches, not bytes. The sum
            # is rounded once, not twice; the CPU keeps transformers' two roundings.
            return torch.addmm(residual, x, self.weight.t())
        return residual + self.linear(x)


class OneRowGemv(Protocol):
    """A GPU's one-row matmul for a layer (tandem/kernels/gpu/gemv.py `GpuGemv`)."""

    def takes(self, x: torch.Tensor, weight: torch.Tensor) -> bool: ...

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, silu_mul: bool = False) -> torch.Tensor: ...


def attach_gpu_gemv(model: nn.Module, kernels: Mapping[tuple[int, int], OneRowGemv]) -> int:
    """Give each dense linear layer whose [out, in] has a kernel in `kernels` (the GPU's tuned
    table; the caller attaches on a GPU only) that kernel for one-row steps; returns how many
    took one."""
    taken = 0
    for layer in model.modules():
        if not isinstance(layer, LinearWeights) or layer.int4 is not None or layer.int8 is not None:
            continue
        weight = layer.weight
        if weight.dim() != 2 or weight.stride(-1) != 1:
            continue
        kernel = kernels.get((weight.shape[0], weight.shape[1]))
        if kernel is not None:
            layer.gpu_gemv = kernel
            taken += 1
    return taken


def attach_small_step_weights(model: nn.Module, plan: SmallStepWeights, q4_kernel: Q4Kernel | None = None,
                              dense_kernel: DenseGemvKernel | None = None) -> int:
    """Give every linear layer and the LM head a small-step copy; returns the bytes added."""
    return sum(m.attach_small_step_weights(plan, q4_kernel, dense_kernel)
               for m in model.modules() if isinstance(m, LinearWeights))


def release_coded_rows(model: nn.Module) -> int:
    """Let go of the plain fp32 rows that lossless codes stand for (every projection but a tied
    head, whose rows are the embedding's); returns the bytes let go. Call it once the model is
    built: packing has its own copy by then, and the bounded-greedy head its own reference."""
    return sum(module.small_dense.release_plain_rows() for module in model.modules()
               if isinstance(module, LinearWeights) and module.small_dense is not None
               and not getattr(module, "tied", False))


def small_step_census(model: nn.Module) -> dict[str, int]:
    """How many matrices each kind of small-step copy holds ("4-bit", "5-bit", "8-bit",
    "bf16"): an int4 plan keeps 5 or 8 bits or bf16 where 4 bits would spoil a matrix (a Q5_0
    or Q6_K GGUF tensor re-rounded to 4 bits is ~8% off), and the start-up log says how many
    did."""
    census: dict[str, int] = {}
    for layer in model.modules():
        if not isinstance(layer, LinearWeights) or getattr(layer, "small_step", None) is None:
            continue
        compact = getattr(layer, "small_quantized", None)
        kind = (f"{compact.bits}-bit" if isinstance(compact, Q4Matrix) else "4-bit" if compact is not None
                else "bf16" if getattr(layer, "small_packed", None) is not None else "dense")
        census[kind] = census.get(kind, 0) + 1
    return census


def quantize_int8(model: nn.Module, kernel: Int8RowsKernel | None = None, gemm: Int8GemmKernel | None = None) -> int:
    """--quantization int8: every projection of the decoder layers and the LM head (not the
    experts' fused weights) gets its 8-bit copy. Returns the number of matrices quantized.

    The head is the largest matrix a decode step of many sequences reads (SmolLM2's 49,152 x
    576 took 9.9 ms of a 64-sequence step in bf16, 7.5 ms in W8A8); `tandem bench perplexity`
    reports what 8 bits cost with it. `gemm`: tandem's packed int8 GEMM, where it is the
    faster one (worker/model_builder.py)."""
    return sum(m.quantize_int8(kernel, gemm) for m in model.modules() if isinstance(m, LinearWeights))


def pack_weights_for_cpu(model: nn.Module, dense_gemm: DenseGemmKernel | None = None, weight_bits: int = 16) -> int:
    """Pack every linear layer and the LM head, for tandem's packed GEMM where `dense_gemm` is
    given and takes the matrix, else for oneDNN, dropping their dense copies, except a head
    tied to the embedding (the embedding reads it). `weight_bits` 8: the decoder layers'
    projections as 8-bit weights where the GEMM takes them (the LM head keeps the dtype's: its
    logits pick the tokens). Returns the layers packed; 0 when neither is available."""
    if dense_gemm is None and not onednn_available():
        return 0
    layers = [m for m in model.modules() if isinstance(m, LinearWeights)]
    for layer in layers:
        bits = weight_bits if isinstance(layer, Linear) else 16
        layer.pack_for_cpu(drop_dense=not getattr(layer, "tied", False), dense_gemm=dense_gemm, weight_bits=bits)
        if isinstance(layer, Linear) and layer.small_dense is not None:
            # plain rows that lossless codes stand for go now, not once every matrix is packed:
            # the build's peak holds a matrix twice, not the model (a head waits for
            # release_coded_rows: the bounded-greedy head reads its rows after packing)
            layer.small_dense.release_plain_rows()
    return len(layers)


def count_8bit_packed(model: nn.Module) -> int:
    """The projections whose larger steps read 8-bit packed weights (`--quantization w8a16`)."""
    return sum(1 for m in model.modules() if isinstance(m, Linear)
               and any(p is not None and p.values.dtype == torch.int8
                       for p in (m.dense_packed, getattr(m, "gated_packed", None))))


class Linear(LinearWeights, nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.linear(x) if residual is None else self.linear_plus(x, residual)

    def load(self, param_name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        if param_name in INT4_FIELDS:
            return self._int4_weights().load(param_name, tensor, self._whole_int4_shape())
        target = self.weight if param_name == "weight" else self.bias
        if target is None:
            raise ValueError(f"checkpoint has a {param_name} this layer was built without")
        if target.shape != tensor.shape:
            raise ValueError(f"shape mismatch: checkpoint {tuple(tensor.shape)} vs layer {tuple(target.shape)}")
        target.data.copy_(tensor)
        return None

    def _whole_int4_shape(self) -> tuple[int, int]:
        """The checkpoint matrix's [out, in] (this layer's, unsplit)."""
        weights = self._int4_weights()
        return weights.out_features, weights.in_features


Part = tuple[int, int]  # (start, length) of this rank's rows or columns in the whole matrix


class ColumnParallelLinear(Linear):
    """A projection whose output rows are split over the tensor-parallel group: each rank
    computes its own slice of the output (its heads, its part of the intermediate), no
    communication. `out_features` is the whole model's; the layer holds 1/size of it."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: TensorParallel = SINGLE_RANK) -> None:
        super().__init__(in_features, tp.divide(out_features, "projection width"), bias)
        self.tp = tp

    def load(self, param_name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        if param_name in INT4_FIELDS:
            weights = self._int4_weights()
            rows = (self.tp.rank * weights.out_features, weights.out_features)
            return weights.load(param_name, tensor, (weights.out_features * self.tp.size, weights.in_features), rows)
        return super().load(param_name, self.tp.shard(tensor, 0))


class RowParallelLinear(Linear):
    """A projection whose input columns are split over the group (o_proj, down_proj): each
    rank multiplies its slice of the input by its columns, and one all-reduce sums the
    partial outputs; the bias and the residual are added once, after the sum. `part` is this
    rank's column range when it is not an even share (heads dealt by KV group)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, tp: TensorParallel = SINGLE_RANK,
        part: Part | None = None,
    ) -> None:
        self.part = part or (tp.rank * tp.divide(in_features, "projection input width"), in_features // tp.size)
        super().__init__(self.part[1], out_features, bias)
        self.in_features_whole = in_features
        self.tp = tp

    def load(self, param_name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        if param_name in INT4_FIELDS:
            weights = self._int4_weights()
            whole = (weights.out_features, self.in_features_whole)
            return weights.load(param_name, tensor, whole, columns=self.part if self.tp.split else None)
        if param_name == "weight" and self.tp.split:
            tensor = tensor.narrow(1, *self.part)
        return super().load(param_name, tensor)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if not self.tp.split:
            return super().forward(x, residual)
        out = self.tp.all_reduce(self.linear(x, with_bias=False))
        if self.bias is not None:
            out = out + self.bias
        return out if residual is None else out + residual


class MergedLinear(Linear):
    """Several projections of one input stacked along the output dimension; under tensor
    parallelism each keeps its own slice of every projection (its q, k and v heads)."""

    def __init__(
        self, in_features: int, out_sizes: list[int], bias: bool = False, tp: TensorParallel = SINGLE_RANK,
        parts: list[Part] | None = None,
    ) -> None:
        # This rank's rows of each projection: an even share, or `parts` (heads by KV group).
        self.whole_sizes = list(out_sizes)
        self.parts = parts or [
            (tp.rank * tp.divide(size, "projection width"), size // tp.size) for size in out_sizes
        ]
        out_sizes = [length for _, length in self.parts]
        super().__init__(in_features, sum(out_sizes), bias)
        self.tp = tp
        self.out_sizes = list(out_sizes)
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]

    def load(self, param_name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        if param_name in INT4_FIELDS:
            return self._load_int4(param_name, tensor, shard)
        if shard is None:
            if not self.tp.split:
                return super().load(param_name, tensor)
            for index, part in enumerate(tensor.split(self.whole_sizes)):  # a checkpoint already merged
                self.load(param_name, part, index)
            return None
        target = self.weight if param_name == "weight" else self.bias
        if target is None:
            raise ValueError(f"checkpoint has a {param_name} this layer was built without")
        if self.tp.split:
            tensor = tensor.narrow(0, *self.parts[shard])
        rows = target.data.narrow(0, self.offsets[shard], self.out_sizes[shard])
        if rows.shape != tensor.shape:
            raise ValueError(f"shape mismatch: checkpoint {tuple(tensor.shape)} vs shard {tuple(rows.shape)}")
        rows.copy_(tensor)
        return None

    def _load_int4(self, field: str, tensor: torch.Tensor, shard: int | None) -> None:
        """One projection's INT4 tensor at its rows (`shard`), or a checkpoint's merged one."""
        weights = self._int4_weights()
        if shard is None:
            if field == "weight_shape":
                return weights.load(field, tensor, (sum(self.whole_sizes), weights.in_features))
            for index, part in enumerate(tensor.split(self.whole_sizes)):
                self._load_int4(field, part, index)
            return None
        whole = (self.whole_sizes[shard], weights.in_features)
        rows = self.parts[shard] if self.tp.split else None
        return weights.load(field, tensor, whole, rows, offset=self.offsets[shard])


class SiluMulPass(Protocol):
    """`silu(gate) * up` of [T, 2 * I] in one call: the C pass on the CPU (attach_layer_ops),
    the Triton kernel on a GPU (attach_gpu_passes). `every_step`: taken for every step, not
    only off the exact path (small-step copies, 8-bit weights): a GPU's bf16 is not exact."""

    every_step: bool

    def takes_silu_mul(self, gate_up: torch.Tensor) -> bool: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...


class GateUpLinear(MergedLinear):
    """The gate and up projections of a gated MLP, producing `silu(gate) * up` directly.

    On CPU with packed weights the [tokens, 2 x intermediate] product is never written and
    re-read by separate silu and mul passes (12% of the MLP's time at 2048 tokens, 16% at 64,
    on a 2-core AVX2 CPU): tandem's packed GEMM takes the gate and up blocks side by side and
    writes silu(gate) * up from its registers, where the CPU has it (kernels/dense_gemm.py);
    elsewhere each half is packed for oneDNN, the gate GEMM applying silu as a post-op and the
    up GEMM multiplying by the gate as another. Small-step copies and unpacked weights run one
    merged GEMM and the silu-mul pass or two torch ops.
    """

    packed_halves: tuple[torch.Tensor, torch.Tensor] | None = None
    gated_packed: PackedDense | None = None  # gate and up blocks alternating, for dense_gemm's silu_mul
    ops: SiluMulPass | None = None  # silu-and-mul in one pass: C for small steps, Triton on a GPU

    def __init__(self, in_features: int, intermediate: int, bias: bool = False, tp: TensorParallel = SINGLE_RANK) -> None:
        super().__init__(in_features, [intermediate, intermediate], bias, tp)
        self.intermediate = self.out_sizes[0]

    def pack_for_cpu(self, drop_dense: bool, dense_gemm: DenseGemmKernel | None = None, weight_bits: int = 16) -> int:
        """tandem's packed GEMM with the silu-mul epilogue where `dense_gemm` takes the matrix
        (8-bit weights with `weight_bits` 8 where it takes those), else oneDNN's two halves with
        silu and mul as post-ops. Either way the result is rounded once from fp32 and does not
        depend on which small-step passes are attached."""
        weight = self.weight.detach()
        if self.int8 is not None or self.int4 is not None:
            return super().pack_for_cpu(drop_dense)
        bits = weight_bits if dense_gemm is not None and dense_gemm.fits(weight, weight_bits) else 16
        if dense_gemm is not None and dense_gemm.fits(weight) and self.intermediate % BLOCK_COLUMNS == 0:
            self.gated_packed, self.dense_gemm = dense_gemm.pack_gated(weight, bits), dense_gemm
        elif _packable(weight):
            gate, up = weight.split(self.intermediate)
            self.packed_halves = (_pack(gate), _pack(up))
        else:
            return 0
        return self._release_dense() if drop_dense else 0

    @property
    def packed(self) -> bool:
        return super().packed or self.gated_packed is not None or self.packed_halves is not None

    def step_read_bytes(self, tokens: int) -> int:
        """As `forward` picks: the gated or halved packed layouts for larger steps where it has
        them, else what `linear` reads."""
        if not self._small_step_takes(tokens):
            if self.gated_packed is not None:
                return _tensor_nbytes(self.gated_packed.values)
            if self.packed_halves is not None:
                return sum(_tensor_nbytes(half) for half in self.packed_halves)
        return super().step_read_bytes(tokens)

    def _int8_gate_up_pairs(self) -> bool:
        """Pack the 8-bit copy in gate/up pairs where `gated_down` will run it (no bias, no
        tensor-parallel split): the GEMM's epilogue then writes the middle."""
        return self.bias is None and not self.tp.split

    def gated_down(self, down: RowParallelLinear, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor | None:
        """residual + down(silu(gate) * up) with the middle in one C pass, where both
        projections hold 8-bit weights for a step this size (tandem/layers/int8.py
        `gated_mlp`); None otherwise, and the caller runs them one by one. On the 2-core
        AVX-512 EPYC, 64 bf16 rows of SmolLM2's MLP: the three passes 112 -> 76 us, the MLP
        645 -> 597 us a layer. On a GPU, a one-row step whose down projection has the tuned
        GEMV reads the gate/up row straight into it, silu-and-mul computed as it is read."""
        if down.gpu_gemv is not None and not down.tp.split and down.gpu_gemv.takes(x, down.weight):
            gate_up = self.linear(x)
            if gate_up.shape[-1] == 2 * down.weight.shape[1]:
                return down.gpu_gemv.matmul(gate_up, down.weight, down.bias, residual, silu_mul=True)
            return None
        if (self.int8 is None or down.int8 is None or self.bias is not None or down.tp.split
                or self.uses_small_step(x) or down.uses_small_step(x)):
            return None
        return gated_mlp(self.int8, down.int8, x, residual, down.bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is not None:
            raise ValueError("a gate/up projection takes no residual")
        if self.gated_packed is not None and not self.uses_small_step(x):
            assert self.dense_gemm is not None
            rows = x.reshape(-1, x.shape[-1])
            out = self.dense_gemm.silu_mul(rows if rows.stride(-1) == 1 else rows.contiguous(), self.gated_packed,
                                           self.bias)
            return out.reshape(*x.shape[:-1], self.intermediate)
        if self.packed_halves is not None and not self.uses_small_step(x):
            gate_bias, up_bias = (None, None) if self.bias is None else self.bias.split(self.intermediate)
            gate = _onednn_linear(x, self.packed_halves[0], gate_bias, "swish")
            return _onednn_linear_binary(x, gate, self.packed_halves[1], up_bias, "mul")
        gate_up = self.linear(x)
        # Small-step copies, 8-bit weights and GPUs are not the exact path, so the pass's exp
        # may differ in the last bit from torch's; other CPU steps keep torch's ops (the
        # exact fp32 mode unpacked).
        if (self.ops is not None and (self.ops.every_step or self.uses_small_step(x) or self.int8 is not None)
                and self.ops.takes_silu_mul(gate_up)):
            return self.ops.silu_mul(gate_up)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return F.silu(gate) * up
