/*
 * The dequantize step of an 8-bit GEMM's int32 products (tandem/layers/int8.py), 16 output
 * columns at a time, shared by the separate pass (int8_rows.c `tandem_dequantize`) and the
 * packed int8 GEMM's epilogue (int8_gemm.c `tandem_int8_gemm_dequantize`). One definition, so
 * the two compute the same bits: p * row scale, + the row's outliers times their int8 weight
 * columns, * the column scales, + bias, + residual, stored in the output's kind (0 fp32, 1
 * bf16 rounded to nearest even).
 */
#ifndef TANDEM_INT8_DEQUANTIZE_H
#define TANDEM_INT8_DEQUANTIZE_H
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <stdint.h>

#include "avx512_math.h"

/* The lanes of a 16-wide chunk that lie inside a row with `remaining` values left. */
static inline __mmask16 tail_mask(int64_t remaining) {
    return remaining >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << remaining) - 1u);
}

/* 16 values of x from `offset` as fp32 (masked lanes 0). */
static inline __m512 load16(const void *x, int kind, int64_t offset, __mmask16 mask) {
    if (kind == 0) return _mm512_maskz_loadu_ps(mask, (const float *)x + offset);
    const __m256i half = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)x + offset);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

/* 16 fp32 values stored in the output's kind, bf16 rounded to nearest even. */
static inline void store16(void *out, int kind, int64_t offset, __m512 v, __mmask16 mask) {
    if (kind == 0) {
        _mm512_mask_storeu_ps((float *)out + offset, mask, v);
        return;
    }
    const __m512i bits = _mm512_srli_epi32(bf16_rounded_bits(v), 16);
    _mm256_mask_storeu_epi16((uint16_t *)out + offset, mask, _mm512_cvtepi32_epi16(bits));
}

/* What turns products into the output: the rows' scales and outliers ([rows, outliers] index
 * into weight_t's rows, and their values), the matrix's column scales and transposed int8
 * weight [in, cols], bias [cols] and residual [rows, cols] in the output's kind or NULL, out
 * [rows, cols]. `gated`: the columns are a gated MLP's gate then up halves (cols / 2 each),
 * and out is silu(gate) * up [rows, cols / 2] in fp32 holding `kind`'s roundings (the
 * separate passes' `gate_up` row, then gated_chunk), no bias or residual. */
typedef struct {
    const float *row_scales, *col_scales;
    int64_t outliers;
    const int32_t *outlier_index;
    const float *outlier_value;
    const int8_t *weight_t;
    const void *bias, *residual;
    void *out;
    int kind;
    int64_t cols;
    int gated;
} Int8Dequantize;

/* Row m's products at columns n .. n + 15 (lanes past `mask` 0) scaled, their outliers
 * added, scaled by the columns' scales: fp32, before bias, residual and rounding. */
static inline __m512 dequantize_value(const Int8Dequantize *d, __m512i products, int64_t m, int64_t n,
                                      __mmask16 mask) {
    __m512 p = _mm512_mul_ps(_mm512_cvtepi32_ps(products), _mm512_set1_ps(d->row_scales[m]));
    if (d->outliers > 0) {
        const int32_t *index = d->outlier_index + m * d->outliers;
        const float *value = d->outlier_value + m * d->outliers;
        __m512 extra = _mm512_setzero_ps();
        for (int64_t j = 0; j < d->outliers; j++) {
            const __m128i column = _mm_maskz_loadu_epi8(mask, d->weight_t + (int64_t)index[j] * d->cols + n);
            extra = _mm512_fmadd_ps(_mm512_set1_ps(value[j]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(column)), extra);
        }
        p = _mm512_add_ps(p, extra);
    }
    return _mm512_mul_ps(p, _mm512_maskz_loadu_ps(mask, d->col_scales + n));
}

/* Row m's products at columns n .. n + 15 (lanes past `mask` unused) into the output. */
static inline void dequantize_chunk(const Int8Dequantize *d, __m512i products, int64_t m, int64_t n,
                                    __mmask16 mask) {
    __m512 p = dequantize_value(d, products, m, n, mask);
    if (d->bias != NULL) p = _mm512_add_ps(p, load16(d->bias, d->kind, n, mask));
    if (d->residual != NULL) p = _mm512_add_ps(p, load16(d->residual, d->kind, m * d->cols + n, mask));
    store16(d->out, d->kind, m * d->cols + n, p, mask);
}

/* A row's part of the dequantize step, looked up once for all the chunks a GEMM tile holds in
 * that row: its scale and its outliers' values as vectors, and their weight rows. Per chunk,
 * dequantize_value reloaded these and walked the outliers in a loop of the call's count; in
 * the VNNI GEMM's 6 x 4 tile (int8_gemm.c) the epilogue was a fifth of the tile's time at K
 * = 576 on the 2-core Zen 4 EPYC. The arithmetic is dequantize_value's, in its order. */
#define ROW_TERMS_OUTLIERS 8 /* more a row: dequantize_value */
typedef struct {
    __m512 scale;
    int64_t outliers;
    __m512 value[ROW_TERMS_OUTLIERS];
    const int8_t *column[ROW_TERMS_OUTLIERS]; /* each outlier's weight row in weight_t */
} Int8RowTerms;

/* Row m's terms; 0 where it has more outliers than they hold. */
static inline int row_terms(const Int8Dequantize *d, int64_t m, Int8RowTerms *t) {
    if (d->outliers > ROW_TERMS_OUTLIERS) return 0;
    t->scale = _mm512_set1_ps(d->row_scales[m]);
    t->outliers = d->outliers;
    for (int64_t j = 0; j < d->outliers; j++) {
        t->value[j] = _mm512_set1_ps(d->outlier_value[m * d->outliers + j]);
        t->column[j] = d->weight_t + (int64_t)d->outlier_index[m * d->outliers + j] * d->cols;
    }
    return 1;
}

/* dequantize_value for 16 whole columns from n of the row `t` holds, its outlier count
 * `outliers` (t->outliers) a literal where the caller can make it one. */
static inline __attribute__((always_inline)) __m512 dequantize_row_value(const Int8Dequantize *d,
                                                                         const Int8RowTerms *t, __m512i products,
                                                                         int64_t n, int64_t outliers) {
    /* the empty asm statements keep -ffast-math from regrouping the products across the
     * row's chunks (the scale is the same for all of them): dequantize_value's bits */
    __m512 p = _mm512_mul_ps(_mm512_cvtepi32_ps(products), t->scale);
    __asm__("" : "+v"(p));
    if (outliers > 0) {
        __m512 extra = _mm512_setzero_ps();
        for (int64_t j = 0; j < outliers; j++) {
            const __m128i column = _mm_loadu_si128((const __m128i *)(t->column[j] + n));
            extra = _mm512_fmadd_ps(t->value[j], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(column)), extra);
        }
        p = _mm512_add_ps(p, extra);
        __asm__("" : "+v"(p));
    }
    return _mm512_mul_ps(p, _mm512_loadu_ps(d->col_scales + n));
}

/* dequantize_chunk for 16 whole columns from n of row m, whose terms `t` holds. */
static inline __attribute__((always_inline)) void dequantize_row_chunk(const Int8Dequantize *d,
                                                                       const Int8RowTerms *t, __m512i products,
                                                                       int64_t m, int64_t n, int64_t outliers) {
    __m512 p = dequantize_row_value(d, t, products, n, outliers);
    if (d->bias != NULL) p = _mm512_add_ps(p, load16(d->bias, d->kind, n, (__mmask16)0xFFFF));
    if (d->residual != NULL) p = _mm512_add_ps(p, load16(d->residual, d->kind, m * d->cols + n, (__mmask16)0xFFFF));
    store16(d->out, d->kind, m * d->cols + n, p, (__mmask16)0xFFFF);
}

/* A value rounded to bf16 and widened back, 16 lanes. */
static inline __m512 round_bf16x16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_and_si512(bf16_rounded_bits(v), _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* silu(g) * u for 16 dequantized gate and up values, with the roundings the separate passes
 * make in `kind` (bf16: gate and up as the dequantize pass stores them, silu's result as
 * torch's bf16 silu, and the product; fp32: none), as fp32. */
static inline __m512 gated_chunk(__m512 g, __m512 u, int kind) {
    if (kind == 1) {
        g = round_bf16x16(g);
        u = round_bf16x16(u);
    }
    __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    if (kind == 1) s = round_bf16x16(s);
    const __m512 product = _mm512_mul_ps(s, u);
    return kind == 1 ? round_bf16x16(product) : product;
}

#endif
#endif
