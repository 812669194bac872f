/*
 * Decode attention straight from the paged KV cache, for CPUs.
 *
 * One query token per sequence attends to its sequence's cached keys/values, read block by
 * block through the block table: no gathered copy of the context. Where the CPU has AVX-512
 * and the head size is a multiple of 16 (up to 256), one pass over K and V with an online
 * softmax (below, `attend_item_vec`); elsewhere, one pass over K and one over V with an
 * exact softmax (scores kept, then max, exp, sum). fp32 arithmetic throughout; the
 * cache is fp32 or bf16 (`_bf16` entry points: each cached value widened to fp32 as it is
 * read, which is exact), q and out are fp32 either way.
 *
 * An int8 cache (`_i8`, --kv-cache-dtype int8, tandem/kernels/kv_format.py) stores each row
 * as head_dim int8 values and then the row's fp32 scale, head_dim + 4 bytes: a dot product
 * sums q * value in fp32 and multiplies by the key's scale once; a value row is added with
 * its probability times its scale. With AVX-512 it takes the vector path below: each row's
 * 16-value pieces widened from int8 (one instruction each), the key's dot products and the
 * value's weight multiplied by the row's scale. The rows hold Hadamard-rotated keys and values
 * (kv_format.py): each work item rotates its query rows before reading them (q.k = Rq.Rk) and
 * its output rows after (a weighted sum of rotated values), and the int8 writer rotates a row
 * before rounding it, with the butterflies of `rotate_runs`, so nothing runs around the call.
 *
 * A float8 e4m3 cache (`_f8`, --kv-cache-dtype fp8) stores each value in one byte, divided
 * by its layer's power-of-two scale before the write (tandem/layers/attention.py, which folds
 * the scales into the softmax scale and the output, so nothing here knows them): a row is
 * head_dim bytes, widened to fp32 as it is read (exact), and written by tandem_write_kv_f8.
 *
 * Layout (tandem/kernels/base.py): one layer's cache is [2, kv_heads, num_blocks,
 * block_size, head_dim]; q and out are [num_seqs, num_heads, head_dim]; query head h reads
 * kv head h / (num_heads / num_kv_heads). Work items are (sequence, kv head, slice of its
 * query heads), spread over the OpenMP threads of the process (torch's own runtime: the
 * library links libgomp.so.1, which torch has already loaded).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

/* The values an int8 cache rotates together along a row: kv_format.py's rotation_size (64
 * where the head size is a multiple of it, else the whole head where that is a power of two,
 * else none). */
static int64_t int8_rotation(int64_t head_dim) {
    if (head_dim % 64 == 0) return 64;
    return (head_dim & (head_dim - 1)) == 0 ? head_dim : 0;
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* One butterfly stage inside a vector: lanes whose bit `high` is clear take v + partner,
 * the others partner - v (partner: the lane `swapped` brings them). */
static inline __m512 butterfly(__m512 v, __m512 swapped, __mmask16 high) {
    return _mm512_mask_sub_ps(_mm512_add_ps(v, swapped), high, swapped, v);
}

/* The four stages of a 16-point Walsh-Hadamard transform, partners 1, 2, 4 and 8 lanes away. */
static inline __m512 hadamard16(__m512 v) {
    v = butterfly(v, _mm512_permute_ps(v, 0xB1), 0xAAAA);
    v = butterfly(v, _mm512_permute_ps(v, 0x4E), 0xCCCC);
    v = butterfly(v, _mm512_shuffle_f32x4(v, v, 0xB1), 0xF0F0);
    return butterfly(v, _mm512_shuffle_f32x4(v, v, 0x4E), 0xFF00);
}

/* 64 values times the normalized 64-point Hadamard matrix: four vectors of 16, then the two
 * stages between vectors, then 1/8 (exact). */
static inline void hadamard64(float *x) {
    const __m512 r0 = hadamard16(_mm512_loadu_ps(x)), r1 = hadamard16(_mm512_loadu_ps(x + 16));
    const __m512 r2 = hadamard16(_mm512_loadu_ps(x + 32)), r3 = hadamard16(_mm512_loadu_ps(x + 48));
    const __m512 s0 = _mm512_add_ps(r0, r1), s1 = _mm512_sub_ps(r0, r1);
    const __m512 s2 = _mm512_add_ps(r2, r3), s3 = _mm512_sub_ps(r2, r3);
    const __m512 eighth = _mm512_set1_ps(0.125f);
    _mm512_storeu_ps(x, _mm512_mul_ps(_mm512_add_ps(s0, s2), eighth));
    _mm512_storeu_ps(x + 16, _mm512_mul_ps(_mm512_add_ps(s1, s3), eighth));
    _mm512_storeu_ps(x + 32, _mm512_mul_ps(_mm512_sub_ps(s0, s2), eighth));
    _mm512_storeu_ps(x + 48, _mm512_mul_ps(_mm512_sub_ps(s1, s3), eighth));
}
#endif

/* Each run of `size` values (a power of two) of x[n] times the normalized Sylvester-Hadamard
 * matrix, in place: log2(size) stages of butterflies (a, b) -> (a + b, a - b), then
 * 1/sqrt(size). The same rotation as kv_format.py's matmul, summed in another order (so equal
 * to a few units in the last place, not bitwise). */
static void rotate_runs(float *x, int64_t n, int64_t size) {
#if defined(__AVX512F__)
    if (size == 64) {
        for (int64_t start = 0; start < n; start += 64) hadamard64(x + start);
        return;
    }
#endif
    const float norm = 1.0f / sqrtf((float)size);
    for (int64_t start = 0; start < n; start += size) {
        float *run = x + start;
        for (int64_t h = 1; h < size; h *= 2)
            for (int64_t i = 0; i < size; i += 2 * h)
                for (int64_t j = i; j < i + h; j++) {
                    const float a = run[j], b = run[j + h];
                    run[j] = a + b;
                    run[j + h] = a - b;
                }
        for (int64_t i = 0; i < size; i++) run[i] *= norm;
    }
}

/* bf16 is the top half of an fp32: widening is a shift. */
static inline float widen(uint16_t x) {
    union { uint32_t u; float f; } bits = {.u = (uint32_t)x << 16};
    return bits.f;
}

/* float8 e4m3 (fp8): sign, four exponent bits (bias 7), three mantissa bits, no infinities
 * (0x7f and 0xff are NaN; the writer saturates at 448 and never makes one from a number). A
 * normal value is (8 + m) * 2^(e - 10), a subnormal m * 2^-9. */
static inline float fp8_to_float(uint8_t x) {
    const uint32_t exponent = (x >> 3) & 15u, mantissa = x & 7u;
    union { uint32_t u; float f; } bits = {.u = ((uint32_t)(x & 0x80u) << 24) | ((exponent + 120u) << 23) | (mantissa << 20)};
    if (exponent == 0) bits.f = (x & 0x80u ? -1.0f : 1.0f) * (float)mantissa * 0.001953125f;
    else if ((x & 0x7fu) == 0x7fu) bits.u |= 0x7fc00000u; /* NaN */
    return bits.f;
}

static float dot(const float *restrict a, const float *restrict b, int n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

static void axpy(float *restrict y, float alpha, const float *restrict x, int n) {
#pragma omp simd
    for (int i = 0; i < n; i++) y[i] += alpha * x[i];
}

/* An int8 row's scale: the fp32 after its n values (unaligned: memcpy). */
static inline float row_scale(const int8_t *row, int n) {
    float scale;
    memcpy(&scale, row + n, sizeof scale);
    return scale;
}

static float dot_i8(const float *restrict a, const int8_t *restrict b, int n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int i = 0; i < n; i++) acc += a[i] * (float)b[i];
    return acc * row_scale(b, n);
}

static void axpy_i8(float *restrict y, float alpha, const int8_t *restrict x, int n) {
    const float weight = alpha * row_scale(x, n);
#pragma omp simd
    for (int i = 0; i < n; i++) y[i] += weight * (float)x[i];
}

static float dot_bf16(const float *restrict a, const uint16_t *restrict b, int n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int i = 0; i < n; i++) acc += a[i] * widen(b[i]);
    return acc;
}

static void axpy_bf16(float *restrict y, float alpha, const uint16_t *restrict x, int n) {
#pragma omp simd
    for (int i = 0; i < n; i++) y[i] += alpha * widen(x[i]);
}

static float dot_f8(const float *restrict a, const uint8_t *restrict b, int n) {
    float acc = 0.0f;
    for (int i = 0; i < n; i++) acc += a[i] * fp8_to_float(b[i]);
    return acc;
}

static void axpy_f8(float *restrict y, float alpha, const uint8_t *restrict x, int n) {
    for (int i = 0; i < n; i++) y[i] += alpha * fp8_to_float(x[i]);
}

/* Blocks lie anywhere in the pool, and one kv head's block is often a page of its own, where
 * hardware prefetchers stop: ask for the next block while this one is being read. */
static void prefetch_block(const void *block, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)block + i, 0, 1);
}

/* One work item: `heads` query heads (rows of q/out) over one kv head of one sequence.
 * Inlined with head_dim a literal where it is a common size, so the dot products and
 * accumulations unroll into whole vector registers. Written once for each cache element
 * type (KV_T: float, uint16_t holding bf16, or int8_t; DOT and AXPY read that type; a row is
 * head_dim + EXTRA elements: EXTRA is an int8 row's 4 scale bytes, else 0). */
#define DEFINE_ATTEND(SUFFIX, KV_T, DOT, AXPY, EXTRA)                                             \
static inline __attribute__((always_inline)) void attend_item##SUFFIX(                           \
    const float *q_rows, float *out_rows, const KV_T *k_head, const KV_T *v_head,                \
    const int64_t *table, int64_t len, int64_t heads, const int64_t head_dim,                    \
    int64_t block_size, float scale, float *scores) {                                            \
    const int64_t used_blocks = (len + block_size - 1) / block_size;                             \
    const int64_t row_values = head_dim + (EXTRA);                                               \
    const int64_t block_values = block_size * row_values;                                        \
    const int64_t block_bytes = block_values * (int64_t)sizeof(KV_T);                            \
    for (int64_t b = 0; b < used_blocks; b++) {                                                  \
        if (b + 1 < used_blocks) prefetch_block(k_head + table[b + 1] * block_values, block_bytes); \
        prefetch_block(v_head + table[b] * block_values, block_bytes); /* for the V pass */      \
        const KV_T *k_block = k_head + table[b] * block_values;                                  \
        const int64_t end = (b + 1) * block_size < len ? (b + 1) * block_size : len;             \
        for (int64_t t = b * block_size; t < end; t++) {                                         \
            const KV_T *k = k_block + (t - b * block_size) * row_values;                         \
            for (int64_t g = 0; g < heads; g++)                                                  \
                scores[g * len + t] = DOT(q_rows + g * head_dim, k, (int)head_dim) * scale;      \
        }                                                                                        \
    }                                                                                            \
    for (int64_t g = 0; g < heads; g++) {                                                        \
        float *row = scores + g * len;                                                           \
        float top = -INFINITY;                                                                   \
        for (int64_t t = 0; t < len; t++) top = row[t] > top ? row[t] : top;                     \
        float total = 0.0f;                                                                      \
        for (int64_t t = 0; t < len; t++) {                                                      \
            row[t] = expf(row[t] - top);                                                         \
            total += row[t];                                                                     \
        }                                                                                        \
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;                                    \
        for (int64_t t = 0; t < len; t++) row[t] *= inv;                                         \
        memset(out_rows + g * head_dim, 0, sizeof(float) * (size_t)head_dim);                    \
    }                                                                                            \
    for (int64_t b = 0; b < used_blocks; b++) {                                                  \
        const KV_T *v_block = v_head + table[b] * block_values;                                  \
        const int64_t end = (b + 1) * block_size < len ? (b + 1) * block_size : len;             \
        for (int64_t t = b * block_size; t < end; t++) {                                         \
            const KV_T *v = v_block + (t - b * block_size) * row_values;                         \
            for (int64_t g = 0; g < heads; g++)                                                  \
                AXPY(out_rows + g * head_dim, scores[g * len + t], v, (int)head_dim);            \
        }                                                                                        \
    }                                                                                            \
}

DEFINE_ATTEND(, float, dot, axpy, 0)
DEFINE_ATTEND(_bf16, uint16_t, dot_bf16, axpy_bf16, 0)
DEFINE_ATTEND(_i8, int8_t, dot_i8, axpy_i8, 4)
DEFINE_ATTEND(_f8, uint8_t, dot_f8, axpy_f8, 0)


#define MAX_GROUP 16 /* query heads a work item at most */

/* The (query heads an item, head size) pairs with a build of their own, X(ARG, HEADS, DIM) each:
 * a model's grouped query heads (SmolLM2's 3, Llama 3.2's 4, Qwen2.5-0.5B's 7 at head size 64;
 * Llama 3's 4, Qwen2.5-1.5B's 6, Qwen2.5-7B's 7 at 128). With the count a variable the compiler
 * kept the group's query and output vectors in memory and looped over them: 64 sequences of
 * ~140 keys, 2 threads, cold layer caches, medians of 9, on the 2-core AMX Xeon, µs a layer,
 * variable -> literal in bf16: Qwen2.5-0.5B's 14 heads on 2, 541 -> 438; 12 on 2 at 128, 881 ->
 * 780; 32 on 8 at 128, 2,756 -> 2,261. Bit-identical either way. Each pair's build is a
 * function of its own, so each adds to the library's first-use compile. */
#define GROUPED_BUILDS(X, ARG) X(ARG, 3, 64) X(ARG, 4, 64) X(ARG, 7, 64) X(ARG, 8, 64) \
    X(ARG, 4, 128) X(ARG, 6, 128) X(ARG, 7, 128) X(ARG, 8, 128)
/* SmolLM2's pair alone: the bf16, int8 and fp8 caches' vector paths (below). */
#define SMOLLM2_BUILD(X, ARG) X(ARG, 3, 64)

/* An item's query rows as an int8 cache's rotated rows meet them: `values` of q_rows rotated
 * into `buffer` (returned), or q_rows itself where the cache is not rotated (`rotation` 0). */
static inline const float *rotated_query(const float *q_rows, float *buffer, int64_t values, int64_t rotation) {
    if (!rotation) return q_rows;
    memcpy(buffer, q_rows, sizeof(float) * (size_t)values);
    rotate_runs(buffer, values, rotation);
    return buffer;
}

static inline float bf16_to_float(uint16_t x) {
    union { uint32_t u; float f; } bits = {.u = (uint32_t)x << 16};
    return bits.f;
}

static inline uint16_t float_to_bf16(float x) { /* round to nearest even, as torch's cast */
    union { float f; uint32_t u; } bits = {.f = x};
    if ((bits.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits.u >> 16) | 0x40u);
    bits.u += 0x7fffu + ((bits.u >> 16) & 1u);
    return (uint16_t)(bits.u >> 16);
}

/*
 * A lone stream's context split across the threads (split-K, "flash decoding"). With fewer
 * (sequence, kv head) pairs than two a thread, one item a pair leaves threads idle, and one
 * item a query head (the callers' choice there) reads each key and value row once for every
 * query head of its group and leaves an odd item on one thread. Instead each pair's keys are
 * cut into spans of whole 16-key groups, one item a span for all of the group's query heads;
 * each span's output is normalized over its own keys, kept in fp32 with its maximum score
 * and its sum of exponentials, and the spans are merged after: out = sum_s w_s out_s / sum_s
 * w_s with w_s = exp(top_s - top) total_s. On the 2-core Zen 5 EPYC, one sequence over 30
 * cold layer caches, two threads, an item a query head against spans: SmolLM2's heads (9 on 3
 * kv heads) at 190 keys 11.1 -> 7.9 us a layer, at 1,000 keys 42.1 -> 20.2; Qwen2.5-Coder-
 * 0.5B's (14 on 2) at 8,000 keys 532 -> 198, its decode after an 8,000-token prompt 23.4 ->
 * 16.6 ms a token through the server.
 */
#define SPAN_MIN_KEYS 64 /* no span shorter: its merge and its item's setup would not pay */
#define SPAN_KEYS 16     /* spans start on a group of keys, as the items' loops take them */

/* How many spans each (sequence, kv head) pair's keys are cut into: 1 (no split) where there
 * are pairs enough for every thread, or the group is wider than one item takes. */
static inline int64_t span_count(const int64_t *context_lens, int64_t num_seqs, int64_t num_kv_heads, int64_t group,
                                 int num_threads) {
    const int64_t pairs = num_seqs * num_kv_heads;
    if (pairs >= 2 * (int64_t)num_threads || group > MAX_GROUP) return 1;
    int64_t longest = 0;
    for (int64_t s = 0; s < num_seqs; s++) longest = context_lens[s] > longest ? context_lens[s] : longest;
    int64_t spans = (4 * (int64_t)num_threads + pairs - 1) / pairs; /* about 4 items a thread */
    if (spans > longest / SPAN_MIN_KEYS) spans = longest / SPAN_MIN_KEYS;
    return spans < 2 ? 1 : spans;
}

/* Keys [*begin, *end) of span `span` of a `len`-key context cut into `spans`. */
static inline void span_bounds(int64_t len, int64_t spans, int64_t span, int64_t *begin, int64_t *end) {
    int64_t size = (len + spans - 1) / spans;
    size = (size + SPAN_KEYS - 1) / SPAN_KEYS * SPAN_KEYS;
    *begin = span * size < len ? span * size : len;
    *end = *begin + size < len ? *begin + size : len;
}

/* One pair's spans merged: rows [spans][heads][head_dim] (each span's normalized output),
 * stats [spans][heads][2] (its maximum score, its sum of exponentials) -> out [heads][head_dim],
 * fp32 (out32) or bf16 (out16). */
static inline void merge_spans(const float *rows, const float *stats, int64_t spans, int64_t heads, int64_t head_dim,
                               float *out32, uint16_t *out16) {
    for (int64_t g = 0; g < heads; g++) {
        float top = -INFINITY, weight[spans > 0 ? spans : 1], sum = 0.0f;
        for (int64_t s = 0; s < spans; s++) {
            const float *stat = stats + (s * heads + g) * 2;
            if (stat[1] > 0.0f && stat[0] > top) top = stat[0];
        }
        for (int64_t s = 0; s < spans; s++) {
            const float *stat = stats + (s * heads + g) * 2;
            weight[s] = stat[1] > 0.0f ? expf(stat[0] - top) * stat[1] : 0.0f;
            sum += weight[s];
        }
        const float inverse = sum > 0.0f ? 1.0f / sum : 0.0f;
        for (int64_t d = 0; d < head_dim; d++) {
            float value = 0.0f;
            for (int64_t s = 0; s < spans; s++) value += weight[s] * rows[(s * heads + g) * head_dim + d];
            value *= inverse;
            if (out16 != NULL) out16[g * head_dim + d] = float_to_bf16(value);
            else out32[g * head_dim + d] = value;
        }
    }
}

/* The rows of keys t0 .. t0 + group - 1 (16 with AVX-512, 8 with AVX2) and of their values (the last real row repeated past the
 * context's end), as byte pointers into one kv head's blocks. Returns the byte offset of the
 * next group's first row where that group lies in one block, else -1: the caller asks for
 * that group's rows one at a time while it scores this group's (prefetch_row). The blocks lie
 * anywhere in the pool, where hardware prefetchers stop. Spread over the group, one row a key,
 * the requests overlap the arithmetic; asked for all at once at the group's start, they
 * queued behind each other: on the 2-core AVX-512 EPYC, 64 sequences of 90-200 tokens over
 * 30 cold bf16 layer caches, two threads, alternating in one process: 392 -> 356 us a layer
 * (and 423 -> 392 for the dot-product path below). One group ahead at locality 1 beat two
 * groups ahead (397) and locality 0 or 3 (442, 429). */
static inline __attribute__((always_inline)) int64_t locate_group(
    const char *k_head, const char *v_head, int64_t row_bytes, const int64_t *table, int64_t t0, int64_t len,
    int64_t block_size, const int64_t group, const char *keys[16], const char *values[16]) {
    const int64_t count = len - t0 < group ? len - t0 : group;
    const int64_t block_bytes = block_size * row_bytes;
    const int64_t t = t0 + group; /* the next group */
    if (block_size % group == 0) { /* the group lies in one block: one lookup, rows in a run */
        const int64_t base = table[t0 / block_size] * block_bytes + (t0 % block_size) * row_bytes;
        for (int64_t j = 0; j < group; j++) {
            const int64_t row = (j < count ? j : count - 1) * row_bytes;
            keys[j] = k_head + base + row;
            values[j] = v_head + base + row;
        }
        return t < len ? table[t / block_size] * block_bytes + (t % block_size) * row_bytes : -1;
    }
    for (int64_t j = 0; j < group; j++) {
        const int64_t row = t0 + (j < count ? j : count - 1);
        const int64_t offset = table[row / block_size] * block_bytes + (row % block_size) * row_bytes;
        keys[j] = k_head + offset;
        values[j] = v_head + offset;
    }
    if (t < len) { /* the next group's first key and value rows */
        const int64_t offset = table[t / block_size] * block_bytes + (t % block_size) * row_bytes;
        __builtin_prefetch(k_head + offset, 0, 1);
        __builtin_prefetch(v_head + offset, 0, 1);
    }
    return -1;
}

/* Row j of the next group (its keys and values), where locate_group gave its offset. Rows
 * past the context's end are still inside the block: harmless to ask for. */
static inline __attribute__((always_inline)) void prefetch_row(
    const char *k_head, const char *v_head, int64_t next, int64_t j, int64_t row_bytes) {
    if (next < 0) return;
    for (int64_t byte = 0; byte < row_bytes; byte += 64) {
        __builtin_prefetch(k_head + next + j * row_bytes + byte, 0, 1);
        __builtin_prefetch(v_head + next + j * row_bytes + byte, 0, 1);
    }
}

#if defined(__AVX512F__)
#include "avx512_math.h"
/*
 * The AVX-512 path (head sizes a multiple of 16, up to 256): keys go by in groups of 16 and
 * their scores come out as one vector, 16 keys in 16 lanes. Each key's products with a query
 * are summed down to one vector per key, then the 16 vectors are transposed and added in a
 * tree (15 shuffle-and-add steps for 16 dot products, instead of a horizontal reduction per
 * dot product), and the softmax is online: per group of keys, one max, one vector exp, a
 * rescale of the running output when the max grows. The widened values of a key are used for
 * every query head of its group. Measured on the 2-core AVX-512 EPYC, one call for 64
 * sequences of 64-256 tokens with SmolLM2's heads: bf16 cache 1,070 -> 430 us on one thread,
 * ~560 -> 220-290 us on two; fp32 1,450 -> 560 and ~500 -> 250-390 us.
 */
static inline __m512 load16(const float *x) { return _mm512_loadu_ps(x); }
static inline __m512 load16_bf16(const uint16_t *x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)x)), 16));
}
static inline __m512 load16_i8(const int8_t *x) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)x)));
}

/* 16 fp8 values: each byte's magnitude bits shifted into an fp16's place make an fp16 2^8
 * times smaller (its exponent's bias is 15, e4m3's 7), the sign bit moves to the fp16's, and
 * vcvtph2ps widens that exactly, fp8 subnormals included (they are fp16 subnormals, which the
 * conversion does not flush, whatever MXCSR says). */
static inline __m512 load16_f8(const uint8_t *x) {
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)x));
    const __m256i half = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x80)), 8),
                                         _mm256_slli_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x7f)), 7));
    return _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.0f));
}

/* Sum each of 16 vectors down to one lane: lane t of the result is the sum of v[t]'s lanes. */
static inline __m512 transpose_sum16(__m512 v[16]) {
    /* step 1: pairs -> 8 vectors, lanes of each 128-bit part hold partial sums of 2 inputs */
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    /* a[i] lanes (per 128-bit part): [v2i.01+23 interleaved]: x0 y0 x1 y1 (sums of pairs) */
    for (int i = 0; i < 4; i++) {
        __m512 lo = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1])));
        __m512 hi = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1])));
        b[i] = _mm512_add_ps(lo, hi);
    }
    /* b[i]: each 128-bit part holds [v4i, v4i+1, v4i+2, v4i+3] partial sums (one per 128-bit part) */
    for (int i = 0; i < 2; i++) {
        __m512 lo = _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88); /* parts 0,2 of each */
        __m512 hi = _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD); /* parts 1,3 of each */
        c[i] = _mm512_add_ps(lo, hi);
    }
    __m512 lo = _mm512_shuffle_f32x4(c[0], c[1], 0x88);
    __m512 hi = _mm512_shuffle_f32x4(c[0], c[1], 0xDD);
    return _mm512_add_ps(lo, hi);
}

/* The online softmax over one group of 16 keys: `partial[g][j]` holds head g's products with
 * key j still to be summed across lanes. Leaves the group's probabilities (relative to the
 * running maximum) in probs[g], updates top and total, and returns in rescale[g] the factor
 * head g's running output must be multiplied by (1 where the maximum did not grow). */
static inline __attribute__((always_inline)) void softmax_group(
    __m512 partial[][16], int64_t heads, __mmask16 valid, float scale, float *top, float *total,
    float probs[][16], float *rescale) {
    for (int64_t g = 0; g < heads; g++) {
        __m512 scores = _mm512_mul_ps(transpose_sum16(partial[g]), _mm512_set1_ps(scale));
        scores = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), scores);
        const float group_top = _mm512_reduce_max_ps(scores);
        rescale[g] = 1.0f;
        if (group_top > top[g]) {
            rescale[g] = expf(top[g] - group_top);
            total[g] *= rescale[g];
            top[g] = group_top;
        }
        const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(scores, _mm512_set1_ps(top[g]))));
        total[g] += _mm512_reduce_add_ps(p);
        _mm512_store_ps(probs[g], p);
    }
}

/* EXTRA: bytes after a row's values (an int8 row's fp32 scale, which its products and its
 * weight are multiplied by; 0 for float and bf16 rows, and the multiplications compile away). */
#define DEFINE_ATTEND_VEC(SUFFIX, KV_T, LOAD, EXTRA)                                             \
static inline __attribute__((always_inline)) void attend_item_vec##SUFFIX(                       \
    const float *q_rows, float *out_rows, const KV_T *k_head, const KV_T *v_head,                \
    const int64_t *table, int64_t begin, int64_t len, int64_t heads, int64_t head_dim,           \
    int64_t block_size, float scale, float *stats) {                                             \
    const int64_t chunks = head_dim / 16;                                                        \
    const int64_t row_bytes = head_dim * (int64_t)sizeof(KV_T) + (EXTRA);                        \
    __m512 acc[MAX_GROUP][16];                                                                   \
    float top[MAX_GROUP], total[MAX_GROUP], rescale[MAX_GROUP];                                  \
    float probs[MAX_GROUP][16] __attribute__((aligned(64)));                                     \
    for (int64_t g = 0; g < heads; g++) {                                                        \
        top[g] = -INFINITY;                                                                      \
        total[g] = 0.0f;                                                                         \
        for (int64_t c = 0; c < chunks; c++) acc[g][c] = _mm512_setzero_ps();                    \
    }                                                                                            \
    for (int64_t t0 = begin; t0 < len; t0 += 16) {                                               \
        const int64_t count = len - t0 < 16 ? len - t0 : 16;                                     \
        const char *key_rows[16], *value_rows[16];                                               \
        const int64_t next = locate_group((const char *)k_head, (const char *)v_head, row_bytes,  \
                                          table, t0, len, block_size, 16, key_rows, value_rows); \
        __m512 partial[MAX_GROUP][16];                                                           \
        for (int j = 0; j < 16; j++) { /* each key row widened once, for every head */           \
            prefetch_row((const char *)k_head, (const char *)v_head, next, j, row_bytes);         \
            const KV_T *key = (const KV_T *)key_rows[j];                                         \
            __m512 k[16];                                                                        \
            for (int64_t c = 0; c < chunks; c++) k[c] = LOAD(key + 16 * c);                      \
            for (int64_t g = 0; g < heads; g++) {                                                \
                const float *q = q_rows + g * head_dim;                                          \
                __m512 sum = _mm512_mul_ps(load16(q), k[0]);                                     \
                for (int64_t c = 1; c < chunks; c++) sum = _mm512_fmadd_ps(load16(q + 16 * c), k[c], sum); \
                partial[g][j] = (EXTRA) ? _mm512_mul_ps(sum, _mm512_set1_ps(extra_scale(key_rows[j], head_dim))) : sum; \
            }                                                                                    \
        }                                                                                        \
        softmax_group(partial, heads, (__mmask16)((1u << count) - 1u), scale, top, total, probs, rescale); \
        for (int64_t g = 0; g < heads; g++)                                                      \
            if (rescale[g] != 1.0f)                                                              \
                for (int64_t c = 0; c < chunks; c++) acc[g][c] = _mm512_mul_ps(acc[g][c], _mm512_set1_ps(rescale[g])); \
        for (int64_t j = 0; j < count; j++) {                                                    \
            const KV_T *value = (const KV_T *)value_rows[j];                                     \
            const float weight = (EXTRA) ? extra_scale(value_rows[j], head_dim) : 1.0f;          \
            for (int64_t c = 0; c < chunks; c++) {                                               \
                const __m512 v = LOAD(value + 16 * c);                                           \
                for (int64_t g = 0; g < heads; g++)                                              \
                    acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps((EXTRA) ? probs[g][j] * weight : probs[g][j]), \
                                                v, acc[g][c]);                                   \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
    for (int64_t g = 0; g < heads; g++) {                                                        \
        const __m512 inverse = _mm512_set1_ps(total[g] > 0.0f ? 1.0f / total[g] : 0.0f);         \
        for (int64_t c = 0; c < chunks; c++)                                                     \
            _mm512_storeu_ps(out_rows + g * head_dim + 16 * c, _mm512_mul_ps(acc[g][c], inverse)); \
        if (stats != NULL) {                                                                     \
            stats[2 * g] = top[g];                                                               \
            stats[2 * g + 1] = total[g];                                                         \
        }                                                                                        \
    }                                                                                            \
}

/* An int8 row's scale, after its head_dim values (a byte pointer to the row). */
static inline float extra_scale(const char *row, int64_t head_dim) {
    float scale;
    memcpy(&scale, row + head_dim, sizeof scale);
    return scale;
}

DEFINE_ATTEND_VEC(, float, load16, 0)
DEFINE_ATTEND_VEC(_bf16, uint16_t, load16_bf16, 0)
DEFINE_ATTEND_VEC(_i8, int8_t, load16_i8, 4)
DEFINE_ATTEND_VEC(_f8, uint8_t, load16_f8, 0)


#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/*
 * bf16 queries over a bf16 cache with AVX-512-BF16 (head sizes a multiple of 32): a query
 * head's products with a key come from VDPBF16PS, 32 bf16 pairs an instruction multiplied
 * exactly and summed in fp32, so keys are never widened; values are widened two lanes at a
 * time (the even elements of a 32-value load by a shift, the odd ones by a mask), the output
 * accumulated as even and odd halves and interleaved once at the end. q is read and out
 * written in bf16 directly (no fp32 copies around the call). Per key and three query heads
 * that is ~30 vector instructions against ~55 on the widening path, which on the 2-core
 * AVX-512 EPYC was compute-bound: a hot 6.5 MB layer cache took as long as a cold one's reads.
 */
#define HAS_DP_PATH 1

/* 16 fp32 values to bf16, rounded to nearest even as float_to_bf16 below. */
static inline __m256i narrow16(__m512 v) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_rounded_bits(v), 16));
}

/* Keys [begin, len) for `heads` query heads: out_rows in bf16, or where `partial` is given,
 * its fp32 rows and each head's maximum score and sum of exponentials in `stats` (a span). */
static inline __attribute__((always_inline)) void attend_item_dp(
    const uint16_t *q_rows, uint16_t *out_rows, const uint16_t *k_head, const uint16_t *v_head,
    const int64_t *table, int64_t begin, int64_t len, int64_t heads, int64_t head_dim, int64_t block_size,
    float scale, float *partial, float *stats) {
    const int64_t pairs = head_dim / 32; /* 32-value vectors a row */
    __m512bh query[MAX_GROUP][8];
    __m512 even[MAX_GROUP][8], odd[MAX_GROUP][8]; /* output dims 32c + 2i and 32c + 2i + 1 in lane i */
    float top[MAX_GROUP], total[MAX_GROUP], rescale[MAX_GROUP];
    float probs[MAX_GROUP][16] __attribute__((aligned(64)));
    const __m512i high_halves = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int64_t g = 0; g < heads; g++) {
        top[g] = -INFINITY;
        total[g] = 0.0f;
        for (int64_t c = 0; c < pairs; c++) {
            query[g][c] = (__m512bh)_mm512_loadu_si512(q_rows + g * head_dim + 32 * c);
            even[g][c] = odd[g][c] = _mm512_setzero_ps();
        }
    }
    for (int64_t t0 = begin; t0 < len; t0 += 16) {
        const int64_t count = len - t0 < 16 ? len - t0 : 16;
        const char *key_rows[16], *value_rows[16];
        const int64_t next = locate_group((const char *)k_head, (const char *)v_head, head_dim * 2, table, t0, len,
                                          block_size, 16, key_rows, value_rows);
        __m512 partial[MAX_GROUP][16];
        for (int j = 0; j < 16; j++) {
            prefetch_row((const char *)k_head, (const char *)v_head, next, j, head_dim * 2);
            __m512i k[8];
            for (int64_t c = 0; c < pairs; c++) k[c] = _mm512_loadu_si512((const uint16_t *)key_rows[j] + 32 * c);
            for (int64_t g = 0; g < heads; g++) {
                __m512 sum = _mm512_dpbf16_ps(_mm512_setzero_ps(), query[g][0], (__m512bh)k[0]);
                for (int64_t c = 1; c < pairs; c++) sum = _mm512_dpbf16_ps(sum, query[g][c], (__m512bh)k[c]);
                partial[g][j] = sum;
            }
        }
        softmax_group(partial, heads, (__mmask16)((1u << count) - 1u), scale, top, total, probs, rescale);
        for (int64_t g = 0; g < heads; g++)
            if (rescale[g] != 1.0f)
                for (int64_t c = 0; c < pairs; c++) {
                    even[g][c] = _mm512_mul_ps(even[g][c], _mm512_set1_ps(rescale[g]));
                    odd[g][c] = _mm512_mul_ps(odd[g][c], _mm512_set1_ps(rescale[g]));
                }
        for (int64_t j = 0; j < count; j++) {
            for (int64_t c = 0; c < pairs; c++) {
                const __m512i raw = _mm512_loadu_si512((const uint16_t *)value_rows[j] + 32 * c);
                const __m512 v_even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
                const __m512 v_odd = _mm512_castsi512_ps(_mm512_and_si512(raw, high_halves));
                for (int64_t g = 0; g < heads; g++) {
                    const __m512 p = _mm512_set1_ps(probs[g][j]);
                    even[g][c] = _mm512_fmadd_ps(p, v_even, even[g][c]);
                    odd[g][c] = _mm512_fmadd_ps(p, v_odd, odd[g][c]);
                }
            }
        }
    }
    const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i second = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    for (int64_t g = 0; g < heads; g++) {
        const __m512 inverse = _mm512_set1_ps(total[g] > 0.0f ? 1.0f / total[g] : 0.0f);
        for (int64_t c = 0; c < pairs; c++) {
            const __m512 e = _mm512_mul_ps(even[g][c], inverse), o = _mm512_mul_ps(odd[g][c], inverse);
            if (partial != NULL) {
                float *target = partial + g * head_dim + 32 * c;
                _mm512_storeu_ps(target, _mm512_permutex2var_ps(e, first, o));
                _mm512_storeu_ps(target + 16, _mm512_permutex2var_ps(e, second, o));
                continue;
            }
            uint16_t *target = out_rows + g * head_dim + 32 * c;
            _mm256_storeu_si256((__m256i *)target, narrow16(_mm512_permutex2var_ps(e, first, o)));
            _mm256_storeu_si256((__m256i *)(target + 16), narrow16(_mm512_permutex2var_ps(e, second, o)));
        }
        if (stats != NULL) {
            stats[2 * g] = top[g];
            stats[2 * g + 1] = total[g];
        }
    }
}

/* One item's keys [begin, len): a pair's own build (GROUPED_BUILDS), else head_dim a literal
 * where it is a common size. */
#define ATTEND_DP_AS(UNUSED, HEADS, DIM)                                                         \
    if (heads == (HEADS) && head_dim == (DIM)) {                                                \
        attend_item_dp(q_rows, out_rows, k_head, v_head, table, begin, len, HEADS, DIM, block_size, scale, partial, \
                       stats);                                                                  \
        return;                                                                                 \
    }
static void attend_dp(const uint16_t *q_rows, uint16_t *out_rows, const uint16_t *k_head, const uint16_t *v_head,
                      const int64_t *table, int64_t begin, int64_t len, int64_t heads, int64_t head_dim,
                      int64_t block_size, float scale, float *partial, float *stats) {
    GROUPED_BUILDS(ATTEND_DP_AS, )
    if (head_dim == 64)
        attend_item_dp(q_rows, out_rows, k_head, v_head, table, begin, len, heads, 64, block_size, scale, partial,
                       stats);
    else if (head_dim == 128)
        attend_item_dp(q_rows, out_rows, k_head, v_head, table, begin, len, heads, 128, block_size, scale, partial,
                       stats);
    else
        attend_item_dp(q_rows, out_rows, k_head, v_head, table, begin, len, heads, head_dim, block_size, scale,
                       partial, stats);
}
#undef ATTEND_DP_AS

/* Work item `item` of a long context's spans: one span of a (sequence, kv head) pair, all of
 * its query heads, into fp32 rows and stats for merge_spans. One definition for the call's
 * own region and the caller's team. */
static inline void attend_span_item(const uint16_t *q, int64_t q_stride, const uint16_t *kv_cache,
                                    const uint16_t *v_base, const int64_t *block_tables, const int64_t *context_lens,
                                    int64_t num_kv_heads, int64_t group, int64_t head_dim, int64_t block_size,
                                    int64_t head_stride, int64_t table_stride, int64_t spans, int64_t item,
                                    float scale, float *rows, float *stats) {
    const int64_t pair = item / spans, seq = pair / num_kv_heads, kv_head = pair % num_kv_heads;
    int64_t begin, end;
    span_bounds(context_lens[seq], spans, item % spans, &begin, &end);
    attend_dp(q + seq * q_stride + kv_head * group * head_dim, NULL, kv_cache + kv_head * head_stride,
              v_base + kv_head * head_stride, block_tables + seq * table_stride, begin, end, group, head_dim,
              block_size, scale, rows + item * group * head_dim, stats + item * group * 2);
}

/* Asks for one 64-byte line (prefetcht2, as the next group's rows are asked for). An asm
 * statement, not __builtin_prefetch: GCC 12 at -O3 deleted a loop of nothing but
 * __builtin_prefetch calls once it was inlined into the item loop below (the library held none
 * of prefetch_item_start's requests, and none of its gain). */
static inline void prefetch_line(const char *line) {
#if defined(__x86_64__)
    __asm__ volatile("prefetcht2 %0" : : "m"(*line));
#else
    __builtin_prefetch(line, 0, 1);
#endif
}

/* Asks for the first 16 key and value rows of work item `item` of whole contexts (its kv head's
 * rows in its sequence's first block) while the item before it is attended. The loops below deal
 * the items to the threads in turn (static, 1), so a thread's next item is `item` + its team's
 * size. An item's own rows are asked for a group ahead (locate_group), but its first group met
 * them cold, keys and then values, every item: 64 sequences x 3 kv heads a layer for decode-heavy.
 * On the 2-core AMX Xeon, decode-heavy's 64-row steps in one engine, builds swapped pass by pass
 * (medians of 8): attention 12.8 -> 12.1 ms a step (7 of 8 rounds lower), the layer stack 31.1 ->
 * 29.6; the items in turn with no prefetch were 1% faster than claimed one by one (dynamic, 1),
 * within the noise. */
static inline void prefetch_item_start(const uint16_t *kv_cache, const uint16_t *v_base, const int64_t *block_tables,
                                       const int64_t *context_lens, int64_t num_kv_heads, int64_t slices,
                                       int64_t head_dim, int64_t block_size, int64_t head_stride,
                                       int64_t table_stride, int64_t item) {
    const int64_t seq = item / (num_kv_heads * slices), kv_head = (item / slices) % num_kv_heads;
    const int64_t keys = context_lens[seq] < 16 ? context_lens[seq] : 16, row_bytes = head_dim * 2;
    if (keys <= 0 || block_size < keys) return; /* the rows are not one run in one block */
    const size_t offset = (size_t)(block_tables[seq * table_stride] * block_size) * head_dim + kv_head * head_stride;
    const char *k_rows = (const char *)(kv_cache + offset), *v_rows = (const char *)(v_base + offset);
    for (int64_t byte = 0; byte < keys * row_bytes; byte += 64) {
        prefetch_line(k_rows + byte);
        prefetch_line(v_rows + byte);
    }
}

/* Work item `item` of whole contexts: `heads_per_item` query heads of a (sequence, kv head)
 * pair, into bf16 out. */
static inline void attend_heads_item(const uint16_t *q, int64_t q_stride, const uint16_t *kv_cache,
                                     const uint16_t *v_base, const int64_t *block_tables, const int64_t *context_lens,
                                     uint16_t *out, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                     int64_t block_size, int64_t head_stride, int64_t table_stride,
                                     int64_t heads_per_item, int64_t item, float scale) {
    const int64_t group = num_heads / num_kv_heads, slices = group / heads_per_item;
    const int64_t seq = item / (num_kv_heads * slices);
    const int64_t kv_head = (item / slices) % num_kv_heads;
    const int64_t first_head = kv_head * group + (item % slices) * heads_per_item;
    attend_dp(q + seq * q_stride + first_head * head_dim, out + (seq * num_heads + first_head) * head_dim,
              kv_cache + kv_head * head_stride, v_base + kv_head * head_stride, block_tables + seq * table_stride,
              0, context_lens[seq], heads_per_item, head_dim, block_size, scale, NULL, NULL);
}

/* q [seqs, heads, head_dim] bf16, sequences q_stride apart; out [seqs, heads, head_dim] bf16.
 * Returns 0, or -1 when the spans' scratch could not be allocated. */
static int paged_decode_attention_dp(
    const uint16_t *q, int64_t q_stride, const uint16_t *kv_cache, const int64_t *block_tables,
    const int64_t *context_lens, uint16_t *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, int64_t num_blocks, int64_t table_stride, int64_t heads_per_item,
    float scale, int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t head_stride = num_blocks * block_size * head_dim;
    const uint16_t *v_base = kv_cache + num_kv_heads * head_stride;
    const int64_t spans = span_count(context_lens, num_seqs, num_kv_heads, group, num_threads);
    if (spans > 1) { /* an item a span of a (sequence, kv head) pair, all of its query heads */
        const int64_t items = num_seqs * num_kv_heads * spans;
        float *rows = malloc(sizeof(float) * (size_t)(items * group * head_dim));
        float *stats = malloc(sizeof(float) * (size_t)(items * group * 2));
        if (rows == NULL || stats == NULL) {
            free(rows);
            free(stats);
            return -1;
        }
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
        for (int64_t item = 0; item < items; item++) {
            attend_span_item(q, q_stride, kv_cache, v_base, block_tables, context_lens, num_kv_heads, group, head_dim,
                             block_size, head_stride, table_stride, spans, item, scale, rows, stats);
        }
        for (int64_t pair = 0; pair < num_seqs * num_kv_heads; pair++)
            merge_spans(rows + pair * spans * group * head_dim, stats + pair * spans * group * 2, spans, group,
                        head_dim, NULL, out + pair * group * head_dim);
        free(rows);
        free(stats);
        return 0;
    }
    const int64_t slices = group / heads_per_item;
    const int64_t items = num_seqs * num_kv_heads * slices;
#pragma omp parallel for schedule(static, 1) num_threads(num_threads)
    for (int64_t item = 0; item < items; item++) {
        if (item + num_threads < items)
            prefetch_item_start(kv_cache, v_base, block_tables, context_lens, num_kv_heads, slices, head_dim,
                                block_size, head_stride, table_stride, item + num_threads);
        attend_heads_item(q, q_stride, kv_cache, v_base, block_tables, context_lens, out, num_heads, num_kv_heads,
                          head_dim, block_size, head_stride, table_stride, heads_per_item, item, scale);
    }
    return 0;
}

/* paged_decode_attention_dp as the caller's team runs it: every thread of the enclosing
 * parallel region calls it with the same arguments and takes items from the same dynamic
 * schedule; a lone stream's spans are merged by the team too, and the call returns when the
 * whole output is there. A decode stack that keeps one team through a step (decode_stack.c)
 * pays barriers here instead of a fork and a join. Returns 0, or -1 (on every thread) when the
 * spans' scratch could not be allocated. */
static int paged_decode_attention_dp_team(
    const uint16_t *q, int64_t q_stride, const uint16_t *kv_cache, const int64_t *block_tables,
    const int64_t *context_lens, uint16_t *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, int64_t num_blocks, int64_t table_stride, int64_t heads_per_item,
    float scale) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t head_stride = num_blocks * block_size * head_dim;
    const uint16_t *v_base = kv_cache + num_kv_heads * head_stride;
    const int64_t spans = span_count(context_lens, num_seqs, num_kv_heads, group, omp_get_num_threads());
    if (spans > 1) {
        const int64_t items = num_seqs * num_kv_heads * spans;
        float *rows, *stats;
#pragma omp single copyprivate(rows, stats)
        {
            rows = malloc(sizeof(float) * (size_t)(items * group * head_dim));
            stats = malloc(sizeof(float) * (size_t)(items * group * 2));
            if (rows == NULL || stats == NULL) {
                free(rows);
                free(stats);
                rows = stats = NULL;
            }
        }
        if (rows == NULL) return -1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            attend_span_item(q, q_stride, kv_cache, v_base, block_tables, context_lens, num_kv_heads, group, head_dim,
                             block_size, head_stride, table_stride, spans, item, scale, rows, stats);
        }
#pragma omp for schedule(static)
        for (int64_t pair = 0; pair < num_seqs * num_kv_heads; pair++)
            merge_spans(rows + pair * spans * group * head_dim, stats + pair * spans * group * 2, spans, group,
                        head_dim, NULL, out + pair * group * head_dim);
#pragma omp single nowait
        {
            free(rows);
            free(stats);
        }
        return 0;
    }
    const int64_t slices = group / heads_per_item;
    const int64_t items = num_seqs * num_kv_heads * slices, team = omp_get_num_threads();
#pragma omp for schedule(static, 1)
    for (int64_t item = 0; item < items; item++) {
        if (item + team < items)
            prefetch_item_start(kv_cache, v_base, block_tables, context_lens, num_kv_heads, slices, head_dim,
                                block_size, head_stride, table_stride, item + team);
        attend_heads_item(q, q_stride, kv_cache, v_base, block_tables, context_lens, out, num_heads, num_kv_heads,
                          head_dim, block_size, head_stride, table_stride, heads_per_item, item, scale);
    }
    return 0;
}
#endif
#define HAS_VECTOR_PATH 1
#define VECTOR_LANES 16
#define VECTOR_ISA "AVX-512 fp32 FMA (bf16 widened)"
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "avx2_math.h"
/*
 * The AVX2 path (head sizes a multiple of 8, up to 256): the AVX-512 path's method at half
 * the width. Keys go by in groups of 8, a group's 8 scores come out as one vector (three
 * horizontal adds and one add across the halves for 8 dot products), and the softmax is
 * online. Before it, an AVX2 CPU took the portable loops: a horizontal reduction per dot
 * product, the scores kept and exponentiated one at a time, and a second pass over the
 * values. On the 2-core AVX2 EPYC, 64 sequences of 90-200 tokens with SmolLM2's heads over 30
 * fp32 layer caches, two threads: 969-1,043 -> 745-774 us a layer with the caches
 * cycled (14-15 -> 19-20 GB/s of KV), 663-741 -> 373-383 us with one cache hot.
 */
static inline __m256 load8(const float *x) { return _mm256_loadu_ps(x); }
static inline __m256 load8_bf16(const uint16_t *x) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)x)), 16));
}
static inline __m256 load8_i8(const int8_t *x) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)x)));
}

/* 8 fp8 values, as load16_f8 (F16C's vcvtph2ps; every AVX2 CPU has it). */
static inline __m256 load8_f8(const uint8_t *x) {
#if defined(__F16C__)
    const __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)x));
    const __m128i half = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(bytes, _mm_set1_epi16(0x80)), 8),
                                      _mm_slli_epi16(_mm_and_si128(bytes, _mm_set1_epi16(0x7f)), 7));
    return _mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.0f));
#else
    return _mm256_setr_ps(fp8_to_float(x[0]), fp8_to_float(x[1]), fp8_to_float(x[2]), fp8_to_float(x[3]),
                          fp8_to_float(x[4]), fp8_to_float(x[5]), fp8_to_float(x[6]), fp8_to_float(x[7]));
#endif
}

/* Lane t of the result is the sum of v[t]'s lanes. */
static inline __m256 transpose_sum8(const __m256 v[8]) {
    const __m256 s01 = _mm256_hadd_ps(v[0], v[1]), s23 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 s45 = _mm256_hadd_ps(v[4], v[5]), s67 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 a = _mm256_hadd_ps(s01, s23), b = _mm256_hadd_ps(s45, s67); /* halves: 4 sums each */
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

static inline float max8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* softmax_group's work for a group of 8 keys; `valid` has all bits set in the lanes of real
 * keys (the rest repeat the last real row). */
static inline __attribute__((always_inline)) void softmax_group8(
    __m256 partial[][8], int64_t heads, __m256 valid, float scale, float *top, float *total,
    float probs[][8], float *rescale) {
    for (int64_t g = 0; g < heads; g++) {
        __m256 scores = _mm256_mul_ps(transpose_sum8(partial[g]), _mm256_set1_ps(scale));
        scores = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), scores, valid);
        const float group_top = max8(scores);
        rescale[g] = 1.0f;
        if (group_top > top[g]) {
            rescale[g] = expf(top[g] - group_top);
            total[g] *= rescale[g];
            top[g] = group_top;
        }
        const __m256 p = _mm256_and_ps(valid, exp8(_mm256_sub_ps(scores, _mm256_set1_ps(top[g]))));
        total[g] += sum8(p);
        _mm256_store_ps(probs[g], p);
    }
}

/* attend_item_vec of the AVX-512 path, 8 lanes wide (EXTRA as there). */
#define DEFINE_ATTEND_VEC8(SUFFIX, KV_T, LOAD, EXTRA)                                            \
static inline __attribute__((always_inline)) void attend_item_vec##SUFFIX(                       \
    const float *q_rows, float *out_rows, const KV_T *k_head, const KV_T *v_head,                \
    const int64_t *table, int64_t begin, int64_t len, int64_t heads, int64_t head_dim,           \
    int64_t block_size, float scale, float *stats) {                                             \
    const int64_t chunks = head_dim / 8;                                                         \
    const int64_t row_bytes = head_dim * (int64_t)sizeof(KV_T) + (EXTRA);                        \
    __m256 acc[MAX_GROUP][32];                                                                   \
    float top[MAX_GROUP], total[MAX_GROUP], rescale[MAX_GROUP];                                  \
    float probs[MAX_GROUP][8] __attribute__((aligned(32)));                                      \
    for (int64_t g = 0; g < heads; g++) {                                                        \
        top[g] = -INFINITY;                                                                      \
        total[g] = 0.0f;                                                                         \
        for (int64_t c = 0; c < chunks; c++) acc[g][c] = _mm256_setzero_ps();                    \
    }                                                                                            \
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);                              \
    for (int64_t t0 = begin; t0 < len; t0 += 8) {                                                \
        const int64_t count = len - t0 < 8 ? len - t0 : 8;                                       \
        const char *key_rows[16], *value_rows[16];                                               \
        const int64_t next = locate_group((const char *)k_head, (const char *)v_head, row_bytes,  \
                                          table, t0, len, block_size, 8, key_rows, value_rows);  \
        __m256 partial[MAX_GROUP][8];                                                            \
        for (int j = 0; j < 8; j++) { /* each key row widened once, for every head */            \
            prefetch_row((const char *)k_head, (const char *)v_head, next, j, row_bytes);         \
            const KV_T *key = (const KV_T *)key_rows[j];                                         \
            __m256 k[32];                                                                        \
            for (int64_t c = 0; c < chunks; c++) k[c] = LOAD(key + 8 * c);                       \
            for (int64_t g = 0; g < heads; g++) {                                                \
                const float *q = q_rows + g * head_dim;                                          \
                __m256 sum = _mm256_mul_ps(load8(q), k[0]);                                      \
                for (int64_t c = 1; c < chunks; c++) sum = _mm256_fmadd_ps(load8(q + 8 * c), k[c], sum); \
                partial[g][j] = (EXTRA) ? _mm256_mul_ps(sum, _mm256_set1_ps(row_scale((const int8_t *)key_rows[j], (int)head_dim))) : sum; \
            }                                                                                    \
        }                                                                                        \
        const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)count), lane)); \
        softmax_group8(partial, heads, valid, scale, top, total, probs, rescale);                \
        for (int64_t g = 0; g < heads; g++)                                                      \
            if (rescale[g] != 1.0f)                                                              \
                for (int64_t c = 0; c < chunks; c++) acc[g][c] = _mm256_mul_ps(acc[g][c], _mm256_set1_ps(rescale[g])); \
        for (int64_t j = 0; j < count; j++) {                                                    \
            const KV_T *value = (const KV_T *)value_rows[j];                                     \
            const float weight = (EXTRA) ? row_scale((const int8_t *)value_rows[j], (int)head_dim) : 1.0f; \
            for (int64_t c = 0; c < chunks; c++) {                                               \
                const __m256 v = LOAD(value + 8 * c);                                            \
                for (int64_t g = 0; g < heads; g++)                                              \
                    acc[g][c] = _mm256_fmadd_ps(_mm256_set1_ps((EXTRA) ? probs[g][j] * weight : probs[g][j]), \
                                                v, acc[g][c]);                                   \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
    for (int64_t g = 0; g < heads; g++) {                                                        \
        const __m256 inverse = _mm256_set1_ps(total[g] > 0.0f ? 1.0f / total[g] : 0.0f);         \
        for (int64_t c = 0; c < chunks; c++)                                                     \
            _mm256_storeu_ps(out_rows + g * head_dim + 8 * c, _mm256_mul_ps(acc[g][c], inverse)); \
        if (stats != NULL) {                                                                     \
            stats[2 * g] = top[g];                                                               \
            stats[2 * g + 1] = total[g];                                                         \
        }                                                                                        \
    }                                                                                            \
}

DEFINE_ATTEND_VEC8(, float, load8, 0)
DEFINE_ATTEND_VEC8(_bf16, uint16_t, load8_bf16, 0)
DEFINE_ATTEND_VEC8(_i8, int8_t, load8_i8, 4)
DEFINE_ATTEND_VEC8(_f8, uint8_t, load8_f8, 0)
#define HAS_VECTOR_PATH 1
#define VECTOR_LANES 8
#define VECTOR_ISA "AVX2 fp32 FMA (bf16 widened)"
#else
#define HAS_VECTOR_PATH 0
#define VECTOR_LANES 1
#define VECTOR_ISA "portable C"
#define attend_vector(...) ((void)0)
#define attend_vector_bf16(...) ((void)0)
#define attend_vector_i8(...) ((void)0)
#define attend_vector_f8(...) ((void)0)
#endif

#if HAS_VECTOR_PATH
/* A pair's own build (BUILDS: GROUPED_BUILDS or SMOLLM2_BUILD), else the head size a literal
 * where it is a common one, so the per-chunk loops unroll and the accumulators stay in
 * registers. fp32, Qwen2.5-0.5B's group of 7, 64 sequences of ~140 keys over 24 cold caches on
 * the 2-core AMX Xeon: 655 -> 559 µs a layer with its own build. Only fp32 caches (exact fp32,
 * and the default mode where the CPU has no bf16 dot products) get every pair: every pair for
 * all four kinds of cache took the library's first-use compile from 7 to 14 s on that box. */
#define ATTEND_VEC_AS(SUFFIX, HEADS, DIM)                                                        \
    if (heads == (HEADS) && head_dim == (DIM)) {                                                \
        attend_item_vec##SUFFIX(q_rows, out_rows, k_head, v_head, table, begin, len, HEADS, DIM, block_size, scale, \
                                stats);                                                         \
        return;                                                                                 \
    }
#define DEFINE_DISPATCH_VEC(SUFFIX, KV_T, BUILDS)                                                \
static void attend_vector##SUFFIX(const float *q_rows, float *out_rows, const KV_T *k_head,      \
                                  const KV_T *v_head, const int64_t *table, int64_t begin,       \
                                  int64_t len, int64_t heads, int64_t head_dim, int64_t block_size, \
                                  float scale, float *stats) {                                   \
    BUILDS(ATTEND_VEC_AS, SUFFIX)                                                                \
    if (head_dim == 64)                                                                          \
        attend_item_vec##SUFFIX(q_rows, out_rows, k_head, v_head, table, begin, len, heads, 64, block_size, scale, stats); \
    else if (head_dim == 128)                                                                    \
        attend_item_vec##SUFFIX(q_rows, out_rows, k_head, v_head, table, begin, len, heads, 128, block_size, scale, stats); \
    else                                                                                         \
        attend_item_vec##SUFFIX(q_rows, out_rows, k_head, v_head, table, begin, len, heads, head_dim, block_size, scale, stats); \
}
DEFINE_DISPATCH_VEC(, float, GROUPED_BUILDS)
DEFINE_DISPATCH_VEC(_bf16, uint16_t, SMOLLM2_BUILD)
DEFINE_DISPATCH_VEC(_i8, int8_t, SMOLLM2_BUILD)
DEFINE_DISPATCH_VEC(_f8, uint8_t, SMOLLM2_BUILD)
#endif


#if HAS_VECTOR_PATH
/* A lone stream's spans (span_count) on the vector path: fp32 q and out, as the entry below.
 * Returns 0, or -1 when the scratch could not be allocated. */
#define DEFINE_SPANS(SUFFIX, KV_T, EXTRA)                                                          \
static int attend_spans##SUFFIX(                                                                   \
    const float *q, const KV_T *kv_cache, const int64_t *block_tables, const int64_t *context_lens, \
    float *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,       \
    int64_t block_size, int64_t num_blocks, int64_t table_stride, int64_t spans, float scale,      \
    int num_threads) {                                                                             \
    const int64_t group = num_heads / num_kv_heads, item_values = group * head_dim;               \
    const int64_t head_stride = num_blocks * block_size * (head_dim + (EXTRA));                    \
    const int64_t rotation = (EXTRA) ? int8_rotation(head_dim) : 0;                                \
    const int64_t items = num_seqs * num_kv_heads * spans;                                         \
    float *rows = malloc(sizeof(float) * (size_t)(items * item_values));                           \
    float *stats = malloc(sizeof(float) * (size_t)(items * group * 2));                            \
    if (rows == NULL || stats == NULL) {                                                           \
        free(rows);                                                                                \
        free(stats);                                                                               \
        return -1;                                                                                 \
    }                                                                                              \
_Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                          \
    for (int64_t item = 0; item < items; item++) {                                                 \
        const int64_t pair = item / spans, seq = pair / num_kv_heads, kv_head = pair % num_kv_heads; \
        int64_t begin, end;                                                                        \
        span_bounds(context_lens[seq], spans, item % spans, &begin, &end);                         \
        const float *q_rows = q + (seq * num_heads + kv_head * group) * head_dim;                  \
        float rotated_q[rotation ? item_values : 1];                                               \
        q_rows = rotated_query(q_rows, rotated_q, item_values, rotation);                          \
        attend_vector##SUFFIX(q_rows, rows + item * item_values, kv_cache + kv_head * head_stride,  \
                              kv_cache + (num_kv_heads + kv_head) * head_stride,                   \
                              block_tables + seq * table_stride, begin, end, group, head_dim,      \
                              block_size, scale, stats + item * group * 2);                        \
    }                                                                                              \
    for (int64_t pair = 0; pair < num_seqs * num_kv_heads; pair++) {                               \
        float *target = out + pair * item_values; /* a pair's query heads are contiguous */        \
        merge_spans(rows + pair * spans * item_values, stats + pair * spans * group * 2, spans, group, \
                    head_dim, target, NULL);                                                       \
        if (rotation) rotate_runs(target, item_values, rotation);                                  \
    }                                                                                              \
    free(rows);                                                                                    \
    free(stats);                                                                                   \
    return 0;                                                                                      \
}
#else /* no vector path, no spans: the entry never calls these */
#define DEFINE_SPANS(SUFFIX, KV_T, EXTRA)
#define attend_spans(...) (-1)
#define attend_spans_bf16(...) (-1)
#define attend_spans_i8(...) (-1)
#define attend_spans_f8(...) (-1)
#endif

/* Returns 0, or -1 when a scratch allocation failed (out is then incomplete). An int8 cache's
 * rows are rotated (EXTRA: its scale bytes): each item reads a rotated copy of its query rows
 * and rotates its output rows back in place. A lone stream's keys are cut into spans on the
 * vector path (span_count), whatever `heads_per_item` asks. */
#define DEFINE_ENTRY(SUFFIX, KV_T, EXTRA)                                                          \
DEFINE_SPANS(SUFFIX, KV_T, EXTRA)                                                                  \
int tandem_paged_decode_attention##SUFFIX(                                                         \
    const float *q, const KV_T *kv_cache, const int64_t *block_tables,                             \
    const int64_t *context_lens, float *out, int64_t num_seqs, int64_t num_heads,                  \
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks,                \
    int64_t table_stride, int64_t heads_per_item, float scale, int num_threads) {                  \
    const int64_t group = num_heads / num_kv_heads;                                                \
    if (HAS_VECTOR_PATH && head_dim % VECTOR_LANES == 0 && head_dim <= 256) {                      \
        const int64_t spans = span_count(context_lens, num_seqs, num_kv_heads, group, num_threads); \
        if (spans > 1)                                                                             \
            return attend_spans##SUFFIX(q, kv_cache, block_tables, context_lens, out, num_seqs,    \
                                        num_heads, num_kv_heads, head_dim, block_size, num_blocks, \
                                        table_stride, spans, scale, num_threads);                  \
    }                                                                                              \
    const int64_t slices = group / heads_per_item;                                                 \
    const int64_t items = num_seqs * num_kv_heads * slices;                                        \
    const int64_t head_stride = num_blocks * block_size * (head_dim + (EXTRA)); /* a kv head's */  \
    const int64_t rotation = (EXTRA) ? int8_rotation(head_dim) : 0;                                \
    const int64_t item_values = heads_per_item * head_dim;                                         \
    const KV_T *k_base = kv_cache;                                                                 \
    const KV_T *v_base = kv_cache + num_kv_heads * head_stride;                                    \
    int failed = 0;                                                                                \
_Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : failed)")    \
    for (int64_t item = 0; item < items; item++) {                                                 \
        const int64_t seq = item / (num_kv_heads * slices);                                        \
        const int64_t kv_head = (item / slices) % num_kv_heads;                                    \
        const int64_t first_head = kv_head * group + (item % slices) * heads_per_item;             \
        const int64_t len = context_lens[seq];                                                     \
        const int64_t *table = block_tables + seq * table_stride;                                  \
        const KV_T *k_head = k_base + kv_head * head_stride;                                       \
        const KV_T *v_head = v_base + kv_head * head_stride;                                       \
        const float *q_rows = q + (seq * num_heads + first_head) * head_dim;                       \
        float *out_rows = out + (seq * num_heads + first_head) * head_dim;                         \
        float rotated_q[rotation ? item_values : 1];                                               \
        q_rows = rotated_query(q_rows, rotated_q, item_values, rotation);                          \
        if (HAS_VECTOR_PATH && head_dim % VECTOR_LANES == 0 && head_dim <= 256 && heads_per_item <= 16) { \
            attend_vector##SUFFIX(q_rows, out_rows, k_head, v_head, table, 0, len, heads_per_item, \
                                  head_dim, block_size, scale, NULL);                              \
        } else {                                                                                   \
            float *scores = malloc(sizeof(float) * (size_t)(heads_per_item * (len > 0 ? len : 1)));\
            if (scores == NULL) {                                                                  \
                failed = 1;                                                                        \
                continue;                                                                          \
            }                                                                                      \
            switch (head_dim) {                                                                    \
            case 64:                                                                               \
                attend_item##SUFFIX(q_rows, out_rows, k_head, v_head, table, len, heads_per_item, 64,\
                                    block_size, scale, scores);                                    \
                break;                                                                             \
            case 128:                                                                              \
                attend_item##SUFFIX(q_rows, out_rows, k_head, v_head, table, len, heads_per_item, 128,\
                                    block_size, scale, scores);                                    \
                break;                                                                             \
            default:                                                                               \
                attend_item##SUFFIX(q_rows, out_rows, k_head, v_head, table, len, heads_per_item,  \
                                    head_dim, block_size, scale, scores);                          \
            }                                                                                      \
            free(scores);                                                                          \
        }                                                                                          \
        if (rotation) rotate_runs(out_rows, item_values, rotation);                                \
    }                                                                                              \
    return failed ? -1 : 0;                                                                        \
}

DEFINE_ENTRY(, float, 0)
DEFINE_ENTRY(_bf16, uint16_t, 0)
DEFINE_ENTRY(_i8, int8_t, 4)
DEFINE_ENTRY(_f8, uint8_t, 0)

/* Which path a decode step of bf16 queries over a bf16 cache takes here (logged at start). */
const char *tandem_decode_attention_isa(void) {
#ifdef HAS_DP_PATH
    return "AVX-512-BF16 dot products";
#else
    return VECTOR_ISA;
#endif
}

/* Store this step's keys and values ([tokens, kv_heads, head_dim] rows, `key_stride` /
 * `value_stride` elements apart: views into the fused qkv projection) into their cache slots,
 * elements of `element_bytes` (4: fp32, 2: bf16) in both. One small copy per (token, kv head,
 * K or V); index_copy_ costs ~70 us a call here. */
void tandem_write_kv(
    const char *key, const char *value, char *kv_cache, const int64_t *slots,
    int64_t num_tokens, int64_t key_stride, int64_t value_stride, int64_t num_kv_heads,
    int64_t head_dim, int64_t num_slots, int64_t element_bytes, int num_threads) {
    char *k_base = kv_cache;
    char *v_base = kv_cache + num_kv_heads * num_slots * head_dim * element_bytes;
    const size_t row_bytes = (size_t)element_bytes * (size_t)head_dim;
    key_stride *= element_bytes;
    value_stride *= element_bytes;
    /* Slots are scattered, so each row is a cache miss on write: split the rows over the
     * threads when there are enough to pay for waking them. */
#pragma omp parallel for schedule(static) num_threads(num_tokens >= 16 ? num_threads : 1)
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slots[t];
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t offset = (h * num_slots + slot) * (int64_t)row_bytes;
            memcpy(k_base + offset, key + t * key_stride + h * (int64_t)row_bytes, row_bytes);
            memcpy(v_base + offset, value + t * value_stride + h * (int64_t)row_bytes, row_bytes);
        }
    }
}

enum { KV_FP32 = 0, KV_BF16 = 1, KV_INT8 = 2, KV_FP8 = 3 };

/* Whether tandem_decode_attention, called by every thread of a parallel region, runs as that
 * region's team (the bf16 dot-product path: bf16 queries over a bf16 cache with AVX-512-BF16).
 * Elsewhere it must be called from outside any region (decode_stack.c asks first). */
int tandem_decode_attention_in_team(int q_bf16, int kv_kind, int64_t head_dim, int64_t heads_per_item) {
#ifdef HAS_DP_PATH
    return q_bf16 && kv_kind == KV_BF16 && head_dim % 32 == 0 && head_dim <= 256 && heads_per_item <= MAX_GROUP;
#else
    (void)q_bf16, (void)kv_kind, (void)head_dim, (void)heads_per_item;
    return 0;
#endif
}

/* The decode attention as the model calls it: q [seqs, heads, head_dim] fp32 or bf16
 * (`q_bf16`), its sequences `q_stride` elements apart (a view into the fused qkv projection),
 * out [seqs, heads, head_dim] contiguous in q's dtype, from an fp32, bf16, int8 or fp8 cache
 * (`kv_kind` 0, 1, 2 or 3: KV_FP32, KV_BF16, KV_INT8, KV_FP8). q is widened and out narrowed here, in one pass each, instead of a torch cast
 * and copy on either side of the call. Called by every thread of a parallel region where
 * tandem_decode_attention_in_team says so, it is that team's (paged_decode_attention_dp_team).
 * Returns 0, or -1 when an allocation failed. */
int tandem_decode_attention(
    const void *q, int q_bf16, int64_t q_stride, const void *kv_cache, int kv_kind, const int64_t *block_tables,
    const int64_t *context_lens, void *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, int64_t num_blocks, int64_t table_stride, int64_t heads_per_item,
    float scale, int num_threads) {
#ifdef HAS_DP_PATH
    if (omp_in_parallel() && tandem_decode_attention_in_team(q_bf16, kv_kind, head_dim, heads_per_item))
        return paged_decode_attention_dp_team(q, q_stride, kv_cache, block_tables, context_lens, out, num_seqs,
                                              num_heads, num_kv_heads, head_dim, block_size, num_blocks, table_stride,
                                              heads_per_item, scale);
    if (q_bf16 && kv_kind == KV_BF16 && head_dim % 32 == 0 && head_dim <= 256 && heads_per_item <= MAX_GROUP) {
        return paged_decode_attention_dp(q, q_stride, kv_cache, block_tables, context_lens, out, num_seqs,
                                         num_heads, num_kv_heads, head_dim, block_size, num_blocks, table_stride,
                                         heads_per_item, scale, num_threads);
    }
#endif
    const int64_t width = num_heads * head_dim;
    const int dense_fp32 = !q_bf16 && q_stride == width;
    float *q32 = dense_fp32 ? (float *)q : malloc(sizeof(float) * (size_t)(num_seqs * width));
    float *out32 = q_bf16 ? malloc(sizeof(float) * (size_t)(num_seqs * width)) : (float *)out;
    int status = -1;
    if (q32 != NULL && out32 != NULL) {
        if (!dense_fp32) {
            for (int64_t s = 0; s < num_seqs; s++) {
                if (q_bf16) {
                    const uint16_t *row = (const uint16_t *)q + s * q_stride;
                    for (int64_t i = 0; i < width; i++) q32[s * width + i] = bf16_to_float(row[i]);
                } else {
                    memcpy(q32 + s * width, (const float *)q + s * q_stride, sizeof(float) * (size_t)width);
                }
            }
        }
        if (kv_kind == KV_INT8)
            status = tandem_paged_decode_attention_i8(q32, kv_cache, block_tables, context_lens, out32, num_seqs,
                                                      num_heads, num_kv_heads, head_dim, block_size, num_blocks,
                                                      table_stride, heads_per_item, scale, num_threads);
        else if (kv_kind == KV_FP8)
            status = tandem_paged_decode_attention_f8(q32, kv_cache, block_tables, context_lens, out32, num_seqs,
                                                      num_heads, num_kv_heads, head_dim, block_size, num_blocks,
                                                      table_stride, heads_per_item, scale, num_threads);
        else
        status = kv_kind == KV_BF16
            ? tandem_paged_decode_attention_bf16(q32, kv_cache, block_tables, context_lens, out32, num_seqs, num_heads,
                                                 num_kv_heads, head_dim, block_size, num_blocks, table_stride,
                                                 heads_per_item, scale, num_threads)
            : tandem_paged_decode_attention(q32, kv_cache, block_tables, context_lens, out32, num_seqs, num_heads,
                                            num_kv_heads, head_dim, block_size, num_blocks, table_stride,
                                            heads_per_item, scale, num_threads);
        if (q_bf16)
            for (int64_t i = 0; i < num_seqs * width; i++) ((uint16_t *)out)[i] = float_to_bf16(out32[i]);
    }
    if (!dense_fp32) free(q32);
    if (q_bf16) free(out32);
    return status;
}

/* Store this step's keys and values into an int8 cache (kv_format.py's quantize_rows): each
 * (token, kv head) row of fp32 or bf16 (`src_bf16`) values is rotated (rotate_runs), scaled by
 * 127 over its largest magnitude, rounded to nearest even, and followed by its fp32 scale
 * (largest / 127). The rotation's butterflies sum in another order than quantize_rows's
 * matmul, so a value lying within a few units in the last place of a rounding boundary may
 * round the other way. Rows of the cache are head_dim + 4 bytes; strides as tandem_write_kv's,
 * in source elements. */
void tandem_write_kv_i8(
    const void *key, const void *value, int src_bf16, uint8_t *kv_cache, const int64_t *slots,
    int64_t num_tokens, int64_t key_stride, int64_t value_stride, int64_t num_kv_heads,
    int64_t head_dim, int64_t num_slots, int num_threads) {
    const int64_t row_bytes = head_dim + 4;
    const int64_t rotation = int8_rotation(head_dim);
    uint8_t *v_base = kv_cache + num_kv_heads * num_slots * row_bytes;
#pragma omp parallel for schedule(static) num_threads(num_tokens >= 16 ? num_threads : 1)
    for (int64_t t = 0; t < num_tokens; t++) {
        float row[head_dim];
        for (int plane = 0; plane < 2; plane++) {
            const int64_t stride = plane ? value_stride : key_stride;
            const void *source = plane ? value : key;
            uint8_t *base = plane ? v_base : kv_cache;
            for (int64_t h = 0; h < num_kv_heads; h++) {
                const int64_t first = t * stride + h * head_dim;
                for (int64_t i = 0; i < head_dim; i++)
                    row[i] = src_bf16 ? bf16_to_float(((const uint16_t *)source)[first + i])
                                      : ((const float *)source)[first + i];
                if (rotation) rotate_runs(row, head_dim, rotation);
                float top = 0.0f;
                for (int64_t i = 0; i < head_dim; i++) {
                    const float magnitude = fabsf(row[i]);
                    top = magnitude > top ? magnitude : top;
                }
                const float scale = top / 127.0f;
                const float inverse = top > 0.0f ? 127.0f / top : 0.0f;
                uint8_t *target = base + (h * num_slots + slots[t]) * row_bytes;
                for (int64_t i = 0; i < head_dim; i++) {
                    float rounded = nearbyintf(row[i] * inverse);
                    rounded = rounded > 127.0f ? 127.0f : (rounded < -127.0f ? -127.0f : rounded);
                    ((int8_t *)target)[i] = (int8_t)rounded;
                }
                memcpy(target + head_dim, &scale, sizeof scale);
            }
        }
    }
}

/* One value rounded to float8 e4m3 as torch's clamp(-448, 448) then cast does: to nearest,
 * ties to even, magnitudes past 448 saturated, NaN kept NaN. Below 2^-6 the step is 2^-9 (the
 * subnormals, and 2^-6 itself where a value rounds up to it); above, the fp32's mantissa is
 * rounded to three bits with the carry running into the exponent. */
static inline uint8_t float_to_fp8(float x) {
    union { float f; uint32_t u; } bits = {.f = x};
    const uint8_t sign = (uint8_t)((bits.u >> 24) & 0x80u);
    if ((bits.u & 0x7fffffffu) > 0x7f800000u) return sign | 0x7fu;
    float magnitude = fabsf(x);
    magnitude = magnitude < 448.0f ? magnitude : 448.0f;
    if (magnitude < 0.015625f) return sign | (uint8_t)(int32_t)rintf(magnitude * 512.0f);
    union { float f; uint32_t u; } m = {.f = magnitude};
    const uint32_t rounded = m.u + 0x7ffffu + ((m.u >> 20) & 1u);
    return sign | (uint8_t)((rounded >> 20) - (120u << 3));
}

#if defined(__AVX512F__)
/* float_to_fp8 on 16 values at once: the same two roundings (below 2^-6 a multiple of 2^-9,
 * by vcvtps2dq's nearest-even; above, the mantissa's carry into the exponent), picked per
 * lane, then narrowed to bytes. A 2,048-token chunk of SmolLM2's keys and values (3 kv heads
 * of 64, two threads, the 2-core AVX-512 EPYC): 0.10-0.11 ms, the scalar loop 0.14-0.21. */
static inline __m128i fp8_of16(__m512 x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80));
    const __m512i magnitude_bits = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(magnitude_bits, _mm512_set1_epi32(0x7f800000));
    const __m512 magnitude = _mm512_min_ps(_mm512_castsi512_ps(magnitude_bits), _mm512_set1_ps(448.0f));
    const __m512i m = _mm512_castps_si512(magnitude);
    const __m512i carry = _mm512_and_si512(_mm512_srli_epi32(m, 20), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(m, _mm512_set1_epi32(0x7ffff)), carry);
    const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(rounded, 20), _mm512_set1_epi32(120 << 3));
    const __m512i small = _mm512_cvtps_epi32(_mm512_mul_ps(magnitude, _mm512_set1_ps(512.0f)));
    const __mmask16 is_small = _mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(0.015625f), _CMP_LT_OQ);
    __m512i code = _mm512_mask_blend_epi32(is_small, normal, small);
    code = _mm512_mask_blend_epi32(nan, code, _mm512_set1_epi32(0x7f));
    return _mm512_cvtepi32_epi8(_mm512_or_si512(code, sign));
}
#endif

/* Store this step's keys and values into an fp8 cache: each (token, kv head) row of fp32 or
 * bf16 (`src_bf16`) values times `key_multiplier` / `value_multiplier` (one over the layer's
 * power-of-two scales: exact, as the layer's division is; 1 where the caller divided them
 * already), rounded by float_to_fp8. Rows of the cache are head_dim bytes; strides as
 * tandem_write_kv's, in source elements. */
void tandem_write_kv_f8(
    const void *key, const void *value, int src_bf16, uint8_t *kv_cache, const int64_t *slots,
    int64_t num_tokens, int64_t key_stride, int64_t value_stride, int64_t num_kv_heads,
    int64_t head_dim, int64_t num_slots, float key_multiplier, float value_multiplier, int num_threads) {
    uint8_t *v_base = kv_cache + num_kv_heads * num_slots * head_dim;
#pragma omp parallel for schedule(static) num_threads(num_tokens >= 16 ? num_threads : 1)
    for (int64_t t = 0; t < num_tokens; t++) {
        for (int plane = 0; plane < 2; plane++) {
            const void *source = plane ? value : key;
            const int64_t stride = plane ? value_stride : key_stride;
            uint8_t *base = plane ? v_base : kv_cache;
            const float multiplier = plane ? value_multiplier : key_multiplier;
            for (int64_t h = 0; h < num_kv_heads; h++) {
                const int64_t first = t * stride + h * head_dim;
                uint8_t *target = base + (h * num_slots + slots[t]) * head_dim;
                int64_t i = 0;
#if defined(__AVX512F__)
                const __m512 times = _mm512_set1_ps(multiplier);
                for (; i + 16 <= head_dim; i += 16) {
                    const __m512 x = src_bf16
                        ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                              _mm256_loadu_si256((const __m256i *)((const uint16_t *)source + first + i))), 16))
                        : _mm512_loadu_ps((const float *)source + first + i);
                    _mm_storeu_si128((__m128i *)(target + i), fp8_of16(_mm512_mul_ps(x, times)));
                }
#endif
                for (; i < head_dim; i++) {
                    const float x = src_bf16 ? bf16_to_float(((const uint16_t *)source)[first + i])
                                             : ((const float *)source)[first + i];
                    target[i] = float_to_fp8(x * multiplier);
                }
            }
        }
    }
}

/* Store this step's fp32 keys and values into a bf16 cache (--kv-cache-dtype bfloat16 under
 * an fp32 model), each value rounded to nearest even as torch's cast. The signature is the
 * int8 and fp8 writers' (`src_bf16` must be 0: bf16 rows go in by tandem_write_kv). */
void tandem_write_kv_bf16(
    const void *key, const void *value, int src_bf16, uint16_t *kv_cache, const int64_t *slots,
    int64_t num_tokens, int64_t key_stride, int64_t value_stride, int64_t num_kv_heads,
    int64_t head_dim, int64_t num_slots, int num_threads) {
    (void)src_bf16;
    uint16_t *v_base = kv_cache + num_kv_heads * num_slots * head_dim;
#pragma omp parallel for schedule(static) num_threads(num_tokens >= 16 ? num_threads : 1)
    for (int64_t t = 0; t < num_tokens; t++) {
        for (int plane = 0; plane < 2; plane++) {
            const float *source = (const float *)(plane ? value : key) + t * (plane ? value_stride : key_stride);
            uint16_t *base = plane ? v_base : kv_cache;
            for (int64_t h = 0; h < num_kv_heads; h++) {
                uint16_t *target = base + (h * num_slots + slots[t]) * head_dim;
                for (int64_t i = 0; i < head_dim; i++) target[i] = float_to_bf16(source[h * head_dim + i]);
            }
        }
    }
}

/* The blocks `block_ids[0..n)` of an int8 or fp8 cache (`kv_kind` KV_INT8, KV_FP8) widened into
 * a dense cache of fp32 or bf16 (`out_bf16`) of n blocks, [2, kv_heads, n, block_size,
 * head_dim], for the prefill kernel, which reads a cache of its queries' dtype: an int8 row's
 * values times its scale, rotated back (kv_format.py's dequantize_rows, the rotation summed as
 * the writer's butterflies), an fp8 value widened exactly; bf16 rounded to nearest even. In
 * torch the same took 1.7 (fp8) and 2.9 ms (int8) a layer for 2,048 tokens of SmolLM2's heads. */
void tandem_widen_blocks(const uint8_t *kv_cache, int kv_kind, const int64_t *block_ids, int64_t n,
                         int64_t num_kv_heads, int64_t num_blocks, int64_t block_size, int64_t head_dim,
                         void *out, int out_bf16, int num_threads) {
    const int64_t row_bytes = kv_kind == KV_INT8 ? head_dim + 4 : head_dim;
    const int64_t rotation = kv_kind == KV_INT8 ? int8_rotation(head_dim) : 0;
    const int64_t items = 2 * num_kv_heads * n; /* (plane, kv head, block) */
#pragma omp parallel for schedule(static) num_threads(items >= 8 ? num_threads : 1)
    for (int64_t item = 0; item < items; item++) {
        const int64_t head_plane = item / n, b = item % n; /* plane * kv_heads + head */
        const uint8_t *block = kv_cache + (head_plane * num_blocks + block_ids[b]) * block_size * row_bytes;
        const int64_t first = (head_plane * n + b) * block_size * head_dim;
        float row[head_dim];
        for (int64_t t = 0; t < block_size; t++) {
            const uint8_t *source = block + t * row_bytes;
            int64_t i = 0;
            if (kv_kind == KV_INT8) {
                float scale;
                memcpy(&scale, source + head_dim, sizeof scale);
                for (; i < head_dim; i++) row[i] = (float)((const int8_t *)source)[i] * scale;
                if (rotation) rotate_runs(row, head_dim, rotation);
            } else {
#if defined(__AVX512F__)
                for (; i + 16 <= head_dim; i += 16) _mm512_storeu_ps(row + i, load16_f8(source + i));
#endif
                for (; i < head_dim; i++) row[i] = fp8_to_float(source[i]);
            }
            if (out_bf16)
                for (i = 0; i < head_dim; i++) ((uint16_t *)out)[first + t * head_dim + i] = float_to_bf16(row[i]);
            else
                memcpy((float *)out + first + t * head_dim, row, sizeof(float) * (size_t)head_dim);
        }
    }
}
