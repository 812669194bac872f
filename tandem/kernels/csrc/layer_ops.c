/*
 * The small per-layer passes between a decoder layer's GEMMs, one C call each.
 *
 * At a one-token step the GEMMs read a few hundred KB each, so the passes around them cost
 * as much as they do: RMSNorm in bf16 is eight torch ops (cast, pow, mean, add, rsqrt, mul,
 * cast, mul), rotary five plus a cat, silu-and-mul three. Measured in the engine on the
 * 2-core AVX-512 EPYC, SmolLM2-135M bf16 with 4-bit decode weights: 32 us per norm, 20 us
 * per rotary, against 1-3 us of arithmetic. Each function here is one pass over its rows.
 *
 * Every function reproduces the roundings of the torch ops it replaces:
 *   - fp32 rotary is bit-identical (no FMA contraction: see the pragmas below), so the exact
 *     fp32 mode keeps its greedy parity with transformers;
 *   - bf16 rounds each intermediate to bf16 where torch's bf16 ops do (round to nearest even);
 *   - RMSNorm's mean is summed in another order than torch's, which can move a result by
 *     one bf16 unit in the last place, and silu's exp is a polynomial within 2 ulp of expf.
 */
#pragma STDC FP_CONTRACT OFF
#pragma GCC optimize("fp-contract=off", "no-associative-math")
#include <math.h>
#include <stdint.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

static inline float widen(uint16_t x) {
    union { uint32_t u; float f; } bits = {.u = (uint32_t)x << 16};
    return bits.f;
}

/* fp32 -> bf16, round to nearest even, as torch's casts do (NaN stays a quiet NaN). */
static inline uint16_t narrow(float x) {
    union { float f; uint32_t u; } bits = {.f = x};
    if ((bits.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits.u >> 16) | 0x40u);
    bits.u += 0x7fffu + ((bits.u >> 16) & 1u);
    return (uint16_t)(bits.u >> 16);
}

/* A bf16 op's result: the fp32 value rounded to bf16 and back. */
static inline float round_bf16(float x) { return widen(narrow(x)); }

#if defined(__AVX512BF16__)
/* The same three on 16 values: vcvtneps2bf16 is narrow() in one instruction (nearest even, a
 * NaN kept quiet the same way), except that it reads an fp32 denormal as zero; so does the
 * whole process once a kernel built with -ffast-math is loaded (it sets flush-to-zero). The emulated rounding was most of the
 * bf16 norm's and rotary's instructions: a 2,048-token chunk's rotary took 600 us, ~40% of it
 * in AVX2-width integer rounding. */
static inline __m512 widen16(const uint16_t *x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)x)), 16));
}
static inline __m512 round16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}
static inline __m256i narrow16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }

/* 32 values a vector, in place. A 512-bit load of 32 bf16 values holds value 2i in the low
 * half of 32-bit lane i and value 2i + 1 in its high half, so a shift widens the even values
 * and a mask the odd ones, in their lanes, with nothing moved across lanes (where widen16 took
 * a cross-lane zero-extension for each 16). Arithmetic then runs on the even and odd vectors
 * alike, and the results go back to 32 bf16 values by one rounding instruction for both and
 * one permutation into pairs; a bf16 rounding in between (round_pair) is that permutation
 * read back by the shift and the mask. Per 32 values this is 4 instructions where the 16-value
 * round trip took 6. */
static inline __m512 even32(__m512i raw) { return _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16)); }
static inline __m512 odd32(__m512i raw) {
    return _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32((int)0xFFFF0000u)));
}
/* even / odd fp32 lanes -> 32 bf16 values, each rounded to nearest even as narrow() rounds. */
static inline __m512i narrow32(__m512 even, __m512 odd) {
    /* words 0-15 even's, 16-31 odd's -> word 2i even's i, word 2i + 1 odd's i */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(odd, even));
}
/* round16 of an even and an odd vector together. */
static inline void round_pair(__m512 *even, __m512 *odd) {
    const __m512i rounded = narrow32(*even, *odd);
    *even = even32(rounded);
    *odd = odd32(rounded);
}
#endif

/* Rows are split over threads only when there are enough to pay for waking them; fewer run
 * on the calling thread with no OpenMP region at all (a one-thread region between torch's
 * two-thread ones cost ~10 us a call in the engine). */
#define PARALLEL_ROWS(rows, num_threads) ((rows) >= 32 && (num_threads) > 1)

static inline void norm_row(const uint16_t *row, const uint16_t *weight, uint16_t *dst, int64_t hidden, float eps) {
    float total = 0.0f;
    int64_t i = 0;
#if defined(__AVX512BF16__)
    /* the squares summed by vdpbf16ps, 32 values an instruction (each bf16 product is exact in
     * fp32), in two chains: the widen-multiply-add loop's one chain of adds bound it */
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
    for (; i + 64 <= hidden; i += 64) {
        const __m512bh x0 = (__m512bh)_mm512_loadu_si512(row + i), x1 = (__m512bh)_mm512_loadu_si512(row + i + 32);
        sum0 = _mm512_dpbf16_ps(sum0, x0, x0);
        sum1 = _mm512_dpbf16_ps(sum1, x1, x1);
    }
    if (i + 32 <= hidden) {
        const __m512bh x = (__m512bh)_mm512_loadu_si512(row + i);
        sum0 = _mm512_dpbf16_ps(sum0, x, x);
        i += 32;
    }
    total = _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
#endif
#pragma omp simd reduction(+ : total)
    for (int64_t j = i; j < hidden; j++) {
        const float v = widen(row[j]);
        total += v * v;
    }
    const float inverse = 1.0f / sqrtf(total / (float)hidden + eps);
    i = 0;
#if defined(__AVX512BF16__)
    for (; i + 32 <= hidden; i += 32) {
        const __m512i x = _mm512_loadu_si512(row + i), w = _mm512_loadu_si512(weight + i);
        __m512 even = _mm512_mul_ps(even32(x), _mm512_set1_ps(inverse));
        __m512 odd = _mm512_mul_ps(odd32(x), _mm512_set1_ps(inverse));
        round_pair(&even, &odd);
        _mm512_storeu_si512(dst + i, narrow32(_mm512_mul_ps(even32(w), even), _mm512_mul_ps(odd32(w), odd)));
    }
    for (; i + 16 <= hidden; i += 16) {
        const __m512 scaled = round16(_mm512_mul_ps(widen16(row + i), _mm512_set1_ps(inverse)));
        _mm256_storeu_si256((__m256i *)(dst + i), narrow16(_mm512_mul_ps(widen16(weight + i), scaled)));
    }
#endif
    for (; i < hidden; i++) dst[i] = narrow(widen(weight[i]) * round_bf16(widen(row[i]) * inverse));
}

/* out = weight * bf16(x * rsqrt(mean(x^2) + eps)), x widened to fp32: transformers' LlamaRMSNorm
 * on bf16 rows (x rows `x_stride` elements apart; out contiguous). */
void tandem_rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *weight, uint16_t *out,
                          int64_t rows, int64_t hidden, float eps, int num_threads) {
    if (PARALLEL_ROWS(rows, num_threads)) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t r = 0; r < rows; r++) norm_row(x + r * x_stride, weight, out + r * hidden, hidden, eps);
    } else {
        for (int64_t r = 0; r < rows; r++) norm_row(x + r * x_stride, weight, out + r * hidden, hidden, eps);
    }
}

static inline void norm_row_f32(const float *row, const float *weight, float *dst, int64_t hidden, float eps) {
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < hidden; i++) total += row[i] * row[i];
    const float inverse = 1.0f / sqrtf(total / (float)hidden + eps);
    for (int64_t i = 0; i < hidden; i++) dst[i] = weight[i] * (row[i] * inverse);
}

/* The same formula on fp32 rows, for the fp32 decode stack (csrc/decode_stack.c). The layer
 * path's fp32 norm is torch's fused kernel, whose mean is summed in another order: the two
 * can differ in the last place. */
void tandem_rms_norm_f32(const float *x, int64_t x_stride, const float *weight, float *out, int64_t rows,
                         int64_t hidden, float eps, int num_threads) {
    if (PARALLEL_ROWS(rows, num_threads)) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t r = 0; r < rows; r++) norm_row_f32(x + r * x_stride, weight, out + r * hidden, hidden, eps);
    } else {
        for (int64_t r = 0; r < rows; r++) norm_row_f32(x + r * x_stride, weight, out + r * hidden, hidden, eps);
    }
}

/* One token's heads; fp32: x1*c - x2*s, x2*c + x1*s with every product and sum rounded as
 * torch rounds it. */
static inline void rotary_token_f32(float *x, int64_t heads, int64_t head_dim, const float *c, const float *s) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *first = x + h * head_dim, *second = first + half;
        for (int64_t i = 0; i < half; i++) {
            const float a = first[i], b = second[i];
            const float ac = a * c[i], bs = b * s[i], bc = b * c[i], as = a * s[i];
            first[i] = ac - bs;
            second[i] = bc + as;
        }
    }
}

/* bf16: each product and sum rounded to bf16 as torch's bf16 ops round them. */
static inline void rotary_token_bf16(uint16_t *x, int64_t heads, int64_t head_dim, const uint16_t *c,
                                     const uint16_t *s) {
    const int64_t half = head_dim / 2;
#if defined(__AVX512BF16__)
    if (half % 32 == 0 && half <= 128) { /* 32 values a vector (even32), the token's cos and sin widened once */
        __m512 ce[4], co[4], se[4], so[4];
        for (int64_t k = 0; k < half / 32; k++) {
            const __m512i cr = _mm512_loadu_si512(c + 32 * k), sr = _mm512_loadu_si512(s + 32 * k);
            ce[k] = even32(cr);
            co[k] = odd32(cr);
            se[k] = even32(sr);
            so[k] = odd32(sr);
        }
        for (int64_t h = 0; h < heads; h++)
            for (int64_t k = 0; k < half / 32; k++) {
                uint16_t *first = x + h * head_dim + 32 * k, *second = first + half;
                const __m512i a = _mm512_loadu_si512(first), b = _mm512_loadu_si512(second);
                __m512 ac_e = _mm512_mul_ps(even32(a), ce[k]), ac_o = _mm512_mul_ps(odd32(a), co[k]);
                __m512 bs_e = _mm512_mul_ps(even32(b), se[k]), bs_o = _mm512_mul_ps(odd32(b), so[k]);
                __m512 bc_e = _mm512_mul_ps(even32(b), ce[k]), bc_o = _mm512_mul_ps(odd32(b), co[k]);
                __m512 as_e = _mm512_mul_ps(even32(a), se[k]), as_o = _mm512_mul_ps(odd32(a), so[k]);
                round_pair(&ac_e, &ac_o);
                round_pair(&bs_e, &bs_o);
                round_pair(&bc_e, &bc_o);
                round_pair(&as_e, &as_o);
                _mm512_storeu_si512(first, narrow32(_mm512_sub_ps(ac_e, bs_e), _mm512_sub_ps(ac_o, bs_o)));
                _mm512_storeu_si512(second, narrow32(_mm512_add_ps(bc_e, as_e), _mm512_add_ps(bc_o, as_o)));
            }
        return;
    }
#endif
    for (int64_t h = 0; h < heads; h++) {
        uint16_t *first = x + h * head_dim, *second = first + half;
        int64_t i = 0;
#if defined(__AVX512BF16__)
        for (; i + 16 <= half; i += 16) {
            const __m512 a = widen16(first + i), b = widen16(second + i), ci = widen16(c + i), si = widen16(s + i);
            _mm256_storeu_si256((__m256i *)(first + i),
                                narrow16(_mm512_sub_ps(round16(_mm512_mul_ps(a, ci)), round16(_mm512_mul_ps(b, si)))));
            _mm256_storeu_si256((__m256i *)(second + i),
                                narrow16(_mm512_add_ps(round16(_mm512_mul_ps(b, ci)), round16(_mm512_mul_ps(a, si)))));
        }
#endif
        for (; i < half; i++) {
            const float a = widen(first[i]), b = widen(second[i]), ci = widen(c[i]), si = widen(s[i]);
            first[i] = narrow(round_bf16(a * ci) - round_bf16(b * si));
            second[i] = narrow(round_bf16(b * ci) + round_bf16(a * si));
        }
    }
}

/* Rotate-half rotary embedding, in place, on [tokens, heads, head_dim] rows whose tokens are
 * `token_stride` elements apart (q and k heads side by side in the fused projection) and
 * whose heads are dense; cos/sin are [tokens, head_dim / 2] in the rows' dtype. */
#define DEFINE_ROTARY(SUFFIX, T)                                                                 \
void tandem_rotary_##SUFFIX(T *x, int64_t tokens, int64_t heads, int64_t token_stride, int64_t head_dim, \
                            const T *cos, const T *sin, int num_threads) {                       \
    const int64_t half = head_dim / 2;                                                           \
    if (PARALLEL_ROWS(tokens, num_threads)) {                                                    \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                    \
        for (int64_t t = 0; t < tokens; t++)                                                     \
            rotary_token_##SUFFIX(x + t * token_stride, heads, head_dim, cos + t * half, sin + t * half); \
    } else {                                                                                     \
        for (int64_t t = 0; t < tokens; t++)                                                     \
            rotary_token_##SUFFIX(x + t * token_stride, heads, head_dim, cos + t * half, sin + t * half); \
    }                                                                                            \
}
DEFINE_ROTARY(f32, float)
DEFINE_ROTARY(bf16, uint16_t)

/* e^x for silu, written so the compiler vectorizes it (the C library's expf is a call per
 * element: 14 us for one 1,536-wide row): x = n ln2 + r, e^r by its degree-6 Taylor polynomial
 * on |r| <= ln2 / 2, 2^n put into the exponent bits. Within 2 ulp of expf. */
static inline float exp_approx(float x) {
    const float above = x > 88.72f ? INFINITY : 1.0f; /* overflows as expf does: silu(-100) = -0 */
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = rintf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { uint32_t u; float f; } scale = {.u = (uint32_t)((int32_t)n + 127) << 23};
    return p * scale.f * above;
}

static inline float silu(float x) { return x / (1.0f + exp_approx(-x)); }

static inline void silu_mul_row_f32(const float *gate, float *dst, int64_t inter) {
    const float *up = gate + inter;
    for (int64_t i = 0; i < inter; i++) dst[i] = silu(gate[i]) * up[i];
}

static inline void silu_mul_row_bf16(const uint16_t *gate, uint16_t *dst, int64_t inter) {
    const uint16_t *up = gate + inter;
    for (int64_t i = 0; i < inter; i++) dst[i] = narrow(round_bf16(silu(widen(gate[i]))) * widen(up[i]));
}

/* out [rows, inter] = silu(gate) * up, from [rows, 2 * inter] rows of gate then up. */
#define DEFINE_SILU_MUL(SUFFIX, T)                                                               \
void tandem_silu_mul_##SUFFIX(const T *gate_up, T *out, int64_t rows, int64_t inter, int num_threads) { \
    if (PARALLEL_ROWS(rows, num_threads)) {                                                      \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                    \
        for (int64_t r = 0; r < rows; r++) silu_mul_row_##SUFFIX(gate_up + r * 2 * inter, out + r * inter, inter); \
    } else {                                                                                     \
        for (int64_t r = 0; r < rows; r++) silu_mul_row_##SUFFIX(gate_up + r * 2 * inter, out + r * inter, inter); \
    }                                                                                            \
}
DEFINE_SILU_MUL(f32, float)
DEFINE_SILU_MUL(bf16, uint16_t)

/* Each row's argmax, as torch.argmax gives it: the first index of the largest value, or of
 * the first NaN where a row has one. The greedy sampler's pass over a step's logits: torch's
 * took 1.3 ms for 64 rows of SmolLM2's 49,152 (two threads, the rows hot), ~2 cycles a value.
 * A bf16 row (the logits of a bf16 LM head, before forward's fp32 copy) is widened as it is
 * read, which is exact, so its argmax is its fp32 copy's: that copy took 2.9 ms of a 40 ms
 * step of 64 rows on the 2-core AMX Xeon. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
static inline __m512 argmax_load_f32(const float *row, __mmask16 lanes) {
    return _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), lanes, row);
}
static inline __m512 argmax_load_bf16(const uint16_t *row, __mmask16 lanes) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, row));
    return _mm512_mask_blend_ps(lanes, _mm512_set1_ps(-INFINITY), _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
}
#define DEFINE_ARGMAX_ROW(SUFFIX, T)                                                              \
static int64_t argmax_row_##SUFFIX(const T *row, int64_t cols) {                                  \
    __m512 top = _mm512_set1_ps(-INFINITY);                                                       \
    __mmask16 nan = 0;                                                                            \
    for (int64_t k = 0; k < cols; k += 16) {                                                      \
        const __mmask16 lanes = cols - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (cols - k)) - 1u); \
        const __m512 v = argmax_load_##SUFFIX(row + k, lanes);                                    \
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);                                            \
        top = _mm512_max_ps(top, v);                                                              \
    }                                                                                             \
    if (nan) {                                                                                    \
        for (int64_t k = 0; k < cols; k += 16) {                                                  \
            const __mmask16 lanes = cols - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (cols - k)) - 1u); \
            const __m512 v = argmax_load_##SUFFIX(row + k, lanes);                                \
            const __mmask16 hit = _mm512_mask_cmp_ps_mask(lanes, v, v, _CMP_UNORD_Q);             \
            if (hit) return k + __builtin_ctz((unsigned)hit);                                     \
        }                                                                                         \
    }                                                                                             \
    const __m512 best = _mm512_set1_ps(_mm512_reduce_max_ps(top));                                \
    for (int64_t k = 0; k < cols; k += 16) {                                                      \
        const __mmask16 lanes = cols - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (cols - k)) - 1u); \
        const __mmask16 hit = _mm512_mask_cmp_ps_mask(lanes, argmax_load_##SUFFIX(row + k, lanes), best, _CMP_EQ_OQ); \
        if (hit) return k + __builtin_ctz((unsigned)hit);                                         \
    }                                                                                             \
    return 0;                                                                                     \
}
#else
static inline float argmax_value_f32(const float *row, int64_t k) { return row[k]; }
static inline float argmax_value_bf16(const uint16_t *row, int64_t k) { return widen(row[k]); }
#define DEFINE_ARGMAX_ROW(SUFFIX, T)                                                              \
static int64_t argmax_row_##SUFFIX(const T *row, int64_t cols) {                                  \
    int64_t best = 0;                                                                             \
    for (int64_t k = 0; k < cols; k++) {                                                          \
        const float v = argmax_value_##SUFFIX(row, k);                                            \
        if (v != v) return k;                                                                     \
        if (v > argmax_value_##SUFFIX(row, best)) best = k;                                       \
    }                                                                                             \
    return best;                                                                                  \
}
#endif

#define DEFINE_ARGMAX(SUFFIX, T)                                                                  \
DEFINE_ARGMAX_ROW(SUFFIX, T)                                                                      \
void tandem_argmax_##SUFFIX(const T *x, int64_t rows, int64_t cols, int64_t stride, int64_t *out, int num_threads) { \
    if (rows >= 2 && num_threads > 1) {                                                           \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                     \
        for (int64_t r = 0; r < rows; r++) out[r] = argmax_row_##SUFFIX(x + r * stride, cols);    \
    } else {                                                                                      \
        for (int64_t r = 0; r < rows; r++) out[r] = argmax_row_##SUFFIX(x + r * stride, cols);    \
    }                                                                                             \
}
DEFINE_ARGMAX(f32, float)
DEFINE_ARGMAX(bf16, uint16_t)

/* The bounded greedy head's candidates (tandem/layers/bounded_greedy.py): for each row of bf16
 * approximate logits, its top and the bound B = norm_terms[r] + output_factor * max|x| (the
 * inputs' rounding and both accumulations, and the bf16 output's rounding); every id whose
 * value is at least top - 2B could still be the fp32 maximum. Up to `capacity` ids per row
 * go to ids[r * capacity ...], in ascending order; counts[r] is how many there were (more
 * than `capacity`: the caller computes the logits instead), 0 where the row has a NaN. Two
 * passes over the row, the second skipping 16 values at a time where none passes. */
static inline float widen_bf16(uint16_t x) {
    union { uint32_t u; float f; } bits = {.u = (uint32_t)x << 16};
    return bits.f;
}

static void bounded_row(const uint16_t *row, int64_t cols, double norm_term, double output_factor,
                        int64_t *count, int64_t *ids, int64_t capacity) {
    float top = -INFINITY, low = INFINITY;
    int nan = 0;
    for (int64_t k = 0; k < cols; k++) {
        const float v = widen_bf16(row[k]);
        nan |= v != v;
        top = v > top ? v : top;
        low = v < low ? v : low;
    }
    if (nan) {
        *count = 0;
        return;
    }
    const double largest = fabs((double)top) > fabs((double)low) ? fabs((double)top) : fabs((double)low);
    const double threshold = (double)top - 2.0 * (norm_term + output_factor * largest + 1e-30);
    float limit = (float)threshold;
    if ((double)limit > threshold) limit = nextafterf(limit, -INFINITY); /* never above the bound */
    int64_t n = 0;
    int64_t k = 0;
#if defined(__AVX512F__)
    const __m512 bar = _mm512_set1_ps(limit);
    for (; k + 16 <= cols; k += 16) {
        const __m256i halves = _mm256_loadu_si256((const __m256i *)(row + k));
        const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
        unsigned hit = _mm512_cmp_ps_mask(v, bar, _CMP_GE_OQ);
        while (hit) {
            const int64_t id = k + __builtin_ctz(hit);
            if (n < capacity) ids[n] = id;
            n++;
            hit &= hit - 1;
        }
    }
#endif
    for (; k < cols; k++) {
        if (widen_bf16(row[k]) >= limit) {
            if (n < capacity) ids[n] = k;
            n++;
        }
    }
    *count = n;
}

void tandem_bounded_candidates_bf16(const uint16_t *x, int64_t rows, int64_t cols, int64_t stride,
                                    const double *norm_terms, double output_factor, int64_t *counts, int64_t *ids,
                                    int64_t capacity, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= 2 && num_threads > 1)
    for (int64_t r = 0; r < rows; r++)
        bounded_row(x + r * stride, cols, norm_terms[r], output_factor, counts + r, ids + r * capacity, capacity);
}
