"""One row times a weight matrix on a GPU: batch-1 decode's projections, in one Triton kernel.

At batch 1 every projection is a GEMV: the step reads each weight once and multiplies it by one
row, so its time is the weight's bytes over the memory bandwidth. cuBLAS's kernels for these
shapes reach 3.9 TB/s on Llama-3.1-8B's gate/up (235 MB) but 3.35 TB/s on the fused q/k/v (50 MB)
and 2.6 TB/s on o_proj (34 MB, split over K with a second kernel to sum the parts) on an H200
that copies at 4.2 TB/s: an 8B batch-1 step's projections took ~3.85 ms against ~3.3 at the copy
rate. This kernel gives each program `block_n` output rows over the whole K (no split, no second
kernel), accumulates in fp32 and rounds once, with the residual add (o_proj, down_proj) and the
gated MLP's `silu(gate) * up` (down_proj's input, computed from the gate/up row as it is read)
folded in, which also saves the silu-and-mul kernel.

Which block sizes win depends on the device and the matrix, and whether this kernel beats cuBLAS
at all, so nothing is assumed: `tandem bench gpu --gemv` times each candidate against cuBLAS on a
model's shapes and writes the winners (a matrix it does not win stays cuBLAS's) as a table for
the device, shipped under `gemv_configs/`; a GPU without a table runs cuBLAS everywhere.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import triton
import triton.language as tl

from tandem.kernels.gpu import interpreted

TABLES = Path(__file__).parent / "gemv_configs"


@dataclass(frozen=True)
class GemvConfig:
    """The kernel's launch: output rows a program, K a loop step, warps, pipeline stages, and
    whether it is launched as a programmatic dependent (Hopper's PDL: it starts while the kernel
    before it finishes, reads its first weight tile, then waits for that kernel's writes)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    pdl: bool = False


# What `tandem bench gpu --gemv` tries on each matrix: narrow row blocks give a small matrix
# enough programs to fill the device without splitting K; wide K steps keep loads in flight.
_SHAPES = (
    GemvConfig(4, 1024), GemvConfig(8, 512), GemvConfig(8, 1024), GemvConfig(16, 256),
    GemvConfig(16, 512), GemvConfig(16, 512, 8), GemvConfig(4, 2048, 8), GemvConfig(2, 2048, 4),
    GemvConfig(4, 1024, 4, 4), GemvConfig(8, 2048, 8),
)
CANDIDATES = _SHAPES + tuple(replace(config, pdl=True) for config in _SHAPES)


@triton.jit
def _x_chunk(x_ptr, k, K, dtype, EVEN_K: tl.constexpr, SILU_MUL: tl.constexpr):
    """The row's values at k in fp32; with SILU_MUL, silu(gate) * up from [gate, up] of K
    each, with silu_mul.py's two roundings."""
    if EVEN_K:
        x = tl.load(x_ptr + k).to(tl.float32)
    else:
        x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
    if SILU_MUL:
        if EVEN_K:
            up = tl.load(x_ptr + K + k).to(tl.float32)
        else:
            up = tl.load(x_ptr + K + k, mask=k < K, other=0.0).to(tl.float32)
        x = ((x / (1.0 + tl.exp(-x))).to(dtype).to(tl.float32) * up).to(dtype).to(tl.float32)
    return x


@triton.jit
def _w_tile(w_ptr, n, k, N, K, stride_w, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    rows = w_ptr + n[:, None] * stride_w + k[None, :]
    if EVEN_N and EVEN_K:
        return tl.load(rows)
    return tl.load(rows, mask=(n < N)[:, None] & (k < K)[None, :], other=0.0)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, residual_ptr, out_ptr, N, K, stride_w,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr, PDL: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    dtype = out_ptr.dtype.element_ty
    if PDL:  # the next kernel may launch once every program has started, to fill this one's tail
        tl.extra.cuda.gdc_launch_dependents()
    k = tl.arange(0, BLOCK_K)
    w = _w_tile(w_ptr, n, k, N, K, stride_w, EVEN_N, EVEN_K)  # weights are never written: read them early
    if PDL:  # launched before the kernel that writes the row has finished: wait for it here
        tl.extra.cuda.gdc_wait()
    acc = w.to(tl.float32) * _x_chunk(x_ptr, k, K, dtype, EVEN_K, SILU_MUL)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = _w_tile(w_ptr, n, k, N, K, stride_w, EVEN_N, EVEN_K)
        acc += w.to(tl.float32) * _x_chunk(x_ptr, k, K, dtype, EVEN_K, SILU_MUL)[None, :]
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        out += tl.load(residual_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + n, out.to(dtype), mask=n_ok)


def gemv(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig, bias: torch.Tensor | None = None,
         residual: torch.Tensor | None = None, silu_mul: bool = False) -> torch.Tensor:
    """x [1, K] (or, with `silu_mul`, the gate/up row [1, 2K]) times weight [N, K] -> [1, N] in
    x's dtype: `residual + x @ weight.T + bias`, summed in fp32 and rounded once, as cuBLAS's
    addmm rounds it."""
    n, k = weight.shape
    assert x.shape == (1, 2 * k if silu_mul else k) and x.stride(-1) == 1 and weight.stride(-1) == 1
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    pdl = config.pdl and not interpreted()  # the interpreter has no grid dependencies
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, out if bias is None else bias, out if residual is None else residual, out, n, k, weight.stride(0),
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, EVEN_N=n % config.block_n == 0,
        EVEN_K=k % config.block_k == 0, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        SILU_MUL=silu_mul, PDL=pdl, num_warps=config.num_warps, num_stages=config.num_stages,
        **({"launch_pdl": True} if pdl else {}),
    )
    return out


def shape_key(n: int, k: int) -> str:
    """A table's key for a matrix of n rows (outputs) and k columns (inputs)."""
    return f"{n}x{k}"


def table_path(device_name: str, tables: Path | None = None) -> Path:
    """Where a device's table lives: its name as torch gives it, spaces as underscores."""
    return (tables or TABLES) / f"{''.join(c if c.isalnum() or c in '-.' else '_' for c in device_name)}.json"


def load_table(device_name: str, dtype: torch.dtype, tables: Path | None = None) -> dict[tuple[int, int], GemvConfig]:
    """The configs tuned for `device_name` in `dtype`, by matrix [out, in]; empty where none was."""
    path = table_path(device_name, tables)
    if not path.exists():
        return {}
    table = json.loads(path.read_text())
    if table["dtype"] != str(dtype).removeprefix("torch."):
        return {}
    return {tuple(int(size) for size in shape.split("x")): GemvConfig(**entry["config"])  # type: ignore[misc]
            for shape, entry in table["shapes"].items()}


def write_table(path: Path, device_name: str, dtype: torch.dtype, entries: dict[str, dict]) -> None:
    path.write_text(json.dumps({"device": device_name, "dtype": str(dtype).removeprefix("torch."),
                                "shapes": entries}, indent=2) + "\n")


def table_entry(config: GemvConfig, gemv_us: float, cublas_us: float) -> dict:
    """A table's record of one shape: the config and the timings that chose it."""
    return {"config": asdict(config), "gemv_us": round(gemv_us, 2), "cublas_us": round(cublas_us, 2)}


class GpuGemv:
    """A linear layer's batch-1 GEMV (tandem/layers/linear.py takes it for one-row steps)."""

    def __init__(self, config: GemvConfig) -> None:
        self.config = config

    @staticmethod
    def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
        return x.dim() == 2 and x.shape[0] == 1 and x.stride(-1) == 1 and x.dtype == weight.dtype

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, silu_mul: bool = False) -> torch.Tensor:
        if residual is not None:
            residual = residual.reshape(1, -1)
            if residual.stride(-1) != 1:
                residual = residual.contiguous()
        return gemv(x, weight, self.config, bias, residual, silu_mul)
