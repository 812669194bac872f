"""The small passes between a decoder layer's GEMMs (RMSNorm, rotary, silu-and-mul) as one C
call each (csrc/layer_ops.c).

At a one-token step each of these is several torch ops whose dispatch costs more than their
arithmetic: in the engine on the 2-core AVX-512 EPYC (SmolLM2-135M, bf16, 4-bit decode
weights) the two norms of a layer took 63 us and its rotary 20 us, of a 418 us layer. The C
versions reproduce the torch ops' roundings (see the source's header), so a model gives the
same tokens with or without them, and fp32 rotary stays bit-identical.

Built on first use like the other kernels (c_library.py); where it cannot be built, the
layers run their torch ops.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tandem.kernels.c_library import bind, build_kernel_library, build_or_none

SOURCE = Path(__file__).parent / "csrc" / "layer_ops.c"
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_INT = ctypes.c_int
_SIGNATURES = {
    "tandem_rms_norm_bf16": (None, [_PTR, _I64, _PTR, _PTR, _I64, _I64, ctypes.c_float, _INT]),
    "tandem_rms_norm_f32": (None, [_PTR, _I64, _PTR, _PTR, _I64, _I64, ctypes.c_float, _INT]),
    "tandem_rotary_f32": (None, [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _INT]),
    "tandem_rotary_bf16": (None, [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _INT]),
    "tandem_silu_mul_f32": (None, [_PTR, _PTR, _I64, _I64, _INT]),
    "tandem_silu_mul_bf16": (None, [_PTR, _PTR, _I64, _I64, _INT]),
    "tandem_argmax_f32": (None, [_PTR, _I64, _I64, _I64, _PTR, _INT]),
    "tandem_argmax_bf16": (None, [_PTR, _I64, _I64, _I64, _PTR, _INT]),
    "tandem_bounded_candidates_bf16": (None, [_PTR, _I64, _I64, _I64, _PTR, ctypes.c_double, _PTR, _PTR, _I64,
                                               _INT]),
}
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


class LayerOpsKernel:
    """The loaded C functions, called on tensors' data pointers; each `takes_*` says whether a
    tensor is one the function reads (else the caller runs its torch ops)."""

    # silu-and-mul only off the exact path (small-step copies, 8-bit weights): its exp may
    # differ from torch's in the last bit.
    every_step = False

    def __init__(self, library: Path) -> None:
        functions = bind(library, _SIGNATURES)
        self._rms_norm = {dtype: functions[f"tandem_rms_norm_{suffix}"] for dtype, suffix in _SUFFIX.items()}
        self._rotary = {dtype: functions[f"tandem_rotary_{suffix}"] for dtype, suffix in _SUFFIX.items()}
        self._silu_mul = {dtype: functions[f"tandem_silu_mul_{suffix}"] for dtype, suffix in _SUFFIX.items()}
        self._argmax = {dtype: functions[f"tandem_argmax_{suffix}"] for dtype, suffix in _SUFFIX.items()}
        self._bounded = functions["tandem_bounded_candidates_bf16"]

    # The C functions themselves, for callers in C (tandem/kernels/decode_stack.py).
    def rms_norm_entry(self, dtype: torch.dtype = torch.bfloat16) -> object:
        return self._rms_norm[dtype]

    def rotary_entry(self, dtype: torch.dtype) -> object:
        return self._rotary[dtype]

    def silu_mul_entry(self, dtype: torch.dtype) -> object:
        return self._silu_mul[dtype]

    @classmethod
    def build(cls, cache_dir: Path) -> LayerOpsKernel:
        return cls(build_kernel_library(cache_dir, SOURCE))

    @staticmethod
    def takes_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (x.dtype == weight.dtype and x.dtype in _SUFFIX and x.dim() == 2 and x.stride(1) == 1
                and weight.is_contiguous() and x.device.type == "cpu")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Rows [T, H] -> weight * (x * rsqrt(mean(x^2) + eps)), transformers' formula: bf16 rows
        widened to fp32 and x * rsqrt rounded to bf16 as it rounds; fp32 rows summed in another
        order than torch's (an element can move by a few units in the last place; tested to 4)."""
        rows, hidden = x.shape
        out = torch.empty(rows, hidden, dtype=x.dtype)
        self._rms_norm[x.dtype](x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), rows, hidden, eps,
                                torch.get_num_threads())
        return out

    @staticmethod
    def takes_rotary(x: torch.Tensor, cos: torch.Tensor) -> bool:
        """[T, heads, dim] rows with dense heads (any token stride), tables in x's dtype."""
        return (x.dtype in _SUFFIX and cos.dtype == x.dtype and x.dim() == 3 and x.stride(2) == 1
                and x.stride(1) == x.shape[2] and x.shape[2] % 2 == 0 and cos.is_contiguous()
                and x.device.type == "cpu")

    def rotary_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, dim] in place (rotate-half form) by cos/sin rows [T, ..., dim/2]."""
        tokens, heads, dim = x.shape
        self._rotary[x.dtype](x.data_ptr(), tokens, heads, x.stride(0), dim, cos.data_ptr(),
                              sin.contiguous().data_ptr(), torch.get_num_threads())
        return x

    @staticmethod
    def takes_silu_mul(gate_up: torch.Tensor) -> bool:
        return gate_up.dtype in _SUFFIX and gate_up.dim() == 2 and gate_up.is_contiguous()

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2 * I] gate then up -> silu(gate) * up [T, I]."""
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        self._silu_mul[gate_up.dtype](gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads())
        return out

    @staticmethod
    def takes_argmax(x: torch.Tensor) -> bool:
        return x.dtype in _SUFFIX and x.dim() == 2 and x.stride(1) == 1 and x.device.type == "cpu"

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 or bf16 rows [R, V] -> int64 [R]: torch.argmax(x, -1), the first of equal
        maxima (or the first NaN) in each row; a bf16 row's is its fp32 copy's (widening is
        exact)."""
        rows, cols = x.shape
        out = torch.empty(rows, dtype=torch.int64)
        self._argmax[x.dtype](x.data_ptr(), rows, cols, x.stride(0), out.data_ptr(), torch.get_num_threads())
        return out


    @staticmethod
    def takes_candidates(x: torch.Tensor) -> bool:
        return x.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(1) == 1 and x.device.type == "cpu"

    def bounded_candidates(self, x: torch.Tensor, norm_terms: torch.Tensor, output_factor: float,
                           capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """bf16 rows [R, V] -> (counts [R], ids [R, capacity]): per row, the ids at or above
        top - 2 * (norm_terms[r] + output_factor * max|row|), ascending; a count above
        `capacity` means more than were kept, 0 a row with a NaN (bounded_greedy.py)."""
        rows, cols = x.shape
        norm_terms = norm_terms.to(torch.float64).contiguous()
        counts = torch.empty(rows, dtype=torch.int64)
        ids = torch.empty(rows, capacity, dtype=torch.int64)
        self._bounded(x.data_ptr(), rows, cols, x.stride(0), norm_terms.data_ptr(), output_factor,
                      counts.data_ptr(), ids.data_ptr(), capacity, torch.get_num_threads())
        return counts, ids


def load_layer_ops(cache_dir: Path) -> LayerOpsKernel | None:
    """The kernel, or None (and a warning saying why) where it cannot be built here."""
    return build_or_none(LayerOpsKernel.build, cache_dir, "layer op kernels", "norms and rotary run as torch ops")
