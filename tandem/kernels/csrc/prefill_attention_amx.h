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
 * a zeroed buffer, so every tile has 16 rows) against its causal keys, 32 at a time:
 *   S = Q K^T      tmm0: a 32-dim chunk of Q; tmm4: K^T of 16 keys at a time (B tiles, a
 *                  dim pair a row: the gather writes K transposed in 32-bit words); tmm1,
 *                  tmm7: S of the two 16-key halves (16 x 16 fp32), summed over the head's
 *                  dim chunks. The next block's S is issued before this block's softmax
 *                  (amx_block_scores), so the two overlap
 *   softmax        row by row in AVX-512 on the stored S: scale, causal mask, running maximum,
 *                  exp2 (a degree-3 polynomial: P is rounded to bf16), row sums, the rescale of the
 *                  accumulated output; P rounded to bf16 is one A tile (tmm6)
 *   O += P V       tmm7: V of the 32 keys for 16 dims (B tiles: V is gathered in key pairs,
 *                  as for the lane tiles' vdpbf16ps); tmm2-5: up to 64 dims of P V at a time,
 *                  stored and added to the fp32 output rows, which stay in memory (the tiles
 *                  cannot be rescaled in place).
 * Every tile has 16 rows of 64 bytes, so a thread configures them once.
 *
 * An item is one query tile for the query heads that share a kv head (the whole group, or a
 * divisor of it when there would be too few items to balance): they take turns over ranges of
 * 512 keys, so a range's K and V come from memory once and from cache for the other heads.
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

/* One kv head's keys transposed for the S tiles: [padded / 16][dim / 2][16] 32-bit words (a
 * group of 16 keys, then a dim pair, then the key), zero beyond `context`. */
static void amx_gather_keys(const char *k_head, const int64_t *block_ids, int64_t context, int64_t padded,
                            int64_t dim, int64_t block_size, uint32_t *out) {
    const int64_t words = dim / 2;
    for (int64_t t = 0; t < padded; t++) {
        uint32_t *column = out + (t / 16) * words * 16 + t % 16;
        if (t >= context) {
            for (int64_t w = 0; w < words; w++) column[w * 16] = 0;
            continue;
        }
        const int64_t slot = block_ids[t / block_size] * block_size + t % block_size;
        const uint32_t *row = (const uint32_t *)(k_head + (size_t)slot * dim * 2);
        for (int64_t w = 0; w < words; w++) column[w * 16] = row[w];
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

/* The item's output rows: O / total, rounded to bf16 (nearest even). */
static void amx_write_rows(const Problem *p, const float *o, const float *total, int64_t head, int64_t t0,
                           int64_t rows) {
    const int64_t dim = p->dim;
    for (int64_t r = 0; r < rows; r++) {
        const __m512 inverse = _mm512_set1_ps(1.0f / total[r]);
        uint16_t *row = (uint16_t *)(p->out + ((size_t)(t0 + r) * p->out_stride + (size_t)head * dim) * 2);
        for (int64_t d = 0; d < dim; d += 16) {
            const __m512 value = _mm512_mul_ps(_mm512_load_ps(o + r * dim + d), inverse);
            const __m512i bits = _mm512_castps_si512(value);
            const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
            const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
            _mm256_storeu_si256((__m256i *)(row + d), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
        }
    }
}

/* One query head's running state over its 16 rows, kept between ranges of keys: each row's
 * running maximum, sums and correction, the output so far (`o`, at the current maxima) and,
 * for the resident items, the O tiles' contents between ranges (the output is o + tiles). */
typedef struct {
    float top[16] __attribute__((aligned(64)));
    float sums[16] __attribute__((aligned(64)));
    float correction[16] __attribute__((aligned(64)));
    float tiles[16 * 64] __attribute__((aligned(64)));
    float o[16 * MAX_DIM] __attribute__((aligned(64)));
} AmxHeadState;

static void amx_state_start(AmxHeadState *state, int64_t dim) {
    for (int r = 0; r < 16; r++) state->top[r] = -1e30f;
    memset(state->sums, 0, sizeof state->sums);
    memset(state->tiles, 0, sizeof state->tiles);
    memset(state->o, 0, sizeof(float) * 16 * dim);
}

/* S = Q K^T of one block (16 queries x 32 keys) into s [16][32] fp32, through tmm1 and tmm7
 * (tmm0 the query's 32-dim chunks, tmm4 K^T's B tiles). Both paths below issue the next
 * block's scores before this block's softmax: nothing in the softmax waits for them, so the
 * vector units work through it while the tiles multiply, where in the order S, softmax, P V
 * of each block in turn the two took turns. On the 2-core AMX Xeon, the two orders built side
 * by side in one process and called alternately (bit-identical output; medians of 15):
 * SmolLM2's heads, 640 and 1,024 queries over themselves, 607-685 -> 583-665 and 1,496-1,580
 * -> 1,420-1,510 us; Qwen2.5-0.5B's, 512 queries after 1,536 cached, 3,232-3,323 -> 3,099-3,252;
 * head size 128 (the path with O in memory): no change (834-880 against 852-869). Only the
 * scores overlap so: a block's P V needs its own softmax, and the tiles are all in use. */
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

/* Blocks [b0, b1) with the output in tiles (head sizes of 32 and 64: two or four 16-dim O
 * tiles, loaded from and stored back to the state around the range), which P V accumulates
 * into across blocks while every row's maximum stays; where one moves, the tiles are added to
 * `o` in memory, `o` is rescaled row by row, and the tiles restart from zero. Tiles: tmm0 Q
 * (scores) then P (values); tmm1, tmm7 S (scores) then B tiles of V, with tmm4; tmm4 the
 * B tiles of K^T; tmm2, tmm3, tmm5, tmm6 O. Saves each block's P V store and the pass that
 * added it to the output: the spilled item's per-block work besides the softmax. */
static void amx_attend_range_resident(const Problem *p, const char *q_tile, int64_t a_stride, const uint32_t *keys,
                                      const char *values, AmxHeadState *state, const int32_t *position,
                                      int64_t first, int64_t b0, int64_t b1) {
    const int64_t dim = p->dim, chunks = dim / 32, v_stride = dim * 4;
    float scores[2][16 * AMX_KEYS] __attribute__((aligned(64)));
    uint16_t probs[16 * AMX_KEYS] __attribute__((aligned(64)));
    float *o = state->o, *tiles = state->tiles;
    _tile_loadd(2, tiles, dim * 4);
    _tile_loadd(3, tiles + 16, dim * 4);
    if (chunks > 1) {
        _tile_loadd(5, tiles + 32, dim * 4);
        _tile_loadd(6, tiles + 48, dim * 4);
    }
    if (b0 < b1) amx_block_scores(q_tile, a_stride, keys, dim, b0 * AMX_KEYS, scores[0]);
    for (int64_t b = b0; b < b1; b++) {
        const int64_t key0 = b * AMX_KEYS;
        float *s = scores[(b - b0) % 2];
        if (b + 1 < b1) amx_block_scores(q_tile, a_stride, keys, dim, key0 + AMX_KEYS, scores[(b + 1 - b0) % 2]);
        if (!amx_softmax(p, s, probs, state->top, state->sums, state->correction, position, key0, first) && b > 0) {
            _tile_stored(2, tiles, dim * 4);
            _tile_stored(3, tiles + 16, dim * 4);
            if (chunks > 1) {
                _tile_stored(5, tiles + 32, dim * 4);
                _tile_stored(6, tiles + 48, dim * 4);
            }
            for (int r = 0; r < 16; r++) {
                const __m512 scale = _mm512_set1_ps(state->correction[r]);
                for (int64_t d = 0; d < dim; d += 16)
                    _mm512_store_ps(o + r * dim + d,
                                    _mm512_mul_ps(_mm512_add_ps(_mm512_load_ps(o + r * dim + d),
                                                                _mm512_load_ps(tiles + r * dim + d)), scale));
            }
            _tile_zero(2);
            _tile_zero(3);
            if (chunks > 1) {
                _tile_zero(5);
                _tile_zero(6);
            }
        }
        /* O tiles += P V: V of the block's 32 keys, 16 dims a B tile */
        const char *v_block = values + key0 / 2 * dim * 4;
        _tile_loadd(0, probs, AMX_KEYS * 2);
        _tile_loadd(4, v_block, v_stride);
        _tile_dpbf16ps(2, 0, 4);
        _tile_loadd(1, v_block + 16 * 4, v_stride);
        _tile_dpbf16ps(3, 0, 1);
        if (chunks > 1) {
            _tile_loadd(7, v_block + 32 * 4, v_stride);
            _tile_dpbf16ps(5, 0, 7);
            _tile_loadd(4, v_block + 48 * 4, v_stride);
            _tile_dpbf16ps(6, 0, 4);
        }
    }
    _tile_stored(2, tiles, dim * 4);
    _tile_stored(3, tiles + 16, dim * 4);
    if (chunks > 1) {
        _tile_stored(5, tiles + 32, dim * 4);
        _tile_stored(6, tiles + 48, dim * 4);
    }
}

/* The item's rows of one head, all blocks seen: O (+ the tiles) / total, rounded to bf16. */
static void amx_finish(const Problem *p, AmxHeadState *state, int64_t head, int64_t t0, int64_t rows) {
    const int64_t dim = p->dim;
    if (dim <= 64)
        for (int64_t i = 0; i < 16 * dim; i += 16)
            _mm512_store_ps(state->o + i, _mm512_add_ps(_mm512_load_ps(state->o + i), _mm512_load_ps(state->tiles + i)));
    amx_write_rows(p, state->o, state->sums, head, t0, rows);
}

/* Blocks a range: the heads of one item take turns over a range of blocks, so its K and V are
 * read from memory once per item and from cache by the other heads (512 keys are 128 KiB of K
 * and V at head size 64; 256 and 1,024 keys were 1-5% slower). */
#define AMX_RANGE_BLOCKS 16

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

/* tandem_prefill_attention for a bf16 cache on the tiles (head_dim a multiple of 32). Returns
 * 0, or -1 when a scratch allocation failed. */
static int amx_prefill_attention(const void *q, const void *kv_cache, const int64_t *block_ids, void *out,
                                 int64_t q_len, int64_t context_len, int64_t num_heads, int64_t num_kv_heads,
                                 int64_t head_dim, int64_t block_size, int64_t num_blocks, int64_t q_stride,
                                 int64_t out_stride, float scale, int num_threads) {
    const int64_t padded = (context_len + AMX_KEYS - 1) / AMX_KEYS * AMX_KEYS;
    const size_t head_bytes = (size_t)padded * head_dim * 2;
    char *keys, *values;
    if (context_buffers(head_bytes * num_kv_heads, &keys, &values) != 0) return -1;
    Problem problem = {
        .q = q, .out = out, .keys = keys, .values = values, .q_len = q_len,
        .cached = context_len - q_len, .padded = padded, .num_heads = num_heads,
        .group = num_heads / num_kv_heads, .dim = head_dim, .q_stride = q_stride,
        .out_stride = out_stride, .kind = 1, .pair_values = 1, .log2_scale = scale * 1.4426950408889634f,
    };
    const size_t plane = (size_t)num_kv_heads * num_blocks * block_size * head_dim * 2;
    const size_t cache_head = (size_t)num_blocks * block_size * head_dim * 2;
#pragma omp parallel for schedule(static, 1) num_threads(num_threads)
    for (int64_t h = 0; h < num_kv_heads; h++) {
        amx_gather_keys((const char *)kv_cache + h * cache_head, block_ids, context_len, padded, head_dim,
                        block_size, (uint32_t *)(keys + h * head_bytes));
        gather_value_pairs((const char *)kv_cache + plane + h * cache_head, block_ids, context_len, padded,
                           head_dim, block_size, values + h * head_bytes);
    }
    const int64_t tiles = (q_len + 15) / 16, group = problem.group;
    const int64_t per_item = amx_heads_per_item(tiles, num_kv_heads, group, num_threads);
    const int64_t parts = num_kv_heads * (group / per_item); /* items a tile */
    const int64_t a_stride = q_stride * 2;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        AmxHeadState *states = aligned_alloc(64, sizeof(AmxHeadState) * per_item);
        uint16_t *tails = aligned_alloc(64, sizeof(uint16_t) * 16 * MAX_DIM * per_item);
        if (states == NULL || tails == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        amx_attention_configure();
        /* The last tiles see the longest context: hand them out first. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < tiles * parts; item++) {
            if (states == NULL || tails == NULL) continue;
            const int64_t tile = tiles - 1 - item / parts, part = item % parts;
            const int64_t head0 = part * per_item, kv_head = head0 / group;
            const int64_t t0 = tile * 16, rows = q_len - t0 < 16 ? q_len - t0 : 16;
            const char *q_tiles[AMX_MAX_HEADS];
            int64_t strides[AMX_MAX_HEADS];
            int32_t position[16];
            for (int r = 0; r < 16; r++) position[r] = (int32_t)(problem.cached + t0 + (r < rows ? r : rows - 1));
            for (int64_t i = 0; i < per_item; i++) {
                const char *q_tile = (const char *)q + ((size_t)t0 * q_stride + (size_t)(head0 + i) * head_dim) * 2;
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
            const uint32_t *item_keys = (const uint32_t *)(keys + kv_head * head_bytes);
            const char *item_values = values + kv_head * head_bytes;
            const int64_t first = problem.cached + t0, blocks = (first + rows - 1) / AMX_KEYS + 1;
            const int64_t range = per_item > 1 ? AMX_RANGE_BLOCKS : blocks;
            for (int64_t b0 = 0; b0 < blocks; b0 += range) {
                const int64_t b1 = b0 + range < blocks ? b0 + range : blocks;
                for (int64_t i = 0; i < per_item; i++)
                    (head_dim <= 64 ? amx_attend_range_resident : amx_attend_range)(
                        &problem, q_tiles[i], strides[i], item_keys, item_values, &states[i], position, first, b0, b1);
            }
            for (int64_t i = 0; i < per_item; i++) amx_finish(&problem, &states[i], head0 + i, t0, rows);
        }
        _tile_release();
        free(states);
        free(tails);
    }
    free(keys);
    free(values);
    return failed ? -1 : 0;
}
#endif
