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
 * (32 values of k) are one 16 x 64-byte B tile, 1 KiB contiguous. The A operand is 16 rows of
 * the activations, 32 values of k each, read in place with the rows' stride. A unit is up to
 * two row tiles (32 rows) by two blocks (32 columns): four fp32 accumulator tiles (tmm0-3),
 * two A tiles (tmm4-5), two B tiles (tmm6-7), so each tile load feeds two multiplies. The
 * accumulators go through a 1 KiB buffer to dense_gemm.c's epilogues (bias, residual, one
 * rounding to bf16; or the gated silu(gate) * up, where a pair of blocks is a gate and its up).
 *
 * A row tile of fewer than 16 rows is configured with that many rows (tile loads and stores
 * then touch only those rows). K must be a multiple of 32: the caller sends other K to the
 * AVX-512-BF16 tiles. The OS grants the tiles' state per process (arch_prctl); where it
 * refuses, the AVX-512-BF16 tiles run instead.
 */
#ifndef TANDEM_DENSE_GEMM_AMX_H
#define TANDEM_DENSE_GEMM_AMX_H
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"

#define AMX_ROWS 16          /* rows of an A or C tile */
#define AMX_STEP_K 32        /* values of k a tile multiply covers (16 bf16 pairs) */
#define AMX_UNIT_ROWS 32     /* two row tiles */
#define AMX_PANEL_BLOCKS 4    /* column blocks an item multiplies */
/* An item's rows: as many as fill AMX_GROUP_BYTES of activations, at least AMX_GROUP_MIN_ROWS
 * (a K of thousands, as a down projection's, would otherwise stream the whole matrix every
 * few rows). SmolLM2's and Qwen2.5-0.5B's shapes at 2,048 rows ran best near these, against
 * 256 KiB and 32 rows (down at K = 4,864: 1,769 -> 2,212-2,314 GFLOP/s) and 1 MiB. */
#define AMX_GROUP_BYTES (640 * 1024)
#define AMX_GROUP_MIN_ROWS 128
/* tmm0-1: C of row tile 0 (blocks 0, 1); tmm2-3: C of row tile 1; tmm4-5: A of row tiles 0, 1;
 * tmm6-7: B of blocks 0, 1. rows1 may be 0 (one row tile): its tiles are then unused. */
static void amx_configure(int rows0, int rows1) {
    AmxTileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    const int rows[8] = {rows0, rows0, rows1 > 0 ? rows1 : 1, rows1 > 0 ? rows1 : 1,
                         rows0, rows1 > 0 ? rows1 : 1, AMX_ROWS, AMX_ROWS};
    for (int t = 0; t < 8; t++) {
        config.rows[t] = (uint8_t)rows[t];
        config.bytes_per_row[t] = 64;
    }
    _tile_loadconfig(&config);
}

/* A unit whose accumulators wait in a buffer for their epilogue. */
typedef struct {
    int64_t m, rows, block;
    int two_blocks;
    const float *c; /* [row tile][block][16 rows][16 columns] */
} AmxUnit;

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
        const float *row = unit->c + (i / AMX_ROWS) * 512 + (i % AMX_ROWS) * 16;
        const int64_t m = unit->m + i, block = unit->block, N = o->N;
        if (o->argmax != NULL) {
            amx_argmax_chunk(o->argmax, m, _mm512_load_ps(row), block * 16);
            if (unit->two_blocks) amx_argmax_chunk(o->argmax, m, _mm512_load_ps(row + 256), block * 16 + 16);
            continue;
        }
        if (o->gated) {
            store_gated_chunk(_mm512_load_ps(row), _mm512_load_ps(row + 256), 2, o->bias, o->out, block * 8, N / 2,
                              m * (N / 2) + block * 8);
            continue;
        }
        store_chunk(_mm512_load_ps(row), 2, o->bias, o->residual, o->out, block * 16, m * N + block * 16);
        if (unit->two_blocks)
            store_chunk(_mm512_load_ps(row + 256), 2, o->bias, o->residual, o->out, block * 16 + 16,
                        m * N + block * 16 + 16);
    }
}

/* One unit's products over all of K into tmm0-3: a (its first row, a_stride bytes between
 * rows), b0 / b1 (the blocks' packed data; b1 unused unless TWO_BLOCKS). The previous unit's
 * epilogue (pending, if any) is done a few rows a step between the tile instructions: run
 * after them, its ~600 vector instructions (1,000 with the gated silu) did not fit the
 * reorder window beside the waiting tile products, and took 10-25% of a GEMM at K = 576.
 * The compiler needs the tile numbers as constants, hence one function per shape. */
#define DEFINE_AMX_UNIT(SHAPE, TWO_ROWS, TWO_BLOCKS)                                                   \
    static inline void amx_multiply_##SHAPE(const char *a, int64_t a_stride, int64_t k_steps,          \
                                            const char *b0, const char *b1, const AmxUnit *pending,     \
                                            const AmxOutput *output) {                                  \
        const int64_t per_step = pending != NULL ? (pending->rows + k_steps - 1) / k_steps : 0;         \
        _tile_zero(0);                                                                                  \
        if (TWO_BLOCKS) _tile_zero(1);                                                                  \
        if (TWO_ROWS) _tile_zero(2);                                                                    \
        if (TWO_ROWS && TWO_BLOCKS) _tile_zero(3);                                                      \
        for (int64_t q = 0; q < k_steps; q++) {                                                         \
            _tile_loadd(4, a + q * 64, a_stride);                                                       \
            _tile_loadd(6, b0 + q * 1024, 64);                                                          \
            _tile_dpbf16ps(0, 4, 6);                                                                    \
            if (TWO_BLOCKS) {                                                                           \
                _tile_loadd(7, b1 + q * 1024, 64);                                                      \
                _tile_dpbf16ps(1, 4, 7);                                                                \
            }                                                                                           \
            if (TWO_ROWS) {                                                                             \
                _tile_loadd(5, a + AMX_ROWS * a_stride + q * 64, a_stride);                             \
                _tile_dpbf16ps(2, 5, 6);                                                                \
                if (TWO_BLOCKS) _tile_dpbf16ps(3, 5, 7);                                                \
            }                                                                                           \
            const int64_t from = q * per_step;                                                          \
            if (from < (per_step > 0 ? pending->rows : 0))                                              \
                amx_epilogue_rows(pending, output, from,                                                \
                                  from + per_step < pending->rows ? from + per_step : pending->rows);   \
        }                                                                                               \
    }                                                                                                   \
    static inline void amx_store_##SHAPE(float *c) {                                                    \
        _tile_stored(0, c, 64);                                                                         \
        if (TWO_BLOCKS) _tile_stored(1, c + 256, 64);                                                   \
        if (TWO_ROWS) _tile_stored(2, c + 512, 64);                                                     \
        if (TWO_ROWS && TWO_BLOCKS) _tile_stored(3, c + 768, 64);                                       \
    }
DEFINE_AMX_UNIT(1_1, 0, 0)
DEFINE_AMX_UNIT(1_2, 0, 1)
DEFINE_AMX_UNIT(2_1, 1, 0)
DEFINE_AMX_UNIT(2_2, 1, 1)

/* The bf16 product on the tiles. Same arguments and result as dense_gemm (kind 1); the caller
 * checked them. Each unit's epilogue runs while the next unit multiplies, a few rows between
 * each step's tile instructions: the tiles work beside the vector units, and the epilogue (a
 * rounding of 1,024 sums) took a third of a unit's time at K = 576 when the two ran one after
 * the other, and 10-25% of a GEMM when it ran whole after the next unit's tile products. */
static int amx_dense_gemm(const void *x, int64_t x_stride, int64_t M, int64_t K, const void *packed,
                          const void *bias, const void *residual, void *out, int64_t N, int gated,
                          int64_t *ids, int num_threads) {
    const int64_t blocks = N / 16, pair_steps = K / 2, k_steps = K / AMX_STEP_K;
    const int64_t a_stride = x_stride * 2;
    /* Row groups whose activations stay in L2, each multiplied by every panel before the next
     * group: a thread's consecutive items are one group's panels. The rows' units are dealt
     * evenly over the groups (sizes differ by one unit at most): with groups of the largest
     * size and a short last one, the thread whose static share held it waited at the end of
     * every GEMM (2,048 rows at K = 576: groups of 544 rows and one of 416, 6% of the product). */
    int64_t group_rows = AMX_GROUP_BYTES / (K * 2) / AMX_UNIT_ROWS * AMX_UNIT_ROWS;
    if (group_rows < AMX_GROUP_MIN_ROWS) group_rows = AMX_GROUP_MIN_ROWS;
    const int64_t units = (M + AMX_UNIT_ROWS - 1) / AMX_UNIT_ROWS;
    const int64_t groups = (M + group_rows - 1) / group_rows;
    /* Items split statically over the threads: a count the threads do not divide left one of
     * them an item longer (SmolLM2's o and down at 64 rows: 9 panels, 5 against 4), so such a
     * product takes panels of 2 blocks, twice as many items. 2 threads, alone, medians: o / down
     * / q,k,v 36-41 / 111 / 62-70 us -> 33-35 / 99-104 / 59-60 at 64 rows, 2,048 rows q,k,v
     * 1,016 -> 910 us. */
    int64_t panel_blocks = AMX_PANEL_BLOCKS;
    if (groups * ((blocks + panel_blocks - 1) / panel_blocks) % num_threads != 0) panel_blocks = 2;
    const int64_t panels = (blocks + panel_blocks - 1) / panel_blocks;
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
        float buffers[2][4 * 256] __attribute__((aligned(64)));
        AmxArgmax lanes = {NULL, NULL, NULL};
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
        if (ids != NULL) { /* every thread's allocation is known before any reads `failed` */
#pragma omp barrier
        }
        const AmxOutput output = {bias, residual, out, N, gated, ids != NULL ? &lanes : NULL};
        int configured0 = -1, configured1 = -1, next_buffer = 0;
        AmxUnit pending = {0, 0, 0, 0, NULL};
        const AmxUnit *waiting = NULL;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < groups * panels; item++) {
            if (failed) continue;
            const int64_t panel = item % panels * panel_blocks;
            const int64_t group = item / panels;
            const int64_t first = group * units / groups * AMX_UNIT_ROWS;
            const int64_t width = blocks - panel < panel_blocks ? blocks - panel : panel_blocks;
            const int64_t last = (group + 1) * units / groups * AMX_UNIT_ROWS;
            const int64_t end = last < M ? last : M;
            for (int64_t m = first; m < end; m += AMX_UNIT_ROWS) {
                const int64_t rows = end - m < AMX_UNIT_ROWS ? end - m : AMX_UNIT_ROWS;
                const int rows0 = rows < AMX_ROWS ? (int)rows : AMX_ROWS, rows1 = (int)rows - rows0;
                if (rows0 != configured0 || rows1 != configured1) { /* all tiles are stored by now */
                    amx_configure(rows0, rows1);
                    configured0 = rows0;
                    configured1 = rows1;
                }
                const char *a = (const char *)x + m * a_stride;
                for (int64_t block = panel; block < panel + width; block += 2) {
                    const int two_blocks = block + 1 < panel + width;
                    const char *b0 = (const char *)packed + block * pair_steps * 64;
                    const char *b1 = b0 + pair_steps * 64;
                    float *c = buffers[next_buffer];
                    next_buffer ^= 1;
                    if (rows1 > 0 && two_blocks) amx_multiply_2_2(a, a_stride, k_steps, b0, b1, waiting, &output);
                    else if (rows1 > 0) amx_multiply_2_1(a, a_stride, k_steps, b0, b1, waiting, &output);
                    else if (two_blocks) amx_multiply_1_2(a, a_stride, k_steps, b0, b1, waiting, &output);
                    else amx_multiply_1_1(a, a_stride, k_steps, b0, b1, waiting, &output);
                    if (rows1 > 0 && two_blocks) amx_store_2_2(c);
                    else if (rows1 > 0) amx_store_2_1(c);
                    else if (two_blocks) amx_store_1_2(c);
                    else amx_store_1_1(c);
                    pending = (AmxUnit){m, rows, block, two_blocks, c};
                    waiting = &pending;
                }
            }
        }
        if (waiting != NULL) amx_epilogue_rows(waiting, &output, 0, waiting->rows);
        if (configured0 >= 0) _tile_release();
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
