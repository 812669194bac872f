/*
 * Decode attention straight from the paged KV cache, for CPUs.
 *
 * One query token per sequence attends to its sequence's cached keys/values, read block by
 * block through the block table: no gathered copy of the context, one pass over K and one
 * over V. Exact softmax (scores kept, then max, exp, sum), fp32 arithmetic throughout; the
 * cache is fp32 or bf16 (`_bf16` entry points: each cached value widened to fp32 as it is
 * read, which is exact), q and out are fp32 either way.
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

/* bf16 is the top half of an fp32: widening is a shift. */
static inline float widen(uint16_t x) {
    union { uint32_t u; float f; } bits = {.u = (uint32_t)x << 16};
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

/* Blocks lie anywhere in the pool, and one kv head's block is often a page of its own, where
 * hardware prefetchers stop: ask for the next block while this one is being read. */
static void prefetch_block(const void *block, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)block + i, 0, 1);
}

/* One work item: `heads` query heads (rows of q/out) over one kv head of one sequence.
 * Inlined with head_dim a literal where it is a common size, so the dot products and
 * accumulations unroll into whole vector registers. Written once for each cache element
 * type (KV_T: float or uint16_t holding bf16; DOT and AXPY read that type). */
#define DEFINE_ATTEND(SUFFIX, KV_T, DOT, AXPY)                                                    \
static inline __attribute__((always_inline)) void attend_item##SUFFIX(                           \
    const float *q_rows, float *out_rows, const KV_T *k_head, const KV_T *v_head,                \
    const int64_t *table, int64_t len, int64_t heads, const int64_t head_dim,                    \
    int64_t block_size, float scale, float *scores) {                                            \
    const int64_t used_blocks = (len + block_size - 1) / block_size;                             \
    const int64_t block_values = block_size * head_dim;                                          \
    const int64_t block_bytes = block_values * (int64_t)sizeof(KV_T);                            \
    for (int64_t b = 0; b < used_blocks; b++) {                                                  \
        if (b + 1 < used_blocks) prefetch_block(k_head + table[b + 1] * block_values, block_bytes); \
        prefetch_block(v_head + table[b] * block_values, block_bytes); /* for the V pass */      \
        const KV_T *k_block = k_head + table[b] * block_values;                                  \
        const int64_t end = (b + 1) * block_size < len ? (b + 1) * block_size : len;             \
        for (int64_t t = b * block_size; t < end; t++) {                                         \
            const KV_T *k = k_block + (t - b * block_size) * head_dim;                           \
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
            const KV_T *v = v_block + (t - b * block_size) * head_dim;                           \
            for (int64_t g = 0; g < heads; g++)                                                  \
                AXPY(out_rows + g * head_dim, scores[g * len + t], v, (int)head_dim);            \
        }                                                                                        \
    }                                                                                            \
}

DEFINE_ATTEND(, float, dot, axpy)
DEFINE_ATTEND(_bf16, uint16_t, dot_bf16, axpy_bf16)

/* Returns 0, or -1 when a scratch allocation failed (out is then incomplete). */
#define DEFINE_ENTRY(SUFFIX, KV_T)                                                               \
int tandem_paged_decode_attention##SUFFIX(                                                       \
    const float *q, const KV_T *kv_cache, const int64_t *block_tables,                           \
    const int64_t *context_lens, float *out, int64_t num_seqs, int64_t num_heads,                \
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks,              \
    int64_t table_stride, int64_t heads_per_item, float scale, int num_threads) {                \
    const int64_t group = num_heads / num_kv_heads;                                              \
    const int64_t slices = group / heads_per_item;                                               \
    const int64_t items = num_seqs * num_kv_heads * slices;                                      \
    const int64_t head_stride = num_blocks * block_size * head_dim; /* one kv head's blocks */   \
    const KV_T *k_base = kv_cache;                                                               \
    const KV_T *v_base = kv_cache + num_kv_heads * head_stride;                                  \
    int failed = 0;                                                                              \
_Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : failed)") \
    for (int64_t item = 0; item < items; item++) {                                               \
        const int64_t seq = item / (num_kv_heads * slices);                                      \
        const int64_t kv_head = (item / slices) % num_kv_heads;                                  \
        const int64_t first_head = kv_head * group + (item % slices) * heads_per_item;           \
        const int64_t len = context_lens[seq];                                                   \
        const int64_t *table = block_tables + seq * table_stride;                                \
        const KV_T *k_head = k_base + kv_head * head_stride;                                     \
        const KV_T *v_head = v_base + kv_head * head_stride;                                     \
        const float *q_rows = q + (seq * num_heads + first_head) * head_dim;                     \
        float *out_rows = out + (seq * num_heads + first_head) * head_dim;                       \
        float *scores = malloc(sizeof(float) * (size_t)(heads_per_item * (len > 0 ? len : 1)));  \
        if (scores == NULL) {                                                                    \
            failed = 1;                                                                          \
            continue;                                                                            \
        }                                                                                        \
        switch (head_dim) {                                                                      \
        case 64:                                                                                 \
            attend_item##SUFFIX(q_rows, out_rows, k_head, v_head, table, len, heads_per_item, 64, \
                                block_size, scale, scores);                                      \
            break;                                                                               \
        case 128:                                                                                \
            attend_item##SUFFIX(q_rows, out_rows, k_head, v_head, table, len, heads_per_item, 128, \
                                block_size, scale, scores);                                      \
            break;                                                                               \
        default:                                                                                 \
            attend_item##SUFFIX(q_rows, out_rows, k_head, v_head, table, len, heads_per_item,    \
                                head_dim, block_size, scale, scores);                            \
        }                                                                                        \
        free(scores);                                                                            \
    }                                                                                            \
    return failed ? -1 : 0;                                                                      \
}

DEFINE_ENTRY(, float)
DEFINE_ENTRY(_bf16, uint16_t)

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
