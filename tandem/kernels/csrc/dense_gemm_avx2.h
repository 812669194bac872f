/*
 * dense_gemm.c's fp32 products on a CPU with AVX2 + FMA and no AVX-512 (included by it):
 * the same packed blocks of 16 columns ([N/16][K][16]), each block two 8-lane vectors.
 *
 * Why: at a decode batch's 16-128 rows oneDNN's packed fp32 linear ran at 93-115 GFLOP/s on
 * the 2-core AVX2 EPYC and took 72-80% of a decode-heavy step's time there.
 *
 * Tiles: 6 rows x 16 columns (one block), 12 accumulators, the block's two vectors and the
 * broadcast row value: 15 of the 16 registers. A panel is 2 blocks, which a gated product's
 * gate/up pair always fills; its tiles are 6 rows x 8 intermediate columns, the gate's and
 * the up's halves of the same 8 columns, so silu(gate) * up is computed in fp32 and stored
 * once, as on AVX-512.
 */
#ifndef TANDEM_DENSE_GEMM_AVX2_H
#define TANDEM_DENSE_GEMM_AVX2_H
#include "avx2_math.h"

#define AVX2_PANEL_BLOCKS 2
#define AVX2_TILE_ROWS 6

/* acc (+ bias) (+ residual) for 8 columns from n, stored once at `at`. */
static inline void avx2_store8(__m256 acc, const float *bias, const float *residual, float *out, int64_t n,
                               int64_t at) {
    if (bias != NULL) acc = _mm256_add_ps(acc, _mm256_loadu_ps(bias + n));
    if (residual != NULL) acc = _mm256_add_ps(_mm256_loadu_ps(residual + at), acc);
    _mm256_storeu_ps(out + at, acc);
}

/* silu(gate (+ its bias)) * (up (+ its bias)) for 8 intermediate columns from n; bias is
 * [2 x intermediate], the gate's then the up's. */
static inline void avx2_store_gated8(__m256 gate, __m256 up, const float *bias, float *out, int64_t n,
                                     int64_t intermediate, int64_t at) {
    if (bias != NULL) {
        gate = _mm256_add_ps(gate, _mm256_loadu_ps(bias + n));
        up = _mm256_add_ps(up, _mm256_loadu_ps(bias + intermediate + n));
    }
    const __m256 silu = _mm256_div_ps(gate, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gate))));
    _mm256_storeu_ps(out + at, _mm256_mul_ps(silu, up));
}

/* A plain tile: rows m.. of out, the 16 columns of the block at `panel` (its first column n);
 * a: the tile's first row, a_stride floats apart; n_total: out's row length. */
#define DEFINE_AVX2_PLAIN(ROWS)                                                                       \
TILE_ATTRIBUTES static void avx2_plain_##ROWS(const float *a, int64_t a_stride, int64_t steps,         \
                                              const float *panel, const float *bias, const float *residual, \
                                              float *out, int64_t m, int64_t n, int64_t n_total,      \
                                              const char *ahead, int64_t ahead_lines) {               \
    __m256 low[ROWS], high[ROWS];                                                                     \
    _Pragma("GCC unroll 8") for (int i = 0; i < ROWS; i++) low[i] = high[i] = _mm256_setzero_ps();    \
    for (int64_t q = 0; q < steps; q++) {                                                             \
        const __m256 b0 = _mm256_loadu_ps(panel + q * 16), b1 = _mm256_loadu_ps(panel + q * 16 + 8);  \
        PREFETCH_AHEAD(q, steps)                                                                      \
        _Pragma("GCC unroll 8") for (int i = 0; i < ROWS; i++) {                                      \
            const __m256 word = _mm256_broadcast_ss(a + i * a_stride + q);                            \
            low[i] = _mm256_fmadd_ps(word, b0, low[i]);                                               \
            high[i] = _mm256_fmadd_ps(word, b1, high[i]);                                             \
        }                                                                                             \
    }                                                                                                 \
    _Pragma("GCC unroll 8") for (int i = 0; i < ROWS; i++) {                                          \
        avx2_store8(low[i], bias, residual, out, n, (m + i) * n_total + n);                           \
        avx2_store8(high[i], bias, residual, out, n + 8, (m + i) * n_total + n + 8);                  \
    }                                                                                                 \
}
/* A gated tile: 8 intermediate columns, `half` of the gate block at `panel` (its first
 * packed column n) and the same half of the up block after it; n_total: the packed matrix's
 * columns (twice out's row length). */
#define DEFINE_AVX2_GATED(ROWS)                                                                       \
TILE_ATTRIBUTES static void avx2_gated_##ROWS(const float *a, int64_t a_stride, int64_t steps,         \
                                              const float *panel, int half, const float *bias, float *out, \
                                              int64_t m, int64_t n, int64_t n_total, const char *ahead, \
                                              int64_t ahead_lines) {                                  \
    __m256 gate[ROWS], up[ROWS];                                                                      \
    const float *gate_panel = panel + 8 * half, *up_panel = panel + steps * 16 + 8 * half;           \
    _Pragma("GCC unroll 8") for (int i = 0; i < ROWS; i++) gate[i] = up[i] = _mm256_setzero_ps();     \
    for (int64_t q = 0; q < steps; q++) {                                                             \
        const __m256 g = _mm256_loadu_ps(gate_panel + q * 16), u = _mm256_loadu_ps(up_panel + q * 16); \
        PREFETCH_AHEAD(q, steps)                                                                      \
        _Pragma("GCC unroll 8") for (int i = 0; i < ROWS; i++) {                                      \
            const __m256 word = _mm256_broadcast_ss(a + i * a_stride + q);                            \
            gate[i] = _mm256_fmadd_ps(word, g, gate[i]);                                              \
            up[i] = _mm256_fmadd_ps(word, u, up[i]);                                                  \
        }                                                                                             \
    }                                                                                                 \
    const int64_t intermediate = n_total / 2, column = n / 2 + 8 * half;                             \
    _Pragma("GCC unroll 8") for (int i = 0; i < ROWS; i++)                                            \
        avx2_store_gated8(gate[i], up[i], bias, out, column, intermediate, (m + i) * intermediate + column); \
}
#define DEFINE_AVX2_TILES(KIND)                                                                       \
    DEFINE_AVX2_##KIND(1) DEFINE_AVX2_##KIND(2) DEFINE_AVX2_##KIND(3) DEFINE_AVX2_##KIND(4)          \
    DEFINE_AVX2_##KIND(5) DEFINE_AVX2_##KIND(6)
DEFINE_AVX2_TILES(PLAIN)
DEFINE_AVX2_TILES(GATED)

typedef void (*avx2_plain_fn)(const float *, int64_t, int64_t, const float *, const float *, const float *, float *,
                              int64_t, int64_t, int64_t, const char *, int64_t);
typedef void (*avx2_gated_fn)(const float *, int64_t, int64_t, const float *, int, const float *, float *, int64_t,
                              int64_t, int64_t, const char *, int64_t);
/* [rows - 1] */
static const avx2_plain_fn AVX2_PLAIN[AVX2_TILE_ROWS] = {avx2_plain_1, avx2_plain_2, avx2_plain_3,
                                                         avx2_plain_4, avx2_plain_5, avx2_plain_6};
static const avx2_gated_fn AVX2_GATED[AVX2_TILE_ROWS] = {avx2_gated_1, avx2_gated_2, avx2_gated_3,
                                                         avx2_gated_4, avx2_gated_5, avx2_gated_6};

/* Rows m.. (`rows` of them, a: the first) of one panel: `width` blocks from `block`, or a
 * gated pair's two halves. The prefetch of the next panel goes with the panel's first tile. */
static inline void avx2_panel(int gated, const float *a, int64_t a_stride, int64_t rows, int64_t K,
                              const float *packed, int64_t block, int64_t width, const float *bias,
                              const float *residual, float *out, int64_t m, int64_t N, const char *ahead,
                              int64_t ahead_lines) {
    const float *panel = packed + block * K * 16;
    for (int64_t part = 0; part < (gated ? 2 : width); part++) {
        const char *prefetch = part == 0 ? ahead : NULL;
        const int64_t lines = part == 0 ? ahead_lines : 0;
        if (gated)
            AVX2_GATED[rows - 1](a, a_stride, K, panel, (int)part, bias, out, m, block * 16, N, prefetch, lines);
        else
            AVX2_PLAIN[rows - 1](a, a_stride, K, panel + part * K * 16, bias, residual, out, m, (block + part) * 16, N,
                                 prefetch, lines);
    }
}
#endif
