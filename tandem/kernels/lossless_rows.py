"""fp32 matrices that are small integers in disguise, stored as those integers (csrc/dense_gemv.c
`tandem_coded_gemv`).

Every model this project serves from a GGUF reaches the engine as fp32 rows dequantized from
its blocks: a Q4_1 block of 32 weights is fl(fl(d * q) + m) for 4-bit q and fp16 d and m, a
Q5_0 or Q8_0 block fl(d * q) for signed q. Exact fp32 (`--exact`) must multiply those very
values, but a one-token step that streams them as fp32 reads 4 bytes a weight for what is 5
or 9 bits of information. Here each block of 32 is written as int8 codes plus an fp32 scale
and offset such that fl(fl(scale * code) + offset) is bit for bit the fp32 weight (checked
on every weight before the codes are used), 1.25 bytes a weight; the GEMV rebuilds each
weight and sums as it sums the plain rows. Every scale has at most fp16's 11 significant bits
(the formats store fp16 scales), so scale * code is exact in fp32 and the kernel's fused
multiply-add rounds only where the check's separate add does.

The scale and offset are not read from the GGUF: they are found from the values, by the rules
that the block formats' own quantizers leave behind (below), and a block that no rule rebuilds
exactly leaves the whole matrix on its plain rows. The K-quants (Q4_K, Q6_K: a 6-bit scale
times an fp16 one, a minimum that is no weight of the block) are not found and stay fp32.
"""

from __future__ import annotations

import torch

BLOCK = 32  # weights sharing a scale and an offset (the GGUF block of Q4_0/1, Q5_0/1, Q8_0)
STEP = 64  # the kernel walks a row 64 weights at a time: rows must hold whole steps
_SAMPLE_ROWS = 64  # rows tried first, so a matrix no rule fits costs little at start-up


def coded_row_bytes(k: int) -> int:
    """Bytes of one coded row of `k` weights: k int8 codes, k / 32 fp32 scales, k / 32 offsets."""
    return k + 2 * 4 * (k // BLOCK)


def _rules(blocks: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Candidate (offset, scale) per block, fp32 [rows, blocks] each, in the order tried.
    The scales are rounded to 11 significant bits (`_fp16_precision`), as the formats store
    them (and as the kernel's fused multiply-add needs: an exact product).

    - Q4_1 / Q5_1: the block's minimum is a weight whose code is 0 (so it is the offset
      itself, fl(0 + m) = m), and its maximum has the top code, 15 or 31.
    - Q5_0 / Q4_0: no offset; the weight of largest magnitude has code -16 / -8 (their
      quantizers divide by it), so the scale is it divided by that power of two, exactly.
    - Q8_0: no offset; the largest magnitude has code +-127.
    """
    low, high = blocks.amin(-1), blocks.amax(-1)
    extreme = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True)).squeeze(-1)
    zero = torch.zeros_like(low)
    return [(low, (high - low) / 15), (zero, extreme / -16), (zero, extreme.abs() / 127), (zero, extreme / -8),
            (low, (high - low) / 31)]


def _fp16_precision(scale: torch.Tensor) -> torch.Tensor:
    """`scale` rounded to fp16's 11 significant bits (to nearest even), at any fp32 exponent.
    Not `scale.half()`: a weight divided after loading by a power of two (the key rows of a
    model with key divisors, models/key_divisors.py: Qwen2.5-Coder's first layer by 16 and
    more) has its format's fp16 scale divided too, past fp16's normal range, where a cast to
    fp16 drops its low bits and the block no longer comes back."""
    mantissa, exponent = torch.frexp(scale)  # scale = mantissa * 2^exponent, 0.5 <= |mantissa| < 1
    return torch.ldexp(torch.round(mantissa * 2048) / 2048, exponent)


def _codes(blocks: torch.Tensor, order: list[int] | None = None,
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]] | None:
    """(codes int8 [rows, blocks, 32], scales, offsets fp32 [rows, blocks], the rules that
    served, first to last) that rebuild every weight of `blocks` exactly, or None. `order`:
    the rules to try first (those a sample of the matrix needed), the others after."""
    rules = _rules(blocks)
    order = list(order or []) + [i for i in range(len(rules)) if i not in (order or [])]
    scales = torch.ones(blocks.shape[:2])
    offsets = torch.zeros(blocks.shape[:2])
    codes = torch.zeros(blocks.shape, dtype=torch.int8)
    found = torch.zeros(blocks.shape[:2], dtype=torch.bool)
    served: list[int] = []
    for index in order:
        offset, scale = rules[index]
        scale = _fp16_precision(scale)
        scale = torch.where((scale == 0) | ~scale.isfinite(), torch.ones_like(scale), scale)
        level = ((blocks - offset[..., None]) / scale[..., None]).round_().clamp_(-128, 127)
        rebuilt = scale[..., None] * level  # exact: 11 significant bits times an int8 code
        rebuilt += offset[..., None]
        fits = (rebuilt == blocks).all(-1) & ~found
        if not bool(fits.any()):
            continue
        served.append(index)
        scales = torch.where(fits, scale, scales)
        offsets = torch.where(fits, offset, offsets)
        codes = torch.where(fits[..., None], level.to(torch.int8), codes)
        found |= fits
        if bool(found.all()):
            return codes, scales, offsets, served
    return None


def code_rows(weight: torch.Tensor) -> torch.Tensor | None:
    """The coded rows of an fp32 [N, K] matrix (uint8 [N, coded_row_bytes(K)]: each row's codes,
    then its scales, then its offsets), or None where K is not whole steps of 64, the matrix
    is not fp32, or some block is not rebuilt exactly by any rule. The first rows are tried
    alone first: a matrix no rule fits is given up cheaply, and the rules that served them
    are tried first on the rest (an LM head of Q8_0 blocks: one pass, not three)."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % STEP or weight.numel() == 0:
        return None
    rows, k = weight.shape
    blocks = weight.detach().reshape(rows, k // BLOCK, BLOCK)
    order: list[int] = []
    if rows > _SAMPLE_ROWS:
        sample = _codes(blocks[:_SAMPLE_ROWS])
        if sample is None:
            return None
        order = sample[3]
    found = _codes(blocks, order)
    if found is None:
        return None
    codes, scales, offsets, _ = found
    return torch.cat([codes.reshape(rows, k).view(torch.uint8), scales.view(torch.uint8),
                      offsets.view(torch.uint8)], dim=1).contiguous()


def rebuild_rows(coded: torch.Tensor, k: int) -> torch.Tensor:
    """The fp32 [N, K] matrix coded rows stand for (the kernel's arithmetic, in torch)."""
    rows = coded.shape[0]
    codes = coded[:, :k].contiguous().view(torch.int8).float().reshape(rows, k // BLOCK, BLOCK)
    scales = coded[:, k:k + 4 * (k // BLOCK)].contiguous().view(torch.float32)
    offsets = coded[:, k + 4 * (k // BLOCK):].contiguous().view(torch.float32)
    rebuilt = scales[..., None] * codes
    rebuilt += offsets[..., None]
    return rebuilt.reshape(rows, k)
