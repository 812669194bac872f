/*
 * The 8-bit GEMM's products on AMX tiles (included by int8_gemm.c where the build targets a
 * CPU with AMX-INT8): the same packed matrix, the same int32 products, the same epilogues.
 *
 * Why: where the CPU has AMX, the vpdpbusd tiles of int8_gemm.c multiply at a fraction of what
 * the tiles do, so on the 2-core Xeon with AMX `--quantization int8` ran SmolLM2's layers at
 * ~2.2 TOP/s against the bf16 tiles' ~2.9 TFLOP/s, and 8-bit GEMMs were slower than bf16 there.
 * tdpbssd multiplies 16 x 64 signed bytes by 64 x 16 in one instruction, twice the k of a bf16
 * tile product for the same bytes, with half the weight bytes to stream.
 *
 * The packed layout is already the tiles' B operand: within a block of 16 columns, each 4
 * consecutive k are one 64-byte row of the 16 columns' 4 bytes, so 16 of them (64 values of
 * k) are one 16 x 64-byte B tile, 1 KiB contiguous. The A operand is 16 rows of the signed
 * activations, 64 values of k each, read in place with the rows' stride. Signed times signed
 * (tdpbssd), so the activations are not flipped to unsigned and the products need no
 * compensation: the integer sums are the vpdpbusd path's after its compensation, exactly, and
 * the dequantizing epilogue (int8_dequantize.h) gives the same bits.
 *
 * The units, their tiles, the epilogue run a few rows a k step while the next unit multiplies,
 * and how the threads share the items are amx_gemm.h's, shared with the bf16 tiles; this file
 * is the tile product (tdpbssd into int32) and its epilogues: the int32 products themselves, or
 * int8_dequantize.h's dequantizing and gated ones. K must be a multiple of 64; the caller
 * sends other K to the vpdpbusd tiles.
 */
#ifndef TANDEM_INT8_GEMM_AMX_H
#define TANDEM_INT8_GEMM_AMX_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "amx_gemm.h"

#define AMX8_STEP_K 64 /* values of k a tile product covers */

/* Where a unit's products go: the int32 products themselves (c, row stride N), or (dq) what
 * they dequantize to. */
typedef struct {
    int32_t *c;
    int64_t N;
    const Int8Dequantize *dq;
} AmxInt8Output;

/* Rows [from, to) of a unit's epilogue. */
static inline void amx_int8_epilogue_rows(const AmxUnit *unit, const AmxInt8Output *o, int64_t from, int64_t to) {
    for (int64_t i = from; i < to; i++) {
        const int32_t *row = (const int32_t *)unit->c + (i / AMX_ROWS) * 512 + (i % AMX_ROWS) * 16;
        const int64_t m = unit->m + i, n = unit->block * 16;
        const __m512i first = _mm512_load_si512(row);
        if (o->dq == NULL) {
            _mm512_storeu_si512(o->c + m * o->N + n, first);
            if (unit->two_blocks) _mm512_storeu_si512(o->c + m * o->N + n + 16, _mm512_load_si512(row + 256));
        } else if (o->dq->gated) { /* the unit's two blocks are a gate block and its up */
            gated_pair(o->dq, first, _mm512_load_si512(row + 256), m, n / 2);
        } else {
            dequantize_chunk(o->dq, first, m, n, (__mmask16)0xFFFF);
            if (unit->two_blocks) dequantize_chunk(o->dq, _mm512_load_si512(row + 256), m, n + 16, (__mmask16)0xFFFF);
        }
    }
}

DEFINE_AMX_GEMM(amx_int8, _tile_dpbssd, AmxInt8Output, amx_int8_epilogue_rows, 0)

/* c [M, N] (row stride N) = a [M, K] (row stride a_stride) @ the packed matrix, or (dq not
 * NULL) those products dequantized; int8_gemm's arguments, checked by it, K a multiple of 64.
 * Items are amx_gemm.h's (row group, panel) pairs, claimed by the threads from 256 rows. */
static int amx_int8_gemm(const int8_t *a, int64_t a_stride, int64_t M, int64_t K, const int8_t *packed, int32_t *c,
                         int64_t N, const Int8Dequantize *dq, int num_threads) {
    const AmxGemmPlan plan = amx_gemm_plan(M, K, N, num_threads);
    const AmxInt8Output output = {c, N, dq};
    AmxClaim claims[AMX_MAX_CLAIMS];
#pragma omp parallel num_threads(num_threads)
    amx_int8_items(&plan, (const char *)a, a_stride, K / AMX8_STEP_K, (const char *)packed, K * 16, &output,
                   claims, NULL);
    return 0;
}
#endif
