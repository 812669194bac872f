/*
 * bf16 prefill attention on AMX tiles (included by prefill_attention.c where the build targets
 * a CPU with AMX-BF16): the same flash attention as the lane tiles (online softmax in fp32, P
 * rounded to bf16 for P.V, a chunk attending causally to its cached prefix and itself), with
 * both products on the tiles.
 *
 * Why: on a CPU with AMX the lane tiles' vdpbf16ps products ran at about 40% of PyTorch's
 * flash attention, which multiplies on the tiles through oneDNN, so bf16 prefill went to
 * PyTorch there; and the layer stack, whose one C call a step needs a C attention, could not
 * take prefill steps. With this path both are tandem's again.
 *
 * A work item is 16 query rows of one head (one A tile; a last tile of fewer rows is copied to
 * a zeroed buffer, so every tile has 16 rows) against its causal keys. The call first gathers
 * each kv head's K transposed in 32-bit words (the S products' B tiles, a dim pair a row) and
 * its V in key pairs (the P V products' B tiles), in registers (amx_gather_key_group,
 * amx_gather_value_pairs). Then, at head sizes 32 and 64, each range of 128 keys goes in three
 * phases (amx_attend_range_phased):
 *   S = Q K^T      every 16-key group's S on the tiles (Q's 32-dim chunks in tmm0-1, a block's
 *                  two groups in tmm2-3 and the next block's in tmm4-5, K^T through tmm6-7),
 *                  stored as [16][128] fp32
 *   softmax        row by row in AVX-512 over the whole range: causal mask, one maximum a row
 *                  (the 16 rows folded together), exp2 (a degree-3 polynomial: P is rounded to
 *                  bf16) written as bf16 over its own row of S, one row sum, one correction
 *   O += P V       the output's four 16-dim tiles loaded once a range (rescaled in memory
 *                  first where a row's maximum moved), P and V's B tiles through the range.
 * Where S, the softmax and P V took turns block by block (32 keys), each block's tile products
 * waited on the vector stores before them and paid a fold and a rescale; in phases, with the
 * gathers in registers, on the 2-core AMX Xeon: with random queries and keys, whose maxima
 * keep moving, SmolLM2's heads 1.15-1.3x as fast and Qwen2.5-0.5B's 1.1-1.16x; with the maxima
 * settled on a first key (an attention sink, as real heads have) 1.06-1.11x and 1.03-1.07x. In
 * the engine (one process, the layer stack's kernel swapped pass by pass): SmolLM2's
 * prefill-heavy 1.07x, Qwen2.5-0.5B's 8,000-token prompt unchanged. Head sizes above 64 go a
 * block at a time (amx_attend_range: S of the next block issued before this block's softmax, P
 * V stored and added to the output rows in memory), the accumulators for all of O not fitting
 * in the eight tiles.
 * Every tile has 16 rows of 64 bytes, so a thread configures them once.
 *
 * An item is one query tile for the query heads that share a kv head (the whole group, or a
 * divisor of it when there would be too few items to balance): they take turns over ranges of
 * keys, so a range's K and V come from memory once and from cache for the other heads.
 * One head an item read its kv head's whole K and V per tile: 2.25 MiB at 8,800 tokens and
 * head size 64, more than the core's L2, so every tile streamed it again from L3. Grouped,
 * 480 queries after 8,352 cached tokens took 14.0 ms instead of 17.5-18.0 at Qwen2.5-0.5B's
 * shapes, 25 ms instead of 42 at Qwen2.5-1.5B's (head size 128), on the 2-core AMX Xeon.
 */
#ifndef TANDEM_PREFILL_ATTENTION_AMX_H
#define TANDEM_PREFILL_ATTENTION_AMX_H
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"

#define AMX_KEYS 32 /* keys a block: one P tile's row */

/* Blocks a range: the heads of one item take turns over a range of blocks, so its K and V are
 * read from memory once per item and from cache by the other heads. Head sizes above 64 (one
 * block at a time): 512 keys, 128 KiB of K and V at head size 64 (256 and 1,024 keys were 1-5%
 * slower). Head sizes 32 and 64 (in phases): 128 keys, so a range's K and V (32 KiB at head
 * size 64) stay in L1 for the other heads; 64, 256 and 512 keys were 4-15% slower. */
#define AMX_RANGE_BLOCKS 16
#define AMX_PHASE_BLOCKS 4
#define AMX_PHASE_KEYS (AMX_PHASE_BLOCKS * AMX_KEYS)

static void amx_attention_configure(void) {
    AmxTileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.rows[t] = 16;
        config.bytes_per_row[t] = 64;
    }
    _tile_loadconfig(&config);
}

/* Keys [t0, t0 + 16) of one kv head transposed for the S tiles: `out` [dim / 2][16] 32-bit
 * words (a dim pair a row, key k in column k), each 16 words of the 16 rows through a 16 x 16
 * transpose in registers; keys at or past `context` are zero. A word at a time, the gathers
 * were ~20% of the kernel's time at SmolLM2's shapes, and their loop over kv heads left one of
 * two threads idle with 3 kv heads. */
static inline void amx_gather_key_group(const char *k_head, const int64_t *block_ids, int64_t context, int64_t t0,
                                        int64_t dim, int64_t block_size, uint32_t *out) {
    const uint32_t *rows[16];
    static const uint32_t zeros[MAX_DIM / 2] __attribute__((aligned(64)));
    for (int k = 0; k < 16; k++) {
        const int64_t t = t0 + k;
        rows[k] = t < context ? (const uint32_t *)(k_head + (size_t)(block_ids[t / block_size] * block_size + t % block_size) * dim * 2)
                              : zeros;
    }
    for (int64_t c = 0; c < dim / 32; c++) {
        __m512i r[16], a[16], b[16];
        for (int k = 0; k < 16; k++) r[k] = _mm512_loadu_si512(rows[k] + 16 * c);
        for (int k = 0; k < 16; k += 2) {
            a[k] = _mm512_unpacklo_epi32(r[k], r[k + 1]);
            a[k + 1] = _mm512_unpackhi_epi32(r[k], r[k + 1]);
        }
        for (int k = 0; k < 16; k += 4) {
            b[k] = _mm512_unpacklo_epi64(a[k], a[k + 2]);
            b[k + 1] = _mm512_unpackhi_epi64(a[k], a[k + 2]);
            b[k + 2] = _mm512_unpacklo_epi64(a[k + 1], a[k + 3]);
            b[k + 3] = _mm512_unpackhi_epi64(a[k + 1], a[k + 3]);
        }
        /* b[4i + j], 128-bit lane l: word 4l + j of rows 4i .. 4i + 3 */
        for (int k = 0; k < 16; k += 8)
            for (int j = 0; j < 4; j++) {
                a[k + j] = _mm512_shuffle_i32x4(b[k + j], b[k + 4 + j], 0x88);
                a[k + 4 + j] = _mm512_shuffle_i32x4(b[k + j], b[k + 4 + j], 0xDD);
            }
        for (int j = 0; j < 8; j++) {
            r[j] = _mm512_shuffle_i32x4(a[j], a[j + 8], 0x88);
            r[j + 8] = _mm512_shuffle_i32x4(a[j], a[j + 8], 0xDD);
        }
        /* r[m]: word 16c + m of the 16 keys, key k in lane k */
        for (int m = 0; m < 16; m++) _mm512_store_si512(out + (16 * c + m) * 16, r[m]);
    }
}

/* Keys [t0, t1) (even bounds) of one kv head's values in key pairs for the P V tiles: row t / 2
 * of `out` holds keys t and t + 1 interleaved dim by dim; keys at or past `context` are zero. */
static inline void amx_gather_value_pairs(const char *v_head, const int64_t *block_ids, int64_t context, int64_t t0,
                                          int64_t t1, int64_t dim, int64_t block_size, uint16_t *out) {
    static const uint16_t zeros[MAX_DIM] __attribute__((aligned(64)));
    const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                         39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
    for (int64_t t = t0; t < t1; t += 2) {
        const uint16_t *even = t < context ? (const uint16_t *)v_head + (block_ids[t / block_size] * block_size + t % block_size) * dim : zeros;
        const uint16_t *odd = t + 1 < context ? (const uint16_t *)v_head + (block_ids[(t + 1) / block_size] * block_size + (t + 1) % block_size) * dim : zeros;
        uint16_t *row = out + (t / 2) * dim * 2;
        for (int64_t d = 0; d < dim; d += 32) {
            const __m512i a = _mm512_loadu_si512(even + d), b = _mm512_loadu_si512(odd + d);
            _mm512_store_si512(row + 2 * d, _mm512_permutex2var_epi16(a, low, b));
            _mm512_store_si512(row + 2 * d + 32, _mm512_permutex2var_epi16(a, high, b));
        }
    }
}

/* P V for one block into `pv` [16][dim] fp32: tmm6 holds P; up to four 16-dim chunks a pass. */
static inline void amx_values(const char *v_block, int64_t dim, float *pv) {
    const int64_t v_stride = dim * 4; /* bytes from one key pair's row to the next */
    for (int64_t d0 = 0; d0 < dim; d0 += 64) {
        const int64_t chunks = (dim - d0) / 16 < 4 ? (dim - d0) / 16 : 4;
        _tile_zero(2);
        if (chunks > 1) _tile_zero(3);
        if (chunks > 2) _tile_zero(4);
        if (chunks > 3) _tile_zero(5);
        _tile_loadd(7, v_block + (d0 + 0) * 4, v_stride);
        _tile_dpbf16ps(2, 6, 7);
        _tile_stored(2, pv + d0, dim * 4);
        if (chunks > 1) {
            _tile_loadd(7, v_block + (d0 + 16) * 4, v_stride);
            _tile_dpbf16ps(3, 6, 7);
            _tile_stored(3, pv + d0 + 16, dim * 4);
        }
        if (chunks > 2) {
            _tile_loadd(7, v_block + (d0 + 32) * 4, v_stride);
            _tile_dpbf16ps(4, 6, 7);
            _tile_stored(4, pv + d0 + 32, dim * 4);
        }
        if (chunks > 3) {
            _tile_loadd(7, v_block + (d0 + 48) * 4, v_stride);
            _tile_dpbf16ps(5, 6, 7);
            _tile_stored(5, pv + d0 + 48, dim * 4);
        }
    }
}

/* Lane r of the result: the maximum (or sum) of the 8 values row r has across half[r / 2]
 * (rows 2i and 2i + 1 in 128-bit lanes 0-1 and 2-3 of half[i]). The rows are reduced together,
 * as a transpose would: four rows share a vector after one step, eight after two, and so on,
 * where a horizontal reduction a row took 8 instructions. */
static inline __m512 amx_fold_rows(const __m512 half[8], const int add) {
#define AMX_COMBINE(a, b) (add ? _mm512_add_ps((a), (b)) : _mm512_max_ps((a), (b)))
    __m512 quarter[4], eighth[2];
    for (int i = 0; i < 4; i++) /* rows 4i .. 4i + 3: 128-bit lane j holds row 4i + j */
        quarter[i] = AMX_COMBINE(_mm512_shuffle_f32x4(half[2 * i], half[2 * i + 1], 0x88),
                                 _mm512_shuffle_f32x4(half[2 * i], half[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* within a 128-bit lane j: rows 8i + j, 8i + 4 + j, two values each */
        eighth[i] = AMX_COMBINE(_mm512_shuffle_ps(quarter[2 * i], quarter[2 * i + 1], 0x44),
                                _mm512_shuffle_ps(quarter[2 * i], quarter[2 * i + 1], 0xEE));
    /* lane 4j + k: row 4k + j */
    const __m512 crossed = AMX_COMBINE(_mm512_shuffle_ps(eighth[0], eighth[1], 0x88),
                                       _mm512_shuffle_ps(eighth[0], eighth[1], 0xDD));
#undef AMX_COMBINE
    const __m512i rows = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(rows, crossed);
}

/* Two rows' 16 values each (a: row 2i, b: row 2i + 1) as half[i] of amx_fold_rows: 128-bit
 * lanes 0-1 row 2i, 2-3 row 2i + 1. */
static inline __m512 amx_pair_rows(__m512 a, __m512 b, const int add) {
    const __m512 low = _mm512_shuffle_f32x4(a, b, 0x44), high = _mm512_shuffle_f32x4(a, b, 0xEE);
    return add ? _mm512_add_ps(low, high) : _mm512_max_ps(low, high);
}

/* Each of 16 rows' maximum, rows [16][32] floats, as one vector (lane r: row r): 46
 * instructions, where a reduction a row took 128. */
static inline __m512 amx_rows_max(const float *s) {
    __m512 half[8];
    for (int i = 0; i < 8; i++)
        half[i] = amx_pair_rows(
            _mm512_max_ps(_mm512_load_ps(s + (2 * i) * AMX_KEYS), _mm512_load_ps(s + (2 * i) * AMX_KEYS + 16)),
            _mm512_max_ps(_mm512_load_ps(s + (2 * i + 1) * AMX_KEYS), _mm512_load_ps(s + (2 * i + 1) * AMX_KEYS + 16)),
            0);
    return amx_fold_rows(half, 0);
}

/* The online softmax of one block's scores s [16][32] (fp32, as the tiles stored them): causal
 * mask, each row's running maximum `top` (in unscaled scores: the scale is positive), its
 * `correction` (the factor the output so far is rescaled by), its running sum `sums` (lane r:
 * row r, the block's row sums folded together as the maxima are); P = 2^(scale (s - top))
 * rounded to bf16 into `probs` [16][32], one A tile. The scale is one FMA in the exponent's
 * argument. Returns whether every row's maximum stayed (every correction is 1). */
static inline int amx_softmax(const Problem *p, float *s, uint16_t *probs, float *top, float *sums,
                              float *correction, const int32_t *position, int64_t key0, int64_t first) {
    const __m512i key_lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 scale = _mm512_set1_ps(p->log2_scale);
    if (key0 + AMX_KEYS - 1 > first) /* a block on the diagonal: keys past a row's position masked */
        for (int r = 0; r < 16; r++) {
            const __m512i limit = _mm512_set1_epi32(position[r] - (int32_t)key0);
            const __mmask16 hidden0 = _mm512_cmpgt_epi32_mask(key_lane, limit);
            const __mmask16 hidden1 = _mm512_cmpgt_epi32_mask(_mm512_add_epi32(key_lane, _mm512_set1_epi32(16)), limit);
            _mm512_mask_store_ps(s + r * AMX_KEYS, hidden0, _mm512_set1_ps(-1e30f));
            _mm512_mask_store_ps(s + r * AMX_KEYS + 16, hidden1, _mm512_set1_ps(-1e30f));
        }
    const __m512 old_top = _mm512_load_ps(top);
    const __m512 new_top = _mm512_max_ps(old_top, amx_rows_max(s));
    const __m512 shift = _mm512_mul_ps(_mm512_sub_ps(old_top, new_top), scale);
    _mm512_store_ps(correction, (__m512)exp2_nonpositive((vec)shift, 5));
    _mm512_store_ps(top, new_top);
    float offsets[16] __attribute__((aligned(64)));
    _mm512_store_ps(offsets, _mm512_mul_ps(new_top, scale));
    __m512 half[8], even = _mm512_setzero_ps();
    for (int r = 0; r < 16; r++) {
        /* a masked score is -1e30: its exponential is 0 */
        const __m512 offset = _mm512_set1_ps(offsets[r]);
        const __m512 p0 = (__m512)exp2_nonpositive(
            (vec)_mm512_fmsub_ps(_mm512_load_ps(s + r * AMX_KEYS), scale, offset), 3);
        const __m512 p1 = (__m512)exp2_nonpositive(
            (vec)_mm512_fmsub_ps(_mm512_load_ps(s + r * AMX_KEYS + 16), scale, offset), 3);
        _mm512_store_si512(probs + r * AMX_KEYS, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
        if (r % 2 == 0)
            even = _mm512_add_ps(p0, p1);
        else
            half[r / 2] = amx_pair_rows(even, _mm512_add_ps(p0, p1), 1);
    }
    const __m512 kept = _mm512_load_ps(correction);
    _mm512_store_ps(sums, _mm512_fmadd_ps(_mm512_load_ps(sums), kept, amx_fold_rows(half, 1)));
    return _mm512_cmpneq_ps_mask(kept, _mm512_set1_ps(1.0f)) == 0;
}

/* The item's output rows: O / total, rounded to bf16 (nearest even: vcvtneps2bf16, one instruction
 * where the integer rounding took five; denormals are flushed process-wide either way). */
static void amx_write_rows(const Problem *p, const float *o, const float *total, int64_t head, int64_t t0,
                           int64_t rows) {
    const int64_t dim = p->dim;
    for (int64_t r = 0; r < rows; r++) {
        const __m512 inverse = _mm512_set1_ps(1.0f / total[r]);
        uint16_t *row = (uint16_t *)(p->out + ((size_t)(t0 + r) * p->out_stride + (size_t)head * dim) * 2);
        for (int64_t d = 0; d < dim; d += 16) {
            const __m512 value = _mm512_mul_ps(_mm512_load_ps(o + r * dim + d), inverse);
            _mm256_storeu_si256((__m256i *)(row + d), (__m256i)_mm512_cvtneps_pbh(value));
        }
    }
}

/* One query head's running state over its 16 rows, kept between ranges of keys: each row's
 * running maximum, sums and correction, and the output so far (`o`, at the current maxima). */
typedef struct {
    float top[16] __attribute__((aligned(64)));
    float sums[16] __attribute__((aligned(64)));
    float correction[16] __attribute__((aligned(64)));
    float o[16 * MAX_DIM] __attribute__((aligned(64)));
} AmxHeadState;

static void amx_state_start(AmxHeadState *state, int64_t dim) {
    for (int r = 0; r < 16; r++) state->top[r] = -1e30f;
    memset(state->sums, 0, sizeof state->sums);
    memset(state->o, 0, sizeof(float) * 16 * dim);
}

/* S = Q K^T of one block (16 queries x 32 keys) into s [16][32] fp32, through tmm1 and tmm7
 * (tmm0 the query's 32-dim chunks, tmm4 K^T's B tiles), for the block-at-a-time path (head
 * sizes above 64). That path issues the next block's scores before this block's softmax, so
 * the vector units work through the softmax while the tiles multiply (with the output's tiles
 * resident, at head size 64 before the phases: 1,024 queries over themselves 1,496-1,580 ->
 * 1,420-1,510 us; head size 128: no change, 834-880 against 852-869). */
static inline void amx_block_scores(const char *q_tile, int64_t a_stride, const uint32_t *keys, int64_t dim,
                                    int64_t key0, float *s) {
    _tile_zero(1);
    _tile_zero(7);
    const char *k_block = (const char *)(keys + (key0 / 16) * (dim / 2) * 16);
    for (int64_t c = 0; c < dim / 32; c++) {
        _tile_loadd(0, q_tile + c * 64, a_stride);
        _tile_loadd(4, k_block + c * 1024, 64);
        _tile_dpbf16ps(1, 0, 4);
        _tile_loadd(4, k_block + (dim / 2) * 64 + c * 1024, 64);
        _tile_dpbf16ps(7, 0, 4);
    }
    _tile_stored(1, s, AMX_KEYS * 4);
    _tile_stored(7, s + 16, AMX_KEYS * 4);
}

/* Blocks [b0, b1) of one head's item (head sizes above 64): S on the tiles, P V stored and added
 * to the output rows in memory. q_tile: 16 rows of this head's query (a_stride bytes apart);
 * keys / values: its kv head's gathered K^T and V pairs. */
static void amx_attend_range(const Problem *p, const char *q_tile, int64_t a_stride, const uint32_t *keys,
                             const char *values, AmxHeadState *state, const int32_t *position, int64_t first,
                             int64_t b0, int64_t b1) {
    const int64_t dim = p->dim;
    float scores[2][16 * AMX_KEYS] __attribute__((aligned(64)));
    uint16_t probs[16 * AMX_KEYS] __attribute__((aligned(64)));
    float pv[16 * MAX_DIM] __attribute__((aligned(64)));
    float *o = state->o;
    if (b0 < b1) amx_block_scores(q_tile, a_stride, keys, dim, b0 * AMX_KEYS, scores[0]);
    for (int64_t b = b0; b < b1; b++) {
        const int64_t key0 = b * AMX_KEYS;
        float *s = scores[(b - b0) % 2];
        if (b + 1 < b1) amx_block_scores(q_tile, a_stride, keys, dim, key0 + AMX_KEYS, scores[(b + 1 - b0) % 2]);
        amx_softmax(p, s, probs, state->top, state->sums, state->correction, position, key0, first);
        /* O = O * correction + P V */
        _tile_loadd(6, probs, AMX_KEYS * 2);
        amx_values(values + key0 / 2 * dim * 4, dim, pv);
        for (int r = 0; r < 16; r++) {
            const __m512 scale = _mm512_set1_ps(state->correction[r]);
            if (state->correction[r] == 1.0f) { /* the row's maximum stayed */
                for (int64_t d = 0; d < dim; d += 16)
                    _mm512_store_ps(o + r * dim + d,
                                    _mm512_add_ps(_mm512_load_ps(o + r * dim + d), _mm512_load_ps(pv + r * dim + d)));
                continue;
            }
            for (int64_t d = 0; d < dim; d += 16)
                _mm512_store_ps(o + r * dim + d, _mm512_fmadd_ps(_mm512_load_ps(o + r * dim + d), scale,
                                                                 _mm512_load_ps(pv + r * dim + d)));
        }
    }
}

/* The phases' tile steps for one block of 32 keys, the tile numbers constants as the
 * intrinsics need them. AMX_PHASE_SCORES: S of the block's two 16-key groups into the
 * accumulators A and B (Q's 32-dim chunks in tmm0-1, K^T through tmm6-7), stored at sb.
 * AMX_PHASE_VALUES: P (bf16, 16 rows of the block's 32 keys) into tile P, then the output's
 * 16-dim tiles tmm2-5 += P V, V's key pairs through tmm6-7. */
#define AMX_PHASE_SCORES(A, B, kb, group_bytes, chunks, sb, sbytes)  \
    do {                                                             \
        _tile_zero(A);                                               \
        _tile_zero(B);                                               \
        _tile_loadd(6, (kb), 64);                                    \
        _tile_dpbf16ps(A, 0, 6);                                     \
        _tile_loadd(7, (kb) + (group_bytes), 64);                    \
        _tile_dpbf16ps(B, 0, 7);                                     \
        if ((chunks) > 1) {                                          \
            _tile_loadd(6, (kb) + 1024, 64);                         \
            _tile_dpbf16ps(A, 1, 6);                                 \
            _tile_loadd(7, (kb) + (group_bytes) + 1024, 64);         \
            _tile_dpbf16ps(B, 1, 7);                                 \
        }                                                            \
        _tile_stored(A, (sb), (sbytes));                             \
        _tile_stored(B, (sb) + 16, (sbytes));                        \
    } while (0)

#define AMX_PHASE_VALUES(P, probs, sbytes, v_block, v_stride, chunks) \
    do {                                                              \
        _tile_loadd(P, (probs), (sbytes));                            \
        _tile_loadd(6, (v_block), (v_stride));                        \
        _tile_dpbf16ps(2, P, 6);                                      \
        _tile_loadd(7, (v_block) + 64, (v_stride));                   \
        _tile_dpbf16ps(3, P, 7);                                      \
        if ((chunks) > 1) {                                           \
            _tile_loadd(6, (v_block) + 128, (v_stride));              \
            _tile_dpbf16ps(4, P, 6);                                  \
            _tile_loadd(7, (v_block) + 192, (v_stride));              \
            _tile_dpbf16ps(5, P, 7);                                  \
        }                                                             \
    } while (0)

/* One head's range [b0, b1) in three phases (head sizes 32 and 64): every block's S = Q K^T on
 * the tiles into `scores` [16][AMX_PHASE_KEYS] fp32, then the softmax over the whole range row
 * by row in AVX-512 (one maximum and one rescale a range, P written as bf16 over its own
 * scores' row), then O += P V on the tiles with O loaded from and stored back to the state. */
static void amx_attend_range_phased(const Problem *p, const char *q_tile, int64_t a_stride, const uint32_t *keys,
                                    const char *values, AmxHeadState *state, const int32_t *position,
                                    int64_t b0, int64_t b1, float *scores) {
    const int64_t dim = p->dim, chunks = dim / 32, key0 = b0 * AMX_KEYS, n = (b1 - b0) * AMX_KEYS;
    const int64_t srow = AMX_PHASE_KEYS, sbytes = AMX_PHASE_KEYS * 4;
    const int64_t group_bytes = dim * 32; /* one 16-key group of K^T */
    const char *k_base = (const char *)keys + (key0 / 16) * group_bytes;
    /* phase 1: S */
    _tile_loadd(0, q_tile, a_stride);
    if (chunks > 1) _tile_loadd(1, q_tile + 64, a_stride);
    /* a block's two 16-key groups into tmm2-3, the next block's into tmm4-5 */
    for (int64_t b = 0; b < b1 - b0; b++) {
        const char *kb = k_base + 2 * b * group_bytes;
        float *sb = scores + b * AMX_KEYS;
        if (b % 2 == 0)
            AMX_PHASE_SCORES(2, 3, kb, group_bytes, chunks, sb, sbytes);
        else
            AMX_PHASE_SCORES(4, 5, kb, group_bytes, chunks, sb, sbytes);
    }
    /* phase 2: the softmax, row by row */
    const __m512 scale = _mm512_set1_ps(p->log2_scale);
    float range_max[16] __attribute__((aligned(64)));
    __m512 max_half[8], even_max = _mm512_setzero_ps();
    for (int r = 0; r < 16; r++) {
        float *s = scores + r * srow;
        const int64_t last = position[r] - key0; /* keys past it are masked */
        if (last < n - 1) {
            const int64_t from = last + 1 > 0 ? last + 1 : 0;
            for (int64_t j = from / 16 * 16; j < n; j += 16) {
                const __m512i lane = _mm512_add_epi32(_mm512_set1_epi32((int32_t)j),
                                                      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
                const __mmask16 hidden = _mm512_cmpgt_epi32_mask(lane, _mm512_set1_epi32((int32_t)last));
                _mm512_mask_store_ps(s + j, hidden, _mm512_set1_ps(-1e30f));
            }
        }
        __m512 m0 = _mm512_load_ps(s), m1 = _mm512_load_ps(s + 16);
        for (int64_t j = 32; j < n; j += 32) {
            m0 = _mm512_max_ps(m0, _mm512_load_ps(s + j));
            m1 = _mm512_max_ps(m1, _mm512_load_ps(s + j + 16));
        }
        if (r % 2 == 0)
            even_max = _mm512_max_ps(m0, m1);
        else
            max_half[r / 2] = amx_pair_rows(even_max, _mm512_max_ps(m0, m1), 0);
    }
    _mm512_store_ps(range_max, amx_fold_rows(max_half, 0));
    const __m512 old_top = _mm512_load_ps(state->top);
    const __m512 new_top = _mm512_max_ps(old_top, _mm512_load_ps(range_max));
    const __m512 correction = (__m512)exp2_nonpositive((vec)_mm512_mul_ps(_mm512_sub_ps(old_top, new_top), scale), 5);
    _mm512_store_ps(state->correction, correction);
    _mm512_store_ps(state->top, new_top);
    float offsets[16] __attribute__((aligned(64))), row_sums[16] __attribute__((aligned(64)));
    __m512 sum_half[8], even_sum = _mm512_setzero_ps();
    _mm512_store_ps(offsets, _mm512_mul_ps(new_top, scale));
    for (int r = 0; r < 16; r++) {
        float *s = scores + r * srow;
        uint16_t *probs = (uint16_t *)s;
        const __m512 offset = _mm512_set1_ps(offsets[r]);
        __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j += 32) {
            const __m512 p0 = (__m512)exp2_nonpositive((vec)_mm512_fmsub_ps(_mm512_load_ps(s + j), scale, offset), 3);
            const __m512 p1 = (__m512)exp2_nonpositive((vec)_mm512_fmsub_ps(_mm512_load_ps(s + j + 16), scale, offset), 3);
            _mm512_store_si512(probs + j, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
            sum0 = _mm512_add_ps(sum0, p0);
            sum1 = _mm512_add_ps(sum1, p1);
        }
        if (r % 2 == 0)
            even_sum = _mm512_add_ps(sum0, sum1);
        else
            sum_half[r / 2] = amx_pair_rows(even_sum, _mm512_add_ps(sum0, sum1), 1);
    }
    _mm512_store_ps(row_sums, amx_fold_rows(sum_half, 1));
    _mm512_store_ps(state->sums, _mm512_fmadd_ps(_mm512_load_ps(state->sums), correction, _mm512_load_ps(row_sums)));
    /* phase 3: O = O * correction + P V */
    float *o = state->o;
    if (_mm512_cmpneq_ps_mask(correction, _mm512_set1_ps(1.0f)) != 0)
        for (int r = 0; r < 16; r++) {
            const __m512 c = _mm512_set1_ps(state->correction[r]);
            for (int64_t d = 0; d < dim; d += 16) _mm512_store_ps(o + r * dim + d, _mm512_mul_ps(_mm512_load_ps(o + r * dim + d), c));
        }
    const int64_t v_stride = dim * 4;
    _tile_loadd(2, o, v_stride);
    _tile_loadd(3, o + 16, v_stride);
    if (chunks > 1) {
        _tile_loadd(4, o + 32, v_stride);
        _tile_loadd(5, o + 48, v_stride);
    }
    const char *probs = (const char *)scores;
    for (int64_t b = 0; b < b1 - b0; b++) {
        const char *v_block = values + (key0 + b * AMX_KEYS) / 2 * dim * 4;
        if (b % 2 == 0) /* P in tmm0 or tmm1 in turn, so a block's P loads while the last one's multiply */
            AMX_PHASE_VALUES(0, probs + b * 64, sbytes, v_block, v_stride, chunks);
        else
            AMX_PHASE_VALUES(1, probs + b * 64, sbytes, v_block, v_stride, chunks);
    }
    _tile_stored(2, o, v_stride);
    _tile_stored(3, o + 16, v_stride);
    if (chunks > 1) {
        _tile_stored(4, o + 32, v_stride);
        _tile_stored(5, o + 48, v_stride);
    }
}

/* The item's rows of one head, all blocks seen: O / total, rounded to bf16. */
static void amx_finish(const Problem *p, AmxHeadState *state, int64_t head, int64_t t0, int64_t rows) {
    amx_write_rows(p, state->o, state->sums, head, t0, rows);
}

#define AMX_MAX_HEADS 16 /* query heads an item takes at most */

/* The largest divisor of `group` below `limit` (1 at least). */
static int64_t amx_divisor_below(int64_t group, int64_t limit) {
    int64_t heads = limit - 1 < group ? limit - 1 : group;
    while (heads > 1 && group % heads != 0) heads--;
    return heads;
}

/* Query heads sharing a kv head that one item takes: the whole group (up to AMX_MAX_HEADS), so
 * each K and V range is read once for all of them, unless that leaves fewer than 4 items a
 * thread to balance. */
static int64_t amx_heads_per_item(int64_t tiles, int64_t num_kv_heads, int64_t group, int num_threads) {
    int64_t heads = amx_divisor_below(group, AMX_MAX_HEADS + 1);
    while (heads > 1 && tiles * num_kv_heads * (group / heads) < 4 * (int64_t)num_threads)
        heads = amx_divisor_below(group, heads);
    return heads;
}

/* One chunk of queries for amx_prefill_attention_spans: its first row of q and of out (the
 * call's token strides), its sequence's blocks, its length and its context (its own tokens
 * the last q_len). */
typedef struct {
    const void *q;
    void *out;
    const int64_t *block_ids;
    int64_t q_len, context_len;
} AmxSpan;

/* A query tile of one span, and the keys it attends to (its work). */
typedef struct {
    int64_t span, tile, keys;
} AmxTileRef;

/* Most keys first; then span and tile, so the order is the same on every run. */
static int amx_more_keys_first(const void *a, const void *b) {
    const AmxTileRef *x = a, *y = b;
    if (x->keys != y->keys) return x->keys > y->keys ? -1 : 1;
    if (x->span != y->span) return x->span < y->span ? -1 : 1;
    return x->tile < y->tile ? -1 : x->tile > y->tile;
}

/* The span whose items [first[i], first[i + 1]) hold `item` (first ascending, count + 1 long). */
static int64_t amx_span_of(const int64_t *first, int64_t count, int64_t item) {
    int64_t low = 0, high = count - 1;
    while (low < high) {
        const int64_t mid = (low + high + 1) / 2;
        if (first[mid] <= item) low = mid;
        else high = mid - 1;
    }
    return low;
}

/* tandem_prefill_attention for a bf16 cache on the tiles (head_dim a multiple of 32), for every
 * prefill chunk of a step at once: one parallel region gathers every span's K and V, and one
 * attends every span's query tiles, the tiles with the most keys first whichever span they are
 * in. A call a span paid its two regions, its buffers, its tile configuration and its last,
 * unbalanced items each time: ~20 us for a 32-token span on the 2-core AMX Xeon, and a step of
 * 27 short prompts (decode-heavy's first) made 27 calls a layer. Each tile is attended as a call
 * of its own span alone attends it (the bits are the same). Returns 0, or -1 when a scratch
 * allocation failed. */
static int amx_prefill_attention_spans(const AmxSpan *spans, int64_t count, const void *kv_cache, int64_t num_heads,
                                       int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                       int64_t num_blocks, int64_t q_stride, int64_t out_stride, float scale,
                                       int num_threads) {
    if (count <= 0) return 0;
    Problem *problems = malloc(sizeof(Problem) * (size_t)count);
    int64_t *gather_first = malloc(sizeof(int64_t) * (size_t)(count + 1)); /* the gathers' items, by span */
    size_t *offsets = malloc(sizeof(size_t) * (size_t)count);             /* a span's place in the buffers */
    if (problems == NULL || gather_first == NULL || offsets == NULL) {
        free(problems);
        free(gather_first);
        free(offsets);
        return -1;
    }
    size_t total_bytes = 0;
    int64_t total_tiles = 0;
    gather_first[0] = 0;
    for (int64_t i = 0; i < count; i++) {
        const int64_t padded = (spans[i].context_len + AMX_KEYS - 1) / AMX_KEYS * AMX_KEYS;
        offsets[i] = total_bytes;
        total_bytes += (size_t)padded * head_dim * 2 * num_kv_heads;
        gather_first[i + 1] = gather_first[i] + num_kv_heads * ((padded + 255) / 256); /* 256 keys of a kv head */
        total_tiles += (spans[i].q_len + 15) / 16;
        problems[i] = (Problem){
            .q = spans[i].q, .out = spans[i].out, .q_len = spans[i].q_len,
            .cached = spans[i].context_len - spans[i].q_len, .padded = padded, .num_heads = num_heads,
            .group = num_heads / num_kv_heads, .dim = head_dim, .q_stride = q_stride, .out_stride = out_stride,
            .kind = 1, .pair_values = 1, .log2_scale = scale * 1.4426950408889634f,
        };
    }
    char *keys, *values;
    AmxTileRef *order = malloc(sizeof(AmxTileRef) * (size_t)(total_tiles > 0 ? total_tiles : 1));
    if (order == NULL || context_buffers(total_bytes > 0 ? total_bytes : 64, &keys, &values) != 0) {
        free(order);
        free(problems);
        free(gather_first);
        free(offsets);
        return -1;
    }
    for (int64_t i = 0; i < count; i++) {
        problems[i].keys = keys + offsets[i];
        problems[i].values = values + offsets[i];
    }
    const size_t plane = (size_t)num_kv_heads * num_blocks * block_size * head_dim * 2;
    const size_t cache_head = (size_t)num_blocks * block_size * head_dim * 2;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t item = 0; item < gather_first[count]; item++) {
        const int64_t i = amx_span_of(gather_first, count, item), local = item - gather_first[i];
        const Problem *p = &problems[i];
        const int64_t chunks = (p->padded + 255) / 256;
        const int64_t h = local / chunks, t0 = local % chunks * 256, t1 = t0 + 256 < p->padded ? t0 + 256 : p->padded;
        const size_t head_bytes = (size_t)p->padded * head_dim * 2;
        const char *k_head = (const char *)kv_cache + h * cache_head;
        const char *v_head = (const char *)kv_cache + plane + h * cache_head;
        uint32_t *k_out = (uint32_t *)(p->keys + h * head_bytes);
        for (int64_t t = t0; t < t1; t += 16)
            amx_gather_key_group(k_head, spans[i].block_ids, spans[i].context_len, t, head_dim, block_size,
                                 k_out + (t / 16) * (head_dim / 2) * 16);
        amx_gather_value_pairs(v_head, spans[i].block_ids, spans[i].context_len, t0, t1, head_dim, block_size,
                               (uint16_t *)(p->values + h * head_bytes));
    }
    int64_t n = 0;
    for (int64_t i = 0; i < count; i++)
        for (int64_t tile = 0; tile < (spans[i].q_len + 15) / 16; tile++) {
            const int64_t t0 = tile * 16, rows = spans[i].q_len - t0 < 16 ? spans[i].q_len - t0 : 16;
            order[n++] = (AmxTileRef){i, tile, problems[i].cached + t0 + rows};
        }
    qsort(order, (size_t)total_tiles, sizeof(AmxTileRef), amx_more_keys_first);
    const int64_t group = num_heads / num_kv_heads;
    const int64_t per_item = amx_heads_per_item(total_tiles, num_kv_heads, group, num_threads);
    const int64_t parts = num_kv_heads * (group / per_item); /* items a tile */
    const int64_t a_stride = q_stride * 2;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        AmxHeadState *states = aligned_alloc(64, sizeof(AmxHeadState) * per_item);
        uint16_t *tails = aligned_alloc(64, sizeof(uint16_t) * 16 * MAX_DIM * per_item);
        float *scores = aligned_alloc(64, sizeof(float) * 16 * AMX_PHASE_KEYS); /* the phases' S, then P */
        if (states == NULL || tails == NULL || scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        amx_attention_configure();
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < total_tiles * parts; item++) {
            if (states == NULL || tails == NULL || scores == NULL) continue;
            const AmxTileRef *ref = &order[item / parts];
            const Problem *problem = &problems[ref->span];
            const int64_t part = item % parts, head0 = part * per_item, kv_head = head0 / group;
            const int64_t t0 = ref->tile * 16, rows = problem->q_len - t0 < 16 ? problem->q_len - t0 : 16;
            const char *q_tiles[AMX_MAX_HEADS];
            int64_t strides[AMX_MAX_HEADS];
            int32_t position[16];
            for (int r = 0; r < 16; r++) position[r] = (int32_t)(problem->cached + t0 + (r < rows ? r : rows - 1));
            for (int64_t i = 0; i < per_item; i++) {
                const char *q_tile = problem->q + ((size_t)t0 * q_stride + (size_t)(head0 + i) * head_dim) * 2;
                strides[i] = a_stride;
                if (rows < 16) { /* a short last tile: its rows in a zeroed 16-row buffer */
                    uint16_t *tail = tails + i * 16 * MAX_DIM;
                    memset(tail, 0, sizeof(uint16_t) * 16 * head_dim);
                    for (int64_t r = 0; r < rows; r++)
                        memcpy(tail + r * head_dim, q_tile + r * a_stride, (size_t)head_dim * 2);
                    q_tile = (const char *)tail;
                    strides[i] = head_dim * 2;
                }
                q_tiles[i] = q_tile;
                amx_state_start(&states[i], head_dim);
            }
            const size_t head_bytes = (size_t)problem->padded * head_dim * 2;
            const uint32_t *item_keys = (const uint32_t *)(problem->keys + kv_head * head_bytes);
            const char *item_values = problem->values + kv_head * head_bytes;
            const int64_t first = problem->cached + t0, blocks = (first + rows - 1) / AMX_KEYS + 1;
            const int64_t range = head_dim <= 64 ? AMX_PHASE_BLOCKS : per_item > 1 ? AMX_RANGE_BLOCKS : blocks;
            for (int64_t b0 = 0; b0 < blocks; b0 += range) {
                const int64_t b1 = b0 + range < blocks ? b0 + range : blocks;
                for (int64_t i = 0; i < per_item; i++) {
                    if (head_dim <= 64)
                        amx_attend_range_phased(problem, q_tiles[i], strides[i], item_keys, item_values, &states[i],
                                                position, b0, b1, scores);
                    else
                        amx_attend_range(problem, q_tiles[i], strides[i], item_keys, item_values, &states[i],
                                         position, first, b0, b1);
                }
            }
            for (int64_t i = 0; i < per_item; i++) amx_finish(problem, &states[i], head0 + i, t0, rows);
        }
        _tile_release();
        free(states);
        free(tails);
        free(scores);
    }
    free(keys);
    free(values);
    free(order);
    free(problems);
    free(gather_first);
    free(offsets);
    return failed ? -1 : 0;
}

/* One span's call (tandem_prefill_attention). */
static int amx_prefill_attention(const void *q, const void *kv_cache, const int64_t *block_ids, void *out,
                                 int64_t q_len, int64_t context_len, int64_t num_heads, int64_t num_kv_heads,
                                 int64_t head_dim, int64_t block_size, int64_t num_blocks, int64_t q_stride,
                                 int64_t out_stride, float scale, int num_threads) {
    const AmxSpan span = {q, out, block_ids, q_len, context_len};
    return amx_prefill_attention_spans(&span, 1, kv_cache, num_heads, num_kv_heads, head_dim, block_size, num_blocks,
                                       q_stride, out_stride, scale, num_threads);
}
#endif
