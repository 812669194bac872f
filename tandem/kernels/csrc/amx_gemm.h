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
 *
 * A tile load from L2 costs about as much as a product, so from AMX_SNAKE_MIN_ROWS rows the
 * units go in a snake that keeps one operand of each in L1 (AMX_GEMM_ITEM_), and from
 * AMX_CLAIM_MIN_ROWS the threads claim items rather than split them statically (AmxClaim).
 * The A rows must start on 64-byte lines (decode_stack.c's scratch): a row that spans two
 * lines made a 2,048-row product a third slower.
 */
#ifndef TANDEM_AMX_GEMM_H
#define TANDEM_AMX_GEMM_H
#include <immintrin.h>
#include <omp.h>
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

/* What is left of a thread's share of the items, [low, high), packed as low | high << 32 so
 * that one compare-and-swap takes an item from either end: the owner from the low end, its
 * partner (thread me ^ 1), done with its own share, from the high end. */
typedef struct {
    uint64_t range;
} __attribute__((aligned(64))) AmxClaim;

/* From AMX_CLAIM_MIN_ROWS rows (a prefill's products, compute bound) the threads claim their
 * shares' items, and one that finishes first takes its partner's last ones. Split statically,
 * a thread whose core ran slower for a while (this kind of VM's virtual cores do) left the other
 * waiting at the end of every product: the GEMM's time in a prefill pass was 25-40% over its
 * median in 14 of 62 passes, against 1 of 46 with the claims. Steps of a few rows (memory
 * bound) keep the static split. */
#define AMX_CLAIM_MIN_ROWS 256
#define AMX_MAX_CLAIMS 64 /* threads that claim (a larger team: the static split) */

/* One item of `claim`: its lowest (from_top 0) or its highest. Returns 0 when none is left. */
static inline int amx_claim_item(AmxClaim *claim, int from_top, int64_t *item) {
    uint64_t old = __atomic_load_n(&claim->range, __ATOMIC_RELAXED);
    for (;;) {
        const uint64_t low = old & 0xFFFFFFFFu, high = old >> 32;
        if (low >= high) return 0;
        const uint64_t next = from_top ? low | (high - 1) << 32 : (low + 1) | high << 32;
        if (__atomic_compare_exchange_n(&claim->range, &old, next, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
            *item = (int64_t)(from_top ? high - 1 : low);
            return 1;
        }
    }
}

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

/* From this many rows the units go in a snake (AMX_GEMM_ITEM_). Fewer rows read their weights
 * from memory once a step, and there the snake made no step faster: decode-heavy's 64 rows went
 * 2-3% slower in the engine. */
#define AMX_SNAKE_MIN_ROWS 256
#define AMX_STREAM_A 1
#define AMX_STREAM_B 2
/* A tile load; STREAM marks an operand the next unit does not share (TILELOADDT1), so that it
 * is not kept in L1 in place of the one that unit will read again. */
#define AMX_LOAD_TILE(STREAM, TILE, BASE, STRIDE)                                                          \
    do {                                                                                                   \
        if (STREAM) _tile_stream_loadd(TILE, BASE, STRIDE);                                                \
        else _tile_loadd(TILE, BASE, STRIDE);                                                              \
    } while (0)

/* Below AMX_SNAKE_MIN_ROWS an item's first unit reads its blocks from memory (a step's weights,
 * once). A tile load waits for all its 16 lines, and the next step's B loads into the same tiles
 * wait for this step's products, so each step paid the memory's latency in turn. The first unit
 * asks, a step at a time, for the lines AMX_PREFETCH_BYTES ahead in each block into L1. On the
 * 2-core AMX Xeon, decode-heavy's 64-row products (timed builds swapped pass by pass in one
 * engine, medians of 4): SmolLM2 2,000 -> 1,884 ms a pass, Qwen2.5-0.5B 6,418 -> 6,075; 2 KiB
 * ahead 1,876 and 6,204, 16 KiB ahead 5% slower than none. Software prefetches into L2 made no
 * difference. (The whole next panel asked for into L2 helped SmolLM2 and cost Qwen2.5-0.5B 13-20%.)
 * Past a block's end the requests go on into the next pair's blocks (two blocks on: for the
 * item's last pair, the first pair of the next panel, which a thread's static share takes next),
 * so a pair's first 4 KiB of each block no longer come cold: with SmolLM2's K = 576 (18 KiB
 * blocks) that was a fifth of the bytes. Decode-heavy's 64-row products, medians of 6, 6 and 10
 * rounds as above: 2,223 -> 1,997, 1,846 -> 1,797, 2,599 -> 2,436 ms a pass; Qwen2.5-0.5B (28
 * and 152 KiB blocks) 7,065 -> 7,042. */
#define AMX_PREFETCH_BYTES 4096

/* 8-bit weights widened on the way (WIDENS, dense_gemm_amx.h's kind 3): a block's packed data
 * is the bf16 layout's with each value one signed byte (a k step's B tile, 512 bytes). An
 * item's first unit widens each step's bytes to the bf16 tile (1 KiB, exact: every byte is an
 * integer bf16 holds) into the thread's buffer one step ahead of its products, so the vector
 * widening runs beside the tiles, and the item's other units read the widened tiles there;
 * the weights' scales multiply the sums in the epilogue. Below the snake the units go pair by
 * pair (AMX_GEMM_ITEM_'s pair_major), so the buffer is one pair's and stays in L1 or L2; with
 * the panel's four blocks widened before the second unit read them (unit by unit, as bf16
 * goes), the buffer had left the caches between the engine's GEMMs. The bytes read from memory
 * are half the bf16 matrix's, and the widening costs about 6 vector instructions a 32-byte
 * row: on the 2-core AMX Xeon, a decode-heavy step of 64 sequences in one engine process
 * against bf16 weights, the GEMMs' ms a step: Qwen2.5-Coder-0.5B 46.7 -> 36.8 (gate/up 25.4
 * -> 19.5, down 15.2 -> 10.9), SmolLM2-135M 13.7-14.2 -> 13.3-13.4; the same step with the
 * widening left out (wrong products, a bound) SmolLM2 11.3. */
#define AMX_WIDE_STEP_BYTES 512
#if defined(__AVX512BF16__)
static inline void amx_widen_step(const int8_t *bytes, char *tile) {
    for (int i = 0; i < AMX_WIDE_STEP_BYTES; i += 32) {
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(bytes + i))));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(bytes + i + 16))));
        _mm512_store_si512(tile + i * 2, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}
#else
static inline void amx_widen_step(const int8_t *bytes, char *tile) { (void)bytes, (void)tile; }
#endif

/* One unit shape's products over all of K into tmm0-3: a (its first row, a_stride bytes
 * between rows), b0 / b1 (the blocks' packed data; b1 unused unless TWO_BLOCKS), k_steps steps
 * of 64 bytes of A and one 1 KiB B tile a block, from the last step to the first if reverse;
 * the operands in `stream` (AMX_STREAM_A, AMX_STREAM_B) streamed; with `prefetch`, each block's
 * lines AMX_PREFETCH_BYTES ahead (past its end, the block two on's) asked for into L1 (forward
 * only). s0 / s1: the blocks' data in memory, which `prefetch` asks for: b0 / b1 themselves, or
 * under WIDENS the bytes widened into b0 / b1 as the unit goes (NULL: b0 / b1 already hold the
 * tiles). The previous unit's epilogue (pending, if any) is done a few rows a step between the
 * tile instructions. The compiler needs the tile numbers as constants, hence one function per
 * shape. */
#define AMX_GEMM_UNIT_(NAME, TILE_PRODUCT, OUTPUT, EPILOGUE, WIDENS, SHAPE, TWO_ROWS, TWO_BLOCKS)          \
    static inline void NAME##_multiply_##SHAPE(const char *a, int64_t a_stride, int64_t k_steps,           \
                                               const char *b0, const char *b1, const char *s0,             \
                                               const char *s1, const AmxUnit *pending,                     \
                                               const OUTPUT *output, int reverse, int stream,              \
                                               int prefetch) {                                             \
        const int64_t per_step = pending != NULL ? (pending->rows + k_steps - 1) / k_steps : 0;            \
        const int64_t s_step = WIDENS ? AMX_WIDE_STEP_BYTES : 1024;                                        \
        const int widen = WIDENS && s0 != NULL;                                                            \
        if (widen) {                                                                                       \
            const int64_t q0_ = reverse ? k_steps - 1 : 0;                                                 \
            amx_widen_step((const int8_t *)s0 + q0_ * s_step, (char *)b0 + q0_ * 1024);                    \
            if (TWO_BLOCKS) amx_widen_step((const int8_t *)s1 + q0_ * s_step, (char *)b1 + q0_ * 1024);    \
        }                                                                                                  \
        _tile_zero(0);                                                                                     \
        if (TWO_BLOCKS) _tile_zero(1);                                                                     \
        if (TWO_ROWS) _tile_zero(2);                                                                       \
        if (TWO_ROWS && TWO_BLOCKS) _tile_zero(3);                                                         \
        for (int64_t step = 0; step < k_steps; step++) {                                                   \
            const int64_t q = reverse ? k_steps - 1 - step : step;                                         \
            AMX_LOAD_TILE(stream & AMX_STREAM_A, 4, a + q * 64, a_stride);                                 \
            if (prefetch) {                                                                                \
                const int64_t ahead_ = q * s_step + AMX_PREFETCH_BYTES * s_step / 1024;                    \
                const int64_t at_ = ahead_ + (ahead_ >= k_steps * s_step ? k_steps * s_step : 0);          \
                for (int line = 0; line < s_step; line += 64) {                                            \
                    _mm_prefetch(s0 + at_ + line, _MM_HINT_T0);                                            \
                    if (TWO_BLOCKS) _mm_prefetch(s1 + at_ + line, _MM_HINT_T0);                            \
                }                                                                                          \
            }                                                                                              \
            AMX_LOAD_TILE(stream & AMX_STREAM_B, 6, b0 + q * 1024, 64);                                    \
            TILE_PRODUCT(0, 4, 6);                                                                         \
            if (TWO_BLOCKS) {                                                                              \
                AMX_LOAD_TILE(stream & AMX_STREAM_B, 7, b1 + q * 1024, 64);                                \
                TILE_PRODUCT(1, 4, 7);                                                                     \
            }                                                                                              \
            if (TWO_ROWS) {                                                                                \
                AMX_LOAD_TILE(stream & AMX_STREAM_A, 5, a + AMX_ROWS * a_stride + q * 64, a_stride);       \
                TILE_PRODUCT(2, 5, 6);                                                                     \
                if (TWO_BLOCKS) TILE_PRODUCT(3, 5, 7);                                                     \
            }                                                                                              \
            if (widen && step + 1 < k_steps) { /* the next step's tiles, while these products run */       \
                const int64_t qn_ = reverse ? q - 1 : q + 1;                                               \
                amx_widen_step((const int8_t *)s0 + qn_ * s_step, (char *)b0 + qn_ * 1024);                \
                if (TWO_BLOCKS) amx_widen_step((const int8_t *)s1 + qn_ * s_step, (char *)b1 + qn_ * 1024); \
            }                                                                                              \
            const int64_t from = step * per_step;                                                          \
            if (from < (per_step > 0 ? pending->rows : 0))                                                 \
                EPILOGUE(pending, output, from, from + per_step < pending->rows ? from + per_step          \
                                                                                 : pending->rows);         \
        }                                                                                                  \
    }                                                                                                      \
    static inline void NAME##_store_##SHAPE(char *c) {                                                     \
        _tile_stored(0, c, 64);                                                                            \
        if (TWO_BLOCKS) _tile_stored(1, c + 1024, 64);                                                     \
        if (TWO_ROWS) _tile_stored(2, c + 2048, 64);                                                       \
        if (TWO_ROWS && TWO_BLOCKS) _tile_stored(3, c + 3072, 64);                                         \
    }

/* A thread's state across the items it multiplies: the two sums buffers, the unit whose
 * epilogue waits (it runs between the next unit's tile steps), the tile configuration. */
typedef struct {
    char buffers[2][4096] __attribute__((aligned(64)));
    int configured0, configured1, next_buffer;
    AmxUnit pending;
    const AmxUnit *waiting;
    char *widened; /* WIDENS: widened tiles, [block][k step][1 KiB]: one pair's, or (the snake) the panel's */
} AmxItemsState;

/* One item: its group's units, each over the panel's block pairs. The units go in a snake: a
 * unit takes the panel's pairs in the order the last one ended, so every unit shares an operand
 * (its A rows, or a pair's B tiles) with the one before it, and walks K the other way from it,
 * so it starts on the steps of that operand still in L1; the operand the next unit does not
 * share is streamed (AMX_LOAD_TILE). A unit's direction is fixed by its rows and columns
 * (a checkerboard), so the bits do not depend on which thread takes the item. */
#define AMX_GEMM_ITEM_(NAME, OUTPUT, WIDENS)                                                                  \
    static inline void NAME##_item(const AmxGemmPlan *plan, int64_t item, const char *a, int64_t a_stride,    \
                                   int64_t k_steps, const char *packed, int64_t block_bytes,                  \
                                   const OUTPUT *output, AmxItemsState *st) {                                 \
        const int64_t M = plan->M, blocks = plan->blocks, units = plan->units, groups = plan->groups;         \
        const int64_t panel_blocks = plan->panel_blocks, panels = plan->panels;                               \
        const int64_t panel = item % panels * panel_blocks, group = item / panels;                            \
        const int64_t first = group * units / groups * AMX_UNIT_ROWS;                                         \
        const int64_t last = (group + 1) * units / groups * AMX_UNIT_ROWS;                                    \
        const int64_t end = last < M ? last : M;                                                              \
        const int64_t width = blocks - panel < panel_blocks ? blocks - panel : panel_blocks;                  \
        const int64_t pairs = (width + 1) / 2;                                                                \
        const int snake = M >= AMX_SNAKE_MIN_ROWS;                                                            \
        /* WIDENS below the snake: pair by pair, each pair's units in turn, so the tiles the first            \
         * widens wait for the others in a buffer of one pair, kept in L1 or L2 over the item */              \
        const int pair_major = WIDENS && !snake;                                                              \
        const int64_t unit_count = (end - first + AMX_UNIT_ROWS - 1) / AMX_UNIT_ROWS;                         \
        for (int64_t next = 0; next < unit_count * pairs; next++) {                                           \
            const int64_t unit = pair_major ? next % unit_count : next / pairs;                               \
            const int64_t j = pair_major ? next / unit_count : next % pairs;                                  \
            const int64_t m = first + unit * AMX_UNIT_ROWS;                                                   \
            const int64_t rows = end - m < AMX_UNIT_ROWS ? end - m : AMX_UNIT_ROWS;                           \
            const int rows0 = rows < AMX_ROWS ? (int)rows : AMX_ROWS, rows1 = (int)rows - rows0;              \
            if (rows0 != st->configured0 || rows1 != st->configured1) { /* all tiles are stored by now */     \
                amx_gemm_configure(rows0, rows1);                                                             \
                st->configured0 = rows0;                                                                      \
                st->configured1 = rows1;                                                                      \
            }                                                                                                 \
            const char *rows_a = a + m * a_stride;                                                            \
            const int64_t block = panel + 2 * (snake && unit % 2 ? pairs - 1 - j : j);                        \
            const int reverse = snake && (m / AMX_UNIT_ROWS + block / 2) % 2;                                 \
            /* the next unit shares this pair's B (its last pair) or these rows (the others) */               \
            const int stream = !snake ? 0 : j == pairs - 1 ? AMX_STREAM_A : AMX_STREAM_B;                     \
            const int two_blocks = block + 1 < panel + width;                                                 \
            const int prefetch = !snake && m == first; /* the item's first unit: from memory */               \
            const char *s0 = packed + block * block_bytes, *s1 = s0 + block_bytes;                            \
            const char *b0 = s0, *b1 = s1;                                                                    \
            if (WIDENS) { /* the first unit widens the bytes, the others read its tiles */                    \
                b0 = st->widened + (pair_major ? 0 : (block - panel) * k_steps * 1024);                       \
                b1 = b0 + k_steps * 1024;                                                                     \
                if (m != first) s0 = s1 = NULL;                                                               \
            }                                                                                                 \
            const AmxUnit *waiting = st->waiting;                                                             \
            char *c = st->buffers[st->next_buffer];                                                           \
            st->next_buffer ^= 1;                                                                             \
            if (rows1 > 0 && two_blocks)                                                                      \
                NAME##_multiply_2_2(rows_a, a_stride, k_steps, b0, b1, s0, s1, waiting, output, reverse, stream, \
                                     prefetch);                                                               \
            else if (rows1 > 0)                                                                               \
                NAME##_multiply_2_1(rows_a, a_stride, k_steps, b0, b1, s0, s1, waiting, output, reverse, stream, \
                                     prefetch);                                                               \
            else if (two_blocks)                                                                              \
                NAME##_multiply_1_2(rows_a, a_stride, k_steps, b0, b1, s0, s1, waiting, output, reverse, stream, \
                                     prefetch);                                                               \
            else                                                                                              \
                NAME##_multiply_1_1(rows_a, a_stride, k_steps, b0, b1, s0, s1, waiting, output, reverse, stream, \
                                     prefetch);                                                               \
            if (rows1 > 0 && two_blocks) NAME##_store_2_2(c);                                                 \
            else if (rows1 > 0) NAME##_store_2_1(c);                                                          \
            else if (two_blocks) NAME##_store_1_2(c);                                                         \
            else NAME##_store_1_1(c);                                                                         \
            st->pending = (AmxUnit){m, rows, block, two_blocks, c};                                           \
            st->waiting = &st->pending;                                                                       \
        }                                                                                                     \
    }

/* NAME##_items(plan, a, a_stride, k_steps, packed, block_bytes, output, claims): this thread's
 * share of the plan's items, to be called by every thread of a parallel region; a block's
 * packed data is block_bytes long. Ends with the last unit's epilogue and the tiles released.
 * EPILOGUE(unit, output, from, to) writes rows [from, to) of a unit. claims: AMX_MAX_CLAIMS
 * entries shared by the region (amx_claim_item), or NULL for the static split. WIDENS: the blocks
 * are bytes (amx_widen_step), and widened is the thread's AMX_PANEL_BLOCKS x k_steps KiB buffer. */
#define DEFINE_AMX_GEMM(NAME, TILE_PRODUCT, OUTPUT, EPILOGUE, WIDENS)                                        \
    AMX_GEMM_UNIT_(NAME, TILE_PRODUCT, OUTPUT, EPILOGUE, WIDENS, 1_1, 0, 0)                                    \
    AMX_GEMM_UNIT_(NAME, TILE_PRODUCT, OUTPUT, EPILOGUE, WIDENS, 1_2, 0, 1)                                    \
    AMX_GEMM_UNIT_(NAME, TILE_PRODUCT, OUTPUT, EPILOGUE, WIDENS, 2_1, 1, 0)                                    \
    AMX_GEMM_UNIT_(NAME, TILE_PRODUCT, OUTPUT, EPILOGUE, WIDENS, 2_2, 1, 1)                                    \
    AMX_GEMM_ITEM_(NAME, OUTPUT, WIDENS)                                                                     \
    static void NAME##_items(const AmxGemmPlan *plan, const char *a, int64_t a_stride, int64_t k_steps,      \
                             const char *packed, int64_t block_bytes, const OUTPUT *output,                  \
                             AmxClaim *claims, char *widened) {                                              \
        AmxItemsState st;                                                                                    \
        st.configured0 = st.configured1 = -1;                                                                \
        st.next_buffer = 0;                                                                                  \
        st.waiting = NULL;                                                                                   \
        st.widened = widened;                                                                                \
        const int64_t items = plan->groups * plan->panels;                                                   \
        const int team = omp_get_num_threads(), me = omp_get_thread_num();                                   \
        if (claims == NULL || plan->M < AMX_CLAIM_MIN_ROWS || team < 2 || team > AMX_MAX_CLAIMS) {           \
            _Pragma("omp for schedule(static)") /* the same test for every thread: all or none meet it */    \
            for (int64_t item = 0; item < items; item++)                                                     \
                NAME##_item(plan, item, a, a_stride, k_steps, packed, block_bytes, output, &st);             \
        } else {                                                                                             \
            _Pragma("omp single") /* its barrier: every share is set before any is claimed */                \
            for (int t = 0; t < team; t++)                                                                   \
                claims[t].range = (uint64_t)(t * items / team) | (uint64_t)((t + 1) * items / team) << 32;   \
            int64_t item;                                                                                    \
            while (amx_claim_item(claims + me, 0, &item))                                                    \
                NAME##_item(plan, item, a, a_stride, k_steps, packed, block_bytes, output, &st);             \
            if ((me ^ 1) < team)                                                                             \
                while (amx_claim_item(claims + (me ^ 1), 1, &item))                                          \
                    NAME##_item(plan, item, a, a_stride, k_steps, packed, block_bytes, output, &st);         \
        }                                                                                                    \
        if (st.waiting != NULL) EPILOGUE(st.waiting, output, 0, st.waiting->rows);                           \
        if (st.configured0 >= 0) _tile_release();                                                            \
    }
#endif
