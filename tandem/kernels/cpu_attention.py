"""CPU attention backend: decode and prefill attention read straight from the paged cache by
C kernels (prefill's is in cpu_prefill.py).

The torch backend gathers every decoding sequence's blocks into one padded tensor before two
batched matmuls: at 64 sequences that copy is most of a decode step's attention time, and
attention is half the step. The kernel in `csrc/paged_decode_attention.c` walks the block
tables instead and reads each cached key and value once, with no padding, in one call per
layer instead of ~15 ops.

The C sources are compiled on first use (c_library.py). Where there is no compiler, or the build fails, or the cache is not fp32, bf16, int8 or
fp8, the torch path runs and the log says why. A bf16 cache is read by the kernel's bf16 variant (q and
out stay fp32 inside it): the torch path's gather + SDPA took ~0.9 ms a layer at a 700-token
context for Qwen2.5-Coder in bf16, most of it overhead, ~20 ms of a 0.5B draft's forward.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
from pathlib import Path

import torch

from tandem.kernels.base import AttentionMetadata
from tandem.kernels.c_library import KernelBuildError, bind, build_kernel_library
from tandem.kernels.cpu_prefill import PrefillAttentionKernel
from tandem.kernels.kv_format import FP8, INT8_SCALE_BYTES
from tandem.kernels.torch_attention import TorchAttentionBackend

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode_attention.c"
# The cache element kinds the C kernel reads (kv_kind in paged_decode_attention.c); uint8 is
# an int8 cache's rows with their scales (tandem/kernels/kv_format.py), float8 e4m3 an fp8
# cache's bytes (already divided by the layer's scale: tandem/layers/attention.py).
KV_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.uint8: 2, FP8: 3}
_QUANTIZED = (torch.uint8, FP8)  # caches written from fp32 or bf16 rows by the kernel's own rounding
_FLOAT = ctypes.c_float
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_INT = ctypes.c_int


class PagedDecodeKernel:
    """The loaded C function, called on tensors' data pointers."""

    def __init__(self, library: Path) -> None:
        functions = bind(library, {
            "tandem_decode_attention": (ctypes.c_int, [_PTR, _INT, _I64, _PTR, _INT, _PTR, _PTR, _PTR,
                                                       *[_I64] * 8, ctypes.c_float, _INT]),
            "tandem_write_kv": (None, [_PTR, _PTR, _PTR, _PTR, *[_I64] * 7, _INT]),
            "tandem_write_kv_i8": (None, [_PTR, _PTR, _INT, _PTR, _PTR, *[_I64] * 6, _INT]),
            "tandem_write_kv_f8": (None, [_PTR, _PTR, _INT, _PTR, _PTR, *[_I64] * 6, _FLOAT, _FLOAT, _INT]),
            "tandem_write_kv_bf16": (None, [_PTR, _PTR, _INT, _PTR, _PTR, *[_I64] * 6, _INT]),
            "tandem_widen_blocks": (None, [_PTR, _INT, _PTR, *[_I64] * 5, _PTR, _INT, _INT]),
            "tandem_decode_attention_isa": (ctypes.c_char_p, []),
            "tandem_decode_attention_in_team": (_INT, [_INT, _INT, _I64, _I64]),
        })
        self._attend = functions["tandem_decode_attention"]
        self._write = functions["tandem_write_kv"]
        self._write_i8 = functions["tandem_write_kv_i8"]
        self._write_f8 = functions["tandem_write_kv_f8"]
        self._write_bf16 = functions["tandem_write_kv_bf16"]
        self._widen = functions["tandem_widen_blocks"]
        self._in_team = functions["tandem_decode_attention_in_team"]
        self.isa: str = functions["tandem_decode_attention_isa"]().decode()  # for bf16 steps

    # The C functions themselves, for callers in C (tandem/kernels/decode_stack.py).
    def write_kv_entry(self) -> object:
        return self._write

    def rounding_write_entries(self) -> tuple[object, object, object]:
        """The writers that round fp32 / bf16 rows into an int8, a bf16 and an fp8 cache (the
        layer stack's Kernels record's order)."""
        return self._write_i8, self._write_bf16, self._write_f8

    def attend_entry(self) -> object:
        return self._attend

    def team_entry(self) -> object:
        """Whether `attend_entry`, called by every thread of a C parallel region, runs as that
        team's (decode_stack.c keeps one team through a small step where it does)."""
        return self._in_team

    @staticmethod
    def reads(kv_cache: torch.Tensor) -> bool:
        """Whether the kernel takes this cache (fp32, bf16, int8 or fp8 rows, contiguous)."""
        return kv_cache.dtype in KV_KINDS and kv_cache.is_contiguous()

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
        """key/value [tokens, kv_heads, dim] in the cache's dtype (fp32 or bf16 into an int8
        or fp8 cache, rounded here) with rows of one token contiguous."""
        num_tokens, num_kv_heads, head_dim = key.shape
        _, _, num_blocks, block_size, _ = kv_cache.shape
        if kv_cache.dtype != key.dtype:  # rounded here: int8 rotated too (kv_format.py), fp8, or fp32 to bf16
            args = (key.data_ptr(), value.data_ptr(), key.dtype == torch.bfloat16, kv_cache.data_ptr(),
                    slots.data_ptr(), num_tokens, key.stride(0), value.stride(0), num_kv_heads, head_dim,
                    num_blocks * block_size)
            if kv_cache.dtype == FP8:
                self._write_f8(*args, 1.0, 1.0, torch.get_num_threads())  # the layer divided by its scales
            else:
                (self._write_i8 if kv_cache.dtype == torch.uint8 else self._write_bf16)(*args, torch.get_num_threads())
            return
        self._write(
            key.data_ptr(), value.data_ptr(), kv_cache.data_ptr(), slots.data_ptr(), num_tokens,
            key.stride(0), value.stride(0), num_kv_heads, head_dim, num_blocks * block_size,
            kv_cache.element_size(), torch.get_num_threads(),
        )

    def widen_blocks(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Blocks `block_ids` of an int8, fp8 or (into fp32) bf16 cache as a dense cache of
        `dtype` (fp32 or bf16) holding just them, in order: what the prefill kernel reads."""
        _, kv_heads, num_blocks, block_size, width = kv_cache.shape
        if kv_cache.dtype not in _QUANTIZED:  # a bf16 cache under fp32 queries: torch's cast is one pass
            return kv_cache[:, :, block_ids].to(dtype).contiguous()
        head_dim = width - INT8_SCALE_BYTES if kv_cache.dtype == torch.uint8 else width
        ids = block_ids.contiguous()
        out = torch.empty(2, kv_heads, len(ids), block_size, head_dim, dtype=dtype)
        self._widen(kv_cache.data_ptr(), KV_KINDS[kv_cache.dtype], ids.data_ptr(), len(ids), kv_heads, num_blocks,
                    block_size, head_dim, out.data_ptr(), dtype == torch.bfloat16, torch.get_num_threads())
        return out

    @staticmethod
    def takes_query(q: torch.Tensor) -> bool:
        """q [seqs, heads, dim] in fp32 or bf16 with each sequence's heads dense (any stride
        between sequences: a view into the fused projection)."""
        return (q.dtype in (torch.float32, torch.bfloat16) and q.dim() == 3 and q.stride(2) == 1
                and q.stride(1) == q.shape[2])

    def __call__(
        self, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
        context_lens: torch.Tensor, scale: float,
    ) -> torch.Tensor:
        """q [seqs, heads, dim] (`takes_query`) -> out [seqs, heads, dim] in q's dtype,
        contiguous, from an fp32, bf16, int8 or fp8 cache (an int8 cache's rotated rows the
        kernel meets with a rotated query, kv_format.py); tables and lengths contiguous."""
        num_seqs, num_heads, head_dim = q.shape
        _, num_kv_heads, num_blocks, block_size, _ = kv_cache.shape
        group = num_heads // num_kv_heads
        threads = torch.get_num_threads()
        # Few sequences: one work item per query head, so every thread has some; many: one
        # per kv head, so a head's keys are read once for all the query heads that share it.
        # (Few sequences with contexts long enough are cut into spans by the kernel instead,
        # whatever this asks: paged_decode_attention.c's span_count.)
        heads_per_item = 1 if num_seqs * num_kv_heads < 2 * threads else group
        out = torch.empty(num_seqs, num_heads, head_dim, dtype=q.dtype)
        status = self._attend(
            q.data_ptr(), q.dtype == torch.bfloat16, q.stride(0), kv_cache.data_ptr(),
            KV_KINDS[kv_cache.dtype], block_tables.data_ptr(), context_lens.data_ptr(),
            out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, block_size, num_blocks,
            block_tables.shape[1], heads_per_item, scale, threads,
        )
        if status != 0:
            raise MemoryError("paged decode attention could not allocate its score buffer")
        return out


class CpuAttentionBackend(TorchAttentionBackend):
    """The torch backend with decode attention done by `PagedDecodeKernel` and prefill
    attention by `PrefillAttentionKernel` where they apply."""

    name = "cpu"

    def __init__(self, kernel: PagedDecodeKernel, prefill: PrefillAttentionKernel | None = None) -> None:
        self.kernel = kernel
        self.prefill = prefill

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        writable = kv_cache.dtype == key.dtype == value.dtype or (key.dtype == value.dtype and (
            (kv_cache.dtype in _QUANTIZED and key.dtype in (torch.float32, torch.bfloat16))
            or (kv_cache.dtype == torch.bfloat16 and key.dtype == torch.float32)))
        if writable and self.kernel.reads(kv_cache) and _rows_contiguous(key) and _rows_contiguous(value):
            self.kernel.write_kv(key, value, kv_cache, meta.slot_mapping)
        else:
            super().write_kv(key, value, kv_cache, meta)

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    ) -> torch.Tensor:
        # A step of decodes only: the kernel's output is the whole result, no copy into a
        # preallocated one.
        if not meta.prefills and meta.num_decode_tokens == query.shape[0] and self._kernel_decodes(query, kv_cache):
            return self.kernel(query, kv_cache, meta.decode_block_tables, meta.decode_context_lens, scale)
        return super().attend(query, key, value, kv_cache, meta, scale)

    def _kernel_decodes(self, q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        return self.kernel.reads(kv_cache) and self.kernel.takes_query(q)

    def _decode(self, q, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if not self._kernel_decodes(q, kv_cache):
            return super()._decode(q, kv_cache, meta, scale)
        return self.kernel(q, kv_cache, meta.decode_block_tables, meta.decode_context_lens, scale)

    def _prefill(self, q, k, v, kv_cache, span, scale, out: torch.Tensor | None = None) -> torch.Tensor:
        # The chunk's own keys and values are in the cache already (write_kv runs first); the
        # kernel writes the step's output rows itself (the copy was ~1% of a bf16 prefill).
        if self.prefill is not None and self.prefill.takes(q, kv_cache):
            return self.prefill(q, kv_cache, span.block_ids, span.context_len, scale, out)
        if self.prefill is not None and kv_cache.dtype != q.dtype and kv_cache.dtype in KV_KINDS:
            # An int8, fp8 or (under fp32 queries) bf16 cache: the span's blocks widened into
            # a dense cache of q's dtype, which the kernel reads in place of torch's attention
            # (one pass over the context, against a product over the context per query).
            blocks = span.block_ids
            dense = self.kernel.widen_blocks(kv_cache, blocks, q.dtype)
            if self.prefill.takes(q, dense):
                return self.prefill(q, dense, torch.arange(len(blocks)), span.context_len, scale, out)
        return super()._prefill(q, k, v, kv_cache, span, scale, out)


def _rows_contiguous(x: torch.Tensor) -> bool:
    """[tokens, heads, dim] whose heads and dims of one token are dense (a token stride may be
    anything, as in a view into the fused qkv projection)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def build_cpu_backend(cache_dir: Path, required: bool) -> TorchAttentionBackend:
    """The C kernels compiled under `cache_dir`; where they do not build, an error when they
    were asked for by name, else the torch backend with a warning."""
    try:
        backend = CpuAttentionBackend(PagedDecodeKernel(build_kernel_library(cache_dir, SOURCE)),
                                      PrefillAttentionKernel.build(cache_dir))
    except (KernelBuildError, OSError, subprocess.SubprocessError) as error:
        if required:
            raise
        logger.warning("CPU attention kernels unavailable (%s); using the torch backend", error)
        return TorchAttentionBackend()
    logger.info("CPU attention kernels: paged decode (bf16 with %s); prefill with %s%s", backend.kernel.isa,
                backend.prefill.isa, "" if torch.bfloat16 in backend.prefill.dtypes
                else " in fp32, bf16 by PyTorch's flash attention (AMX tiles)")
    return backend
