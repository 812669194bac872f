/*
 * Prefill attention for CPUs: one sequence's chunk of queries attends causally to its cached
 * prefix and to itself, read from the paged KV cache (flash attention: online softmax, the
 * score matrix never leaves registers and L1).
 *
 * Why a kernel of our own: PyTorch's CPU flash attention reaches 60-130 GFLOP/s on a 2-core
 * AVX-512 box where a bf16 GEMM reaches ~450, and at an 8,000-token prompt attention is 3/4
 * of the time to first token.
 *
 * The shape of the work. A tile is LANES consecutive query tokens of one query head (16 with
 * AVX-512, 8 with AVX2: one machine vector of fp32), held transposed: the queries are the
 * lanes of a vector, so every softmax step (max, exp, sum, rescale) is lane-wise, with no
 * horizontal reductions. Keys go by in groups of LANES:
 *   S[j] (LANES lanes = queries) += Q^T[d] * broadcast(K[j][d])      for each key j, dim d
 *   O^T[d] (LANES lanes)         += P[j] * broadcast(V[j][d])
 * so K and V are read as rows, straight as the cache stores them. With AVX-512-BF16 both
 * products use vdpbf16ps on pairs: pairs of dims for Q.K (a cached key row already is pairs),
 * pairs of keys for P.V (V is regrouped into key pairs once per call, below).
 *
 * Before the tiles, one pass gathers each kv head's context from its blocks into a dense,
 * zero-padded buffer (V in key pairs for bf16); that is O(context * dim) against the tiles'
 * O(queries * context * dim), and it keeps block tables and never-written cache slots out of
 * the inner loops.
 *
 * Arithmetic is fp32 throughout (a bf16 P is rounded to bf16 for P.V, as in every bf16 flash
 * attention); the score scale is folded into a base-2 exponent. With AVX-512 a tile's Q^T and
 * its output rows are transposed in registers, 16 x 16 at a time (element by element, a scalar
 * load or store each, the Q^T loads alone were 9% of the fp32 kernel). With the cheaper
 * exponential below, a prefill-heavy run's attention took 8-15% less time in bf16, 3-7% in fp32
 * (the 2-core AVX-512 EPYC, the engine's own calls timed, alternating processes). Vector code is
 * written with GCC vector extensions, which compile to AVX-512 or AVX2 (two halves) as
 * -march=native allows; vdpbf16ps is used only where __AVX512BF16__ is defined, else bf16 is widened.
 *
 * With AVX-512, fp32 products (an fp32 cache, or bf16 where there is no AVX-512-BF16) go through
 * prefill_attention_avx512.h instead: tiles of 6 query rows shaped as the packed GEMMs, 8% less
 * time in an exact prefill-heavy run's attention. The lane tiles here keep bf16's vdpbf16ps
 * (the GEMM shape was no faster there) and every CPU without AVX-512.
 *
 * Layout (tandem/kernels/base.py): one layer's cache is [2, kv_heads, num_blocks, block_size,
 * head_dim]; q and out are [q_len, num_heads, head_dim] with a token stride of their own.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* Queries per tile = fp32 lanes of one machine vector: 16 with AVX-512, 8 otherwise. A
 * 16-lane tile on AVX2 (each vector two ymm halves) needs twice the 16 registers its
 * accumulators take and spills in every inner loop: 4 GFLOP/s on a 2-core AVX2 EPYC. */
#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
#define MAX_DIM 256

typedef float vec __attribute__((vector_size(LANES * 4), aligned(LANES * 4)));
typedef int32_t veci __attribute__((vector_size(LANES * 4), aligned(LANES * 4)));

static inline vec splat(float x) { return (vec){0} + x; }

static inline vec vmax(vec a, vec b) {
#if defined(__AVX512F__)
    return (vec)_mm512_max_ps((__m512)a, (__m512)b); /* a where a > b, else b: as below */
#else
    veci take_a = a > b;
    return (vec)(((veci)a & take_a) | ((veci)b & ~take_a));
#endif
}

static inline float widen(uint16_t x) {
    union { uint32_t u; float f; } bits = {.u = (uint32_t)x << 16};
    return bits.f;
}

/* 2^x for x <= 0: x = n + f with n the nearest integer and |f| <= 1/2, 2^f by its
 * Taylor series in f (the powers of ln 2 folded into the coefficients), 2^n applied by scaling
 * the exponent (vscalefps with AVX-512: 10 instructions where the integer route took 15).
 * DEGREE 7 is ~1e-7 relative (fp32); 5 is ~3e-6, far below a bf16's 2^-9, for bf16 rows whose
 * probabilities are rounded to bf16 anyway; 3 is 7.5e-5, still a 26th of that rounding, for
 * the probabilities themselves (not the corrections, which must give exactly 1 at 0).
 * Degree 3 with AVX-512 takes f = x - floor(x) in [0, 1) from one vreduceps, and vscalefps
 * applies 2^floor(x) from x itself: 5 instructions, not 6 (the same polynomial moved by a half,
 * so the same error). Inputs below -126 give ~2^-126 (AVX2) or 0. */
static inline vec exp2_nonpositive(vec x, const int degree) {
#if defined(__AVX512DQ__)
    if (degree == 3) { /* the minimax polynomial below on [0, 1): sqrt(2) p(f - 1/2) */
        const vec f = (vec)_mm512_reduce_ps((__m512)x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        vec p = splat(7.8024066985e-02f);
        p = p * f + 2.2606673837e-01f;
        p = p * f + 6.9583427906e-01f;
        p = p * f + 9.9992507696e-01f;
        return (vec)_mm512_scalef_ps((__m512)p, (__m512)x);
    }
#endif
#if defined(__AVX512F__)
    const __m512 n = _mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const vec f = x - (vec)n;
#else
    x = vmax(x, splat(-126.0f));
    const veci n = __builtin_convertvector(x - 0.5f, veci); /* truncates: rounds to nearest */
    const vec f = x - __builtin_convertvector(n, vec);
#endif
    /* ln2^k / k!; degree 3: the polynomial of least relative error on |f| <= 1/2 (7.5e-5,
     * against the Taylor series' 8e-4), whose 2^0 is 0.99993, not 1 */
    vec p;
    if (degree == 3) {
        p = splat(5.517134442925453e-02f);
        p = p * f + 2.4261033535003662e-01f;
        p = p * f + 6.932609677314758e-01f;
        p = p * f + 9.999281167984009e-01f;
#if defined(__AVX512F__)
        return (vec)_mm512_scalef_ps((__m512)p, n);
#else
        return p * (vec)((n + 127) << 23);
#endif
    }
    if (degree == 7) {
        p = splat(1.5252733804059840e-05f);
        p = p * f + 1.5403530393381606e-04f;
        p = p * f + 1.3333558146428443e-03f;
    } else {
        p = splat(1.3333558146428443e-03f);
    }
    p = p * f + 9.6181291076284772e-03f;
    p = p * f + 5.5504108664821580e-02f;
    p = p * f + 2.4022650695910071e-01f;
    p = p * f + 6.9314718055994531e-01f;
    p = p * f + 1.0f;
#if defined(__AVX512F__)
    return (vec)_mm512_scalef_ps((__m512)p, n);
#else
    return p * (vec)((n + 127) << 23);
#endif
}

static inline int any_greater(vec a, vec b) {
#if defined(__AVX512F__)
    return _mm512_cmp_ps_mask((__m512)a, (__m512)b, _CMP_GT_OQ) != 0;
#endif
    veci greater = a > b;
    int any = 0;
    for (int i = 0; i < LANES; i++) any |= greater[i];
    return any;
}

#if defined(__AVX512F__)
/* r[i] lane j -> r[j] lane i: a 16 x 16 block of 32-bit elements transposed in registers
 * (within 128-bit lanes by unpacks, then across them by 128-bit shuffles). */
static inline void transpose16(__m512 r[16]) {
    __m512 a[16], b[16];
    for (int i = 0; i < 8; i++) {
        a[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        b[4 * i] = (__m512)_mm512_unpacklo_pd((__m512d)a[4 * i], (__m512d)a[4 * i + 2]);
        b[4 * i + 1] = (__m512)_mm512_unpackhi_pd((__m512d)a[4 * i], (__m512d)a[4 * i + 2]);
        b[4 * i + 2] = (__m512)_mm512_unpacklo_pd((__m512d)a[4 * i + 1], (__m512d)a[4 * i + 3]);
        b[4 * i + 3] = (__m512)_mm512_unpackhi_pd((__m512d)a[4 * i + 1], (__m512d)a[4 * i + 3]);
    }
    /* b[4 i + k] lane L: column 4 L + k of rows 4 i .. 4 i + 3 */
    for (int k = 0; k < 4; k++) {
        const __m512 low01 = _mm512_shuffle_f32x4(b[k], b[4 + k], 0x44);
        const __m512 low23 = _mm512_shuffle_f32x4(b[8 + k], b[12 + k], 0x44);
        const __m512 high01 = _mm512_shuffle_f32x4(b[k], b[4 + k], 0xEE);
        const __m512 high23 = _mm512_shuffle_f32x4(b[8 + k], b[12 + k], 0xEE);
        r[k] = _mm512_shuffle_f32x4(low01, low23, 0x88);
        r[4 + k] = _mm512_shuffle_f32x4(low01, low23, 0xDD);
        r[8 + k] = _mm512_shuffle_f32x4(high01, high23, 0x88);
        r[12 + k] = _mm512_shuffle_f32x4(high01, high23, 0xDD);
    }
}
#endif

#if defined(__AVX512F__)
#include "prefill_attention_avx512.h"
#endif

/* The cache element: fp32 (KIND 0) or bf16 held as uint16_t (KIND 1). */
static inline float load_kv(const void *base, int64_t index, int kind) {
    return kind == 0 ? ((const float *)base)[index] : widen(((const uint16_t *)base)[index]);
}

/* One kv head's values as bf16 key pairs: [padded / 2][dim][2] (element (t, d) at
 * ((t / 2) * dim + d) * 2 + t % 2), zero beyond `context`: a vdpbf16ps or AMX B operand. */
static void gather_value_pairs(const char *v_head, const int64_t *block_ids, int64_t context, int64_t padded,
                               int64_t dim, int64_t block_size, char *v_out) {
    uint16_t *pairs = (uint16_t *)v_out;
    for (int64_t t = 0; t < padded; t++) {
        uint16_t *column = pairs + (t / 2) * dim * 2 + t % 2;
        if (t >= context) {
            for (int64_t d = 0; d < dim; d++) column[2 * d] = 0;
            continue;
        }
        const int64_t slot = block_ids[t / block_size] * block_size + t % block_size;
        const uint16_t *source = (const uint16_t *)v_head + slot * dim;
        for (int64_t d = 0; d < dim; d++) column[2 * d] = source[d];
    }
}

/* One kv head's first `padded` keys and values out of its blocks, dense and zero beyond
 * `context`. K stays in rows [padded][dim]. V is rows too, or, for the vdpbf16ps path, key
 * pairs: [padded / 2][dim][2] (element (t, d) at ((t / 2) * dim + d) * 2 + t % 2). */
static void gather_head(const char *k_head, const char *v_head, const int64_t *block_ids,
                        int64_t context, int64_t padded, int64_t dim, int64_t block_size,
                        size_t element, int pair_values, char *k_out, char *v_out) {
    const size_t row = (size_t)dim * element;
    for (int64_t t = 0; t < padded; t++) {
        char *k_row = k_out + (size_t)t * row;
        if (t >= context) {
            memset(k_row, 0, row);
        } else {
            const int64_t slot = block_ids[t / block_size] * block_size + t % block_size;
            memcpy(k_row, k_head + (size_t)slot * row, row);
        }
    }
    if (!pair_values) {
        for (int64_t t = 0; t < padded; t++) {
            char *v_row = v_out + (size_t)t * row;
            if (t >= context) {
                memset(v_row, 0, row);
            } else {
                const int64_t slot = block_ids[t / block_size] * block_size + t % block_size;
                memcpy(v_row, v_head + (size_t)slot * row, row);
            }
        }
        return;
    }
    gather_value_pairs(v_head, block_ids, context, padded, dim, block_size, v_out);
}

typedef struct {
    const char *q;
    char *out;
    const char *keys;   /* [kv_heads][padded][dim] */
    const char *values; /* [kv_heads][padded][dim] or key pairs */
    int64_t q_len, cached, padded, num_heads, group, dim, q_stride, out_stride;
    int kind;           /* 0 fp32, 1 bf16 */
    int pair_values;    /* vdpbf16ps path */
    float log2_scale;   /* softmax scale * log2(e) */
} Problem;

/* S[j] += Q^T . K[j] for LANES keys, fp32 arithmetic on widened or fp32 keys: one accumulator
 * a key, LANES independent accumulations to hide the FMA latency. */
static inline __attribute__((always_inline)) void scores_fma_of(const vec *qt, const char *k_group, vec *s,
                                                                const int kind, const int64_t dim) {
    vec acc[LANES];
    for (int j = 0; j < LANES; j++) acc[j] = splat(0.0f);
    for (int64_t d = 0; d < dim; d++) {
        const vec q = qt[d];
#pragma GCC unroll 16
        for (int j = 0; j < LANES; j++) acc[j] += q * load_kv(k_group, (int64_t)j * dim + d, kind);
    }
    for (int j = 0; j < LANES; j++) s[j] = acc[j];
}

/* With the head size a constant, each key row is a fixed offset from the group's start. Eight
 * keys at a time with a runtime size spilled the sixteen row pointers to the stack; one
 * accumulator a key and a constant size: bf16 6.40 -> 5.53 ms, fp32 9.24 -> 8.68 ms for five
 * prompts of 256-1024 tokens, SmolLM2's heads, the 2-core AVX-512 EPYC (with the AVX-512
 * max and compare below). */
static inline __attribute__((always_inline)) void scores_fma(const Problem *p, const vec *qt, const char *k_group,
                                                             vec *s, const int kind) {
    if (p->dim == 64)
        scores_fma_of(qt, k_group, s, kind, 64);
    else if (p->dim == 128)
        scores_fma_of(qt, k_group, s, kind, 128);
    else
        scores_fma_of(qt, k_group, s, kind, p->dim);
}

/* O^T[d] += sum_j P[j] * V[j][d] for LANES keys, V in rows. */
static inline __attribute__((always_inline)) void values_fma(const Problem *p, const vec *probs, const char *v_group,
                                                             vec *ot, const int kind) {
    for (int64_t d0 = 0; d0 < p->dim; d0 += LANES) {
        vec acc[LANES];
        for (int i = 0; i < LANES; i++) acc[i] = ot[d0 + i];
        for (int j = 0; j < LANES; j++) {
            const int64_t base = (int64_t)j * p->dim + d0;
#pragma GCC unroll 16
            for (int i = 0; i < LANES; i++) acc[i] += probs[j] * load_kv(v_group, base + i, kind);
        }
        for (int i = 0; i < LANES; i++) ot[d0 + i] = acc[i];
    }
}

#if defined(__AVX512BF16__)
/* S[j] += Q^T . K[j] with vdpbf16ps: qt holds pairs of dims (16 lanes x 2 bf16 each), and a
 * cached key row read as 32-bit words is already pairs of dims. */
static inline __attribute__((always_inline)) void scores_bf16_of(const __m512i *qt_pairs, const char *k_group, vec *s,
                                                                 const int64_t pairs) {
    const uint32_t *k_words = (const uint32_t *)k_group;
    __m512 acc[LANES];
    for (int j = 0; j < LANES; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t w = 0; w < pairs; w++) {
        const __m512bh q = (__m512bh)qt_pairs[w];
#pragma GCC unroll 16
        for (int j = 0; j < LANES; j++)
            acc[j] = _mm512_dpbf16_ps(acc[j], q, (__m512bh)_mm512_set1_epi32((int)k_words[j * pairs + w]));
    }
    for (int j = 0; j < LANES; j++) s[j] = (vec)acc[j];
}

/* The head size a constant, as for scores_fma. */
static inline void scores_bf16(const Problem *p, const __m512i *qt_pairs, const char *k_group, vec *s) {
    if (p->dim == 64)
        scores_bf16_of(qt_pairs, k_group, s, 32);
    else if (p->dim == 128)
        scores_bf16_of(qt_pairs, k_group, s, 64);
    else
        scores_bf16_of(qt_pairs, k_group, s, p->dim / 2);
}

/* O^T[d] += sum_j P[j] * V[j][d] with vdpbf16ps over key pairs: P[j], P[j+1] rounded to bf16
 * and interleaved lane by lane; V regrouped into key pairs by gather_head. */
static inline void values_bf16(const Problem *p, const vec *probs, const char *v_group, vec *ot) {
    /* word i of the result: bf16 of a[i] low, of b[i] high; cvtne2ps puts b in words 0-15 and
     * a in words 16-31 */
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512i prob_pairs[LANES / 2];
    for (int i = 0; i < LANES / 2; i++) {
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh((__m512)probs[2 * i + 1], (__m512)probs[2 * i]);
        prob_pairs[i] = _mm512_permutexvar_epi16(interleave, both);
    }
    const uint32_t *v_words = (const uint32_t *)v_group; /* [8 key pairs][dim] words */
    for (int64_t d0 = 0; d0 < p->dim; d0 += LANES) {
        __m512 acc[LANES];
        for (int i = 0; i < LANES; i++) acc[i] = (__m512)ot[d0 + i];
        for (int k = 0; k < LANES / 2; k++) {
            const __m512bh pk = (__m512bh)prob_pairs[k];
            const uint32_t *row = v_words + k * p->dim + d0;
#pragma GCC unroll 16
            for (int i = 0; i < LANES; i++)
                acc[i] = _mm512_dpbf16_ps(acc[i], pk, (__m512bh)_mm512_set1_epi32((int)row[i]));
        }
        for (int i = 0; i < LANES; i++) ot[d0 + i] = (vec)acc[i];
    }
}
#endif

/* One tile: query tokens [t0, t0 + rows) of query head `head`. */
static void attend_tile(const Problem *p, int64_t head, int64_t t0, int64_t rows) {
    const int64_t dim = p->dim, kv_head = head / p->group;
    const size_t element = p->kind == 0 ? 4 : 2;
    vec qt[MAX_DIM]; /* Q^T in fp32: [dim] vectors of LANES queries */
    vec ot[MAX_DIM]; /* O^T: [dim] vectors */
    vec s[LANES];
    veci position; /* each lane's query position in the context; padding lanes repeat the last */
    for (int r = 0; r < LANES; r++) position[r] = (int32_t)(p->cached + t0 + (r < rows ? r : rows - 1));
#if defined(__AVX512BF16__)
    __m512i qt_pairs[MAX_DIM / 2];
#endif
#if defined(__AVX512F__)
    /* Q^T a 16 x 16 block at a time: rows of 16 elements (fp32, widened bf16, or bf16 pairs as
     * 32-bit words) transposed in registers. */
    const char *q_rows[LANES];
    for (int r = 0; r < LANES; r++)
        q_rows[r] = p->q + (size_t)(t0 + (r < rows ? r : rows - 1)) * p->q_stride * element
                    + (size_t)head * dim * element;
    const int64_t q_words = p->pair_values ? dim / 2 : dim; /* vectors of Q^T */
    for (int64_t w0 = 0; w0 < q_words; w0 += LANES) {
        /* a head size of 16 x odd: its last block of bf16 pairs is 8 words */
        const int64_t count = q_words - w0 < LANES ? q_words - w0 : LANES;
        const __mmask16 present = (__mmask16)((1u << count) - 1u);
        __m512 block[LANES];
        for (int r = 0; r < LANES; r++) {
            if (p->kind == 0 || p->pair_values)
                block[r] = _mm512_maskz_loadu_ps(present, q_rows[r] + w0 * 4);
            else
                block[r] = _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(q_rows[r] + w0 * 2))), 16));
        }
        transpose16(block);
#if defined(__AVX512BF16__)
        if (p->pair_values) {
            for (int i = 0; i < count; i++) qt_pairs[w0 + i] = _mm512_castps_si512(block[i]);
            continue;
        }
#endif
        for (int i = 0; i < LANES; i++) qt[w0 + i] = (vec)block[i];
    }
#else
    for (int r = 0; r < LANES; r++) {
        const int64_t token = t0 + (r < rows ? r : rows - 1);
        const char *row = p->q + (size_t)token * p->q_stride * element + (size_t)head * dim * element;
#if defined(__AVX512BF16__)
        if (p->pair_values) {
            for (int64_t w = 0; w < dim / 2; w++) ((uint32_t *)&qt_pairs[w])[r] = ((const uint32_t *)row)[w];
            continue;
        }
#endif
        for (int64_t d = 0; d < dim; d++) qt[d][r] = load_kv(row, d, p->kind);
    }
#endif
    for (int64_t d = 0; d < dim; d++) ot[d] = splat(0.0f);
    vec top = splat(-1e30f), total = splat(0.0f);
    const int degree = p->kind == 0 ? 7 : 5;
    const int64_t first = p->cached + t0, last = p->cached + t0 + rows - 1;
    const int64_t groups = last / LANES + 1;
    const size_t head_bytes = (size_t)p->padded * dim * element;
    const char *k_head = p->keys + kv_head * head_bytes, *v_head = p->values + kv_head * head_bytes;
    for (int64_t g = 0; g < groups; g++) {
        const char *k_group = k_head + (size_t)g * LANES * dim * element;
        const char *v_group = v_head + (size_t)g * LANES * dim * element;
#if defined(__AVX512BF16__)
        if (p->pair_values)
            scores_bf16(p, qt_pairs, k_group, s);
        else
#endif
            if (p->kind == 0) /* a literal kind: the element loads are compiled without a branch */
                scores_fma(p, qt, k_group, s, 0);
            else
                scores_fma(p, qt, k_group, s, 1);
        const int64_t key0 = g * LANES;
        const int masked = key0 + LANES - 1 > first;
        vec block_top = splat(-1e30f);
        for (int j = 0; j < LANES; j++) {
            s[j] *= p->log2_scale;
            if (masked) {
                veci visible = position >= (int32_t)(key0 + j);
                s[j] = (vec)(((veci)s[j] & visible) | ((veci)splat(-1e30f) & ~visible));
            }
            block_top = vmax(block_top, s[j]);
        }
        /* FlashAttention-4 moves the maximum only when a score passes it by 2^8: on random keys
         * that skipped most of these passes (bf16 kernel +16%), but in the engine (real heads
         * settle on a maximum early) it changed nothing measurable, and bf16 paid in accuracy:
         * the top key's probability is no longer exactly 1 before its rounding to bf16. */
        if (any_greater(block_top, top)) {
            const vec new_top = vmax(top, block_top);
            const vec correction = exp2_nonpositive(top - new_top, degree);
            total *= correction;
            for (int64_t d = 0; d < dim; d++) ot[d] *= correction;
            top = new_top;
        }
        for (int j = 0; j < LANES; j++) {
            vec prob = exp2_nonpositive(s[j] - top, degree);
            if (masked) {
                veci visible = position >= (int32_t)(key0 + j);
                prob = (vec)((veci)prob & visible);
            }
            s[j] = prob;
            total += prob;
        }
#if defined(__AVX512BF16__)
        if (p->pair_values)
            values_bf16(p, s, v_group, ot);
        else
#endif
            if (p->kind == 0)
                values_fma(p, s, v_group, ot, 0);
            else
                values_fma(p, s, v_group, ot, 1);
    }
    const vec inverse = 1.0f / total;
#if defined(__AVX512F__)
    /* O = (O^T / total)^T a 16 x 16 block at a time; bf16 rounded to nearest even, as below. */
    for (int64_t d0 = 0; d0 < dim; d0 += LANES) {
        __m512 block[LANES];
        for (int i = 0; i < LANES; i++) block[i] = (__m512)(ot[d0 + i] * inverse);
        transpose16(block);
        for (int r = 0; r < rows; r++) {
            char *row = p->out + (size_t)(t0 + r) * p->out_stride * element + (size_t)(head * dim + d0) * element;
            if (p->kind == 0) {
                _mm512_storeu_ps(row, block[r]);
            } else {
                const __m512i bits = _mm512_castps_si512(block[r]);
                const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
                const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
                _mm256_storeu_si256((__m256i *)row, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
            }
        }
    }
#else
    for (int r = 0; r < rows; r++) {
        char *row = p->out + (size_t)(t0 + r) * p->out_stride * element + (size_t)head * dim * element;
        for (int64_t d = 0; d < dim; d++) {
            const float value = ot[d][r] * inverse[r];
            if (p->kind == 0) {
                ((float *)row)[d] = value;
            } else { /* round to nearest even bf16 */
                union { float f; uint32_t u; } bits = {.f = value};
                bits.u += 0x7FFFu + ((bits.u >> 16) & 1u);
                ((uint16_t *)row)[d] = (uint16_t)(bits.u >> 16);
            }
        }
    }
#endif
}

/* The gathered keys' and values' buffers, `bytes` each (64-byte aligned): 0, or -1 with
 * neither allocated. */
static int context_buffers(size_t bytes, char **keys, char **values) {
    *keys = aligned_alloc(64, (bytes + 63) / 64 * 64);
    *values = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (*keys != NULL && *values != NULL) return 0;
    free(*keys);
    free(*values);
    return -1;
}

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAS_AMX 1
#include "prefill_attention_amx.h"
#else
#define HAS_AMX 0
#endif

/* Whether a bf16 cache's products run on AMX tiles here (head sizes a multiple of 32). */
int tandem_prefill_uses_amx(void) {
#if HAS_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

/* Defined below; the spans' entry calls it a chunk at a time where the tiles do not run. */
int tandem_prefill_attention(const void *q, const void *kv_cache, const int64_t *block_ids, void *out,
                             int64_t q_len, int64_t context_len, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, int64_t block_size, int64_t num_blocks, int64_t q_stride,
                             int64_t out_stride, int kind, float scale, int num_threads);

/*
 * Every prefill chunk of a step, one call: span i's queries are the q_len = span_len[i] rows
 * from row span_start[i] of q (and of out), attending to the first span_context[i] tokens of
 * the sequence whose blocks are block_tables + i * table_stride. On the tiles, the spans share
 * one parallel region for their gathers and one for their tiles
 * (amx_prefill_attention_spans); elsewhere, each span is tandem_prefill_attention's call.
 * Returns as that does, at the first span that fails.
 */
int tandem_prefill_attention_spans(const void *q, const void *kv_cache, const int64_t *block_tables,
                                   int64_t table_stride, const int64_t *span_start, const int64_t *span_len,
                                   const int64_t *span_context, int64_t spans, void *out, int64_t num_heads,
                                   int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks,
                                   int64_t q_stride, int64_t out_stride, int kind, float scale, int num_threads) {
    if (head_dim % LANES != 0 || head_dim > MAX_DIM) return -2;
    const size_t element = kind == 0 ? 4 : 2;
#if HAS_AMX
    if (kind == 1 && head_dim % 32 == 0 && amx_permitted()) {
        AmxSpan *each = malloc(sizeof(AmxSpan) * (size_t)(spans > 0 ? spans : 1));
        if (each == NULL) return -1;
        for (int64_t i = 0; i < spans; i++)
            each[i] = (AmxSpan){(const char *)q + (size_t)span_start[i] * q_stride * element,
                                (char *)out + (size_t)span_start[i] * out_stride * element,
                                block_tables + i * table_stride, span_len[i], span_context[i]};
        const int status = amx_prefill_attention_spans(each, spans, kv_cache, num_heads, num_kv_heads, head_dim,
                                                       block_size, num_blocks, q_stride, out_stride, scale,
                                                       num_threads);
        free(each);
        return status;
    }
#endif
    for (int64_t i = 0; i < spans; i++) {
        const int status = tandem_prefill_attention(
            (const char *)q + (size_t)span_start[i] * q_stride * element, kv_cache, block_tables + i * table_stride,
            (char *)out + (size_t)span_start[i] * out_stride * element, span_len[i], span_context[i], num_heads,
            num_kv_heads, head_dim, block_size, num_blocks, q_stride, out_stride, kind, scale, num_threads);
        if (status != 0) return status;
    }
    return 0;
}

/* 2^x of the softmax's exponential at `degree` (3, 5 or 7) for n values x <= 0 (n a multiple of
 * 16): what the tests check the polynomials' accuracy on, since a wrong coefficient that scales
 * every probability alike cancels in the normalisation and hides from the attention's tests. */
void tandem_exp2_probe(const float *x, float *out, int64_t n, int degree) {
    for (int64_t i = 0; i + LANES <= n; i += LANES) {
        vec v, r;
        memcpy(&v, x + i, sizeof v);
        r = degree == 3 ? exp2_nonpositive(v, 3) : degree == 5 ? exp2_nonpositive(v, 5) : exp2_nonpositive(v, 7);
        memcpy(out + i, &r, sizeof r);
    }
}

/* Whether this build uses vdpbf16ps for a bf16 cache (1) or widens to fp32 (0). */
int tandem_prefill_uses_bf16_dot(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/*
 * q [q_len, num_heads, head_dim] (token stride q_stride elements) attends to the first
 * context_len tokens of the sequence whose blocks are block_ids; its last q_len tokens are the
 * chunk's own, already written to the cache. kind: 0 fp32 (q, cache, out), 1 bf16.
 * Returns 0; -1 when a scratch allocation failed; -2 when head_dim is not a multiple of 16 or
 * above 256.
 */
int tandem_prefill_attention(const void *q, const void *kv_cache, const int64_t *block_ids, void *out,
                             int64_t q_len, int64_t context_len, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, int64_t block_size, int64_t num_blocks, int64_t q_stride,
                             int64_t out_stride, int kind, float scale, int num_threads) {
    if (head_dim % LANES != 0 || head_dim > MAX_DIM) return -2;
#if HAS_AMX
    if (kind == 1 && head_dim % 32 == 0 && amx_permitted())
        return amx_prefill_attention(q, kv_cache, block_ids, out, q_len, context_len, num_heads, num_kv_heads,
                                     head_dim, block_size, num_blocks, q_stride, out_stride, scale, num_threads);
#endif
#if defined(__AVX512F__)
    if (!(kind == 1 && tandem_prefill_uses_bf16_dot())) /* fp32 products: the GEMM-shaped tiles */
        return prefill_attention_rows(q, kv_cache, block_ids, out, q_len, context_len, num_heads, num_kv_heads,
                                      head_dim, block_size, num_blocks, q_stride, out_stride, kind, scale,
                                      num_threads);
#endif
    const size_t element = kind == 0 ? 4 : 2;
    const int64_t padded = (context_len + LANES - 1) / LANES * LANES;
    const size_t head_bytes = (size_t)padded * head_dim * element;
    char *keys, *values;
    if (context_buffers(head_bytes * num_kv_heads, &keys, &values) != 0) return -1;
    Problem problem = {
        .q = q, .out = out, .keys = keys, .values = values, .q_len = q_len,
        .cached = context_len - q_len, .padded = padded, .num_heads = num_heads,
        .group = num_heads / num_kv_heads, .dim = head_dim, .q_stride = q_stride,
        .out_stride = out_stride, .kind = kind, .pair_values = kind == 1 && tandem_prefill_uses_bf16_dot(),
        .log2_scale = scale * 1.4426950408889634f,
    };
    const size_t plane = (size_t)num_kv_heads * num_blocks * block_size * head_dim * element;
    const size_t cache_head = (size_t)num_blocks * block_size * head_dim * element;
#pragma omp parallel for schedule(static, 1) num_threads(num_threads)
    for (int64_t h = 0; h < num_kv_heads; h++)
        gather_head((const char *)kv_cache + h * cache_head, (const char *)kv_cache + plane + h * cache_head,
                    block_ids, context_len, padded, head_dim, block_size, element, problem.pair_values,
                    keys + h * head_bytes, values + h * head_bytes);
    const int64_t tiles = (q_len + LANES - 1) / LANES;
    /* The last tiles see the longest context: hand them out first. */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < tiles * num_heads; item++) {
        const int64_t tile = tiles - 1 - item / num_heads, head = item % num_heads;
        const int64_t t0 = tile * LANES;
        attend_tile(&problem, head, t0, q_len - t0 < LANES ? q_len - t0 : LANES);
    }
    free(keys);
    free(values);
    return 0;
}
