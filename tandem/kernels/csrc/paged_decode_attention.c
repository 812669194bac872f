/*
 * Decode attention straight from the paged KV cache, for CPUs.
 *
 * One query token per sequence attends to its sequence's cached keys/values, read block by
 * block through the block table: no gathered copy of the context, one pass over K and one
 * over V. Exact softmax (scores kept, then max, exp, sum), fp32 throughout.
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

/* Blocks lie anywhere in the pool, and one kv head's block is often a page of its own, where
 * hardware prefetchers stop: ask for the next block while this one is being read. */
static void prefetch_block(const float *block, int64_t floats) {
    for (int64_t i = 0; i < floats; i += 16) __builtin_prefetch(block + i, 0, 1);
}

/* One work item: `heads` query heads (rows of q/out) over one kv head of one sequence.
 * Inlined with head_dim a literal where it is a common size, so the dot products and
 * accumulations unroll into whole vector registers. */
static inline __attribute__((always_inline)) void attend_item(
    const float *q_rows, float *out_rows, const float *k_head, const float *v_head,
    const int64_t *table, int64_t len, int64_t heads, const int64_t head_dim,
    int64_t block_size, float scale, float *scores) {
    const int64_t used_blocks = (len + block_size - 1) / block_size;
    const int64_t block_floats = block_size * head_dim;
    for (int64_t b = 0; b < used_blocks; b++) {
        if (b + 1 < used_blocks) prefetch_block(k_head + table[b + 1] * block_floats, block_floats);
        prefetch_block(v_head + table[b] * block_floats, block_floats); /* for the V pass */
        const float *k_block = k_head + table[b] * block_floats;
        const int64_t end = (b + 1) * block_size < len ? (b + 1) * block_size : len;
        for (int64_t t = b * block_size; t < end; t++) {
            const float *k = k_block + (t - b * block_size) * head_dim;
            for (int64_t g = 0; g < heads; g++)
                scores[g * len + t] = dot(q_rows + g * head_dim, k, (int)head_dim) * scale;
        }
    }
    for (int64_t g = 0; g < heads; g++) {
        float *row = scores + g * len;
        float top = -INFINITY;
        for (int64_t t = 0; t < len; t++) top = row[t] > top ? row[t] : top;
        float total = 0.0f;
        for (int64_t t = 0; t < len; t++) {
            row[t] = expf(row[t] - top);
            total += row[t];
        }
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int64_t t = 0; t < len; t++) row[t] *= inv;
        memset(out_rows + g * head_dim, 0, sizeof(float) * (size_t)head_dim);
    }
    for (int64_t b = 0; b < used_blocks; b++) {
        const float *v_block = v_head + table[b] * block_floats;
        const int64_t end = (b + 1) * block_size < len ? (b + 1) * block_size : len;
        for (int64_t t = b * block_size; t < end; t++) {
            const float *v = v_block + (t - b * block_size) * head_dim;
            for (int64_t g = 0; g < heads; g++)
                axpy(out_rows + g * head_dim, scores[g * len + t], v, (int)head_dim);
        }
    }
}

/* Returns 0, or -1 when a scratch allocation failed (out is then incomplete). */
int tandem_paged_decode_attention(
    const float *q, const float *kv_cache, const int64_t *block_tables,
    const int64_t *context_lens, float *out, int64_t num_seqs, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks,
    int64_t table_stride, int64_t heads_per_item, float scale, int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t slices = group / heads_per_item;
    const int64_t items = num_seqs * num_kv_heads * slices;
    const int64_t head_stride = num_blocks * block_size * head_dim; /* one kv head's blocks */
    const float *k_base = kv_cache;
    const float *v_base = kv_cache + num_kv_heads * head_stride;
    int failed = 0;

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : failed)
    for (int64_t item = 0; item < items; item++) {
        const int64_t seq = item / (num_kv_heads * slices);
        const int64_t kv_head = (item / slices) % num_kv_heads;
        const int64_t first_head = kv_head * group + (item % slices) * heads_per_item;
        const int64_t len = context_lens[seq];
        const int64_t *table = block_tables + seq * table_stride;
        const float *k_head = k_base + kv_head * head_stride;
        const float *v_head = v_base + kv_head * head_stride;
        const float *q_rows = q + (seq * num_heads + first_head) * head_dim;
        float *out_rows = out + (seq * num_heads + first_head) * head_dim;
        float *scores = malloc(sizeof(float) * (size_t)(heads_per_item * (len > 0 ? len : 1)));
        if (scores == NULL) {
            failed = 1;
            continue;
        }
        switch (head_dim) {
        case 64:
            attend_item(q_rows, out_rows, k_head, v_head, table, len, heads_per_item, 64,
                        block_size, scale, scores);
            break;
        case 128:
            attend_item(q_rows, out_rows, k_head, v_head, table, len, heads_per_item, 128,
                        block_size, scale, scores);
            break;
        default:
            attend_item(q_rows, out_rows, k_head, v_head, table, len, heads_per_item, head_dim,
                        block_size, scale, scores);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* Store this step's keys and values ([tokens, kv_heads, head_dim] rows, `key_stride` /
 * `value_stride` floats apart: views into the fused qkv projection) into their cache slots.
 * One small copy per (token, kv head, K or V); index_copy_ costs ~70 us a call here. */
void tandem_write_kv(
    const float *key, const float *value, float *kv_cache, const int64_t *slots,
    int64_t num_tokens, int64_t key_stride, int64_t value_stride, int64_t num_kv_heads,
    int64_t head_dim, int64_t num_slots, int num_threads) {
    float *k_base = kv_cache;
    float *v_base = kv_cache + num_kv_heads * num_slots * head_dim;
    const size_t row_bytes = sizeof(float) * (size_t)head_dim;
    /* Slots are scattered, so each row is a cache miss on write: split the rows over the
     * threads when there are enough to pay for waking them. */
#pragma omp parallel for schedule(static) num_threads(num_tokens >= 16 ? num_threads : 1)
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slots[t];
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t offset = (h * num_slots + slot) * head_dim;
            memcpy(k_base + offset, key + t * key_stride + h * head_dim, row_bytes);
            memcpy(v_base + offset, value + t * value_stride + h * head_dim, row_bytes);
        }
    }
}
