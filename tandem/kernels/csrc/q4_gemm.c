/*
 * 4-bit weight-only GEMM for a few rows (decode steps), for CPUs.
 *
 * A step of one or two tokens reads every weight once and does two FLOPs with it, so its
 * time is the bytes read; a 4-bit matrix is a quarter of bf16's. Unpacking nibbles into
 * floats costs more instructions than the bytes save, though (PyTorch's CPU int4 kernel
 * runs at ~9 GB/s of weights here, against ~19 for bf16), so this kernel follows llama.cpp
 * instead: the activations are quantized to int8 per group of 32 inputs, and the nibbles
 * are multiplied with them by integer dot products (AVX-512 VNNI `vpdpbusd`: 64 products a
 * instruction; AVX2 `vpmaddubsw` + `vpmaddwd`; plain C elsewhere), one float FMA per group
 * applying both scales.
 *
 * Layout of a [N, K] matrix (K a multiple of 64), per output row:
 *   nibbles [N, K/2] bytes: each 64 inputs are 32 bytes, byte j holding input j in its low
 *            nibble and input j + 32 in its high one, so one block unpacks into two whole
 *            groups with an AND and a shift;
 *   scales, mins [N, K/32] fp16: weight = nibble * scale + min, per group of 32 inputs.
 * Activations: x [M, K] fp32 -> out [M, N] fp32.
 *
 * The 8-bit variant (`tandem_q8_gemm`, for a matrix 4 bits would spoil, such as an LM head
 * read at every token) has the same scales, minimums and arithmetic with one level byte per
 * input: levels [N, K] bytes, weight = level * scale + min. Levels reach 255, so the AVX2
 * path widens to 16 bits before multiplying (vpmaddubsw would saturate).
 *
 * Per group g of row m: x ~= d_g * xq (xq int8, d_g = max|x| / 127), so
 *   sum_i w_i x_i = scale * d_g * sum_i nibble_i xq_i + min * sum_i x_i,
 * with the min term over the exact x. The int8 rounding of x is the only approximation
 * beyond the 4-bit weights themselves (llama.cpp's Q4 x Q8 scheme).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define GROUP 32
#define BLOCK 64

static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
    if (exponent == 0) {
        if (mantissa == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exponent = 127 - 15 + 1;
            while (!(mantissa & 0x400)) {
                mantissa <<= 1;
                exponent--;
            }
            bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
        }
    } else if (exponent == 31) {
        bits = sign | 0x7f800000 | (mantissa << 13);
    } else {
        bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
    }
    union { uint32_t u; float f; } out = {.u = bits};
    return out.f;
#endif
}

/* One activation row quantized per group: xq int8, d (its scale), xsum (sum of exact x). */
static void quantize_row(const float *x, int64_t k, int8_t *xq, float *d, float *xsum) {
    for (int64_t g = 0; g < k / GROUP; g++) {
        const float *v = x + g * GROUP;
        float top = 0.0f, total = 0.0f;
        for (int i = 0; i < GROUP; i++) {
            const float a = fabsf(v[i]);
            top = a > top ? a : top;
            total += v[i];
        }
        const float scale = top / 127.0f;
        const float inverse = top > 0.0f ? 127.0f / top : 0.0f;
        for (int i = 0; i < GROUP; i++) xq[g * GROUP + i] = (int8_t)lrintf(v[i] * inverse);
        d[g] = scale;
        xsum[g] = total;
    }
}

/* sum over one block's two groups of nibble * xq, as two int32 sums. */
static inline void block_dots(const uint8_t *levels, int bits, const int8_t *xq, int32_t *first, int32_t *second) {
    int32_t a = 0, b = 0;
    for (int j = 0; j < GROUP; j++) {
        if (bits == 4) {
            a += (int32_t)(levels[j] & 0x0f) * xq[j];
            b += (int32_t)(levels[j] >> 4) * xq[GROUP + j];
        } else {
            a += (int32_t)levels[j] * xq[j];
            b += (int32_t)levels[GROUP + j] * xq[GROUP + j];
        }
    }
    *first = a;
    *second = b;
}

/* Bytes of one block of 64 inputs. */
#define BLOCK_BYTES(bits) ((bits) == 4 ? BLOCK / 2 : BLOCK)

#define MAX_ROWS 4 /* activation rows sharing one pass over the weights */

#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512F__))
/* 32 u8 x s8 products summed into 8 int32s, through 16-bit lanes: 8-bit levels reach
 * 255, whose pair sums (2 * 255 * 127) would saturate vpmaddubsw's 16 bits. */
static inline __m256i dots_u8_s8_wide(__m256i u, __m256i s) {
    const __m256i u_lo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(u));
    const __m256i u_hi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(u, 1));
    const __m256i s_lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(s));
    const __m256i s_hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(s, 1));
    /* products summed in pairs to int32 (inputs 0-15, then 16-31), the two added lane-wise:
     * the group's sum is the sum of the lanes, all the caller needs */
    return _mm256_add_epi32(_mm256_madd_epi16(u_lo, s_lo), _mm256_madd_epi16(u_hi, s_hi));
}
#endif

/* factor[m][g] = scale_g * d[m][g]: both scales of group g's integer dot product. */
static inline __attribute__((always_inline)) void group_factors(const uint16_t *scales, const float *d,
                                                                int64_t groups, int64_t m_rows, float *factor) {
    int64_t g = 0;
#if defined(__AVX512F__)
    for (; g < groups; g += 16) {
        const __mmask16 mask = groups - g >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (groups - g)) - 1);
        const __m512 scale = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, scales + g));
        for (int64_t m = 0; m < m_rows; m++)
            _mm512_mask_storeu_ps(factor + m * groups + g, mask,
                                  _mm512_mul_ps(scale, _mm512_maskz_loadu_ps(mask, d + m * groups + g)));
    }
#endif
    for (; g < groups; g++) {
        const float scale = half_to_float(scales[g]);
        for (int64_t m = 0; m < m_rows; m++) factor[m * groups + g] = scale * d[m * groups + g];
    }
}

/* sum_g min_g * xsum[m][g] per row m, added to totals (the AVX-512 path folds this into its
 * accumulators instead). */
static inline __attribute__((always_inline)) void add_min_terms(const uint16_t *mins, const float *xsum,
                                                                int64_t groups, int64_t m_rows, float *totals) {
    for (int64_t g = 0; g < groups; g++) {
        const float low = half_to_float(mins[g]);
        for (int64_t m = 0; m < m_rows; m++) totals[m] += low * xsum[m * groups + g];
    }
}

/* out[m, n] for rows m < m_rows (<= MAX_ROWS) of one output row n; `factor` is scratch of
 * m_rows * k / GROUP floats. Inlined with m_rows a literal (see row_dot), so the
 * accumulators stay in registers. */
static inline __attribute__((always_inline)) void row_dot_rows(const uint8_t *nibbles, int bits, const uint16_t *scales,
                    const uint16_t *mins, int64_t k, const int8_t *xq, const float *d, const float *xsum,
                    int64_t m_rows, float *out, int64_t out_stride, float *factor) {
    const int64_t groups = k / GROUP, blocks = k / BLOCK;
    float totals[MAX_ROWS] = {0.0f, 0.0f, 0.0f, 0.0f};
    group_factors(scales, d, groups, m_rows, factor);
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
    __m512 acc[MAX_ROWS];
    for (int64_t m = 0; m < MAX_ROWS; m++) acc[m] = _mm512_setzero_ps();
    const __m256i low_mask = _mm256_set1_epi8(0x0f);
    /* lanes 0-7 hold the first group's partial sums, lanes 8-15 the second's */
    const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int64_t b = 0; b < blocks; b++) {
        __m512i w;
        if (bits == 4) {
            const __m256i packed = _mm256_loadu_si256((const __m256i *)(nibbles + b * (BLOCK / 2)));
            const __m256i lo = _mm256_and_si256(packed, low_mask);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_mask);
            w = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        } else {
            w = _mm512_loadu_si512((const void *)(nibbles + b * BLOCK));
        }
        for (int64_t m = 0; m < m_rows; m++) {
            const __m512i x = _mm512_loadu_si512((const void *)(xq + m * k + b * BLOCK));
            const __m512i dots = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x);
            const __m128d pair = _mm_load_sd((const double *)(factor + m * groups + 2 * b));
            const __m512 factors = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(_mm_castpd_ps(pair)));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), factors, acc[m]);
        }
    }
    /* the min terms, sum_g min_g * xsum[m][g], into the same accumulators: one reduction */
    for (int64_t g = 0; g < groups; g += 16) {
        const __mmask16 mask = groups - g >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (groups - g)) - 1);
        const __m512 low = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, mins + g));
        for (int64_t m = 0; m < m_rows; m++)
            acc[m] = _mm512_fmadd_ps(low, _mm512_maskz_loadu_ps(mask, xsum + m * groups + g), acc[m]);
    }
    for (int64_t m = 0; m < m_rows; m++) out[m * out_stride] = _mm512_reduce_add_ps(acc[m]);
    return;
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc[MAX_ROWS];
    for (int64_t m = 0; m < MAX_ROWS; m++) acc[m] = _mm256_setzero_ps();
    const __m256i low_mask = _mm256_set1_epi8(0x0f);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < blocks; b++) {
        __m256i lo, hi;
        if (bits == 4) {
            const __m256i packed = _mm256_loadu_si256((const __m256i *)(nibbles + b * (BLOCK / 2)));
            lo = _mm256_and_si256(packed, low_mask);
            hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_mask);
        } else {
            lo = _mm256_loadu_si256((const __m256i *)(nibbles + b * BLOCK));
            hi = _mm256_loadu_si256((const __m256i *)(nibbles + b * BLOCK + GROUP));
        }
        for (int64_t m = 0; m < m_rows; m++) {
            const int8_t *q = xq + m * k + b * BLOCK;
            const float *f = factor + m * groups + 2 * b;
            __m256i dot_lo, dot_hi;
            if (bits == 4) {
                /* u8 x s8 -> pairs summed to s16 (at most 2 * 15 * 127: no saturation) -> s32 */
                dot_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)q)), ones);
                dot_hi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(q + GROUP))),
                                           ones);
            } else {
                dot_lo = dots_u8_s8_wide(lo, _mm256_loadu_si256((const __m256i *)q));
                dot_hi = dots_u8_s8_wide(hi, _mm256_loadu_si256((const __m256i *)(q + GROUP)));
            }
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_lo), _mm256_broadcast_ss(f), acc[m]);
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_hi), _mm256_broadcast_ss(f + 1), acc[m]);
        }
    }
    for (int64_t m = 0; m < m_rows; m++) {
        const __m128 four = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
        const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
        totals[m] = _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
    }
#else
    for (int64_t b = 0; b < blocks; b++) {
        for (int64_t m = 0; m < m_rows; m++) {
            int32_t first, second;
            block_dots(nibbles + b * BLOCK_BYTES(bits), bits, xq + m * k + b * BLOCK, &first, &second);
            totals[m] += (float)first * factor[m * groups + 2 * b] + (float)second * factor[m * groups + 2 * b + 1];
        }
    }
#endif
    add_min_terms(mins, xsum, groups, m_rows, totals);
    for (int64_t m = 0; m < m_rows; m++) out[m * out_stride] = totals[m];
}

#define DEFINE_ROW_DOT(BITS)                                                                     \
static void row_dot_##BITS(const uint8_t *levels, const uint16_t *scales, const uint16_t *mins, int64_t k, \
                           const int8_t *xq, const float *d, const float *xsum, int64_t m_rows,  \
                           float *out, int64_t out_stride, float *factor) {                      \
    switch (m_rows) {                                                                            \
    case 1:                                                                                      \
        row_dot_rows(levels, BITS, scales, mins, k, xq, d, xsum, 1, out, out_stride, factor);    \
        break;                                                                                   \
    case 2:                                                                                      \
        row_dot_rows(levels, BITS, scales, mins, k, xq, d, xsum, 2, out, out_stride, factor);    \
        break;                                                                                   \
    case 3:                                                                                      \
        row_dot_rows(levels, BITS, scales, mins, k, xq, d, xsum, 3, out, out_stride, factor);    \
        break;                                                                                   \
    default:                                                                                     \
        row_dot_rows(levels, BITS, scales, mins, k, xq, d, xsum, 4, out, out_stride, factor);    \
    }                                                                                            \
}
DEFINE_ROW_DOT(4)
DEFINE_ROW_DOT(8)

/* out [m_rows, n] = x [m_rows, k] @ W.T (+ residual [m_rows, n] where not NULL: a layer's
 * o_proj and down_proj add the residual stream, one torch op less a call). Returns 0, or -1
 * when scratch memory ran out. */
static int lowbit_gemm(int bits, const uint8_t *nibbles, const uint16_t *scales, const uint16_t *mins, const float *x,
                       const float *residual, float *out, int64_t m_rows, int64_t n, int64_t k, int num_threads) {
    const int64_t groups = k / GROUP;
    int8_t *xq = malloc((size_t)(m_rows * k));
    float *d = malloc(sizeof(float) * (size_t)(m_rows * groups));
    float *xsum = malloc(sizeof(float) * (size_t)(m_rows * groups));
    if (xq == NULL || d == NULL || xsum == NULL) {
        free(xq);
        free(d);
        free(xsum);
        return -1;
    }
    for (int64_t m = 0; m < m_rows; m++) quantize_row(x + m * k, k, xq + m * k, d + m * groups, xsum + m * groups);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *factor = malloc(sizeof(float) * (size_t)(MAX_ROWS * groups));
        if (factor == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int64_t row = 0; row < n; row++) {
            if (factor == NULL) continue;
            for (int64_t m = 0; m < m_rows; m += MAX_ROWS) {
                const int64_t rows = m_rows - m < MAX_ROWS ? m_rows - m : MAX_ROWS;
                if (bits == 4)
                    row_dot_4(nibbles + row * (k / 2), scales + row * groups, mins + row * groups, k, xq + m * k,
                              d + m * groups, xsum + m * groups, rows, out + m * n + row, n, factor);
                else
                    row_dot_8(nibbles + row * k, scales + row * groups, mins + row * groups, k, xq + m * k,
                              d + m * groups, xsum + m * groups, rows, out + m * n + row, n, factor);
            }
        }
        free(factor);
    }
    free(xq);
    free(d);
    free(xsum);
    if (residual != NULL)
        for (int64_t i = 0; i < m_rows * n; i++) out[i] = residual[i] + out[i];
    return failed ? -1 : 0;
}

/* The same for bf16 rows in and out (a bf16 model's activations): widened into fp32 here and
 * the results rounded to nearest even on the way out, instead of two torch casts around every
 * call, which at one token cost about as much as the GEMM's own overhead. */
int tandem_q4_gemm(const uint8_t *nibbles, const uint16_t *scales, const uint16_t *mins, const float *x,
                   const float *residual, float *out, int64_t m_rows, int64_t n, int64_t k, int num_threads) {
    return lowbit_gemm(4, nibbles, scales, mins, x, residual, out, m_rows, n, k, num_threads);
}

int tandem_q8_gemm(const uint8_t *levels, const uint16_t *scales, const uint16_t *mins, const float *x,
                   const float *residual, float *out, int64_t m_rows, int64_t n, int64_t k, int num_threads) {
    return lowbit_gemm(8, levels, scales, mins, x, residual, out, m_rows, n, k, num_threads);
}

static inline uint16_t to_bf16(float x) {
    union { float f; uint32_t u; } bits = {.f = x};
    bits.u += 0x7FFFu + ((bits.u >> 16) & 1u);
    return (uint16_t)(bits.u >> 16);
}

static inline float from_bf16(uint16_t x) {
    union { uint32_t u; float f; } bits = {.u = (uint32_t)x << 16};
    return bits.f;
}

/* The residual, where given, is added as torch's bf16 add would: to the product rounded to
 * bf16, the sum rounded again. */
static int lowbit_gemm_bf16(int bits, const uint8_t *nibbles, const uint16_t *scales, const uint16_t *mins,
                            const uint16_t *x, const uint16_t *residual, uint16_t *out, int64_t m_rows, int64_t n,
                            int64_t k, int num_threads) {
    float *x32 = malloc(sizeof(float) * (size_t)(m_rows * k));
    float *out32 = malloc(sizeof(float) * (size_t)(m_rows * n));
    if (x32 == NULL || out32 == NULL) {
        free(x32);
        free(out32);
        return -1;
    }
    for (int64_t i = 0; i < m_rows * k; i++) x32[i] = from_bf16(x[i]);
    const int status = lowbit_gemm(bits, nibbles, scales, mins, x32, NULL, out32, m_rows, n, k, num_threads);
    if (residual != NULL)
        for (int64_t i = 0; i < m_rows * n; i++) out[i] = to_bf16(from_bf16(residual[i]) + from_bf16(to_bf16(out32[i])));
    else
        for (int64_t i = 0; i < m_rows * n; i++) out[i] = to_bf16(out32[i]);
    free(x32);
    free(out32);
    return status;
}

int tandem_q4_gemm_bf16(const uint8_t *nibbles, const uint16_t *scales, const uint16_t *mins, const uint16_t *x,
                        const uint16_t *residual, uint16_t *out, int64_t m_rows, int64_t n, int64_t k,
                        int num_threads) {
    return lowbit_gemm_bf16(4, nibbles, scales, mins, x, residual, out, m_rows, n, k, num_threads);
}

int tandem_q8_gemm_bf16(const uint8_t *levels, const uint16_t *scales, const uint16_t *mins, const uint16_t *x,
                        const uint16_t *residual, uint16_t *out, int64_t m_rows, int64_t n, int64_t k,
                        int num_threads) {
    return lowbit_gemm_bf16(8, levels, scales, mins, x, residual, out, m_rows, n, k, num_threads);
}

/* which integer dot product this build uses, for the log */
const char *tandem_q4_gemm_isa(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
    return "avx512-vnni";
#elif defined(__AVX2__) && defined(__FMA__)
    return "avx2";
#else
    return "portable C";
#endif
}
