"""What `--dtype auto`, `--quantization auto` and `--decode-weights auto` mean on a CPU: the
fastest configuration measured inside the quality bar on this CPU's instructions, or, with
`--exact`, the token-identical fp32 path.

A user who passes no flags should get what the machine does best, not the slowest exact
mode: fp32 at batch 1 decoded at 0.6x of vLLM's bf16 on the same box, while bf16 with 8-bit
GEMMs and 4-bit decode weights ran at 2.6-3x. Each part is on only where its instructions are
(the table below, `choose_cpu_mode`) and where its quality is measured within 1% perplexity of
fp32 (`tandem bench perplexity`, docs/performance.md):

- **bfloat16** where the CPU multiplies it natively (AMX or AVX-512-BF16); elsewhere torch
  emulates it, slower than fp32. SmolLM2 -0.02% / -0.15% (decode / prefill path).
- **int4 decode weights** (`--decode-weights int4`, steps of one or two tokens read a 4-bit
  copy) where the C kernel has its vector path (AVX2 + FMA or AVX-512). A Q4 GGUF's tensors
  come back as their own 4-bit values (SmolLM2 +0.02%); a matrix whose 4-bit copy would be
  further than 1% from it takes an 8-bit copy, or keeps its weights (worker/model_builder.py),
  so a full-precision checkpoint mostly decodes from 8 bits.
- **int8 GEMMs** (`--quantization int8`, W8A8 for larger steps) where AVX-512-VNNI is the
  fastest multiply there is: about twice bf16's rate on a CPU with AVX-512-BF16 and VNNI but
  no AMX. With AMX, the 8-bit path's own passes (rounding each token's activations, the
  dequantizing epilogue) cost what the int8 tiles save over the bf16 ones: on the 2-core
  Xeon with AMX, with both GEMMs on the tiles, bf16 + int8 ran decode-heavy at 1,616-1,679
  output tok/s and prefill-heavy at 5,080-5,177 prompt tok/s against the default's
  1,623-1,663 and 5,800-6,130 (alternating runs, docs/performance.md). And only for a checkpoint that is
  itself quantized (a GGUF file), the checkpoints it was measured on (SmolLM2 +0.14-0.22%);
  a full-precision checkpoint keeps its weights.
- **8-bit weights for bf16 rows** (`--quantization w8a16`, AMX only) are not part of the mode:
  on the default model its 64-row GEMMs are bound by the tiles more than by the weights'
  bytes, so it bought nothing measurable there, while greedy agreement with fp32 fell
  (docs/engine.md); Qwen2.5-Coder-0.5B's decode-heavy steps took 17% less, by flag.
- One rank only: a tensor- or pipeline-parallel engine takes these modes by flag.
- `--exact` is fp32 with no rounding of its own: steps of one or two tokens read the checkpoint's
  plain fp32 rows through tandem's GEMV kernel (`--decode-weights float32`, and the C decode
  stack) where AVX2 or AVX-512 runs it, larger steps a packed copy (tandem's GEMM's or
  oneDNN's), so the linear layers' weights are held twice (+0.42 GiB on SmolLM2). On the 2-core Xeon with AMX, oneDNN's
  packed fp32 one-row GEMM read SmolLM2's layers at 16.9 GB/s; `tandem bench offline --exact`
  decoded one stream at 43.0-44.5 tok/s this way against 25.6 before (vLLM's fp32: 33.4).
  Its greedy tokens equal transformers' in the suite's tests as the packed path's did.
  `--exact --decode-weights none` keeps one copy.
- No decode copy on a prefill worker (`--role prefill`): its steps are whole prompts, which
  read the dense weights, so a 4-bit copy would cost memory and start-up time (three workers
  of Qwen2.5-Coder-0.5B building theirs on two cores took 47 s, not 9) and never be read.

The weight modes' `auto` follows the CPU whatever the dtype: `--dtype float32` alone runs fp32
with the 4-bit decode copy on an AVX2 CPU (+0.00% on SmolLM2). A dtype's own weights alone
are `--quantization none --decode-weights none`, and `--exact` is the exact path.

Decided without torch, from /proc/cpuinfo's flags, so the API process (which never imports
torch) and the engine settle the same mode. `TANDEM_DEFAULT_MODE=exact` makes `auto` mean the
exact path for a whole process tree: the test suite sets it, since most of its tests hold
greedy tokens equal to transformers'.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODE_ENV = "TANDEM_DEFAULT_MODE"  # "exact": auto means the exact fp32 path
EXACT_NOTE = "exact fp32 (token-identical to transformers)"


@dataclass(frozen=True)
class CpuFeatures:
    """The instruction sets the CPU kernels' fast paths need."""

    avx2_fma: bool = False
    avx512: bool = False  # F and BW
    avx512_vnni: bool = False
    avx512_bf16: bool = False
    amx: bool = False  # AMX tiles with bf16 and int8

    @classmethod
    def from_flags(cls, flags: Iterable[str]) -> CpuFeatures:
        have = set(flags)
        return cls(
            avx2_fma={"avx2", "fma"} <= have,
            avx512={"avx512f", "avx512bw"} <= have,
            avx512_vnni="avx512_vnni" in have,
            avx512_bf16="avx512_bf16" in have,
            amx={"amx_tile", "amx_bf16", "amx_int8"} <= have,
        )

    @classmethod
    def detect(cls, cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuFeatures:
        """This CPU's (none where /proc/cpuinfo has no x86 flags line)."""
        try:
            for line in cpuinfo.read_text().splitlines():
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return cls.from_flags(value.split())
        except OSError:
            pass
        return cls()

    @property
    def native_bf16(self) -> bool:
        return self.amx or self.avx512_bf16

    @property
    def int8_fastest(self) -> bool:
        """8-bit GEMMs beat this CPU's bf16 (VNNI without AMX's bf16 tiles). With AMX the int8
        tiles multiply twice as fast as the bf16 ones, but the 8-bit linear's own passes
        (rounding each row's activations, the dequantizing epilogue) take that back: see the
        module's docstring."""
        return self.avx512_vnni and not self.amx

    def describe(self) -> str:
        if self.amx:
            return "AMX"
        if self.avx512:
            extras = [name for name, on in (("BF16", self.avx512_bf16), ("VNNI", self.avx512_vnni)) if on]
            return "AVX-512" + (f" ({'+'.join(extras)})" if extras else "")
        return "AVX2" if self.avx2_fma else "no AVX2"


@dataclass(frozen=True)
class CpuMode:
    """What the three `auto` settings become, and the start-up line's why."""

    dtype: str
    quantization: str
    decode_weights: str
    note: str


def exact_requested() -> bool:
    """Whether this process tree asked `auto` to mean the exact path (TANDEM_DEFAULT_MODE)."""
    return os.environ.get(DEFAULT_MODE_ENV, "").strip().lower() == "exact"


def choose_cpu_mode(features: CpuFeatures, quantized_checkpoint: bool, one_rank: bool = True,
                    exact: bool = False, decodes: bool = True) -> CpuMode:
    """The fastest mode inside the quality bar for `features` (the module's docstring says
    why each part is on where it is). `decodes`: False for a prefill-only worker."""
    vector = features.avx2_fma or features.avx512
    if exact:  # the fp32 rows are the checkpoint's own: exact arithmetic, faster at one token
        return CpuMode("float32", "none", "float32" if one_rank and decodes and vector else "none", EXACT_NOTE)
    dtype = "bfloat16" if features.native_bf16 else "float32"
    int4 = one_rank and decodes and vector
    int8 = one_rank and quantized_checkpoint and features.int8_fastest
    parts = [dtype]
    if int8:
        parts.append("int8 GEMMs")
    if int4:
        parts.append("int4 decode weights")
    why = (f"{features.describe()}" + ("" if quantized_checkpoint else "; a full-precision checkpoint keeps its weights")
           + ("" if decodes else "; a prefill worker reads no decode copy"))
    return CpuMode(dtype, "int8" if int8 else "none", "int4" if int4 else "none",
                   f"{' + '.join(parts)} ({why}; within 1% perplexity of fp32; --exact for token-identical fp32)")


def is_quantized_checkpoint(model: str) -> bool:
    """A GGUF file, an HF directory tandem converted from one, or a model alias: every alias
    names a GGUF file (tandem/loader/resolve.py's ALIASES; the config cannot import the
    loader, which imports the config), and a name that is no path is an alias or nothing."""
    path = Path(model).expanduser()
    if path.is_dir():
        return (path / "tandem_source.json").is_file()
    return path.suffix == ".gguf" or not path.exists()
