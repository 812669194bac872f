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

/* x [rows, cols] -> q [rows, cols] int8 and scales [rows]: q = round(x / scale), scale =
 * max |x| / 127 (at least 1e-12), after each row's `outliers` (<= MAX_OUTLIERS) largest
 * magnitudes went to outlier_index / outlier_value [rows, outliers]. */
void tandem_quantize_rows(const void *x, int kind, int64_t rows, int64_t cols, int64_t stride, int8_t *q,
                          float *scales, int64_t outliers, int32_t *outlier_index, float *outlier_value,
                          int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t m = 0; m < rows; m++) {
        float row[cols];
        load_row(x, kind, m, cols, stride, row);
        if (outliers > 0) take_outliers(row, cols, outliers, outlier_index + m * outliers, outlier_value + m * outliers);
        float top = 0.0f;
        for (int64_t k = 0; k < cols; k++) top = fabsf(row[k]) > top ? fabsf(row[k]) : top;
        const float scale = (top > 1e-12f ? top : 1e-12f) / 127.0f, inverse = 1.0f / scale;
        int8_t *target = q + m * cols;
#pragma omp simd
        for (int64_t k = 0; k < cols; k++) target[k] = (int8_t)(int32_t)nearbyintf(row[k] * inverse);
        scales[m] = scale;
    }
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

/* out [rows, cols] = (products * row_scales[m] + sum_j value[m, j] * weight_t[index[m, j], n])
 * * col_scales[n] (+ bias[n]) (+ residual[m, n]); weight_t is the int8 matrix transposed,
 * [in, cols], read only where outliers > 0. bias and residual are in the output's kind, or
 * NULL. */
void tandem_dequantize(const int32_t *products, int64_t rows, int64_t cols, const float *row_scales,
                       const float *col_scales, int64_t outliers, const int32_t *outlier_index,
                       const float *outlier_value, const int8_t *weight_t, const void *bias, const void *residual,
                       void *out, int kind, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t m = 0; m < rows; m++) {
        float row[cols];
        const int32_t *source = products + m * cols;
        const float row_scale = row_scales[m];
        for (int64_t n = 0; n < cols; n++) row[n] = (float)source[n] * row_scale;
        add_outlier_columns(row, cols, outliers, outlier_index + m * outliers, outlier_value + m * outliers, weight_t);
        for (int64_t n = 0; n < cols; n++) row[n] *= col_scales[n];
        if (bias != NULL)
            for (int64_t n = 0; n < cols; n++) row[n] += read_value(bias, kind, n);
        if (residual != NULL)
            for (int64_t n = 0; n < cols; n++) row[n] += read_value(residual, kind, m * cols + n);
        store_row(out, kind, m, cols, row);
    }
}
