/*
 * The packed dense GEMM's bf16 products on AMX tiles (included by dense_gemm.c where the build
 * targets a CPU with AMX-BF16).
 *
 * Why: on a CPU with AMX, oneDNN multiplies bf16 on the tiles, which the AVX-512-BF16 tiles of
 * dense_gemm.c cannot keep up with, so tandem's linears stayed oneDNN's there, and with them
 * everything built on tandem's own GEMM: the fused epilogues (bias and residual, silu(gate) *
 * up) and the layer stack's batched steps (csrc/decode_stack.c), whose one C call a step
 * needs a C GEMM.
 *
 * The packed bf16 layout is already the tiles' B operand: a block's 16 columns hold, for each
 * pair of consecutive k, one 64-byte row of 16 (k, k + 1) pairs, so 16 pair-steps of a block
 * (32 values of k) are one 16 x 64-byte B tile. The units, their tiles and how the threads
 * share them are amx_gemm.h's (shared with the 8-bit tiles); this file is the bf16 product
 * (tdpbf16ps into fp32) and its epilogues: dense_gemm.c's (bias, residual, one rounding to
 * bf16; or the gated silu(gate) * up, where a pair of blocks is a gate and its up), or a greedy
 * head's argmax.
 *
 * K must be a multiple of 32: the caller sends other K to the AVX-512-BF16 tiles. The OS grants
 * the tiles' state per process (arch_prctl); where it refuses, the AVX-512-BF16 tiles run
 * instead.
 */
#ifndef TANDEM_DENSE_GEMM_AMX_H
#define TANDEM_DENSE_GEMM_AMX_H
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_gemm.h"

#define AMX_STEP_K 32 /* values of k a tile product covers (16 bf16 pairs) */

/* A greedy head's running argmax, one thread's (`tandem_dense_gemm_argmax`): for each row, lane j
 * of its 16 holds the largest value among the columns 16c + j the thread has multiplied, the
 * first such column, and the first column there that was NaN (INT32_MAX: none yet). */
typedef struct {
    float *value;    /* [M][16] */
    int32_t *column; /* [M][16] */
    int32_t *nan;    /* [M][16] */
} AmxArgmax;

/* Where and how units' results are written (dense_gemm.c's epilogues), or, with `argmax`, each
 * row's largest value looked for instead of writing any. */
typedef struct {
    const void *bias, *residual;
    void *out;
    int64_t N;
    int gated;
    const AmxArgmax *argmax;
    const float *scales; /* 8-bit weights: each packed column's fp32 scale (NULL: bf16 weights) */
} AmxOutput;

/* A chunk of 16 columns from `column` of row m into the running argmax: the value the bf16
 * output would hold (the plain epilogue's one vcvtneps2bf16, widened back exactly), so the
 * index is the one torch.argmax gives over those logits. A lane keeps the larger value, or the
 * earlier column of equal ones; a NaN's column goes to the lane's first NaN. */
static inline void amx_argmax_chunk(const AmxArgmax *a, int64_t m, __m512 acc, int64_t column) {
    const __m512 v = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(acc)), 16));
    const __m512i columns = _mm512_add_epi32(_mm512_set1_epi32((int32_t)column),
                                             _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
    float *value = a->value + m * 16;
    int32_t *best_column = a->column + m * 16;
    const __m512 best = _mm512_load_ps(value);
    const __m512i held = _mm512_load_si512(best_column);
    const __mmask16 wins = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ)
                           | (_mm512_cmp_ps_mask(v, best, _CMP_EQ_OQ) & _mm512_cmplt_epi32_mask(columns, held));
    _mm512_store_ps(value, _mm512_mask_mov_ps(best, wins, v));
    _mm512_store_si512(best_column, _mm512_mask_mov_epi32(held, wins, columns));
    const __mmask16 unordered = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    if (unordered) {
        int32_t *nan = a->nan + m * 16;
        const __m512i seen = _mm512_load_si512(nan);
        _mm512_store_si512(nan, _mm512_mask_min_epi32(seen, unordered, seen, columns));
    }
}

/* Whether (value, column) beats (best, at): larger, or equal and earlier. */
static inline int amx_argmax_beats(float value, int32_t column, float best, int32_t at) {
    return value > best || (value == best && column < at);
}

/* Rows [from, to) of a unit's epilogue: bias and residual and one rounding, or the gated
 * silu(gate) * up where its two blocks are a gate block and its up. */
static inline void amx_epilogue_rows(const AmxUnit *unit, const AmxOutput *o, int64_t from, int64_t to) {
    for (int64_t i = from; i < to; i++) {
        const float *row = (const float *)unit->c + (i / AMX_ROWS) * 512 + (i % AMX_ROWS) * 16;
        const int64_t m = unit->m + i, block = unit->block, N = o->N;
        __m512 first = _mm512_load_ps(row), second = _mm512_load_ps(row + 256);
        if (o->scales != NULL) {
            first = _mm512_mul_ps(first, _mm512_loadu_ps(o->scales + block * 16));
            if (unit->two_blocks) second = _mm512_mul_ps(second, _mm512_loadu_ps(o->scales + block * 16 + 16));
        }
        if (o->argmax != NULL) {
            amx_argmax_chunk(o->argmax, m, first, block * 16);
            if (unit->two_blocks) amx_argmax_chunk(o->argmax, m, second, block * 16 + 16);
            continue;
        }
        if (o->gated) {
            store_gated_chunk(first, second, 2, o->bias, o->out, block * 8, N / 2, m * (N / 2) + block * 8);
            continue;
        }
        store_chunk(first, 2, o->bias, o->residual, o->out, block * 16, m * N + block * 16);
        if (unit->two_blocks)
            store_chunk(second, 2, o->bias, o->residual, o->out, block * 16 + 16, m * N + block * 16 + 16);
    }
}

DEFINE_AMX_GEMM(amx_bf16, _tile_dpbf16ps, AmxOutput, amx_epilogue_rows, 0)
DEFINE_AMX_GEMM(amx_w8, _tile_dpbf16ps, AmxOutput, amx_epilogue_rows, 1)

/* The bf16 product on the tiles. Same arguments and result as dense_gemm (kind 1); the caller
 * checked them. With ids, each row's argmax instead of the product (`tandem_dense_gemm_argmax`).
 * Each unit's epilogue runs while the next unit multiplies (amx_gemm.h): run one after the
 * other, the epilogue (a rounding of 1,024 sums) took a third of a unit's time at K = 576. */
static int amx_dense_gemm(const void *x, int64_t x_stride, int64_t M, int64_t K, const void *packed,
                          const float *scales, const void *bias, const void *residual, void *out, int64_t N,
                          int gated, int64_t *ids, int num_threads) {
    const AmxGemmPlan plan = amx_gemm_plan(M, K * 2, N, num_threads);
    AmxClaim claims[AMX_MAX_CLAIMS]; /* the threads' shares of the items (amx_gemm.h) */
    const int widens = scales != NULL; /* 8-bit weights: widened into a buffer of each thread's */
    const int64_t a_stride = x_stride * 2, block_bytes = K * (widens ? 1 : 2) * 16;
    /* a thread's widened tiles: one block pair below the snake (amx_gemm.h's pair_major), else a panel */
    const size_t panel_bytes = (size_t)(M < AMX_SNAKE_MIN_ROWS ? 2 : AMX_PANEL_BLOCKS) * (size_t)(K / AMX_STEP_K) * 1024;
    /* ids: each row's argmax, merged from the threads' (value, column, first NaN) */
    float *merged_value = NULL;
    int32_t *merged_column = NULL, *merged_nan = NULL;
    int failed = 0;
    if (ids != NULL) {
        merged_value = malloc(sizeof(float) * (size_t)M);
        merged_column = malloc(sizeof(int32_t) * (size_t)M);
        merged_nan = malloc(sizeof(int32_t) * (size_t)M);
        if (merged_value == NULL || merged_column == NULL || merged_nan == NULL) failed = 1;
        for (int64_t m = 0; !failed && m < M; m++) {
            merged_value[m] = -__builtin_inff();
            merged_column[m] = merged_nan[m] = INT32_MAX;
        }
    }
#pragma omp parallel num_threads(num_threads) if (!failed)
    {
        AmxArgmax lanes = {NULL, NULL, NULL};
        char *widened = widens ? aligned_alloc(64, panel_bytes) : NULL;
        if (widens && widened == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        if (ids != NULL && !failed) {
            const size_t count = (size_t)M * 16;
            lanes.value = aligned_alloc(64, sizeof(float) * count);
            lanes.column = aligned_alloc(64, sizeof(int32_t) * count);
            lanes.nan = aligned_alloc(64, sizeof(int32_t) * count);
            if (lanes.value == NULL || lanes.column == NULL || lanes.nan == NULL) {
#pragma omp atomic write
                failed = 1;
            } else {
                for (size_t i = 0; i < count; i++) {
                    lanes.value[i] = -__builtin_inff();
                    lanes.column[i] = lanes.nan[i] = INT32_MAX;
                }
            }
        }
        if (ids != NULL || widens) { /* every thread's allocation is known before any reads `failed` */
#pragma omp barrier
        }
        const AmxOutput output = {bias, residual, out, N, gated, ids != NULL ? &lanes : NULL, scales};
        if (!failed && widens) /* every thread reads the same `failed` here: none or all share the items */
            amx_w8_items(&plan, (const char *)x, a_stride, K / AMX_STEP_K, (const char *)packed, block_bytes,
                         &output, claims, widened);
        else if (!failed)
            amx_bf16_items(&plan, (const char *)x, a_stride, K / AMX_STEP_K, (const char *)packed, block_bytes,
                           &output, claims, NULL);
        if (ids != NULL && !failed)
            for (int64_t m = 0; m < M; m++) {
                float value = -__builtin_inff();
                int32_t column = INT32_MAX, nan = INT32_MAX;
                for (int j = 0; j < 16; j++) {
                    if (amx_argmax_beats(lanes.value[m * 16 + j], lanes.column[m * 16 + j], value, column)) {
                        value = lanes.value[m * 16 + j];
                        column = lanes.column[m * 16 + j];
                    }
                    if (lanes.nan[m * 16 + j] < nan) nan = lanes.nan[m * 16 + j];
                }
#pragma omp critical(tandem_amx_argmax)
                {
                    if (amx_argmax_beats(value, column, merged_value[m], merged_column[m])) {
                        merged_value[m] = value;
                        merged_column[m] = column;
                    }
                    if (nan < merged_nan[m]) merged_nan[m] = nan;
                }
            }
        free(widened);
        free(lanes.value);
        free(lanes.column);
        free(lanes.nan);
    }
    if (ids != NULL && !failed)
        for (int64_t m = 0; m < M; m++) /* no value above -inf and no NaN: every column is -inf */
            ids[m] = merged_nan[m] != INT32_MAX ? merged_nan[m] : merged_column[m] != INT32_MAX ? merged_column[m] : 0;
    free(merged_value);
    free(merged_column);
    free(merged_nan);
    return failed ? -1 : 0;
}
#endif
