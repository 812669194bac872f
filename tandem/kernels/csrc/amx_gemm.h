/*
 * The packed GEMM on AMX tiles, whatever the tiles multiply: included by dense_gemm_amx.h (bf16
 * products into fp32, tdpbf16ps) and int8_gemm_amx.h (signed bytes into int32, tdpbssd). The
 * two differ in one tile instruction and in their epilogues, so each names those and
 * DEFINE_AMX_GEMM writes the rest: the unit's tile products over K with the previous unit's
 * epilogue spread between them, and how rows and columns are dealt to the threads. Written
 * once, a change to either (a unit's shape, the item order, the epilogue's placement) reaches
 * both.
 *
 * Both packed layouts are already the tiles' B operand: a block of 16 columns holds, for each
 * k step (32 bf16 or 64 int8 values of k), one 16 x 64-byte B tile, 1 KiB contiguous. The A
 * operand is 16 rows of the activations, 64 bytes of k each, read in place with the rows'
 * stride. A unit is up to two row tiles (32 rows) by two blocks (32 columns):
 *   tmm0-1: the sums of row tile 0 (blocks 0, 1); tmm2-3: of row tile 1;
 *   tmm4-5: A of row tiles 0, 1;  tmm6-7: B of blocks 0, 1;
 * so each tile load feeds two products. A row tile of fewer than 16 rows is configured with
 * that many rows (tile loads and stores then touch only those rows). The sums (4 bytes each)
 * go through a 4 KiB buffer to the kernel's epilogue, which runs a few rows between each k
 * step's tile instructions of the next unit: run after them, its ~600 vector instructions
 * (1,000 with the gated silu) did not fit the reorder window beside the waiting tile products,
 * and took 10-25% of a bf16 GEMM at K = 576.
 */
#ifndef TANDEM_AMX_GEMM_H
#define TANDEM_AMX_GEMM_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "amx_tiles.h"

#define AMX_ROWS 16         /* rows of an A or C tile */
#define AMX_UNIT_ROWS 32    /* two row tiles */
#define AMX_PANEL_BLOCKS 4  /* column blocks an item multiplies */
/* An item's rows: as many as fill AMX_GROUP_BYTES of activations, at least AMX_GROUP_MIN_ROWS
 * (a K of thousands, as a down projection's, would otherwise stream the whole matrix every
 * few rows). SmolLM2's and Qwen2.5-0.5B's bf16 shapes at 2,048 rows ran best near these,
 * against 256 KiB and 32 rows (down at K = 4,864: 1,769 -> 2,212-2,314 GFLOP/s) and 1 MiB. */
#define AMX_GROUP_BYTES (640 * 1024)
#define AMX_GROUP_MIN_ROWS 128

/* The unit's tiles (above) for rows0 rows in row tile 0 and rows1 in row tile 1; rows1 may be
 * 0 (one row tile): its tiles are then unused. */
static void amx_gemm_configure(int rows0, int rows1) {
    AmxTileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    const int one = rows1 > 0 ? rows1 : 1;
    const int rows[8] = {rows0, rows0, one, one, rows0, one, AMX_ROWS, AMX_ROWS};
    for (int t = 0; t < 8; t++) {
        config.rows[t] = (uint8_t)rows[t];
        config.bytes_per_row[t] = 64;
    }
    _tile_loadconfig(&config);
}

/* A unit whose sums wait in a buffer for their epilogue: c is [row tile][block][16 rows][16
 * columns] of fp32 or int32, as the kernel's tile instruction writes them. */
typedef struct {
    int64_t m, rows, block;
    int two_blocks;
    const void *c;
} AmxUnit;

/* How a product's items are cut: items are (row group, panel) pairs, a thread's consecutive
 * items one group's panels, so a group's activations stay in L2 while it meets every panel. */
typedef struct {
    int64_t M, blocks, units, groups, panel_blocks, panels;
} AmxGemmPlan;

/* The plan for M rows of row_bytes bytes of activations against N columns on num_threads. The
 * rows' units are dealt evenly over the groups (sizes differ by one unit at most): with groups
 * of the largest size and a short last one, the thread whose static share held it waited at
 * the end of every GEMM (bf16, 2,048 rows at K = 576: groups of 544 rows and one of 416, 6% of
 * the product). Items are split statically over the threads, and a count the threads do not
 * divide left one of them an item longer (SmolLM2's o and down at 64 rows: 9 panels, 5
 * against 4), so such a product takes panels of 2 blocks, twice as many items (bf16, 2
 * threads, medians: o / down / q,k,v 36-41 / 111 / 62-70 us -> 33-35 / 99-104 / 59-60 at 64
 * rows; 2,048 rows q,k,v 1,016 -> 910 us). */
static AmxGemmPlan amx_gemm_plan(int64_t M, int64_t row_bytes, int64_t N, int num_threads) {
    AmxGemmPlan plan = {.M = M, .blocks = N / 16};
    int64_t group_rows = AMX_GROUP_BYTES / row_bytes / AMX_UNIT_ROWS * AMX_UNIT_ROWS;
    if (group_rows < AMX_GROUP_MIN_ROWS) group_rows = AMX_GROUP_MIN_ROWS;
    plan.units = (M + AMX_UNIT_ROWS - 1) / AMX_UNIT_ROWS;
    plan.groups = (M + group_rows - 1) / group_rows;
    plan.panel_blocks = AMX_PANEL_BLOCKS;
    if (plan.groups * ((plan.blocks + plan.panel_blocks - 1) / plan.panel_blocks) % num_threads != 0)
        plan.panel_blocks = 2;
    plan.panels = (plan.blocks + plan.panel_blocks - 1) / plan.panel_blocks;
    return plan;
}

/* One unit shape's products over all of K into tmm0-3: a (its first row, a_stride bytes
 * between rows), b0 / b1 (the blocks' packed data; b1 unused unless TWO_BLOCKS), k_steps steps
 * of 64 bytes of A and one 1 KiB B tile a block. The previous unit's epilogue (pending, if any)
 * is done a few rows a step between the tile instructions. The compiler needs the tile numbers
 * as constants, hence one function per shape. */
#define AMX_GEMM_UNIT_(NAME, TILE_PRODUCT, OUTPUT, EPILOGUE, SHAPE, TWO_ROWS, TWO_BLOCKS)               \
    static inline void NAME##_multiply_##SHAPE(const char *a, int64_t a_stride, int64_t k_steps,           \
                                               const char *b0, const char *b1, const AmxUnit *pending,     \
                                               const OUTPUT *output) {                                     \
        const int64_t per_step = pending != NULL ? (pending->rows + k_steps - 1) / k_steps : 0;            \
        _tile_zero(0);                                                                                     \
        if (TWO_BLOCKS) _tile_zero(1);                                                                     \
        if (TWO_ROWS) _tile_zero(2);                                                                       \
        if (TWO_ROWS && TWO_BLOCKS) _tile_zero(3);                                                         \
        for (int64_t q = 0; q < k_steps; q++) {                                                            \
            _tile_loadd(4, a + q * 64, a_stride);                                                          \
            _tile_loadd(6, b0 + q * 1024, 64);                                                             \
            TILE_PRODUCT(0, 4, 6);                                                                         \
            if (TWO_BLOCKS) {                                                                              \
                _tile_loadd(7, b1 + q * 1024, 64);                                                         \
                TILE_PRODUCT(1, 4, 7);                                                                     \
            }                                                                                              \
            if (TWO_ROWS) {                                                                                \
                _tile_loadd(5, a + AMX_ROWS * a_stride + q * 64, a_stride);                                \
                TILE_PRODUCT(2, 5, 6);                                                                     \
                if (TWO_BLOCKS) TILE_PRODUCT(3, 5, 7);                                                     \
            }                                                                                              \
            const int64_t from = q * per_step;                                                             \
            if (from < (per_step > 0 ? pending->rows : 0))                                                 \
                EPILOGUE(pending, output, from, from + per_step < pending->rows ? from + per_step          \
                                                                                 : pending->rows);        \
        }                                                                                                  \
    }                                                                                                      \
    static inline void NAME##_store_##SHAPE(char *c) {                                                     \
        _tile_stored(0, c, 64);                                                                            \
        if (TWO_BLOCKS) _tile_stored(1, c + 1024, 64);                                                     \
        if (TWO_ROWS) _tile_stored(2, c + 2048, 64);                                                       \
        if (TWO_ROWS && TWO_BLOCKS) _tile_stored(3, c + 3072, 64);                                         \
    }

/* NAME##_items(plan, a, a_stride, k_steps, packed, block_bytes, output): this thread's share of
 * the plan's items, to be called by every thread of a parallel region (it holds an orphaned
 * `omp for`); a block's packed data is block_bytes long. Ends with the last unit's epilogue
 * and the tiles released. EPILOGUE(unit, output, from, to) writes rows [from, to) of a unit. */
#define DEFINE_AMX_GEMM(NAME, TILE_PRODUCT, OUTPUT, EPILOGUE)                                              \
    AMX_GEMM_UNIT_(NAME, TILE_PRODUCT, OUTPUT, EPILOGUE, 1_1, 0, 0)                                        \
    AMX_GEMM_UNIT_(NAME, TILE_PRODUCT, OUTPUT, EPILOGUE, 1_2, 0, 1)                                        \
    AMX_GEMM_UNIT_(NAME, TILE_PRODUCT, OUTPUT, EPILOGUE, 2_1, 1, 0)                                        \
    AMX_GEMM_UNIT_(NAME, TILE_PRODUCT, OUTPUT, EPILOGUE, 2_2, 1, 1)                                        \
    static void NAME##_items(const AmxGemmPlan *plan, const char *a, int64_t a_stride, int64_t k_steps,    \
                             const char *packed, int64_t block_bytes, const OUTPUT *output) {              \
        char buffers[2][4096] __attribute__((aligned(64)));                                                \
        int configured0 = -1, configured1 = -1, next_buffer = 0;                                           \
        AmxUnit pending = {0, 0, 0, 0, NULL};                                                              \
        const AmxUnit *waiting = NULL;                                                                     \
        const int64_t M = plan->M, blocks = plan->blocks, units = plan->units, groups = plan->groups;      \
        const int64_t panel_blocks = plan->panel_blocks, panels = plan->panels;                            \
        _Pragma("omp for schedule(static)")                                                                \
        for (int64_t item = 0; item < groups * panels; item++) {                                           \
            const int64_t panel = item % panels * panel_blocks;                                            \
            const int64_t group = item / panels;                                                           \
            const int64_t first = group * units / groups * AMX_UNIT_ROWS;                                  \
            const int64_t last = (group + 1) * units / groups * AMX_UNIT_ROWS;                             \
            const int64_t end = last < M ? last : M;                                                       \
            const int64_t width = blocks - panel < panel_blocks ? blocks - panel : panel_blocks;           \
            for (int64_t m = first; m < end; m += AMX_UNIT_ROWS) {                                         \
                const int64_t rows = end - m < AMX_UNIT_ROWS ? end - m : AMX_UNIT_ROWS;                    \
                const int rows0 = rows < AMX_ROWS ? (int)rows : AMX_ROWS, rows1 = (int)rows - rows0;       \
                if (rows0 != configured0 || rows1 != configured1) { /* all tiles are stored by now */      \
                    amx_gemm_configure(rows0, rows1);                                                      \
                    configured0 = rows0;                                                                   \
                    configured1 = rows1;                                                                   \
                }                                                                                          \
                const char *rows_a = a + m * a_stride;                                                     \
                for (int64_t block = panel; block < panel + width; block += 2) {                           \
                    const int two_blocks = block + 1 < panel + width;                                      \
                    const char *b0 = packed + block * block_bytes, *b1 = b0 + block_bytes;                 \
                    char *c = buffers[next_buffer];                                                        \
                    next_buffer ^= 1;                                                                      \
                    if (rows1 > 0 && two_blocks) NAME##_multiply_2_2(rows_a, a_stride, k_steps, b0, b1, waiting, output); \
                    else if (rows1 > 0) NAME##_multiply_2_1(rows_a, a_stride, k_steps, b0, b1, waiting, output); \
                    else if (two_blocks) NAME##_multiply_1_2(rows_a, a_stride, k_steps, b0, b1, waiting, output); \
                    else NAME##_multiply_1_1(rows_a, a_stride, k_steps, b0, b1, waiting, output);          \
                    if (rows1 > 0 && two_blocks) NAME##_store_2_2(c);                                      \
                    else if (rows1 > 0) NAME##_store_2_1(c);                                               \
                    else if (two_blocks) NAME##_store_1_2(c);                                              \
                    else NAME##_store_1_1(c);                                                              \
                    pending = (AmxUnit){m, rows, block, two_blocks, c};                                    \
                    waiting = &pending;                                                                    \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
        if (waiting != NULL) EPILOGUE(waiting, output, 0, waiting->rows);                                  \
        if (configured0 >= 0) _tile_release();                                                             \
    }
#endif
