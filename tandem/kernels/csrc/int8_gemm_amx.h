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
 * A unit is up to two row tiles (32 rows) by two blocks (32 columns): four int32 accumulator
 * tiles (tmm0-3), two A tiles (tmm4-5), two B tiles (tmm6-7). The accumulators go through a
 * buffer to the epilogue, which runs a few rows a k step while the next unit multiplies (as
 * dense_gemm_amx.h does for bf16): the tiles work beside the vector units. K must be a
 * multiple of 64; the caller sends other K to the vpdpbusd tiles.
 */
#ifndef TANDEM_INT8_GEMM_AMX_H
#define TANDEM_INT8_GEMM_AMX_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "amx_tiles.h"

#define AMX8_ROWS 16        /* rows of an A or C tile */
#define AMX8_STEP_K 64      /* values of k a tile product covers */
#define AMX8_UNIT_ROWS 32   /* two row tiles */
#define AMX8_PANEL_BLOCKS 4 /* column blocks an item multiplies */
/* An item's rows: as many as fill this many bytes of activations (the bf16 GEMM's choice,
 * dense_gemm_amx.h), at least AMX8_GROUP_MIN_ROWS. */
#define AMX8_GROUP_BYTES (640 * 1024)
#define AMX8_GROUP_MIN_ROWS 128

/* tmm0-1: C of row tile 0 (blocks 0, 1); tmm2-3: C of row tile 1; tmm4-5: A of row tiles 0, 1;
 * tmm6-7: B of blocks 0, 1. rows1 may be 0 (one row tile): its tiles are then unused. */
static void amx8_configure(int rows0, int rows1) {
    AmxTileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    const int one = rows1 > 0 ? rows1 : 1;
    const int rows[8] = {rows0, rows0, one, one, rows0, one, AMX8_ROWS, AMX8_ROWS};
    for (int t = 0; t < 8; t++) {
        config.rows[t] = (uint8_t)rows[t];
        config.bytes_per_row[t] = 64;
    }
    _tile_loadconfig(&config);
}

/* A unit whose products wait in a buffer for their epilogue. */
typedef struct {
    int64_t m, rows, block;
    int two_blocks;
    const int32_t *c; /* [row tile][block][16 rows][16 columns] */
} Amx8Unit;

/* Where a unit's products go: the int32 products themselves (c, row stride N), or (dq) what
 * they dequantize to. */
typedef struct {
    int32_t *c;
    int64_t N;
    const Int8Dequantize *dq;
} Amx8Output;

/* Rows [from, to) of a unit's epilogue. */
static inline void amx8_epilogue_rows(const Amx8Unit *unit, const Amx8Output *o, int64_t from, int64_t to) {
    for (int64_t i = from; i < to; i++) {
        const int32_t *row = unit->c + (i / AMX8_ROWS) * 512 + (i % AMX8_ROWS) * 16;
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

/* One unit's products over all of K into tmm0-3: a (its first row, a_stride bytes between
 * rows), b0 / b1 (the blocks' packed data; b1 unused unless TWO_BLOCKS). The previous unit's
 * epilogue (pending, if any) is done a few rows a step between the tile instructions. The
 * compiler needs the tile numbers as constants, hence one function per shape. */
#define DEFINE_AMX8_UNIT(SHAPE, TWO_ROWS, TWO_BLOCKS)                                                  \
    static inline void amx8_multiply_##SHAPE(const int8_t *a, int64_t a_stride, int64_t k_steps,       \
                                             const int8_t *b0, const int8_t *b1, const Amx8Unit *pending, \
                                             const Amx8Output *output) {                               \
        const int64_t per_step = pending != NULL ? (pending->rows + k_steps - 1) / k_steps : 0;         \
        _tile_zero(0);                                                                                  \
        if (TWO_BLOCKS) _tile_zero(1);                                                                  \
        if (TWO_ROWS) _tile_zero(2);                                                                    \
        if (TWO_ROWS && TWO_BLOCKS) _tile_zero(3);                                                      \
        for (int64_t q = 0; q < k_steps; q++) {                                                         \
            _tile_loadd(4, a + q * 64, a_stride);                                                       \
            _tile_loadd(6, b0 + q * 1024, 64);                                                          \
            _tile_dpbssd(0, 4, 6);                                                                      \
            if (TWO_BLOCKS) {                                                                           \
                _tile_loadd(7, b1 + q * 1024, 64);                                                      \
                _tile_dpbssd(1, 4, 7);                                                                  \
            }                                                                                           \
            if (TWO_ROWS) {                                                                             \
                _tile_loadd(5, a + AMX8_ROWS * a_stride + q * 64, a_stride);                            \
                _tile_dpbssd(2, 5, 6);                                                                  \
                if (TWO_BLOCKS) _tile_dpbssd(3, 5, 7);                                                  \
            }                                                                                           \
            const int64_t from = q * per_step;                                                          \
            if (from < (per_step > 0 ? pending->rows : 0))                                              \
                amx8_epilogue_rows(pending, output, from,                                               \
                                   from + per_step < pending->rows ? from + per_step : pending->rows);  \
        }                                                                                               \
    }                                                                                                   \
    static inline void amx8_store_##SHAPE(int32_t *c) {                                                 \
        _tile_stored(0, c, 64);                                                                         \
        if (TWO_BLOCKS) _tile_stored(1, c + 256, 64);                                                   \
        if (TWO_ROWS) _tile_stored(2, c + 512, 64);                                                     \
        if (TWO_ROWS && TWO_BLOCKS) _tile_stored(3, c + 768, 64);                                       \
    }
DEFINE_AMX8_UNIT(1_1, 0, 0)
DEFINE_AMX8_UNIT(1_2, 0, 1)
DEFINE_AMX8_UNIT(2_1, 1, 0)
DEFINE_AMX8_UNIT(2_2, 1, 1)

/* c [M, N] (row stride N) = a [M, K] (row stride a_stride) @ the packed matrix, or (dq not
 * NULL) those products dequantized; int8_gemm's arguments, checked by it, K a multiple of 64.
 * Items are (row group, panel) pairs split statically over the threads, as the bf16 tiles'. */
static int amx_int8_gemm(const int8_t *a, int64_t a_stride, int64_t M, int64_t K, const int8_t *packed, int32_t *c,
                         int64_t N, const Int8Dequantize *dq, int num_threads) {
    const int64_t blocks = N / 16, quads = K / 4, k_steps = K / AMX8_STEP_K;
    int64_t group_rows = AMX8_GROUP_BYTES / K / AMX8_UNIT_ROWS * AMX8_UNIT_ROWS;
    if (group_rows < AMX8_GROUP_MIN_ROWS) group_rows = AMX8_GROUP_MIN_ROWS;
    const int64_t units = (M + AMX8_UNIT_ROWS - 1) / AMX8_UNIT_ROWS;
    const int64_t groups = (M + group_rows - 1) / group_rows;
    /* a count of items the threads do not divide: panels of 2 blocks, twice as many items */
    int64_t panel_blocks = AMX8_PANEL_BLOCKS;
    if (groups * ((blocks + panel_blocks - 1) / panel_blocks) % num_threads != 0) panel_blocks = 2;
    const int64_t panels = (blocks + panel_blocks - 1) / panel_blocks;
    const Amx8Output output = {c, N, dq};
#pragma omp parallel num_threads(num_threads)
    {
        int32_t buffers[2][4 * 256] __attribute__((aligned(64)));
        int configured0 = -1, configured1 = -1, next_buffer = 0;
        Amx8Unit pending = {0, 0, 0, 0, NULL};
        const Amx8Unit *waiting = NULL;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < groups * panels; item++) {
            const int64_t panel = item % panels * panel_blocks;
            const int64_t group = item / panels;
            const int64_t first = group * units / groups * AMX8_UNIT_ROWS;
            const int64_t last = (group + 1) * units / groups * AMX8_UNIT_ROWS;
            const int64_t end = last < M ? last : M;
            const int64_t width = blocks - panel < panel_blocks ? blocks - panel : panel_blocks;
            for (int64_t m = first; m < end; m += AMX8_UNIT_ROWS) {
                const int64_t rows = end - m < AMX8_UNIT_ROWS ? end - m : AMX8_UNIT_ROWS;
                const int rows0 = rows < AMX8_ROWS ? (int)rows : AMX8_ROWS, rows1 = (int)rows - rows0;
                if (rows0 != configured0 || rows1 != configured1) { /* all tiles are stored by now */
                    amx8_configure(rows0, rows1);
                    configured0 = rows0;
                    configured1 = rows1;
                }
                const int8_t *rows_a = a + m * a_stride;
                for (int64_t block = panel; block < panel + width; block += 2) {
                    const int two_blocks = block + 1 < panel + width;
                    const int8_t *b0 = packed + block * quads * 64;
                    const int8_t *b1 = b0 + quads * 64;
                    int32_t *unit_c = buffers[next_buffer];
                    next_buffer ^= 1;
                    if (rows1 > 0 && two_blocks) amx8_multiply_2_2(rows_a, a_stride, k_steps, b0, b1, waiting, &output);
                    else if (rows1 > 0) amx8_multiply_2_1(rows_a, a_stride, k_steps, b0, b1, waiting, &output);
                    else if (two_blocks) amx8_multiply_1_2(rows_a, a_stride, k_steps, b0, b1, waiting, &output);
                    else amx8_multiply_1_1(rows_a, a_stride, k_steps, b0, b1, waiting, &output);
                    if (rows1 > 0 && two_blocks) amx8_store_2_2(unit_c);
                    else if (rows1 > 0) amx8_store_2_1(unit_c);
                    else if (two_blocks) amx8_store_1_2(unit_c);
                    else amx8_store_1_1(unit_c);
                    pending = (Amx8Unit){m, rows, block, two_blocks, unit_c};
                    waiting = &pending;
                }
            }
        }
        if (waiting != NULL) amx8_epilogue_rows(waiting, &output, 0, waiting->rows);
        if (configured0 >= 0) _tile_release();
    }
    return 0;
}
#endif
