/*
 * fp32 or bf16 rows [M, K] times a weight matrix packed once at load -> [M, N] in the same
 * dtype, with the bias and a residual added before the one rounding: what oneDNN's packed
 * linear (`_linear_pointwise`, and its binary "add" form) computes, summed in another order.
 *
 * Why: at 16-128 rows (a decode batch) oneDNN's packed fp32 and bf16 GEMMs run well under
 * their large-M rate on the 2-core AVX-512 EPYC, as its int8 GEMM did (csrc/int8_gemm.c has
 * the same structure and the figures that led here).
 *
 * Layout (`tandem_dense_pack`): blocks of 16 output columns; within a block one 64-byte
 * vector per step of k: fp32, 16 columns at one k ([N/16][K][16]); bf16, 16 columns' pairs of
 * consecutive k ([N/16][K/2][16][2], a vdpbf16ps operand). Each activation step (an fp32
 * value, or a pair of bf16 values) is broadcast to the 16 lanes.
 *
 * Tiles: 6 rows x 4 blocks (64 columns), 24 accumulators in registers (GCC's PRE would spill
 * half: the tiles turn it off, as csrc/int8_gemm.c's do). A CPU with AVX2 and no AVX-512
 * multiplies fp32 from the same blocks in 6-row x 16-column tiles (dense_gemm_avx2.h).
 *
 * A gated MLP's gate and up projections (`tandem_dense_gemm_silu_mul`) pack as one matrix whose
 * blocks alternate gate, up, gate, up (each pair the same 16 intermediate columns), so a tile
 * holds both halves of its columns and its epilogue writes silu(gate) * up, computed in fp32
 * and rounded once: the [M, 2 x intermediate] product is never stored, and no separate pass
 * (whose rounding would depend on which pass runs) reads it back.
 */
#include <stdint.h>

/* bf16 rows times 8-bit weights (W8A16), AMX's tiles only: the bf16 layout below with each
 * value one signed byte ([N/16][K/2][16][2] int8), then N fp32 scales, one a column (as packed:
 * a gated matrix's interleaved order); each byte is widened to bf16 in L1 on its way to the
 * tiles (amx_gemm.h's WIDENS) and the scales multiply the sums in the epilogue. */
#define KIND_BF16_W8 3

#include "avx512_math.h"
#include "gemm_split.h"
#include <string.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define TILE_ATTRIBUTES __attribute__((optimize("no-tree-pre", "no-gcse")))
/* At step q of a tile's `steps`, prefetch into L2 the lines q, q + steps, ... of its share of
 * the next panel (gemm_split.h), so the share is spread over the tile's steps. */
#define PREFETCH_AHEAD(q, steps)                                                                      \
    for (int64_t line_ = (q); line_ < ahead_lines; line_ += (steps))                                  \
        _mm_prefetch(ahead + line_ * 64, _MM_HINT_T0);
#endif

#if defined(__AVX512F__)
#define HAS_F32 1
#define HAS_AVX2 0
#if defined(__AVX512BF16__)
#define HAS_BF16 1
#else
#define HAS_BF16 0
#endif
#define PANEL_BLOCKS 4
#define TILE_ROWS 6

static inline __m512 widen16(const uint16_t *x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)x)), 16));
}

/* 16 fp32 -> bf16, rounded to nearest even (a NaN stays a NaN: its quiet bit is set first). */
static inline __m256i narrow16(__m512 v) {
    __m512i bits = _mm512_castps_si512(v);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    bits = _mm512_mask_or_epi32(bits, nan, bits, _mm512_set1_epi32(0x400000));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    const __m512i kept = _mm512_mask_mov_epi32(rounded, nan, bits);
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(kept, 16));
}

/* 16 fp32 -> bf16 for a kind: 1, narrow16; 2 (the AMX tiles' epilogue, dense_gemm_amx.h), one
 * vcvtneps2bf16: the same rounding, except that it flushes fp32 denormals to zero, and an
 * eighth of the instructions, which decided the AMX GEMM's speed at K = 576. */
#if HAS_BF16
static inline __m256i narrow_for(__m512 v, int kind) {
    return kind == 2 ? (__m256i)_mm512_cvtneps_pbh(v) : narrow16(v);
}
#else
static inline __m256i narrow_for(__m512 v, int kind) { (void)kind; return narrow16(v); }
#endif

/* The epilogue of one 16-column chunk: acc (+ bias) (+ residual), stored once in the kind
 * (0 fp32; 1 or 2 bf16, see narrow_for). */
static inline void store_chunk(__m512 acc, int kind, const void *bias, const void *residual, void *out, int64_t n,
                               int64_t at) {
    if (kind == 0) {
        if (bias != NULL) acc = _mm512_add_ps(acc, _mm512_loadu_ps((const float *)bias + n));
        if (residual != NULL) acc = _mm512_add_ps(_mm512_loadu_ps((const float *)residual + at), acc);
        _mm512_storeu_ps((float *)out + at, acc);
        return;
    }
    if (bias != NULL) acc = _mm512_add_ps(acc, widen16((const uint16_t *)bias + n));
    if (residual != NULL) acc = _mm512_add_ps(widen16((const uint16_t *)residual + at), acc);
    _mm256_storeu_si256((__m256i *)((uint16_t *)out + at), narrow_for(acc, kind));
}

/* The gated epilogue of one 16-column chunk: silu(gate (+ its bias)) * (up (+ its bias)), in
 * fp32, stored once; bias is [2 x intermediate], the gate's then the up's. */
static inline void store_gated_chunk(__m512 gate, __m512 up, int kind, const void *bias, void *out, int64_t n,
                                     int64_t intermediate, int64_t at) {
    if (bias != NULL) {
        if (kind == 0) {
            gate = _mm512_add_ps(gate, _mm512_loadu_ps((const float *)bias + n));
            up = _mm512_add_ps(up, _mm512_loadu_ps((const float *)bias + intermediate + n));
        } else {
            gate = _mm512_add_ps(gate, widen16((const uint16_t *)bias + n));
            up = _mm512_add_ps(up, widen16((const uint16_t *)bias + intermediate + n));
        }
    }
    const __m512 silu = _mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate))));
    const __m512 value = _mm512_mul_ps(silu, up);
    if (kind == 0)
        _mm512_storeu_ps((float *)out + at, value);
    else
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + at), narrow_for(value, kind));
}

static inline __m512 broadcast_step(const char *p) {
    float value;
    memcpy(&value, p, 4);
    return _mm512_set1_ps(value);
}

static inline __m512 multiply_add_f32(__m512 acc, __m512 a, __m512 b) { return _mm512_fmadd_ps(a, b, acc); }
#if HAS_BF16
static inline __m512 multiply_add_bf16(__m512 acc, __m512 a, __m512 b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}
#endif

/* a: this tile's first row; a step is 4 bytes of a row (one fp32, or two bf16). */
#define DEFINE_TILE(KIND, MULTIPLY_ADD, ROWS, BLOCKS, EPILOGUE)                                       \
TILE_ATTRIBUTES static void tile_##KIND##_##ROWS##_##BLOCKS##EPILOGUE(                               \
    const char *a, int64_t a_stride, int64_t steps, const char *panel, int kind, const void *bias,    \
    const void *residual, void *out, int64_t m, int64_t n, int64_t n_total, const char *ahead,        \
    int64_t ahead_lines) {                                                                            \
    __m512 acc[ROWS][BLOCKS];                                                                         \
    _Pragma("GCC unroll 8") for (int i = 0; i < ROWS; i++)                                            \
        _Pragma("GCC unroll 8") for (int j = 0; j < BLOCKS; j++) acc[i][j] = _mm512_setzero_ps();     \
    for (int64_t q = 0; q < steps; q++) {                                                             \
        __m512 b[BLOCKS];                                                                             \
        _Pragma("GCC unroll 8") for (int j = 0; j < BLOCKS; j++)                                      \
            b[j] = _mm512_loadu_ps((const float *)(panel + (j * steps + q) * 64));                    \
        PREFETCH_AHEAD(q, steps)                                                                      \
        _Pragma("GCC unroll 8") for (int i = 0; i < ROWS; i++) {                                      \
            const __m512 word = broadcast_step(a + i * a_stride + 4 * q);                             \
            _Pragma("GCC unroll 8") for (int j = 0; j < BLOCKS; j++)                                  \
                acc[i][j] = MULTIPLY_ADD(acc[i][j], word, b[j]);                                      \
        }                                                                                             \
    }                                                                                                 \
    EPILOGUE(ROWS, BLOCKS)                                                                            \
}
/* Each chunk + bias + residual (n_total: out's row length). */
#define PLAIN(ROWS, BLOCKS)                                                                           \
    for (int i = 0; i < ROWS; i++)                                                                    \
        for (int j = 0; j < BLOCKS; j++)                                                              \
            store_chunk(acc[i][j], kind, bias, residual, out, n + 16 * j, (m + i) * n_total + n + 16 * j);
/* Blocks j, j + 1 are one chunk's gate and up (n_total: the packed matrix's columns, twice
 * out's row length; residual unused). */
#define GATED(ROWS, BLOCKS)                                                                           \
    for (int i = 0; i < ROWS; i++)                                                                    \
        for (int j = 0; j + 1 < BLOCKS; j += 2)                                                       \
            store_gated_chunk(acc[i][j], acc[i][j + 1], kind, bias, out, n / 2 + 8 * j, n_total / 2,   \
                              (m + i) * (n_total / 2) + n / 2 + 8 * j);
#define DEFINE_TILES_OF(KIND, MULTIPLY_ADD, BLOCKS, EPILOGUE)                                         \
    DEFINE_TILE(KIND, MULTIPLY_ADD, 1, BLOCKS, EPILOGUE) DEFINE_TILE(KIND, MULTIPLY_ADD, 2, BLOCKS, EPILOGUE) \
    DEFINE_TILE(KIND, MULTIPLY_ADD, 3, BLOCKS, EPILOGUE) DEFINE_TILE(KIND, MULTIPLY_ADD, 4, BLOCKS, EPILOGUE) \
    DEFINE_TILE(KIND, MULTIPLY_ADD, 5, BLOCKS, EPILOGUE) DEFINE_TILE(KIND, MULTIPLY_ADD, 6, BLOCKS, EPILOGUE)
/* Plain tiles of 1-4 blocks; gated tiles of 2 and 4 (a gate/up pair each, a panel always
 * holds whole pairs: panels start at a multiple of 4 blocks and the matrix's count is even). */
#define DEFINE_KIND(KIND, MULTIPLY_ADD) DEFINE_TILES_OF(KIND, MULTIPLY_ADD, 1, PLAIN)                   \
    DEFINE_TILES_OF(KIND, MULTIPLY_ADD, 2, PLAIN) DEFINE_TILES_OF(KIND, MULTIPLY_ADD, 3, PLAIN)        \
    DEFINE_TILES_OF(KIND, MULTIPLY_ADD, 4, PLAIN) DEFINE_TILES_OF(KIND, MULTIPLY_ADD, 2, GATED)        \
    DEFINE_TILES_OF(KIND, MULTIPLY_ADD, 4, GATED)

typedef void (*tile_fn)(const char *, int64_t, int64_t, const char *, int, const void *, const void *, void *,
                        int64_t, int64_t, int64_t, const char *, int64_t);
#define TILE_ROW(KIND, BLOCKS, EPILOGUE)                                                              \
    {tile_##KIND##_1_##BLOCKS##EPILOGUE, tile_##KIND##_2_##BLOCKS##EPILOGUE, tile_##KIND##_3_##BLOCKS##EPILOGUE, \
     tile_##KIND##_4_##BLOCKS##EPILOGUE, tile_##KIND##_5_##BLOCKS##EPILOGUE, tile_##KIND##_6_##BLOCKS##EPILOGUE}
/* [width - 1][rows - 1] for the plain tiles, [width / 2 - 1][rows - 1] for the gated. */
DEFINE_KIND(f32, multiply_add_f32)
static const tile_fn F32_TILES[PANEL_BLOCKS][TILE_ROWS] = {TILE_ROW(f32, 1, PLAIN), TILE_ROW(f32, 2, PLAIN),
                                                           TILE_ROW(f32, 3, PLAIN), TILE_ROW(f32, 4, PLAIN)};
static const tile_fn F32_GATED[PANEL_BLOCKS / 2][TILE_ROWS] = {TILE_ROW(f32, 2, GATED), TILE_ROW(f32, 4, GATED)};
#if HAS_BF16
DEFINE_KIND(bf16, multiply_add_bf16)
static const tile_fn BF16_TILES[PANEL_BLOCKS][TILE_ROWS] = {TILE_ROW(bf16, 1, PLAIN), TILE_ROW(bf16, 2, PLAIN),
                                                            TILE_ROW(bf16, 3, PLAIN), TILE_ROW(bf16, 4, PLAIN)};
static const tile_fn BF16_GATED[PANEL_BLOCKS / 2][TILE_ROWS] = {TILE_ROW(bf16, 2, GATED), TILE_ROW(bf16, 4, GATED)};
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#define HAS_F32 1
#define HAS_BF16 0
#define HAS_AVX2 1
#include "dense_gemm_avx2.h"
#else
#define HAS_F32 0
#define HAS_BF16 0
#define HAS_AVX2 0
#endif
#if HAS_BF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAS_AMX 1
#include "dense_gemm_amx.h"
#else
#define HAS_AMX 0
#endif

/* Which kinds this build multiplies: "amx-bf16" (fp32, and bf16 on AMX tiles where K is a
 * multiple of 32), "avx512-bf16" (fp32 and bf16), "avx512" (fp32), "avx2" (fp32), "none". */
const char *tandem_dense_gemm_isa(void) {
#if HAS_AMX
    if (amx_permitted()) return "amx-bf16";
#endif
    return HAS_BF16 ? "avx512-bf16" : HAS_AVX2 ? "avx2" : HAS_F32 ? "avx512" : "none";
}

/* w [N, K] (row-major; kind 0 fp32, 1 bf16) -> packed in the layout above. N a multiple of 16,
 * K (bf16) even. */
void tandem_dense_pack(const void *w, int kind, int64_t N, int64_t K, void *packed, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t block = 0; block < N / 16; block++) {
        if (kind == 0) {
            const float *source = (const float *)w;
            float *target = (float *)packed + block * K * 16;
            for (int64_t k = 0; k < K; k++)
                for (int64_t lane = 0; lane < 16; lane++) target[k * 16 + lane] = source[(block * 16 + lane) * K + k];
        } else {
            const uint16_t *source = (const uint16_t *)w;
            uint16_t *target = (uint16_t *)packed + block * K * 16;
            for (int64_t k = 0; k < K; k++)
                for (int64_t lane = 0; lane < 16; lane++)
                    target[(k / 2) * 32 + lane * 2 + k % 2] = source[(block * 16 + lane) * K + k];
        }
    }
}

#if HAS_F32 && !HAS_AVX2
/* The tile for a panel `width` blocks wide and `rows` rows tall, plain or gated. */
static inline tile_fn pick_tile(int kind, int gated, int64_t width, int64_t rows) {
#if HAS_BF16
    if (kind == 1) return gated ? BF16_GATED[width / 2 - 1][rows - 1] : BF16_TILES[width - 1][rows - 1];
#endif
    return gated ? F32_GATED[width / 2 - 1][rows - 1] : F32_TILES[width - 1][rows - 1];
}
#endif

/* Both entry points: the refusals, then every tile of out [M, N] over the packed matrix's N
 * columns (gated: N = 2 x intermediate, and the tiles write N / 2 columns). */
static int dense_gemm(const void *x, int64_t x_stride, int64_t M, int64_t K, const void *packed, int kind,
                      const void *bias, const void *residual, void *out, int64_t N, int gated, int num_threads) {
    if (kind == KIND_BF16_W8) {
#if HAS_AMX
        if (N % (gated ? 32 : 16) == 0 && M >= 0 && K % AMX_STEP_K == 0 && amx_permitted())
            return amx_dense_gemm(x, x_stride, M, K, packed, (const float *)((const int8_t *)packed + N * K), bias,
                                  residual, out, N, gated, NULL, num_threads);
#endif
        return -1;
    }
    if (N % (gated ? 32 : 16) != 0 || M < 0 || (kind == 1 && K % 2 != 0) || (kind == 0 && !HAS_F32)
        || (kind == 1 && !HAS_BF16) || kind < 0 || kind > 1)
        return -1;
#if HAS_AMX
    if (kind == 1 && K % AMX_STEP_K == 0 && amx_permitted()) {
        return amx_dense_gemm(x, x_stride, M, K, packed, NULL, bias, residual, out, N, gated, NULL, num_threads);
    }
#endif
#if HAS_AVX2
    GEMM_FOR_EACH_TILE(M, N / 16, AVX2_PANEL_BLOCKS, AVX2_TILE_ROWS, packed, K * 64,
                       avx2_panel(gated, (const float *)x + m * x_stride, x_stride, rows, K, (const float *)packed,
                                  block, width, (const float *)bias, (const float *)residual, (float *)out, m, N,
                                  ahead, ahead_lines));
#elif HAS_F32
    const int64_t element = kind == 0 ? 4 : 2, steps = kind == 0 ? K : K / 2;
    GEMM_FOR_EACH_TILE(M, N / 16, PANEL_BLOCKS, TILE_ROWS, packed, steps * 64,
                       pick_tile(kind, gated, width, rows)((const char *)x + m * x_stride * element,
                                                           x_stride * element, steps,
                                                           (const char *)packed + block * steps * 64, kind, bias,
                                                           residual, out, m, block * 16, N, ahead, ahead_lines));
#endif
    return 0;
}

/* out [M, N] = x [M, K] (row stride x_stride elements) @ packed^T (+ bias [N]) (+ residual
 * [M, N]); all in the kind (0 fp32, 1 bf16; KIND_BF16_W8: bf16, the weights bytes and scales).
 * Returns 0, or -1 where this build cannot (out untouched). out may alias residual: each
 * element is read before it is written. */
int tandem_dense_gemm(const void *x, int64_t x_stride, int64_t M, int64_t K, const void *packed, int kind,
                      const void *bias, const void *residual, void *out, int64_t N, int num_threads) {
    return dense_gemm(x, x_stride, M, K, packed, kind, bias, residual, out, N, 0, num_threads);
}

/* out [M, intermediate] = silu(x @ gate^T (+ gate bias)) * (x @ up^T (+ up bias)), from a
 * matrix packed from the [2 x intermediate, K] rows gate 0-15, up 0-15, gate 16-31, ... (the
 * caller interleaves before `tandem_dense_pack`); bias [2 x intermediate], gate's then up's,
 * or NULL. intermediate a multiple of 16. Returns 0, or -1 where this build cannot. */
int tandem_dense_gemm_silu_mul(const void *x, int64_t x_stride, int64_t M, int64_t K, const void *packed, int kind,
                               const void *bias, void *out, int64_t intermediate, int num_threads) {
    return dense_gemm(x, x_stride, M, K, packed, kind, bias, NULL, out, 2 * intermediate, 1, num_threads);
}

/* ids [M] (int64) = each row's argmax of x @ packed^T in bf16, as torch.argmax gives it over the
 * bf16 product `tandem_dense_gemm` would write (the first of equal maxima, or the first NaN),
 * without writing that product: a greedy LM head's. AMX's tiles only (kind 1, K a multiple of
 * 32, N of 16). Returns 0, or -1 where this build or CPU cannot, or a scratch allocation
 * failed (ids then incomplete). */
int tandem_dense_gemm_argmax(const void *x, int64_t x_stride, int64_t M, int64_t K, const void *packed, int64_t N,
                             int64_t *ids, int num_threads) {
#if HAS_AMX
    if (N % 16 == 0 && M >= 0 && K % AMX_STEP_K == 0 && N <= INT32_MAX && amx_permitted())
        return amx_dense_gemm(x, x_stride, M, K, packed, NULL, NULL, NULL, NULL, N, 0, ids, num_threads);
#else
    (void)x, (void)x_stride, (void)M, (void)K, (void)packed, (void)N, (void)ids, (void)num_threads;
#endif
    return -1;
}
