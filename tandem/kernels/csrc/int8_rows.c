/*
 * The two passes around an 8-bit GEMM (W8A8, tandem/layers/int8.py): quantize each input row
 * with a scale of its own, and turn the int32 products back into the run dtype with the row's
 * and the output column's scales, adding a bias and a residual on the way.
 *
 * Why in C: the same passes as torch ops (abs, amax, div, round, cast; cast, two broadcast
 * multiplies, cast) took longer than the GEMM they wrap, and threw away VNNI's 2x over bf16
 * (measured on the 2-core AVX-512 EPYC: 2,048 x 576 x 1,536, int8 GEMM 4.1 ms, torch's
 * dequantize 1.3-9 ms, against 8.4 ms for oneDNN's bf16 GEMM). Here each is one pass over
 * memory, rows spread over the OpenMP threads; the loops are plain C that -O3 -march=native
 * vectorizes.
 *
 * Outliers: each row's `outliers` largest magnitudes are taken out before its scale is set
 * (their int8 values are 0) and handed back as (column, value) pairs; the dequantize pass adds
 * them exactly, times the matrix's transposed int8 columns. A per-token scale is otherwise set
 * by a few channels far above the rest (SmolLM2's down projection input reaches 100x its
 * median), which costs every other channel its resolution: on the default model four per row
 * take W8A8 from +2.5% perplexity to within 0.6% of fp32.
 *
 * kind: 0 fp32, 1 bf16 (stored as uint16_t, rounded to nearest even on the way out).
 *
 * Where the CPU has AVX-512 (F, BW, VL) both passes are written with its intrinsics, 16
 * values a vector, masked at a row's tail; elsewhere as plain loops. The plain loops ran at
 * ~2 cycles a value: on the 2-core AVX-512 EPYC, 64 bf16 rows of 576 took 22 us to quantize
 * with their outliers on two threads, more than a third of the int8 GEMM they feed.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

static inline float widen(uint16_t x) {
    union { uint32_t u; float f; } bits = {.u = (uint32_t)x << 16};
    return bits.f;
}

static inline uint16_t narrow(float x) {
    union { float f; uint32_t u; } bits = {.f = x};
    bits.u += 0x7FFFu + ((bits.u >> 16) & 1u);
    return (uint16_t)(bits.u >> 16);
}

/* Row m of x (cols values, row stride `stride` elements) as floats into `row`. */
static inline void load_row(const void *x, int kind, int64_t m, int64_t cols, int64_t stride, float *row) {
    if (kind == 0) {
        const float *source = (const float *)x + m * stride;
        for (int64_t k = 0; k < cols; k++) row[k] = source[k];
    } else {
        const uint16_t *source = (const uint16_t *)x + m * stride;
        for (int64_t k = 0; k < cols; k++) row[k] = widen(source[k]);
    }
}

static inline float read_value(const void *x, int kind, int64_t index) {
    return kind == 0 ? ((const float *)x)[index] : widen(((const uint16_t *)x)[index]);
}

static inline void store_row(void *out, int kind, int64_t m, int64_t cols, const float *row) {
    if (kind == 0) {
        float *target = (float *)out + m * cols;
        for (int64_t n = 0; n < cols; n++) target[n] = row[n];
    } else {
        uint16_t *target = (uint16_t *)out + m * cols;
        for (int64_t n = 0; n < cols; n++) target[n] = narrow(row[n]);
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "int8_dequantize.h" /* tail_mask, load16, store16 and the dequantize step */
#define VECTOR_ROWS 1
#else
#define VECTOR_ROWS 0
#endif

/* Rows are staged in a stack buffer of this many floats at most (256 KiB). */
#define MAX_COLS 65536

#define MAX_OUTLIERS 64

/* Insert magnitude `a` at column k into the descending top list (held <= count entries). */
static inline void offer(float *top, int32_t *where, int64_t *held, int64_t count, float a, int64_t k) {
    if (*held == count && !(a > top[*held - 1])) return;
    int64_t slot = *held < count ? (*held)++ : count - 1;
    while (slot > 0 && a > top[slot - 1]) {
        top[slot] = top[slot - 1];
        where[slot] = where[slot - 1];
        slot--;
    }
    top[slot] = a;
    where[slot] = (int32_t)k;
}

#define CHUNK 16

/* The row's `count` largest magnitudes, largest first (ties: the lower column), moved into
 * index/value and zeroed in the row. The `count` largest lie in the `count` chunks of 16 with
 * the largest maxima (any other chunk's maximum is beaten by `count` elements), so one
 * vectorized pass takes each chunk's maximum and only those chunks are searched. */
static void take_outliers(float *row, int64_t cols, int64_t count, int32_t *index, float *value) {
    float top[MAX_OUTLIERS], chunk_top[MAX_OUTLIERS];
    int32_t where[MAX_OUTLIERS], chunk_where[MAX_OUTLIERS];
    int64_t held = 0, chunks_held = 0;
    const int64_t whole = cols / CHUNK;
    for (int64_t c = 0; c <= whole; c++) {
        float high = 0.0f;
        if (c < whole) { /* a whole chunk: a fixed trip count the compiler vectorizes */
            const float *chunk = row + c * CHUNK;
            for (int k = 0; k < CHUNK; k++) high = fabsf(chunk[k]) > high ? fabsf(chunk[k]) : high;
        } else if (whole * CHUNK < cols) {
            for (int64_t k = whole * CHUNK; k < cols; k++) high = fabsf(row[k]) > high ? fabsf(row[k]) : high;
        } else {
            break;
        }
        offer(chunk_top, chunk_where, &chunks_held, count, high, c);
    }
    /* chunks in column order, so ties among elements go to the lower column */
    for (int64_t a = 1; a < chunks_held; a++)
        for (int64_t b = a; b > 0 && chunk_where[b] < chunk_where[b - 1]; b--) {
            const int32_t swap = chunk_where[b];
            chunk_where[b] = chunk_where[b - 1];
            chunk_where[b - 1] = swap;
        }
    /* the smallest of those maxima bounds the count-th largest magnitude from below: only
     * elements reaching it are offered, a handful a row */
    const float floor = chunks_held == count ? chunk_top[count - 1] : 0.0f;
    for (int64_t c = 0; c < chunks_held; c++) {
        const int64_t start = (int64_t)chunk_where[c] * CHUNK, end = start + CHUNK < cols ? start + CHUNK : cols;
        for (int64_t k = start; k < end; k++)
            if (fabsf(row[k]) >= floor) offer(top, where, &held, count, fabsf(row[k]), k);
    }
    for (int64_t j = 0; j < held; j++) {
        index[j] = where[j];
        value[j] = row[where[j]];
        row[where[j]] = 0.0f;
    }
    for (int64_t j = held; j < count; j++) { /* fewer columns than outliers: no-op pairs */
        index[j] = 0;
        value[j] = 0.0f;
    }
}

/* One row, plain C: x row m -> target (int8) and its scale, outliers first. */
static void quantize_row_plain(const void *x, int kind, int64_t m, int64_t cols, int64_t stride, int8_t *target,
                               float *scale_out, int64_t outliers, int32_t *outlier_index, float *outlier_value) {
    float row[cols];
    load_row(x, kind, m, cols, stride, row);
    if (outliers > 0) take_outliers(row, cols, outliers, outlier_index, outlier_value);
    float top = 0.0f;
    for (int64_t k = 0; k < cols; k++) top = fabsf(row[k]) > top ? fabsf(row[k]) : top;
    const float scale = (top > 1e-12f ? top : 1e-12f) / 127.0f, inverse = 1.0f / scale;
#pragma omp simd
    for (int64_t k = 0; k < cols; k++) target[k] = (int8_t)(int32_t)nearbyintf(row[k] * inverse);
    *scale_out = scale;
}

#if VECTOR_ROWS
/* Each lane's rank among v's 16 lanes: how many lanes hold more, or as much at a lower lane
 * (so the ranks are 0..15, each once, ties to the lower lane). 16 compares, all independent:
 * no reduction chain. */
static inline __m512i lane_ranks(__m512 v) {
    __m512i rank = _mm512_setzero_si512();
    const __m512i one = _mm512_set1_epi32(1);
    for (int j = 0; j < 16; j++) {
        const __m512 other = _mm512_permutexvar_ps(_mm512_set1_epi32(j), v);
        const __mmask16 after = (__mmask16)(0xFFFFu << (j + 1)); /* lanes above j lose ties to it */
        const __mmask16 ahead = _mm512_cmp_ps_mask(other, v, _CMP_GT_OQ)
                                | (_mm512_cmp_ps_mask(other, v, _CMP_EQ_OQ) & after);
        rank = _mm512_mask_add_epi32(rank, ahead, rank, one);
    }
    return rank;
}

/* The lane of v whose rank (lane_ranks) is `n`, as a one-lane mask. */
static inline __mmask16 ranked(__m512i ranks, int64_t n) {
    return _mm512_cmpeq_epi32_mask(ranks, _mm512_set1_epi32((int)n));
}

/* One row, AVX-512: the same result as quantize_row_plain. The first pass stages the row and
 * keeps each lane's largest magnitude. The (outliers + 1)-th largest of those 16 lane maxima
 * bounds the row's (outliers + 1)-th largest magnitude from below (that many lanes each hold
 * an element reaching it), so a second pass of one compare a chunk collects every element
 * that can be an outlier or the largest one left, a handful a row; they are ranked in one
 * vector (ties to the lower column, as they were collected in column order). Rows where more
 * than 16 reach the bound (a zero row, wide ties) or more than 15 outliers are asked for take
 * the plain selection over the staged row. Before, each chunk's maximum was reduced and each
 * outlier found by a scan of those maxima, a serial chain ~4x the row's own passes. On the
 * 2-core AVX-512 EPYC (Zen 5), 4 outliers a row, two threads: 2,048 rows of 576 bf16 228 ->
 * 162 us (54 us with none), of 1,536 fp32 342 -> 263 us. Taking each candidate by a scalar
 * insertion instead of the vector ranks was slower (198 and 428 us: its branches miss), and
 * so was compressing every chunk without a branch (208 and 472 us). */
static void quantize_row_vector(const void *x, int kind, int64_t m, int64_t cols, int64_t stride, int8_t *target,
                                float *scale_out, int64_t outliers, int32_t *outlier_index, float *outlier_value) {
    const int64_t chunks = (cols + 15) / 16;
    float row[chunks * 16];
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    __m512 high = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; c++) {
        const __m512 v = load16(x, kind, m * stride + 16 * c, tail_mask(cols - 16 * c));
        _mm512_storeu_ps(row + 16 * c, v);
        high = _mm512_max_ps(high, _mm512_and_ps(v, sign));
    }
    float top = _mm512_reduce_max_ps(high);
    int64_t taken = 0; /* outliers the fast selection left in `row`, set to 0 in `target` */
    if (outliers > 0) {
        float found[32]; /* candidates' magnitudes and columns, in column order */
        int32_t column[32];
        int64_t held = 0;
        if (outliers < 16) {
            const __mmask16 bound_lane = ranked(lane_ranks(high), outliers);
            const __m512 bound = _mm512_set1_ps(_mm512_cvtss_f32(_mm512_maskz_compress_ps(bound_lane, high)));
            const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
            for (int64_t c = 0; c < chunks && held <= 16; c++) {
                const __m512 a = _mm512_and_ps(_mm512_loadu_ps(row + 16 * c), sign);
                const __mmask16 hit = _mm512_mask_cmp_ps_mask(tail_mask(cols - 16 * c), a, bound, _CMP_GE_OQ);
                if (hit) {
                    _mm512_storeu_ps(found + held, _mm512_maskz_compress_ps(hit, a));
                    _mm512_storeu_si512(column + held, _mm512_maskz_compress_epi32(
                        hit, _mm512_add_epi32(lanes, _mm512_set1_epi32((int)(16 * c)))));
                    held += __builtin_popcount((unsigned)hit);
                }
            }
        }
        if (outliers < 16 && held <= 16) {
            const __m512 magnitudes = _mm512_mask_loadu_ps(_mm512_set1_ps(-1.0f), tail_mask(held), found);
            const __m512i ranks = lane_ranks(magnitudes), columns = _mm512_maskz_loadu_epi32(tail_mask(held), column);
            for (int64_t j = 0; j < outliers; j++) {
                if (j >= held) { /* fewer columns than outliers: no-op pairs */
                    outlier_index[j] = 0;
                    outlier_value[j] = 0.0f;
                    continue;
                }
                const int32_t k = _mm_cvtsi128_si32(_mm512_castsi512_si128(
                    _mm512_maskz_compress_epi32(ranked(ranks, j), columns)));
                outlier_index[j] = k;
                outlier_value[j] = row[k];
            }
            /* the largest magnitude left: the next-ranked candidate, 0 where every one was taken */
            top = held > outliers ? _mm512_cvtss_f32(_mm512_maskz_compress_ps(ranked(ranks, outliers), magnitudes))
                                  : 0.0f;
            taken = outliers < held ? outliers : held; /* zeroed in the int8 row below */
        } else {
            take_outliers(row, cols, outliers, outlier_index, outlier_value);
            __m512 most = _mm512_setzero_ps();
            for (int64_t c = 0; c < chunks; c++)
                most = _mm512_max_ps(most, _mm512_and_ps(_mm512_loadu_ps(row + 16 * c), sign));
            top = _mm512_reduce_max_ps(most);
        }
    }
    const float scale = (top > 1e-12f ? top : 1e-12f) / 127.0f, inverse = 1.0f / scale;
    const __m512 times = _mm512_set1_ps(inverse);
    for (int64_t c = 0; c < chunks; c++) {
        /* cvtps rounds to nearest even, as nearbyintf does in the default rounding mode */
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + 16 * c), times));
        _mm_mask_storeu_epi8(target + 16 * c, tail_mask(cols - 16 * c), _mm512_cvtsepi32_epi8(q));
    }
    /* zeroed here, not in the staged row: a 4-byte store there stalls the vector load of its
     * chunk behind it */
    for (int64_t j = 0; j < taken; j++) target[outlier_index[j]] = 0;
    *scale_out = scale;
}
#define QUANTIZE_ROW quantize_row_vector
#else
#define QUANTIZE_ROW quantize_row_plain
#endif

/* x [rows, cols] -> q [rows, cols] int8 and scales [rows]: q = round(x / scale), scale =
 * max |x| / 127 (at least 1e-12), after each row's `outliers` (<= MAX_OUTLIERS) largest
 * magnitudes went to outlier_index / outlier_value [rows, outliers]. */
void tandem_quantize_rows(const void *x, int kind, int64_t rows, int64_t cols, int64_t stride, int8_t *q,
                          float *scales, int64_t outliers, int32_t *outlier_index, float *outlier_value,
                          int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t m = 0; m < rows; m++)
        QUANTIZE_ROW(x, kind, m, cols, stride, q + m * cols, scales + m, outliers, outlier_index + m * outliers,
                     outlier_value + m * outliers);
}

/* Every entry point takes rows of at most MAX_COLS values (the caller checks). */
int tandem_int8_max_cols(void) { return MAX_COLS; }

int tandem_int8_max_outliers(void) { return MAX_OUTLIERS; }

/* row[n] += sum_j value[j] * weight_t[index[j], n], four columns a pass over the row (int8
 * pointers may alias anything, so `restrict` is what lets the loop vectorize). */
static void add_outlier_columns(float *restrict row, int64_t cols, int64_t outliers, const int32_t *index,
                                const float *value, const int8_t *weight_t) {
    int64_t j = 0;
    for (; j + 4 <= outliers; j += 4) {
        const int8_t *restrict c0 = weight_t + (int64_t)index[j] * cols, *restrict c1 = weight_t + (int64_t)index[j + 1] * cols;
        const int8_t *restrict c2 = weight_t + (int64_t)index[j + 2] * cols, *restrict c3 = weight_t + (int64_t)index[j + 3] * cols;
        const float v0 = value[j], v1 = value[j + 1], v2 = value[j + 2], v3 = value[j + 3];
#pragma omp simd
        for (int64_t n = 0; n < cols; n++)
            row[n] += v0 * (float)c0[n] + v1 * (float)c1[n] + v2 * (float)c2[n] + v3 * (float)c3[n];
    }
    for (; j < outliers; j++) {
        const int8_t *restrict column = weight_t + (int64_t)index[j] * cols;
        const float v = value[j];
#pragma omp simd
        for (int64_t n = 0; n < cols; n++) row[n] += v * (float)column[n];
    }
}

/* One output row, plain C. */
static void dequantize_row_plain(const int32_t *source, int64_t cols, float row_scale, const float *col_scales,
                                 int64_t outliers, const int32_t *index, const float *value, const int8_t *weight_t,
                                 const void *bias, const void *residual, void *out, int kind, int64_t m) {
    float row[cols];
    for (int64_t n = 0; n < cols; n++) row[n] = (float)source[n] * row_scale;
    add_outlier_columns(row, cols, outliers, index, value, weight_t);
    for (int64_t n = 0; n < cols; n++) row[n] *= col_scales[n];
    if (bias != NULL)
        for (int64_t n = 0; n < cols; n++) row[n] += read_value(bias, kind, n);
    if (residual != NULL)
        for (int64_t n = 0; n < cols; n++) row[n] += read_value(residual, kind, m * cols + n);
    store_row(out, kind, m, cols, row);
}

#if VECTOR_ROWS
/* One output row, AVX-512, in one pass: 16 products at a time scaled, their outlier
 * columns added, scaled again, bias and residual added, stored (int8_dequantize.h). */
static void dequantize_row_vector(const int32_t *source, int64_t cols, float row_scale, const float *col_scales,
                                  int64_t outliers, const int32_t *index, const float *value, const int8_t *weight_t,
                                  const void *bias, const void *residual, void *out, int kind, int64_t m) {
    /* the row's own scale and outliers, as row 0 of a one-row view; out and residual at row m */
    const int64_t at = m * cols;
    const Int8Dequantize d = {&row_scale, col_scales, outliers, index, value, weight_t, bias,
                              residual == NULL ? NULL : (const char *)residual + at * (kind == 0 ? 4 : 2),
                              (char *)out + at * (kind == 0 ? 4 : 2), kind, cols, 0};
    for (int64_t n = 0; n < cols; n += 16) {
        const __mmask16 mask = tail_mask(cols - n);
        dequantize_chunk(&d, _mm512_maskz_loadu_epi32(mask, source + n), 0, n, mask);
    }
}
#define DEQUANTIZE_ROW dequantize_row_vector
#else
#define DEQUANTIZE_ROW dequantize_row_plain
#endif

/* out [rows, cols] = (products * row_scales[m] + sum_j value[m, j] * weight_t[index[m, j], n])
 * * col_scales[n] (+ bias[n]) (+ residual[m, n]); weight_t is the int8 matrix transposed,
 * [in, cols], read only where outliers > 0. bias and residual are in the output's kind, or
 * NULL. */
void tandem_dequantize(const int32_t *products, int64_t rows, int64_t cols, const float *row_scales,
                       const float *col_scales, int64_t outliers, const int32_t *outlier_index,
                       const float *outlier_value, const int8_t *weight_t, const void *bias, const void *residual,
                       void *out, int kind, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t m = 0; m < rows; m++)
        DEQUANTIZE_ROW(products + m * cols, cols, row_scales[m], col_scales, outliers, outlier_index + m * outliers,
                       outlier_value + m * outliers, weight_t, bias, residual, out, kind, m);
}

/* Which path this build takes, for logs and tests. */
const char *tandem_int8_rows_isa(void) { return VECTOR_ROWS ? "avx512" : "portable C"; }

/* silu(gate) * up for one row, from the gate/up projection's dequantized fp32 row [2 * inter],
 * with the roundings the separate passes make in `kind` (bf16: gate and up as the dequantize
 * pass stores them, silu's result as torch's bf16 silu, and the product; fp32: none). */
static void gated_row_plain(const float *restrict gate_up, float *restrict h, int64_t inter, int kind) {
    const float *restrict up = gate_up + inter;
    if (kind == 1) {
        for (int64_t n = 0; n < inter; n++) {
            const float g = widen(narrow(gate_up[n])), u = widen(narrow(up[n]));
            const float s = widen(narrow(g / (1.0f + expf(-g))));
            h[n] = widen(narrow(s * u));
        }
    } else {
        for (int64_t n = 0; n < inter; n++) h[n] = gate_up[n] / (1.0f + expf(-gate_up[n])) * up[n];
    }
}

#if VECTOR_ROWS
static void gated_row_vector(const float *restrict gate_up, float *restrict h, int64_t inter, int kind) {
    for (int64_t n = 0; n < inter; n += 16) {
        const __mmask16 mask = tail_mask(inter - n);
        const __m512 g = _mm512_maskz_loadu_ps(mask, gate_up + n), u = _mm512_maskz_loadu_ps(mask, gate_up + inter + n);
        _mm512_mask_storeu_ps(h + n, mask, gated_chunk(g, u, kind)); /* int8_dequantize.h */
    }
}
#define GATED_ROW gated_row_vector
#else
#define GATED_ROW gated_row_plain
#endif

/* The gated MLP's middle in one pass, for steps that run both its projections in 8 bits: the
 * gate/up projection's int32 products [rows, 2 * inter] (row_scales, col_scales, outliers_in
 * and weight_t as tandem_dequantize takes them, no bias) -> silu(gate) * up -> int8 rows for
 * the down projection [rows, inter] with their scales and `outliers` set aside, as
 * tandem_quantize_rows gives them. The same arithmetic as dequantize, silu-and-mul and
 * quantize one after another, without writing the [rows, 2 * inter] and [rows, inter]
 * intermediates or waking the threads three times. */
void tandem_gated_quantize(const int32_t *products, int64_t rows, int64_t inter, const float *row_scales,
                           const float *col_scales, int64_t outliers_in, const int32_t *index_in,
                           const float *value_in, const int8_t *weight_t, int kind, int8_t *q, float *scales,
                           int64_t outliers, int32_t *outlier_index, float *outlier_value, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t m = 0; m < rows; m++) {
        float gate_up[2 * inter], h[inter];
        DEQUANTIZE_ROW(products + m * 2 * inter, 2 * inter, row_scales[m], col_scales, outliers_in,
                       index_in + m * outliers_in, value_in + m * outliers_in, weight_t, NULL, NULL, gate_up, 0, 0);
        GATED_ROW(gate_up, h, inter, kind);
        QUANTIZE_ROW(h, 0, 0, inter, inter, q + m * inter, scales + m, outliers, outlier_index + m * outliers,
                     outlier_value + m * outliers);
    }
}
