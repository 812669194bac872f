/*
 * Prefill attention in fp32 with AVX-512, shaped as the packed GEMMs are (dense_gemm.c): a tile
 * of QUERY_ROWS query rows of one head against KEY_BLOCK keys at a time, the block's scores
 * (6 rows x 4 vectors of 16 keys) held in 24 registers over the whole head size, then the
 * output rows (6 rows x up to 4 vectors of 16 dims) in 24 registers over the block's keys.
 * Each product step loads 4 vectors and broadcasts 6 words for 24 FMAs, where the tiles of 16
 * queries in the lanes of a vector (prefill_attention.c) broadcast one key element an FMA.
 * The fp32 attention of a prefill-heavy run took 8% less time (the engine's own calls, the
 * 2-core AVX-512 EPYC, alternating processes: 1.49-1.66 s a pass against 1.71-1.77 s), its
 * calls replayed +10-12% (two threads; one thread: the same 150 GFLOP/s). With vdpbf16ps
 * the same shape was no faster than the lane tiles (451-460 against 469 GFLOP/s, replayed),
 * so bf16 products stay there: with products twice as fast, the softmax, which both shapes
 * pay alike (an exponential a score), is the larger share.
 *
 * The softmax is row-wise here: a row's maximum over a block is one horizontal reduction (4
 * vectors -> 1), its running sum a vector whose lanes are added at the end, and the rescaling
 * of a row's output rides on the load of its accumulators before the block's P.V. The scale
 * multiplies the scores after the products, as the reference rounds (a pre-scaled Q adds a
 * rounding that large scores magnify).
 *
 * Layouts, made once per call by `gather_transposed` from the paged cache (O(context * dim)):
 * K^T in 16-key groups [groups][dim][16], V in rows [padded][dim], both fp32 (a bf16 cache is
 * widened: this path also serves bf16 on AVX-512 CPUs without AVX-512-BF16). `padded` is the
 * context rounded up to KEY_BLOCK; keys past the context are zero and, being past every
 * query's position, masked.
 */
#ifndef TANDEM_PREFILL_ATTENTION_AVX512_H
#define TANDEM_PREFILL_ATTENTION_AVX512_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define QUERY_ROWS 6
#define KEY_BLOCK 64
#define BLOCK_VECTORS (KEY_BLOCK / 16)

typedef struct {
    const char *q;
    char *out;
    const char *keys;   /* per kv head: K^T groups (above) */
    const char *values; /* per kv head: V rows */
    size_t head_bytes;  /* of one kv head's keys, and of its values */
    int64_t q_len, cached, padded, num_heads, group, dim, q_stride, out_stride;
    int kind;           /* of q, the cache and out: 0 fp32, 1 bf16 (widened) */
    float log2_scale;   /* softmax scale * log2(e) */
} RowProblem;

/* 16 fp32 elements of a row of `kind` at `index`, widened from bf16 where it is bf16. */
static inline __m512 load16_as_f32(const char *base, int64_t index, int kind) {
    if (kind == 0) return _mm512_loadu_ps((const float *)base + index);
    const __m256i half = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + index));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

/* One kv head's keys and values in the layouts above. */
static void gather_transposed(const RowProblem *p, const char *k_head, const char *v_head,
                              const int64_t *block_ids, int64_t context, int64_t block_size, char *k_out,
                              char *v_out) {
    const int64_t dim = p->dim;
    const size_t element = p->kind == 0 ? 4 : 2, row = (size_t)dim * element;
    for (int64_t g = 0; g < p->padded / 16; g++) {
        const char *rows[16];
        for (int r = 0; r < 16; r++) {
            const int64_t t = g * 16 + r;
            rows[r] = t < context ? k_head + (size_t)(block_ids[t / block_size] * block_size + t % block_size) * row
                                  : NULL;
        }
        float *group_out = (float *)k_out + (size_t)g * dim * 16;
        for (int64_t d0 = 0; d0 < dim; d0 += 16) {
            __m512 block[16];
            for (int r = 0; r < 16; r++) block[r] = rows[r] ? load16_as_f32(rows[r], d0, p->kind) : _mm512_setzero_ps();
            transpose16(block);
            for (int i = 0; i < 16; i++) _mm512_storeu_ps(group_out + (d0 + i) * 16, block[i]);
        }
    }
    for (int64_t t = 0; t < p->padded; t++) {
        const char *source = t < context
            ? v_head + (size_t)(block_ids[t / block_size] * block_size + t % block_size) * row : NULL;
        float *v_row = (float *)v_out + t * dim;
        for (int64_t d = 0; d < dim; d += 16)
            _mm512_storeu_ps(v_row + d, source ? load16_as_f32(source, d, p->kind) : _mm512_setzero_ps());
    }
}

/* S[r][j] = sum over d of Q[r][d] K[key0 + 16 j + lane][d], for the first `vectors` groups of
 * the block: fp32 FMAs. */
static inline __attribute__((always_inline)) void block_scores_f32(const float *q_rows, int64_t q_pitch,
                                                                   const float *kt, int64_t dim, __m512 s[][BLOCK_VECTORS],
                                                                   const int vectors) {
    __m512 acc[QUERY_ROWS][BLOCK_VECTORS];
    for (int r = 0; r < QUERY_ROWS; r++)
        for (int j = 0; j < vectors; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d++) {
        __m512 b[BLOCK_VECTORS];
        for (int j = 0; j < vectors; j++) b[j] = _mm512_loadu_ps(kt + ((size_t)j * dim + d) * 16);
        for (int r = 0; r < QUERY_ROWS; r++) {
            const __m512 a = _mm512_set1_ps(q_rows[r * q_pitch + d]);
            for (int j = 0; j < vectors; j++) acc[r][j] = _mm512_fmadd_ps(a, b[j], acc[r][j]);
        }
    }
    for (int r = 0; r < QUERY_ROWS; r++)
        for (int j = 0; j < vectors; j++) s[r][j] = acc[r][j];
}

/* O[r][d0 ..] = O[r][d0 ..] * correction[r] + sum over the keys of P[r][k] V[k][d0 ..], for
 * `vectors` vectors of dims and the block's first `keys` keys: fp32 FMAs, V in rows. */
static inline __attribute__((always_inline)) void block_values_f32(const float *probs, const float *v_rows,
                                                                   int64_t dim, int64_t keys,
                                                                   const float *correction, float *o, int64_t o_pitch,
                                                                   const int vectors) {
    __m512 acc[QUERY_ROWS][4];
    for (int r = 0; r < QUERY_ROWS; r++) {
        const __m512 c = _mm512_set1_ps(correction[r]);
        for (int j = 0; j < vectors; j++) acc[r][j] = _mm512_mul_ps(_mm512_loadu_ps(o + r * o_pitch + 16 * j), c);
    }
    for (int64_t k = 0; k < keys; k++) {
        __m512 b[4];
        for (int j = 0; j < vectors; j++) b[j] = _mm512_loadu_ps(v_rows + k * dim + 16 * j);
        for (int r = 0; r < QUERY_ROWS; r++) {
            const __m512 a = _mm512_set1_ps(probs[r * KEY_BLOCK + k]);
            for (int j = 0; j < vectors; j++) acc[r][j] = _mm512_fmadd_ps(a, b[j], acc[r][j]);
        }
    }
    for (int r = 0; r < QUERY_ROWS; r++)
        for (int j = 0; j < vectors; j++) _mm512_storeu_ps(o + r * o_pitch + 16 * j, acc[r][j]);
}


/* The constant-count instances of the products (the loops fully unrolled, as dense_gemm.c's
 * tiles): `vectors` is 1-4. */
#define WITH_VECTORS(COUNT, CALL)                                                                     \
    switch (COUNT) {                                                                                  \
    case 1: CALL(1); break;                                                                           \
    case 2: CALL(2); break;                                                                           \
    case 3: CALL(3); break;                                                                           \
    default: CALL(4); break;                                                                          \
    }

/* One tile: query tokens [t0, t0 + rows) of query head `head`, rows <= QUERY_ROWS (the last
 * row repeated to fill the tile; only `rows` are written). */
static void attend_rows(const RowProblem *p, int64_t head, int64_t t0, int64_t rows) {
    const int64_t dim = p->dim, kv_head = head / p->group;
    const size_t element = p->kind == 0 ? 4 : 2;
    const char *keys = p->keys + kv_head * p->head_bytes, *values = p->values + kv_head * p->head_bytes;
    float q_rows[QUERY_ROWS * MAX_DIM] __attribute__((aligned(64)));
    float o[QUERY_ROWS * MAX_DIM] __attribute__((aligned(64)));
    float probs[QUERY_ROWS * KEY_BLOCK] __attribute__((aligned(64)));
    float correction[QUERY_ROWS] = {0};
    int64_t position[QUERY_ROWS];
    for (int r = 0; r < QUERY_ROWS; r++) {
        const int64_t token = t0 + (r < rows ? r : rows - 1);
        position[r] = p->cached + token;
        const char *row = p->q + (size_t)token * p->q_stride * element + (size_t)head * dim * element;
        for (int64_t d = 0; d < dim; d += 16) _mm512_storeu_ps(q_rows + r * dim + d, load16_as_f32(row, d, p->kind));
    }
    memset(o, 0, sizeof(float) * QUERY_ROWS * dim);
    __m512 top = _mm512_set1_ps(-1e30f);       /* lane r: row r's running maximum */
    __m512 total[QUERY_ROWS];                  /* row r's running sum, by lanes */
    for (int r = 0; r < QUERY_ROWS; r++) total[r] = _mm512_setzero_ps();
    const int degree = p->kind == 0 ? 7 : 5;
    const int64_t first = p->cached + t0, last = p->cached + t0 + rows - 1;
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int64_t key0 = 0; key0 <= last; key0 += KEY_BLOCK) {
        /* the block's groups that hold a key some row sees */
        const int vectors = (int)((last - key0) / 16 + 1 < BLOCK_VECTORS ? (last - key0) / 16 + 1 : BLOCK_VECTORS);
        __m512 s[QUERY_ROWS][BLOCK_VECTORS];
        const float *kt = (const float *)keys + (size_t)(key0 / 16) * dim * 16;
#define SCORES_F32(V) block_scores_f32(q_rows, dim, kt, dim, s, V)
        WITH_VECTORS(vectors, SCORES_F32)
#undef SCORES_F32
        const __m512 scale = _mm512_set1_ps(p->log2_scale);
        for (int r = 0; r < QUERY_ROWS; r++)
            for (int j = 0; j < vectors; j++) s[r][j] = _mm512_mul_ps(s[r][j], scale);
        /* causal mask (and the context's zero padding, past every position) */
        const int masked = key0 + 16 * vectors - 1 > first;
        float block_top[16] __attribute__((aligned(64)));
        for (int r = 0; r < QUERY_ROWS; r++) {
            __m512 m = _mm512_set1_ps(-1e30f);
            for (int j = 0; j < vectors; j++) {
                if (masked) {
                    const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32((int)(key0 + 16 * j)));
                    const __mmask16 visible = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32((int)position[r]));
                    s[r][j] = _mm512_mask_mov_ps(_mm512_set1_ps(-1e30f), visible, s[r][j]);
                }
                m = _mm512_max_ps(m, s[r][j]);
            }
            block_top[r] = _mm512_reduce_max_ps(m);
        }
        for (int r = QUERY_ROWS; r < 16; r++) block_top[r] = -1e30f;
        const __m512 new_top = _mm512_max_ps(top, _mm512_load_ps(block_top));
        const __m512 scaled = (__m512)exp2_nonpositive((vec)_mm512_sub_ps(top, new_top), degree);
        _mm512_store_ps(block_top, scaled); /* now each row's correction */
        top = new_top;
        float tops[16] __attribute__((aligned(64)));
        _mm512_store_ps(tops, top);
        for (int r = 0; r < QUERY_ROWS; r++) {
            correction[r] = block_top[r];
            const __m512 row_top = _mm512_set1_ps(tops[r]);
            __m512 sum = _mm512_mul_ps(total[r], _mm512_set1_ps(correction[r]));
            for (int j = 0; j < vectors; j++) {
                const __m512 prob = (__m512)exp2_nonpositive((vec)_mm512_sub_ps(s[r][j], row_top), degree);
                sum = _mm512_add_ps(sum, prob);
                _mm512_storeu_ps(probs + r * KEY_BLOCK + 16 * j, prob);
            }
            total[r] = sum;
        }
        /* the keys of the block any row sees */
        const int64_t keys_seen = last - key0 + 1 < 16 * vectors ? last - key0 + 1 : 16 * vectors;
        for (int64_t d0 = 0; d0 < dim; d0 += 64) {
            const int dims = (int)((dim - d0) / 16 < 4 ? (dim - d0) / 16 : 4);
            const float *v_rows = (const float *)values + (size_t)key0 * dim + d0;
#define VALUES_F32(V) block_values_f32(probs, v_rows, dim, keys_seen, correction, o + d0, dim, V)
            WITH_VECTORS(dims, VALUES_F32)
#undef VALUES_F32
        }
    }
    for (int r = 0; r < rows; r++) {
        const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total[r]));
        char *row = p->out + (size_t)(t0 + r) * p->out_stride * element + (size_t)head * dim * element;
        for (int64_t d = 0; d < dim; d += 16) {
            const __m512 value = _mm512_mul_ps(_mm512_loadu_ps(o + r * dim + d), inverse);
            if (p->kind == 0) {
                _mm512_storeu_ps((float *)row + d, value);
            } else { /* round to nearest even bf16 */
                const __m512i bits = _mm512_castps_si512(value);
                const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
                const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
                _mm256_storeu_si256((__m256i *)((uint16_t *)row + d), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
            }
        }
    }
}

/* The whole call: gather each kv head, then the tiles over the threads, a kv head's at a time
 * (its keys and values stay in the core's L2), the longest-context tiles first. */
static int prefill_attention_rows(const void *q, const void *kv_cache, const int64_t *block_ids, void *out,
                                  int64_t q_len, int64_t context_len, int64_t num_heads, int64_t num_kv_heads,
                                  int64_t head_dim, int64_t block_size, int64_t num_blocks, int64_t q_stride,
                                  int64_t out_stride, int kind, float scale, int num_threads) {
    const size_t element = kind == 0 ? 4 : 2;
    const int64_t padded = (context_len + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
    const size_t head_bytes = ((size_t)padded * head_dim * 4 + 63) / 64 * 64;
    char *keys = aligned_alloc(64, head_bytes * num_kv_heads);
    char *values = aligned_alloc(64, head_bytes * num_kv_heads);
    if (keys == NULL || values == NULL) {
        free(keys);
        free(values);
        return -1;
    }
    const RowProblem problem = {
        .q = q, .out = out, .keys = keys, .values = values, .head_bytes = head_bytes, .q_len = q_len, .cached = context_len - q_len, .padded = padded,
        .num_heads = num_heads, .group = num_heads / num_kv_heads, .dim = head_dim, .q_stride = q_stride,
        .out_stride = out_stride, .kind = kind, .log2_scale = scale * 1.4426950408889634f,
    };
    const size_t plane = (size_t)num_kv_heads * num_blocks * block_size * head_dim * element;
    const size_t cache_head = (size_t)num_blocks * block_size * head_dim * element;
#pragma omp parallel for schedule(static, 1) num_threads(num_threads)
    for (int64_t h = 0; h < num_kv_heads; h++)
        gather_transposed(&problem, (const char *)kv_cache + h * cache_head,
                          (const char *)kv_cache + plane + h * cache_head, block_ids, context_len, block_size,
                          keys + h * head_bytes, values + h * head_bytes);
    const int64_t tiles = (q_len + QUERY_ROWS - 1) / QUERY_ROWS, group = num_heads / num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < tiles * num_heads; item++) {
        const int64_t kv_head = item / (tiles * group), rest = item % (tiles * group);
        const int64_t tile = tiles - 1 - rest / group, head = kv_head * group + rest % group;
        const int64_t t0 = tile * QUERY_ROWS;
        attend_rows(&problem, head, t0, q_len - t0 < QUERY_ROWS ? q_len - t0 : QUERY_ROWS);
    }
    free(keys);
    free(values);
    return 0;
}
#endif
