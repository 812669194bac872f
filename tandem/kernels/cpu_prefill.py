"""Prefill attention from the paged cache by a C kernel (csrc/prefill_attention.c).

PyTorch's CPU flash attention reaches 60-130 GFLOP/s on the 2-core AVX-512 EPYC, where a
bf16 GEMM reaches ~450; at an 8,000-token prompt attention is three quarters of the time to
first token. The kernel keeps a tile of queries in the lanes of a vector (16 with AVX-512, 8
with AVX2) so the online softmax is lane-wise, and uses AVX-512-BF16 dot products where the
CPU has them; with AVX-512, fp32 products go through tiles of 6 query rows shaped as the
packed GEMMs (csrc/prefill_attention_avx512.h). Measured there, one layer of SmolLM2 (9 heads, 3 kv heads, dim 64), 2,048
queries after 5,952 cached tokens, 2 threads: bf16 113 ms (291 GFLOP/s) against PyTorch's
251 ms, fp32 202 against 251 ms. On the 2-core AVX2 EPYC, Qwen2.5-0.5B's 14 heads, 2,048
queries after 2,048 cached, fp32: 1,050 ms (21.5 GFLOP/s) with 8-lane tiles, 5,345 ms with
the 16-lane tiles (which spill there), PyTorch's masked SDPA 2,426 ms.

It applies where q, the cache and the output share one dtype (fp32 or bf16) and the head
size is a multiple of 16 up to 256; elsewhere the caller's torch path runs. On a CPU with AMX,
bf16 runs on the tiles (csrc/prefill_attention_amx.h, head sizes a multiple of 32): PyTorch's
flash attention multiplies on them too (through oneDNN), and the AVX-512-BF16 lane tiles ran
at 0.3-0.4x of it there (2-core Xeon with AMX, SmolLM2's shapes, 2 threads: 768 fresh queries
3.87 ms against 1.62 ms, 2,048 queries 25.2 against 7.4 ms, 512 queries after 2,048 cached 14.1
against 4.5 ms). The tiles' path against PyTorch's SDPA on the same box: 768 queries 0.98
against 1.65 ms, 2,048 queries 5.98 against 7.73 ms, 512 after 2,048 cached 3.53 against 4.90
ms. A build without that path leaves bf16 to PyTorch on such a CPU; in fp32 the lane and row
tiles are within 20% of PyTorch either way (3.07 / 3.51, 21.6 / 20.7, 13.3 / 11.3 ms) and stay.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tandem.kernels.c_library import KernelBuildError, build_kernel_library
from tandem.platform.cpu_modes import CpuFeatures

SOURCE = Path(__file__).parent / "csrc" / "prefill_attention.c"
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_KINDS = {torch.float32: 0, torch.bfloat16: 1}


class PrefillAttentionKernel:
    """The loaded C function, called on tensors' data pointers."""

    def __init__(self, library: Path) -> None:
        try:
            loaded = ctypes.CDLL(str(library))
            self._attend = loaded.tandem_prefill_attention
            self._spans = loaded.tandem_prefill_attention_spans
            uses_bf16_dot = loaded.tandem_prefill_uses_bf16_dot
            uses_amx = loaded.tandem_prefill_uses_amx
        except (OSError, AttributeError) as error:
            raise KernelBuildError(f"cannot load {library}: {error}") from error
        self._attend.restype = ctypes.c_int
        self._attend.argtypes = [_PTR, _PTR, _PTR, _PTR, *[_I64] * 9, ctypes.c_int, ctypes.c_float, ctypes.c_int]
        self._spans.restype = ctypes.c_int
        self._spans.argtypes = [_PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, *[_I64] * 7, ctypes.c_int,
                                ctypes.c_float, ctypes.c_int]
        uses_bf16_dot.restype = ctypes.c_int
        uses_amx.restype = ctypes.c_int
        self.amx = bool(uses_amx())  # bf16 products on AMX tiles (head sizes a multiple of 32)
        self.isa = ("AMX tiles in bf16, fp32 FMA in fp32" if self.amx else "AVX-512-BF16 dot products" if uses_bf16_dot()
                    else "fp32 FMA (bf16 widened)")
        # bf16 without the tiles on a CPU that has them: PyTorch's flash attention is the faster.
        self.dtypes = set(_KINDS) if self.amx or not CpuFeatures.detect().amx else {torch.float32}

    @classmethod
    def build(cls, cache_dir: Path) -> PrefillAttentionKernel:
        return cls(build_kernel_library(cache_dir, SOURCE))

    def attend_entry(self) -> object:
        """The C function, for the layer stack (csrc/decode_stack.c) to call directly."""
        return self._attend

    def spans_entry(self) -> object:
        """The C function that takes every prefill chunk of a step in one call, for the layer
        stack."""
        return self._spans

    @staticmethod
    def takes_head_dim(head_dim: int) -> bool:
        """A head size the kernel tiles."""
        return head_dim % 16 == 0 and head_dim <= 256

    def takes(self, q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether the kernel runs this chunk: one dtype it knows and is the faster for, dense
        rows, a head size it tiles."""
        dim = q.shape[-1]
        return (
            q.dtype == kv_cache.dtype and q.dtype in self.dtypes and kv_cache.is_contiguous()
            and q.dim() == 3 and q.stride(2) == 1 and q.stride(1) == dim
            and self.takes_head_dim(dim) and not (self.amx and q.dtype == torch.bfloat16 and dim % 32 != 0)
        )

    def __call__(
        self, q: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor, context_len: int, scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [q_len, heads, dim] -> out [q_len, heads, dim]: causal attention over the first
        `context_len` cached tokens, the last q_len of which are the chunk's own. `out`, where
        given, is written (q's shape and dtype, each token's heads dense, any token stride)."""
        q_len, num_heads, head_dim = q.shape
        _, num_kv_heads, num_blocks, block_size, _ = kv_cache.shape
        if out is None:
            out = torch.empty(q_len, num_heads, head_dim, dtype=q.dtype)
        elif (out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1 or out.stride(1) != head_dim):
            raise ValueError(f"prefill attention writes {tuple(q.shape)} {q.dtype} rows with dense heads, got "
                             f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
        block_ids = block_ids.contiguous()
        status = self._attend(
            q.data_ptr(), kv_cache.data_ptr(), block_ids.data_ptr(), out.data_ptr(), q_len, context_len,
            num_heads, num_kv_heads, head_dim, block_size, num_blocks, q.stride(0), out.stride(0),
            _KINDS[q.dtype], scale, torch.get_num_threads(),
        )
        _check(status, head_dim)
        return out

    def attend_spans(self, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     starts: list[int], lengths: list[int], contexts: list[int], scale: float,
                     out: torch.Tensor) -> torch.Tensor:
        """Every prefill chunk of a step in one call, as the layer stack makes it: chunk i is
        rows [starts[i], starts[i] + lengths[i]) of q [tokens, heads, dim] and of `out` (q's
        dtype, dense heads), attending to the first contexts[i] tokens of the sequence whose
        blocks are block_tables[i] (int64 [chunks, table width])."""
        _, num_heads, head_dim = q.shape
        _, num_kv_heads, num_blocks, block_size, _ = kv_cache.shape
        tables = block_tables.to(torch.int64).contiguous()
        starts_t, lengths_t, contexts_t = (torch.tensor(v, dtype=torch.int64) for v in (starts, lengths, contexts))
        status = self._spans(
            q.data_ptr(), kv_cache.data_ptr(), tables.data_ptr(), tables.shape[1], starts_t.data_ptr(),
            lengths_t.data_ptr(), contexts_t.data_ptr(), len(starts), out.data_ptr(), num_heads, num_kv_heads,
            head_dim, block_size, num_blocks, q.stride(0), out.stride(0), _KINDS[q.dtype], scale,
            torch.get_num_threads(),
        )
        _check(status, head_dim)
        return out


def _check(status: int, head_dim: int) -> None:
    """A C call's status as the error it stands for."""
    if status == -1:
        raise MemoryError("prefill attention could not allocate its context buffers")
    if status != 0:
        raise ValueError(f"prefill attention does not take head size {head_dim}")
