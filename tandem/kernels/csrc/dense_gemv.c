/*
 * fp32 weights times a few activation rows (decode steps), for CPUs.
 *
 * A step of one or two tokens reads every weight once and does two FLOPs with it: its time
 * is the bytes read. oneDNN's packed fp32 GEMM, which tandem uses for every other step,
 * streams the default model's small per-layer matrices at about 19 GB/s with one row on
 * the 2-core AVX-512 EPYC, where the box reads memory at about 44 GB/s: its one-row path
 * is not built for a GEMV, and every call pays its setup. This kernel reads the plain
 * row-major [N, K] matrix once, in order, and keeps each (output row, activation row) dot
 * product in registers: fp32 products summed in fp32, like any GEMM, in its own order.
 *
 * Each output row is walked alone, start to end (the memory stream stays sequential), with
 * UNROLL independent accumulators per activation row so the FMAs do not wait on each other;
 * the threads split the output rows.
 *
 *   out [M, N] = x [M, K] @ W.T (+ bias [N]) (+ residual [M, N])
 *
 * bias and residual may be NULL (fp32 sums, in whichever order -ffast-math picks).
 *
 * `tandem_bf16w_gemv` takes bf16 weights (x, bias, residual and out stay fp32): each weight is
 * widened in registers (its 16 bits become a float's high half, exactly) and the arithmetic
 * is the fp32 kernel's. It serves bf16 models on CPUs whose oneDNN has no bf16 GEMM (an
 * AVX2-only EPYC), where torch's bf16 GEMV streams a matrix at a few GB/s.
 *
 * `tandem_bf16_gemv` is the all-bf16 step (x, residual and out bf16 too) of a bf16 model with
 * `--decode-weights bfloat16`: its own plain rows, read by the decode stack (decode_stack.c).
 *
 * `tandem_coded_gemv` reads fp32 weights stored losslessly as small integers: every block of
 * 32 weights of a row is exactly fl(fl(scale * code) + offset) for int8 codes and an fp32
 * scale and offset per block (what a GGUF's Q4_1, Q5_0, Q8_0, ... blocks dequantize to; the
 * Python side finds and checks them, kernels/lossless_rows.py). The scales are fp16 values,
 * so scale * code (11 significant bits times 8) is exact in fp32 and the one rounding is the
 * offset's: a fused multiply-add rebuilds each weight in registers as the fp32 weight itself.
 * The dot products keep the fp32 kernel's accumulators; the outputs agree with
 * tandem_f32_gemv's on the plain rows to fp32 rounding (-ffast-math may sum the last four
 * accumulators in another order), from 1.25 bytes a weight instead of 4.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(_OPENMP)
#include <omp.h>
#endif

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define MAX_ROWS 4 /* activation rows sharing one pass over the weights */

#if defined(__AVX512F__)
#define WIDTH 16
#define UNROLL 4
typedef __m512 vec;
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VSUM(a) _mm512_reduce_add_ps(a)
#define VLOAD_BF16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#elif defined(__AVX2__) && defined(__FMA__)
#define WIDTH 8
#define UNROLL 4
typedef __m256 vec;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VLOAD_BF16(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
static inline float VSUM(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

static inline float widen_bf16(uint16_t x) {
    union { uint32_t u; float f; } bits = {.u = (uint32_t)x << 16};
    return bits.f;
}

/* Weight i of a row: fp32, or bf16 widened (`bf16` is a literal where called). */
#define WEIGHT(w, i, bf16) ((bf16) ? widen_bf16(((const uint16_t *)(w))[i]) : ((const float *)(w))[i])
#if defined(WIDTH)
#define WLOAD(w, i, bf16) ((bf16) ? VLOAD_BF16((const uint16_t *)(w) + (i)) : VLOAD((const float *)(w) + (i)))
#endif

/* dots[m] = W[row] . x[m] for `rows` activation rows (`rows` and `bf16` literals where called). */
static inline __attribute__((always_inline)) void row_dots(const void *w, const float *x, int64_t k, int rows,
                                                           int bf16, float *dots) {
    int64_t i = 0;
#if defined(WIDTH)
    vec acc[MAX_ROWS][UNROLL];
    for (int m = 0; m < rows; m++)
        for (int u = 0; u < UNROLL; u++) acc[m][u] = VZERO();
    for (; i + WIDTH * UNROLL <= k; i += WIDTH * UNROLL) {
#pragma GCC unroll 4
        for (int u = 0; u < UNROLL; u++) {
            const vec wv = WLOAD(w, i + u * WIDTH, bf16);
            for (int m = 0; m < rows; m++) acc[m][u] = VFMA(wv, VLOAD(x + m * k + i + u * WIDTH), acc[m][u]);
        }
    }
    for (; i + WIDTH <= k; i += WIDTH) {
        const vec wv = WLOAD(w, i, bf16);
        for (int m = 0; m < rows; m++) acc[m][0] = VFMA(wv, VLOAD(x + m * k + i), acc[m][0]);
    }
    for (int m = 0; m < rows; m++) dots[m] = VSUM(VADD(VADD(acc[m][0], acc[m][1]), VADD(acc[m][2], acc[m][3])));
#else
    for (int m = 0; m < rows; m++) dots[m] = 0.0f;
#endif
    for (; i < k; i++)
        for (int m = 0; m < rows; m++) dots[m] += WEIGHT(w, i, bf16) * x[m * k + i];
}

/* A coded row: k int8 codes, then k / 32 fp32 scales, then k / 32 fp32 offsets (k a multiple of
 * CODE_STEP). */
#define CODE_BLOCK 32
#define CODE_STEP 64
#ifndef CODED_AHEAD
#define CODED_AHEAD 8192
#endif
static inline size_t coded_row_bytes(int64_t k) { return (size_t)k + 2 * sizeof(float) * (size_t)(k / CODE_BLOCK); }

#if defined(WIDTH)
#if defined(__AVX512F__)
#define VCODES(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define VSET(v) _mm512_set1_ps(v)
#else
#define VCODES(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define VSET(v) _mm256_set1_ps(v)
#endif
#endif

/* dots[m] = W[row] . x[m] for a coded row: row_dots's accumulators and order on the rebuilt weights. */
static inline __attribute__((always_inline)) void coded_row_dots(const uint8_t *w, const float *x, int64_t k,
                                                                 int rows, float *dots) {
    const int8_t *codes = (const int8_t *)w;
    const float *scales = (const float *)(w + k), *offsets = scales + k / CODE_BLOCK;
#if defined(WIDTH)
    /* The rows are one stream, read at a third of the fp32 kernel's bytes a cycle: the
     * hardware prefetcher alone then keeps too few lines in flight (coded rows from memory at
     * 30 GB/s against the plain rows' 80 on a Zen 5). Ask for the row CODED_AHEAD bytes on
     * (SmolLM2's layers, one token, 2 threads: 5.6 ms without; 3.6, 3.2, 3.0, 2.7 and 2.8 ms
     * at 1, 2, 4, 8 and 16 KB on; the plain rows 9.4 ms). */
    for (size_t at = 0; at < coded_row_bytes(k); at += 64) _mm_prefetch((const char *)w + CODED_AHEAD + at, _MM_HINT_T0);
    vec acc[MAX_ROWS][UNROLL];
    for (int m = 0; m < rows; m++)
        for (int u = 0; u < UNROLL; u++) acc[m][u] = VZERO();
    /* a step of 64 weights is two blocks on AVX-512 (u 0-1 and 2-3) and, 32 at a time, one on AVX2 */
    for (int64_t i = 0; i < k; i += WIDTH * UNROLL, scales += WIDTH * UNROLL / CODE_BLOCK,
                 offsets += WIDTH * UNROLL / CODE_BLOCK) {
#pragma GCC unroll 4
        for (int u = 0; u < UNROLL; u++) {
            const int block = u * WIDTH / CODE_BLOCK;
            const vec wv = VFMA(VCODES(codes + i + u * WIDTH), VSET(scales[block]), VSET(offsets[block]));
            for (int m = 0; m < rows; m++) acc[m][u] = VFMA(wv, VLOAD(x + m * k + i + u * WIDTH), acc[m][u]);
        }
    }
    for (int m = 0; m < rows; m++) dots[m] = VSUM(VADD(VADD(acc[m][0], acc[m][1]), VADD(acc[m][2], acc[m][3])));
#else
    for (int m = 0; m < rows; m++) dots[m] = 0.0f;
    for (int64_t i = 0; i < k; i++) {
        const float weight = scales[i / CODE_BLOCK] * (float)codes[i] + offsets[i / CODE_BLOCK];
        for (int m = 0; m < rows; m++) dots[m] += weight * x[m * k + i];
    }
#endif
}

/* Rows [first, last) of W against `rows` activation rows starting at x; W's rows are fp32
 * (kind 0), bf16 (1) or coded (2). */
#define KIND_F32 0
#define KIND_BF16 1
#define KIND_CODED 2
static inline __attribute__((always_inline)) void rows_block(const void *w, int kind, const float *bias,
                                                             const float *x, const float *residual, float *out,
                                                             int64_t rows, int64_t n, int64_t k, int64_t first,
                                                             int64_t last) {
    float dots[MAX_ROWS];
    const size_t row_bytes = kind == KIND_CODED ? coded_row_bytes(k)
                             : (size_t)k * (kind == KIND_BF16 ? sizeof(uint16_t) : sizeof(float));
    for (int64_t row = first; row < last; row++) {
        const void *wr = (const char *)w + (size_t)row * row_bytes;
        if (kind == KIND_CODED) {
            switch (rows) { /* literal row counts: the accumulators stay in registers */
            case 1: coded_row_dots(wr, x, k, 1, dots); break;
            case 2: coded_row_dots(wr, x, k, 2, dots); break;
            case 3: coded_row_dots(wr, x, k, 3, dots); break;
            default: coded_row_dots(wr, x, k, 4, dots); break;
            }
        } else {
            const int bf16 = kind == KIND_BF16;
            switch (rows) {
            case 1: row_dots(wr, x, k, 1, bf16, dots); break;
            case 2: row_dots(wr, x, k, 2, bf16, dots); break;
            case 3: row_dots(wr, x, k, 3, bf16, dots); break;
            default: row_dots(wr, x, k, 4, bf16, dots); break;
            }
        }
        for (int64_t m = 0; m < rows; m++) {
            float value = dots[m];
            if (bias != NULL) value += bias[row];
            if (residual != NULL) value = residual[m * n + row] + value;
            out[m * n + row] = value;
        }
    }
}

/* The threads split W's rows; each walks the activation rows MAX_ROWS at a time. */
static inline __attribute__((always_inline)) void gemv(const void *w, int kind, const float *bias, const float *x,
                                                       const float *residual, float *out, int64_t m_rows,
                                                       int64_t n, int64_t k, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    {
#if defined(_OPENMP)
        const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
#else
        const int64_t threads = 1, me = 0;
#endif
        const int64_t share = (n + threads - 1) / threads;
        const int64_t first = me * share, last = first + share < n ? first + share : n;
        for (int64_t m = 0; m < m_rows && first < last; m += MAX_ROWS) {
            const int64_t rows = m_rows - m < MAX_ROWS ? m_rows - m : MAX_ROWS;
            rows_block(w, kind, bias, x + m * k, residual == NULL ? NULL : residual + m * n, out + m * n, rows, n,
                       k, first, last);
        }
    }
}

/* out [m_rows, n] = x [m_rows, k] @ W.T (+ bias) (+ residual), W [n, k] row-major fp32.
 * out must not alias x; it may alias residual (each element is read before it is written). */
void tandem_f32_gemv(const float *w, const float *bias, const float *x, const float *residual, float *out,
                     int64_t m_rows, int64_t n, int64_t k, int num_threads) {
    gemv(w, KIND_F32, bias, x, residual, out, m_rows, n, k, num_threads);
}

/* The same with W [n, k] row-major bf16 (the raw 16 bits of each weight). */
void tandem_bf16w_gemv(const uint16_t *w, const float *bias, const float *x, const float *residual, float *out,
                       int64_t m_rows, int64_t n, int64_t k, int num_threads) {
    gemv(w, KIND_BF16, bias, x, residual, out, m_rows, n, k, num_threads);
}

/* The same with W's rows coded (coded_row_bytes(k) bytes each: codes, scales, offsets), k a
 * multiple of 64 (else nothing is written); the fp32 GEMV's product of the rows the codes rebuild. */
void tandem_coded_gemv(const uint8_t *w, const float *bias, const float *x, const float *residual, float *out,
                       int64_t m_rows, int64_t n, int64_t k, int num_threads) {
    if (k % CODE_STEP != 0) return;
    gemv(w, KIND_CODED, bias, x, residual, out, m_rows, n, k, num_threads);
}

/* bf16 rounded to nearest even, as torch's .to(torch.bfloat16) rounds (NaN stays a NaN). */
static inline uint16_t round_bf16(float value) {
    union { float f; uint32_t u; } bits = {.f = value};
    if ((bits.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits.u >> 16) | 0x40u);
    return (uint16_t)((bits.u + 0x7fffu + ((bits.u >> 16) & 1u)) >> 16);
}

/* A bf16 model's small step: x, residual and out bf16, W [n, k] bf16, bias fp32 (or NULL).
 * The arithmetic is tandem_bf16w_gemv's on x widened (exactly) to fp32, and each output is
 * rounded to bf16 once, after the bias and the residual: the same bits as DenseRows.matmul
 * gives on the module path (x.float(), this kernel's fp32 sibling, .to(bf16)), so the decode
 * stack's C loop and the layer-by-layer path agree bit for bit. Returns 0, or -1 when its
 * fp32 scratch (x and out, a few KB) cannot be allocated. out may alias residual. */
int tandem_bf16_gemv(const uint16_t *w, const float *bias, const uint16_t *x, const uint16_t *residual,
                     uint16_t *out, int64_t m_rows, int64_t n, int64_t k, int num_threads) {
    float *wide = malloc(sizeof(float) * (size_t)(m_rows * k + m_rows * n));
    if (wide == NULL) return -1;
    float *sums = wide + m_rows * k;
    for (int64_t i = 0; i < m_rows * k; i++) wide[i] = widen_bf16(x[i]);
    gemv(w, KIND_BF16, bias, wide, NULL, sums, m_rows, n, k, num_threads);
    for (int64_t i = 0; i < m_rows * n; i++)
        out[i] = round_bf16(residual == NULL ? sums[i] : widen_bf16(residual[i]) + sums[i]);
    free(wide);
    return 0;
}

/* which vector width this build uses, for the log */
const char *tandem_f32_gemv_isa(void) {
#if defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
    return "avx2";
#else
    return "portable C";
#endif
}
