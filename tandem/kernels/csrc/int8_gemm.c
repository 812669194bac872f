/*
 * An 8-bit GEMM over weights packed once at load: int8 rows [M, K] times an int8 matrix
 * [K, N] -> int32 [M, N], bit for bit torch._int_mm's (integer arithmetic, no rounding).
 *
 * Why a GEMM of our own: torch._int_mm (oneDNN) repacks the weight matrix on every call. On
 * the 2-core AVX-512 EPYC (VNNI, no AMX), SmolLM2's 121 projections of a 64-sequence decode
 * step took 15.1 ms through it, 11.3-11.6 ms here; at 16 rows 8.8-10.1 against 5.2-5.9 ms;
 * in 2,048-row prefill chunks 390-405 against 276-288 ms (1,400 against 1,950 GOP/s).
 *
 * Layout (`tandem_int8_pack`): the matrix in blocks of 16 output columns; within a block, for
 * each 4 consecutive k, the 16 columns' 4 bytes side by side, 64 bytes, one vector:
 *   packed[((n / 16) * (K / 4) + k / 4) * 64 + (n % 16) * 4 + k % 4] = B[k][n].
 * vpdpbusd multiplies 4 unsigned bytes of one operand by 4 signed bytes of the other and adds
 * the four products into a 32-bit lane: the weights are the signed side, and each activation
 * word (4 consecutive k of one row) is broadcast to all 16 lanes. Activations are signed, so
 * each byte is flipped to unsigned (x ^ 0x80 = x + 128) on the way in, and the 128 * sum_k
 * B[k][n] this adds is subtracted at the end (`compensation`, computed at packing).
 *
 * Ranges: an activation word's products sum to at most 4 * 255 * 128 in magnitude, so K up
 * to 65,536 keeps every 32-bit sum exact (MAX_INNER); the caller checks.
 *
 * Tiles: 6 rows x 4 column blocks (64 columns) = 24 accumulators, 4 weight vectors a k step,
 * all in registers. Work items are panels of 64 columns, split by rows too when there are
 * too few panels to share between the threads.
 *
 * `tandem_int8_gemm_dequantize` turns the products into the run dtype in the tiles' epilogue
 * (int8_dequantize.h, the same step as int8_rows.c's separate pass, so the same bits): the
 * [M, N] int32 products are never written and read back. On the 2-core AVX-512 EPYC the
 * separate pass was 9% of a 64-sequence decode step in the default mode.
 */
#include <stddef.h>
#include <stdint.h>

#include "gemm_split.h"

#define MAX_INNER 65536

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

#include "int8_dequantize.h"
#define HAS_VNNI 1
#define PANEL_BLOCKS 4
#define TILE_ROWS 6

/* GCC's partial redundancy elimination hoists the next k step's weight loads and spills half
 * the accumulators to the stack (57 stack moves in the 6 x 4 tile: 750 against 1,500 GOP/s
 * at 64 rows); without it all 24 stay in registers. */
#define TILE_ATTRIBUTES __attribute__((optimize("no-tree-pre", "no-gcse")))

/* The weight rows the epilogue will add for these rows' outliers, at this tile's columns:
 * each a line or two of a row of the [in, out] matrix, one per (row, outlier), scattered, so
 * asked for before the k loop, which is long enough to hide them (in the epilogue unasked,
 * they made the fused dequantize slower than the separate pass, which streams along rows). */
static inline void prefetch_outliers(const Int8Dequantize *dq, int64_t m, int rows, int64_t n, int64_t width) {
    for (int i = 0; i < rows; i++)
        for (int64_t j = 0; j < dq->outliers; j++) {
            const int8_t *line = dq->weight_t + (int64_t)dq->outlier_index[(m + i) * dq->outliers + j] * dq->cols + n;
            _mm_prefetch((const char *)line, _MM_HINT_T0);
            _mm_prefetch((const char *)line + width - 1, _MM_HINT_T0);
        }
}

/* One gate/up pair's 16 output columns (column `at` of silu(gate) * up, gate column `at`,
 * up column cols / 2 + at of the unpacked matrix) into dq->out, fp32 [M, cols / 2]. */
static inline void gated_pair(const Int8Dequantize *dq, __m512i gate, __m512i up, int64_t m, int64_t at) {
    const int64_t half = dq->cols / 2;
    const __m512 g = dequantize_value(dq, gate, m, at, (__mmask16)0xFFFF);
    const __m512 u = dequantize_value(dq, up, m, half + at, (__mmask16)0xFFFF);
    _mm512_storeu_ps((float *)dq->out + m * half + at, gated_chunk(g, u, dq->kind));
}

/* gated_pair for a row whose terms `t` holds (`outliers` its count, a literal where it can be). */
static inline __attribute__((always_inline)) void gated_row_pair(const Int8Dequantize *dq, const Int8RowTerms *t,
                                                                 __m512i gate, __m512i up, int64_t m, int64_t at,
                                                                 int64_t outliers) {
    const int64_t half = dq->cols / 2;
    const __m512 g = dequantize_row_value(dq, t, gate, at, outliers);
    const __m512 u = dequantize_row_value(dq, t, up, half + at, outliers);
    _mm512_storeu_ps((float *)dq->out + m * half + at, gated_chunk(g, u, dq->kind));
}

/* The dequantizing epilogue of a tile's row i (int8 products acc_row[BLOCKS] at columns n..):
 * the row's terms looked up once, the outlier loop unrolled for tandem's default count (4,
 * tandem/layers/int8.py OUTLIER_CHANNELS) and for none. */
#define ROW_EPILOGUE(ACC, BLOCKS, M, N, COUNT)                                                       \
    do {                                                                                            \
        if (!dq->gated) {                                                                           \
            _Pragma("GCC unroll 8") for (int j_ = 0; j_ < (BLOCKS); j_++)                          \
                dequantize_row_chunk(dq, &terms_, (ACC)[j_], (M), (N) + 16 * j_, (COUNT));          \
        } else {                                                                                    \
            _Pragma("GCC unroll 8") for (int j_ = 0; j_ + 1 < (BLOCKS); j_ += 2)                   \
                gated_row_pair(dq, &terms_, (ACC)[j_], (ACC)[j_ + 1], (M), (N) / 2 + 8 * j_, (COUNT)); \
        }                                                                                           \
    } while (0)

#define DEFINE_TILE(ROWS, BLOCKS)                                                                     \
TILE_ATTRIBUTES static void tile_##ROWS##_##BLOCKS(                                                   \
    const int8_t *a, int64_t a_stride, int64_t quads, const int8_t *panel, const int32_t *compensation,\
    int32_t *c, int64_t c_stride, const char *ahead, int64_t ahead_lines, const Int8Dequantize *dq,   \
    int64_t m, int64_t n) {                                                                           \
    __m512i acc[ROWS][BLOCKS];                                                                        \
    _Pragma("GCC unroll 8") for (int i = 0; i < ROWS; i++)                                            \
        _Pragma("GCC unroll 8") for (int j = 0; j < BLOCKS; j++) acc[i][j] = _mm512_setzero_si512();  \
    const __m512i flip = _mm512_set1_epi32((int)0x80808080u);                                         \
    if (dq != NULL && !dq->gated) prefetch_outliers(dq, m, ROWS, n, 16 * BLOCKS);                     \
    if (dq != NULL && dq->gated) { /* the gate's and the up's columns of these pairs */               \
        prefetch_outliers(dq, m, ROWS, n / 2, 8 * BLOCKS);                                            \
        prefetch_outliers(dq, m, ROWS, dq->cols / 2 + n / 2, 8 * BLOCKS);                             \
    }                                                                                                 \
    for (int64_t q = 0; q < quads; q++) {                                                             \
        __m512i b[BLOCKS];                                                                            \
        _Pragma("GCC unroll 8") for (int j = 0; j < BLOCKS; j++)                                      \
            b[j] = _mm512_loadu_si512(panel + (j * quads + q) * 64);                                  \
        /* this tile's share of the next panel, into L2 (gemm_split.h) */                             \
        for (int64_t line = q; line < ahead_lines; line += quads) _mm_prefetch(ahead + line * 64, _MM_HINT_T0); \
        _Pragma("GCC unroll 8") for (int i = 0; i < ROWS; i++) {                                      \
            int32_t bytes;                                                                            \
            __builtin_memcpy(&bytes, a + i * a_stride + 4 * q, 4);                                    \
            const __m512i word = _mm512_xor_si512(_mm512_set1_epi32(bytes), flip);                    \
            _Pragma("GCC unroll 8") for (int j = 0; j < BLOCKS; j++)                                  \
                acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], word, b[j]);                               \
        }                                                                                             \
    }                                                                                                 \
    /* the int32 products (c), or the output they dequantize to (dq; c unused) */                   \
    _Pragma("GCC unroll 8") for (int i = 0; i < ROWS; i++)                                            \
        _Pragma("GCC unroll 8") for (int j = 0; j < BLOCKS; j++)                                      \
            acc[i][j] = _mm512_sub_epi32(acc[i][j], _mm512_loadu_si512(compensation + 16 * j));      \
    if (dq == NULL) {                                                                                 \
        _Pragma("GCC unroll 8") for (int i = 0; i < ROWS; i++)                                        \
            _Pragma("GCC unroll 8") for (int j = 0; j < BLOCKS; j++)                                  \
                _mm512_storeu_si512(c + i * c_stride + 16 * j, acc[i][j]);                            \
    } else {                                                                                          \
        for (int i = 0; i < ROWS; i++) {                                                              \
            Int8RowTerms terms_;                                                                      \
            if (!row_terms(dq, m + i, &terms_)) {                                                     \
                for (int j = 0; j < BLOCKS; j++)                                                      \
                    if (!dq->gated) dequantize_chunk(dq, acc[i][j], m + i, n + 16 * j, (__mmask16)0xFFFF); \
                for (int j = 0; dq->gated && j + 1 < BLOCKS; j += 2) /* blocks j, j + 1: a gate/up pair */ \
                    gated_pair(dq, acc[i][j], acc[i][j + 1], m + i, n / 2 + 8 * j);                   \
            } else if (terms_.outliers == 4) {                                                        \
                ROW_EPILOGUE(acc[i], BLOCKS, m + i, n, 4);                                            \
            } else if (terms_.outliers == 0) {                                                        \
                ROW_EPILOGUE(acc[i], BLOCKS, m + i, n, 0);                                            \
            } else {                                                                                  \
                ROW_EPILOGUE(acc[i], BLOCKS, m + i, n, terms_.outliers);                              \
            }                                                                                         \
        }                                                                                             \
    }                                                                                                 \
}
#define DEFINE_TILES(BLOCKS) DEFINE_TILE(1, BLOCKS) DEFINE_TILE(2, BLOCKS) DEFINE_TILE(3, BLOCKS) \
    DEFINE_TILE(4, BLOCKS) DEFINE_TILE(5, BLOCKS) DEFINE_TILE(6, BLOCKS)
DEFINE_TILES(1)
DEFINE_TILES(2)
DEFINE_TILES(3)
DEFINE_TILES(4)

typedef void (*tile_fn)(const int8_t *, int64_t, int64_t, const int8_t *, const int32_t *, int32_t *, int64_t,
                        const char *, int64_t, const Int8Dequantize *, int64_t, int64_t);
#define TILE_ROW(BLOCKS) \
    {tile_1_##BLOCKS, tile_2_##BLOCKS, tile_3_##BLOCKS, tile_4_##BLOCKS, tile_5_##BLOCKS, tile_6_##BLOCKS}
static const tile_fn TILES[PANEL_BLOCKS][TILE_ROWS] = {TILE_ROW(1), TILE_ROW(2), TILE_ROW(3), TILE_ROW(4)};
#else
#define HAS_VNNI 0
#endif

#if HAS_VNNI && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define HAS_AMX_INT8 1
#include "int8_gemm_amx.h"
#else
#define HAS_AMX_INT8 0
#endif

/* Which path this build has: "amx-int8" (the tiles where K is a multiple of 64, vpdpbusd for
 * other K), "avx512-vnni", or "none" (the GEMM then refuses every call). */
const char *tandem_int8_gemm_isa(void) {
#if HAS_AMX_INT8
    if (amx_permitted()) return "amx-int8";
#endif
    return HAS_VNNI ? "avx512-vnni" : "none";
}

int tandem_int8_gemm_max_inner(void) { return MAX_INNER; }

/* columns [K, N] int8 (row-major) -> packed [K * N] in the layout above, and compensation [N]
 * = 128 * each column's sum. N a multiple of 16, K of 4. */
void tandem_int8_pack(const int8_t *columns, int64_t K, int64_t N, int8_t *packed, int32_t *compensation,
                      int num_threads) {
    const int64_t quads = K / 4;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t block = 0; block < N / 16; block++) {
        for (int64_t lane = 0; lane < 16; lane++) {
            int32_t sum = 0;
            for (int64_t k = 0; k < K; k++) sum += columns[k * N + block * 16 + lane];
            compensation[block * 16 + lane] = 128 * sum;
        }
        for (int64_t q = 0; q < quads; q++)
            for (int64_t lane = 0; lane < 16; lane++)
                for (int64_t byte = 0; byte < 4; byte++)
                    packed[((block * quads + q) * 16 + lane) * 4 + byte] = columns[(4 * q + byte) * N + block * 16 + lane];
    }
}

/* c [M, N] (row stride N) = a [M, K] (row stride a_stride) @ the packed matrix, or (dq not
 * NULL) those products dequantized into dq->out; c is then unused. */
static int int8_gemm(const int8_t *a, int64_t a_stride, int64_t M, int64_t K, const int8_t *packed,
                     const int32_t *compensation, int32_t *c, int64_t N, const void *dq, int num_threads) {
    if (!HAS_VNNI || K % 4 != 0 || N % 16 != 0 || K > MAX_INNER || M < 0) return -1;
#if HAS_AMX_INT8
    if (K % AMX8_STEP_K == 0 && amx_permitted())
        return amx_int8_gemm(a, a_stride, M, K, packed, c, N, (const Int8Dequantize *)dq, num_threads);
#endif
#if HAS_VNNI
    const int64_t blocks = N / 16, quads = K / 4;
    GEMM_FOR_EACH_TILE(M, blocks, PANEL_BLOCKS, TILE_ROWS, packed, quads * 64,
                       TILES[width - 1][rows - 1](a + m * a_stride, a_stride, quads, packed + block * quads * 64,
                                                  compensation + block * 16, c == NULL ? NULL : c + m * N + block * 16,
                                                  N, ahead, ahead_lines, (const Int8Dequantize *)dq, m, block * 16));
#endif
    return 0;
}

/* c [M, N] (row stride N) = a [M, K] (row stride a_stride) @ the packed matrix. Returns 0, or
 * -1 where this build has no VNNI path or the shape is not one it takes (c untouched). */
int tandem_int8_gemm(const int8_t *a, int64_t a_stride, int64_t M, int64_t K, const int8_t *packed,
                     const int32_t *compensation, int32_t *c, int64_t N, int num_threads) {
    return int8_gemm(a, a_stride, M, K, packed, compensation, c, N, NULL, num_threads);
}

/* out [M, N] in `kind` (0 fp32, 1 bf16) = the products above dequantized as int8_rows.c's
 * `tandem_dequantize` does (its arguments, the same meaning), in the tiles' epilogue. */
int tandem_int8_gemm_dequantize(const int8_t *a, int64_t a_stride, int64_t M, int64_t K, const int8_t *packed,
                                const int32_t *compensation, int64_t N, const float *row_scales,
                                const float *col_scales, int64_t outliers, const int32_t *outlier_index,
                                const float *outlier_value, const int8_t *weight_t, const void *bias,
                                const void *residual, void *out, int kind, int num_threads) {
    if (kind < 0 || kind > 1 || (outliers > 0 && weight_t == NULL)) return -1;
#if HAS_VNNI
    const Int8Dequantize dq = {row_scales, col_scales, outliers, outlier_index, outlier_value, weight_t, bias,
                               residual, out, kind, N, 0};
    return int8_gemm(a, a_stride, M, K, packed, compensation, NULL, N, &dq, num_threads);
#else
    (void)a, (void)a_stride, (void)M, (void)K, (void)packed, (void)compensation, (void)N, (void)row_scales;
    (void)col_scales, (void)outlier_index, (void)outlier_value, (void)bias, (void)residual, (void)out;
    (void)num_threads;
    return -1;
#endif
}

/* A gated MLP's middle from its gate/up projection: h [M, N / 2] fp32 = silu(gate) * up of
 * the products dequantized, with `kind`'s roundings (int8_dequantize.h gated_chunk), the
 * separate passes' bits (int8_rows.c tandem_gated_quantize before its quantize step). The
 * packed matrix's blocks alternate gate and up (the caller interleaves the [K, N] columns,
 * gate then up, 16 at a time, before packing); weight_t, col_scales and the outliers are the
 * unpacked matrix's. N a multiple of 32. */
int tandem_int8_gemm_gated(const int8_t *a, int64_t a_stride, int64_t M, int64_t K, const int8_t *packed,
                           const int32_t *compensation, int64_t N, const float *row_scales, const float *col_scales,
                           int64_t outliers, const int32_t *outlier_index, const float *outlier_value,
                           const int8_t *weight_t, float *h, int kind, int num_threads) {
    if (kind < 0 || kind > 1 || N % 32 != 0 || (outliers > 0 && weight_t == NULL)) return -1;
#if HAS_VNNI
    const Int8Dequantize dq = {row_scales, col_scales, outliers, outlier_index, outlier_value, weight_t, NULL,
                               NULL, h, kind, N, 1};
    return int8_gemm(a, a_stride, M, K, packed, compensation, NULL, N, &dq, num_threads);
#else
    (void)a, (void)a_stride, (void)M, (void)K, (void)packed, (void)compensation, (void)row_scales;
    (void)col_scales, (void)outlier_index, (void)outlier_value, (void)h, (void)num_threads;
    return -1;
#endif
}
