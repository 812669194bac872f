"""Every Triton kernel, at the launches an 8B model's steps make (bf16, fp8 KV, fp32), compiled
for an H100/H200 (sm_90) here, without a GPU: the interpreter that runs the other tests never
compiles, so a kernel it runs can still fail to build on the device (a dot too small, a type
the backend refuses). The launches are recorded from the wrappers running interpreted, then
compiled in a fresh process with TRITON_INTERPRET=0, down to the cubin by the ptxas that
Triton's wheel carries. Triton 3.6 (the lent GPUs' version) was checked the same way by hand.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8e4nv",
          torch.int64: "i64", torch.int32: "i32", torch.uint8: "u8"}
_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion", "launch_pdl")

_COMPILE = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

failed = []
for module, name, signature, constexprs, options in json.load(open(sys.argv[1])):
    fn = getattr(importlib.import_module(module), name)
    try:
        triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                       options=options or None)
    except Exception as error:  # every failure reported, not only the first
        failed.append(f"{name} {constexprs}: {type(error).__name__}: {str(error)[:2000]}")
print("\\n".join(failed) or "all compiled")
sys.exit(1 if failed else 0)
"""


def _signature(fn, args: tuple, kwargs: dict) -> list:
    """(module, name, signature, constexprs, options) of one launch, as triton.compile takes them."""
    options = {k: kwargs.pop(k) for k in _OPTIONS if k in kwargs}
    bound = inspect.signature(fn).bind(*args, **kwargs)
    signature, constexprs = {}, {}
    for name, parameter in inspect.signature(fn).parameters.items():
        value = bound.arguments[name]
        if "constexpr" in str(parameter.annotation) or value is None:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        else:
            signature[name] = "fp32"
    return [fn.__module__, fn.__name__, signature, constexprs, options]


def _launch_everything(dtype: torch.dtype, kv_dtype: torch.dtype, heads: int, kv_heads: int, dim: int) -> None:
    """One call of each wrapper at these shapes (decode split and not, prefill, KV write,
    norms, rotary, silu-and-mul): small sizes, the launch parameters of the real ones."""
    from tandem.kernels.base import kv_cache_shape
    from tandem.kernels.gpu.cache_write import write_kv, write_kv_fp8
    from tandem.kernels.gpu.decode_attention import paged_decode_attention
    from tandem.kernels.gpu.prefill_attention import prefill_attention
    from tandem.kernels.gpu.rms_norm import rms_norm
    from tandem.kernels.gpu.rotary import rotary_
    from tandem.kernels.gpu.rotation import rotate_heads
    from tandem.kernels.gpu.silu_mul import silu_mul

    cache = torch.randn(kv_cache_shape(8, 16, kv_heads, dim)).to(kv_dtype)
    table, lens = torch.arange(8).view(2, 4), torch.tensor([40, 64])
    query = torch.randn(2, heads, dim).to(dtype)
    for splits in (1, 4):
        paged_decode_attention(query, cache, table, lens, 64, dim ** -0.5, splits)
    key = torch.randn(3, kv_heads, dim).to(kv_dtype)
    write_kv(key, key, cache, torch.tensor([0, 17, -1]))
    if kv_dtype == torch.float8_e4m3fn:  # the layer's keys and values, rounded in the write
        fresh = torch.randn(3, kv_heads, dim).to(dtype)
        write_kv_fp8(fresh, fresh, cache, torch.tensor([0, 17, -1]), 0.5, 2.0)
    rotate_heads(torch.randn(3, heads + 2 * kv_heads, dim).to(dtype)[:, :heads])  # an int8 cache's query
    chunk = torch.randn(84, heads, dim).to(dtype)
    prefill_attention(chunk, cache, torch.tensor([0, 20]), torch.tensor([20, 64]), lens, table, 64, dim ** -0.5,
                      torch.empty_like(chunk))  # a 64-query tile, as long prompts run
    hidden = torch.randn(3, heads * dim).to(dtype)
    rms_norm(hidden, torch.ones(heads * dim).to(dtype), 1e-5)
    rms_norm(hidden, torch.ones(heads * dim).to(dtype), 1e-5, residual=hidden.clone())
    qk = torch.randn(3, heads + 2 * kv_heads, dim).to(dtype)
    angles = torch.randn(3, 1, dim // 2).to(dtype)
    rotary_(qk[:, : heads + kv_heads], angles, angles)
    silu_mul(torch.randn(3, 2 * 4 * heads * dim).to(dtype))


def _launch_gemv(dtype: torch.dtype) -> None:
    """The one-row GEMV: every candidate block shape (what `tandem bench gpu --gemv` compiles on
    the device) on a plain row, and each form the model calls (bias, residual, silu-and-mul)."""
    from tandem.kernels.gpu.gemv import CANDIDATES, gemv

    weight = torch.randn(48, 64).to(dtype)
    for config in CANDIDATES:
        gemv(torch.randn(1, 64).to(dtype), weight, config)
    residual = torch.randn(1, 48).to(dtype)
    gemv(torch.randn(1, 64).to(dtype), weight, CANDIDATES[1], bias=residual[0])
    gemv(torch.randn(1, 64).to(dtype), weight, CANDIDATES[1], residual=residual)
    gemv(torch.randn(1, 128).to(dtype), weight, CANDIDATES[1], residual=residual, silu_mul=True)


def _launch_int4_moe(dtype: torch.dtype) -> None:
    """The INT4 MoE GEMM at the block sizes Kimi K2.5's experts get under TP 8 and EP 8 (decode
    at 1, 32 and 64 rows an expert, split K and not, the fused silu-and-mul; prefill), launched
    on small tensors: the constexprs are the real launches', the shapes are not."""
    from tandem.kernels.gpu.int4_moe import int4_moe_config, int4_moe_gemm

    for experts, n, k, silu, max_rows, split_k in [
        (384, 2 * 256, 7168, True, 1, 4),  # w13 under TP 8, decode: split K, silu fused in the reduce
        (384, 7168, 256, False, 1, 1),  # w2 under TP 8, decode
        (48, 2 * 2048, 7168, True, 32, 1),  # w13 under EP 8, 32 rows an expert
        (48, 7168, 2048, False, 64, 2),  # w2 under EP 8, 64 rows an expert, split
        (48, 2 * 2048, 7168, True, 4096, 1),  # prefill
        (48, 7168, 2048, False, 4096, 1),
    ]:
        config = int4_moe_config(max_rows, n // 2 if silu else n, k)
        small_k = 2 * config["BLOCK_K"] * split_k  # K's steps and splits, on fewer inputs
        packed = torch.full((experts, 2 * config["BLOCK_N"] if silu else config["BLOCK_N"], small_k // 8),
                            0x88888888 - 2**32, dtype=torch.int32)  # every level 8: weights 0
        scales = torch.ones(experts, packed.shape[1], small_k // 32).to(dtype)
        offsets = torch.zeros(experts + 1, dtype=torch.int32)
        offsets[1:] = 2
        int4_moe_gemm(torch.randn(2, small_k).to(dtype), offsets, packed, scales, silu_mul=silu,
                      max_rows=max_rows, split_k=split_k, config=config)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="records launches through the interpreter")
def test_every_kernel_compiles_for_sm90(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from triton.runtime import interpreter

    launches: dict[str, list] = {}
    run = interpreter.InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        launch = _signature(self.fn, args, dict(kwargs))
        launches[json.dumps(launch, sort_keys=True, default=str)] = launch
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", recording_run)
    _launch_everything(torch.bfloat16, torch.bfloat16, 32, 8, 128)  # Llama-3.1-8B
    _launch_everything(torch.bfloat16, torch.float8_e4m3fn, 32, 8, 128)  # --kv-cache-dtype fp8
    _launch_everything(torch.bfloat16, torch.bfloat16, 14, 2, 64)  # Qwen2.5-0.5B: GQA 7, head 64
    _launch_everything(torch.float32, torch.float32, 9, 3, 64)  # SmolLM2-135M in fp32
    _launch_gemv(torch.bfloat16)  # batch-1 projections
    _launch_int4_moe(torch.bfloat16)  # Kimi K2.5's INT4 experts
    _launch_int4_moe(torch.float16)
    for launch in [launch for launch in launches.values() if launch[1] == "_gemv_kernel"]:
        # The interpreter has no grid dependencies, so the wrapper launches it there without PDL;
        # on the GPU a config may ask for it: compile that variant too.
        pdl = json.loads(json.dumps(launch, default=str))
        pdl[3]["PDL"], pdl[4]["launch_pdl"] = True, True
        launches[json.dumps(pdl, sort_keys=True)] = pdl
    names = {launch[1] for launch in launches.values()}
    assert names == {"_decode_kernel", "_combine_kernel", "_write_kv_kernel", "_write_kv_fp8_kernel",
                     "_prefill_kernel", "_rms_norm_kernel", "_rotate_kernel",
                     "_rotary_kernel", "_silu_mul_kernel", "_int4_moe_kernel", "_int4_moe_reduce",
                     "_gemv_kernel"}
    recorded = tmp_path / "launches.json"
    recorded.write_text(json.dumps(list(launches.values()), default=str))
    env = os.environ | {"TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1",
                        "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", _COMPILE, str(recorded)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
