/*
 * 4-bit weight-only GEMM for a few rows (decode steps), for CPUs.
 *
 * A step of one or two tokens reads every weight once and does two FLOPs with it, so its
 * time is the bytes read; a 4-bit matrix is a quarter of bf16's. Unpacking nibbles into
 * floats costs more instructions than the bytes save, though (PyTorch's CPU int4 kernel
 * runs at ~9 GB/s of weights here, against ~19 for bf16), so this kernel follows llama.cpp
 * instead: the activations are quantized per group of 32 inputs, and the levels are
 * multiplied with them by integer dot products, one float FMA per group applying both
 * scales. The activations take 16 bits (scale max|x| / 32767), not llama.cpp's 8: the 8-bit
 * rounding of activations was all of the scheme's loss beyond the GGUF's own 4-bit weights
 * (+1.45% perplexity on the default model in bf16, outside the project's 1% bar), while
 * 16 bits are below bf16's own rounding. The products are int16 x int16 pairs summed into
 * int32 (AVX-512 VNNI `vpdpwssd`: 32 products an instruction; AVX2 `vpmaddwd`; plain C
 * elsewhere); levels are widened to 16 bits as they are unpacked.
 *
 * Layout of a [N, K] matrix (K a multiple of 64), per output row:
 *   nibbles [N, K/2] bytes: each 64 inputs are 32 bytes, byte j holding input j in its low
 *            nibble and input j + 32 in its high one, so one block unpacks into two whole
 *            groups with an AND and a shift;
 *   scales, mins [N, K/32] fp16: weight = nibble * scale + min, per group of 32 inputs.
 * Activations: x [M, K] fp32 -> out [M, N] fp32.
 *
 * Scales and minimums are fp16 (tandem's own quantization) or bf16 (`scale_bf16`: a checkpoint
 * quantized elsewhere, such as Kimi K2.5's compressed-tensors experts, whose bf16 scales are
 * kept bit for bit rather than rounded into fp16's narrower range). A symmetric matrix has no
 * minimums (`mins` NULL): its levels are q + 8 for q in -8..7 and weight = q * scale, so the
 * dot products take the signed levels (nibble - 8, one subtraction per vector) and there is no
 * minimum's term at all: no bytes for minimums (a ninth of the matrix), and no error from
 * the 16-bit activations times the large -8 * scale * sum(x) offset it would otherwise carry.
 *
 * `tandem_q4_moe` runs a mixture-of-experts layer's routed experts in one call: rows sorted by
 * expert, each expert's gate/up GEMM, SiLU(gate) * up, and its down GEMM, every (expert, tile)
 * pair one work item for the threads (a Python loop over experts paid a call, a quantization
 * of its rows and a thread fork-join per expert and projection).
 *
 * The 8-bit variant (`tandem_q8_gemm`, for a matrix 4 bits would spoil, such as an LM head
 * read at every token) has the same scales, minimums and arithmetic with one level byte per
 * input: levels [N, K] bytes, weight = level * scale + min; or, symmetric (`mins` NULL), each
 * byte a signed level, weight = level * scale. tandem's own 8-bit copies are symmetric: the
 * minimums were a ninth of their bytes, and one-row steps read every byte (an agent's model,
 * Qwen2.5-Coder-0.5B, decodes from 8-bit copies only: its GGUF is mostly 5-bit).
 *
 * The 5-bit variant (`tandem_q5_gemm`) is for the matrices a GGUF holds in Q5_0 (most of
 * Qwen2.5-Coder's layers): an 8-bit copy spends 1.06 bytes a weight on them and still misses
 * their grid (~0.5% relative error), while 5 bits with Q5_0's own scale hold them exactly in
 * 0.69. Each 64 inputs are 40 bytes: the 4-bit layout's 32 nibble bytes, then 8 bytes whose
 * bit j (little-endian) is input j's fifth bit. tandem's 5-bit copies are symmetric (`mins`
 * NULL): levels q + 16 for q in -16..15, weight = q * scale, as Q5_0.
 *
 * Per group g of row m: x ~= d_g * xq (xq int16, d_g = max|x| / 32767), so
 *   sum_i w_i x_i = scale * d_g * sum_i nibble_i xq_i + min * sum_i x_i,
 * with the min term over the exact x. Every product and sum is exact in int32 (at most
 * 32 * 255 * 32767 < 2^31): the 16-bit rounding of x is the only approximation beyond the
 * weights themselves.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define GROUP 32
#define BLOCK 64

static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
    if (exponent == 0) {
        if (mantissa == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exponent = 127 - 15 + 1;
            while (!(mantissa & 0x400)) {
                mantissa <<= 1;
                exponent--;
            }
            bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
        }
    } else if (exponent == 31) {
        bits = sign | 0x7f800000 | (mantissa << 13);
    } else {
        bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
    }
    union { uint32_t u; float f; } out = {.u = bits};
    return out.f;
#endif
}

static inline uint16_t to_bf16(float x) {
    union { float f; uint32_t u; } bits = {.f = x};
    bits.u += 0x7FFFu + ((bits.u >> 16) & 1u);
    return (uint16_t)(bits.u >> 16);
}

static inline float from_bf16(uint16_t x) {
    union { uint32_t u; float f; } bits = {.u = (uint32_t)x << 16};
    return bits.f;
}

/* A scale or minimum as a float: fp16, or bf16 where `bf16`. */
static inline float scale_value(uint16_t raw, int bf16) { return bf16 ? from_bf16(raw) : half_to_float(raw); }

#if defined(__AVX512F__)
/* 16 scales (fewer under `mask`) widened to floats. */
static inline __m512 scale_vector(const uint16_t *raw, __mmask16 mask, int bf16) {
    const __m256i bits = _mm256_maskz_loadu_epi16(mask, raw);
    return bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)) : _mm512_cvtph_ps(bits);
}
#endif

#define LEVELS 32767.0f /* activation steps each side of zero */

/* One activation row quantized per group: xq int16, d (its scale), xsum (sum of exact x). */
static inline __attribute__((always_inline)) void quantize_group(const float *v, int16_t *xq, float *d,
                                                                 float *xsum) {
    float top = 0.0f, total = 0.0f;
    for (int i = 0; i < GROUP; i++) {
        const float a = fabsf(v[i]);
        top = a > top ? a : top;
        total += v[i];
    }
    const float inverse = top > 0.0f ? LEVELS / top : 0.0f;
    for (int i = 0; i < GROUP; i++) xq[i] = (int16_t)lrintf(v[i] * inverse);
    *d = top / LEVELS;
    *xsum = total;
}

#if defined(__AVX512F__)
/* quantize_group on a group held as two vectors. GCC left the scalar loops above scalar (a
 * chain of 32 dependent adds and maxes, then 32 conversions one at a time): on the 2-core Zen
 * 5 EPYC a one-row call spent ~0.8 us quantizing its input on the calling thread while the
 * others waited, 4% of a one-stream token. The levels and the scale are the scalar loops'
 * bits (the same products, rounded to nearest even, truncated to 16 bits as the cast is);
 * xsum is summed in a tree, so it can differ from theirs in the last place. */
static inline __attribute__((always_inline)) void quantize_group_vec(__m512 lo, __m512 hi, int16_t *xq, float *d,
                                                                     float *xsum) {
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    *xsum = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    const __m512 inverse = _mm512_set1_ps(top > 0.0f ? LEVELS / top : 0.0f);
    _mm256_storeu_si256((__m256i *)xq, _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(lo, inverse))));
    _mm256_storeu_si256((__m256i *)(xq + 16), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(hi, inverse))));
    *d = top / LEVELS;
}

static inline __m512 widen_bf16x16(const uint16_t *x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)x)), 16));
}
#endif

static void quantize_row(const float *x, int64_t k, int16_t *xq, float *d, float *xsum) {
    for (int64_t g = 0; g < k / GROUP; g++) {
#if defined(__AVX512F__)
        quantize_group_vec(_mm512_loadu_ps(x + g * GROUP), _mm512_loadu_ps(x + g * GROUP + 16), xq + g * GROUP, d + g,
                           xsum + g);
#else
        quantize_group(x + g * GROUP, xq + g * GROUP, d + g, xsum + g);
#endif
    }
}

/* The same for a bf16 row, widened a group at a time (exactly: the values quantize_row gets
 * from a widened copy). */
static void quantize_row_bf16(const uint16_t *x, int64_t k, int16_t *xq, float *d, float *xsum) {
    for (int64_t g = 0; g < k / GROUP; g++) {
#if defined(__AVX512F__)
        quantize_group_vec(widen_bf16x16(x + g * GROUP), widen_bf16x16(x + g * GROUP + 16), xq + g * GROUP, d + g,
                           xsum + g);
#else
        float v[GROUP];
        for (int i = 0; i < GROUP; i++) v[i] = from_bf16(x[g * GROUP + i]);
        quantize_group(v, xq + g * GROUP, d + g, xsum + g);
#endif
    }
}

/* The fifth bits of a 5-bit block's 64 inputs (bit j: input j), after its 32 nibble bytes. */
static inline uint64_t fifth_bits(const uint8_t *block) {
    uint64_t high;
    memcpy(&high, block + BLOCK / 2, sizeof high);
    return high;
}

/* sum over one block's two groups of nibble * xq, as two int32 sums. */
static inline void block_dots(const uint8_t *levels, int bits, int symmetric, const int16_t *xq, int32_t *first,
                              int32_t *second) {
    int32_t a = 0, b = 0;
    /* symmetric: the signed levels nibble - 8 (4 bits), level - 16 (5 bits) */
    const int32_t offset = symmetric ? (bits == 5 ? 16 : 8) : 0;
    const uint64_t high = bits == 5 ? fifth_bits(levels) : 0;
    for (int j = 0; j < GROUP; j++) {
        if (bits == 5) {
            a += ((int32_t)((levels[j] & 0x0f) | ((high >> j) & 1) << 4) - offset) * xq[j];
            b += ((int32_t)((levels[j] >> 4) | ((high >> (GROUP + j)) & 1) << 4) - offset) * xq[GROUP + j];
        } else if (bits == 4) {
            a += ((int32_t)(levels[j] & 0x0f) - offset) * xq[j];
            b += ((int32_t)(levels[j] >> 4) - offset) * xq[GROUP + j];
        } else if (symmetric) { /* signed levels */
            a += (int32_t)(int8_t)levels[j] * xq[j];
            b += (int32_t)(int8_t)levels[GROUP + j] * xq[GROUP + j];
        } else {
            a += (int32_t)levels[j] * xq[j];
            b += (int32_t)levels[GROUP + j] * xq[GROUP + j];
        }
    }
    *first = a;
    *second = b;
}

/* Bytes of one block of 64 inputs. */
#define BLOCK_BYTES(bits) ((bits) * BLOCK / 8)

#define MAX_ROWS 4 /* activation rows sharing one pass over the weights */

/* Output rows computed together: each (output row, activation row) pair has an accumulator
 * of its own, so a one-token step runs TILE independent FMA chains rather than waiting on
 * one (a lone chain left a 576-input row latency-bound, about half its time). The rows are
 * walked one after the other, each front to back: the tile is contiguous, and the
 * out-of-order core overlaps the independent row loops. Walking the tile's rows side by side
 * instead halved the speed of the 8-bit LM head streamed from memory (28 MB, one thread).
 * A one-row step gives each (output row, activation row) pair a second accumulator for the
 * blocks' second groups: with one, a block's two FMAs queued on the same register, and the
 * FMA's latency, not the vector units, set the pace of a long row. On the 2-core AVX-512 EPYC
 * (Zen 4), 16 MB of 4-bit weights a call, two threads, both builds alternating in one process:
 * 26.5-32.8 -> 30.1-36.6 GB/s at K = 1,536 and 4,864, 32.6-34.4 -> 35.6-35.8 at 896, level at
 * 576 (one thread 15.8 -> 19.9 at 4,864); the AVX2 build on the same CPU 18.2-18.8 -> 21.3-21.4
 * at 1,536 and 4,864. Two activation rows keep one each: their tile already has eight chains,
 * and with sixteen 512-bit accumulators two rows ran slower (20-24 -> 15-20 GB/s at K = 896
 * and 1,536). */
/* How far ahead of the block being read each row's stream asks for its bytes (_mm_prefetch,
 * one a block; past a row's end it asks for the next row's, which come next). The hardware
 * prefetchers alone left these one-row streams at half the memory's rate: on a 2-core Zen 5
 * EPYC, 24 matrices of 4M weights a call, two threads, in-process A/B: 8-bit 29-36 -> 52-62
 * GB/s at K = 896-4,864, 5-bit 19-20 -> 38-41 and 4-bit 24 -> 43 at K >= 1,536, level at K =
 * 896 for 4 and 5 bits (bound by their unpacking there); 2-4 KB gave about two thirds of
 * it, 6-16 KB all of it. The AVX2 build on the same CPU: 8-bit 34-46 -> 43-52 GB/s, 5-bit
 * 18-24 -> 26-29, 4-bit 20 -> 27 at K = 4,864. */
#define PREFETCH_AHEAD 8192

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define TILE 4
#elif defined(__AVX2__) && defined(__FMA__)
#define TILE 2
#else
#define TILE 1
#endif

/* factor[(r * m_rows + m) * groups + g] = scale[r][g] * d[m][g]: both scales of group g's
 * integer dot product, for output row r of the tile (its scales `groups` apart). */
static inline __attribute__((always_inline)) void group_factors(const uint16_t *scales, const float *d,
                                                                int64_t groups, int64_t tile, int64_t m_rows,
                                                                float *factor, int bf16) {
    for (int64_t r = 0; r < tile; r++) {
        const uint16_t *row_scales = scales + r * groups;
        float *row_factor = factor + r * m_rows * groups;
        int64_t g = 0;
#if defined(__AVX512F__)
        for (; g < groups; g += 16) {
            const __mmask16 mask = groups - g >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (groups - g)) - 1);
            const __m512 scale = scale_vector(row_scales + g, mask, bf16);
            for (int64_t m = 0; m < m_rows; m++)
                _mm512_mask_storeu_ps(row_factor + m * groups + g, mask,
                                      _mm512_mul_ps(scale, _mm512_maskz_loadu_ps(mask, d + m * groups + g)));
        }
#elif defined(__AVX2__) && defined(__F16C__)
        for (; g + 8 <= groups; g += 8) {
            const __m128i raw = _mm_loadu_si128((const __m128i *)(row_scales + g));
            const __m256 scale = bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))
                                      : _mm256_cvtph_ps(raw);
            for (int64_t m = 0; m < m_rows; m++)
                _mm256_storeu_ps(row_factor + m * groups + g, _mm256_mul_ps(scale, _mm256_loadu_ps(d + m * groups + g)));
        }
#endif
        for (; g < groups; g++) {
            const float scale = scale_value(row_scales[g], bf16);
            for (int64_t m = 0; m < m_rows; m++) row_factor[m * groups + g] = scale * d[m * groups + g];
        }
    }
}

/* sum_g min_g * xsum[m][g] for one output row, per activation row m (the AVX-512 path folds
 * this into its accumulators instead). A symmetric matrix has none: its dot products take the
 * signed levels. */
static inline __attribute__((always_inline)) float min_term(const uint16_t *mins, const float *xsum,
                                                            int64_t groups, int bf16) {
    float total = 0.0f;
    for (int64_t g = 0; g < groups; g++) total += scale_value(mins[g], bf16) * xsum[g];
    return total;
}

/* out[m * out_stride + r] for activation rows m < m_rows (<= MAX_ROWS) and the tile's output
 * rows r < tile (<= TILE), whose levels are `row_bytes` apart and scales and minimums
 * k / GROUP apart; `factor` is scratch of TILE * MAX_ROWS * k / GROUP floats. Inlined with
 * tile and m_rows literals (see DEFINE_TILE_DOT), so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile_dot(const uint8_t *levels, int64_t row_bytes, int bits,
                                                           const uint16_t *scales, const uint16_t *mins, int64_t k,
                                                           const int16_t *xq, const float *d, const float *xsum,
                                                           int64_t tile, int64_t m_rows, float *out,
                                                           int64_t out_stride, float *factor, int bf16) {
    const int64_t groups = k / GROUP, blocks = k / BLOCK;
    const int symmetric = mins == NULL; /* levels q + 8, weight = q * scale */
    group_factors(scales, d, groups, tile, m_rows, factor, bf16);
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
    __m512 acc[TILE][MAX_ROWS], acc_second[TILE][MAX_ROWS];
    #pragma GCC unroll 4
    for (int64_t r = 0; r < TILE; r++)
        #pragma GCC unroll 4
        for (int64_t m = 0; m < MAX_ROWS; m++) acc[r][m] = acc_second[r][m] = _mm512_setzero_ps();
    const int split = m_rows == 1;
    const __m512i low_mask = _mm512_set1_epi16(0x0f), eight = _mm512_set1_epi16(8), sixteen = _mm512_set1_epi16(16);
    #pragma GCC unroll 4
    for (int64_t r = 0; r < tile; r++) {
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *block = levels + r * row_bytes + b * BLOCK_BYTES(bits);
            _mm_prefetch((const char *)block + PREFETCH_AHEAD, _MM_HINT_T0);
            __m512i first, second; /* the block's two groups' levels, 16 bits each */
            if (bits == 4) {
                /* byte j -> 16-bit lane j: its low nibble is input j, its high nibble input j + 32 */
                const __m512i wide = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)block));
                first = _mm512_and_si512(wide, low_mask);
                second = _mm512_srli_epi16(wide, 4);
                if (symmetric) { /* the signed levels q = nibble - 8: no minimum's term */
                    first = _mm512_sub_epi16(first, eight);
                    second = _mm512_sub_epi16(second, eight);
                }
            } else if (bits == 5) {
                /* the nibbles as for 4 bits, and each input's fifth bit from the block's mask */
                const __m512i wide = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)block));
                const uint64_t high = fifth_bits(block);
                const __mmask32 high_first = (__mmask32)high, high_second = (__mmask32)(high >> 32);
                first = _mm512_and_si512(wide, low_mask);
                second = _mm512_srli_epi16(wide, 4);
                if (symmetric) { /* q = level - 16: the nibble where the fifth bit is set, nibble - 16 elsewhere */
                    first = _mm512_mask_sub_epi16(first, (__mmask32)~high_first, first, sixteen);
                    second = _mm512_mask_sub_epi16(second, (__mmask32)~high_second, second, sixteen);
                } else {
                    first = _mm512_mask_add_epi16(first, high_first, first, sixteen);
                    second = _mm512_mask_add_epi16(second, high_second, second, sixteen);
                }
            } else if (symmetric) { /* signed levels, weight = level * scale */
                first = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)block));
                second = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(block + GROUP)));
            } else {
                first = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)block));
                second = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(block + GROUP)));
            }
            #pragma GCC unroll 4
            for (int64_t m = 0; m < m_rows; m++) {
                const int16_t *q = xq + m * k + b * BLOCK;
                const float *f = factor + (r * m_rows + m) * groups + 2 * b;
                const __m512i dot_first =
                    _mm512_dpwssd_epi32(_mm512_setzero_si512(), first, _mm512_loadu_si512((const void *)q));
                const __m512i dot_second =
                    _mm512_dpwssd_epi32(_mm512_setzero_si512(), second, _mm512_loadu_si512((const void *)(q + GROUP)));
                acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_first), _mm512_set1_ps(f[0]), acc[r][m]);
                if (split)
                    acc_second[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_second), _mm512_set1_ps(f[1]),
                                                       acc_second[r][m]);
                else
                    acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_second), _mm512_set1_ps(f[1]), acc[r][m]);
            }
        }
    }
    #pragma GCC unroll 4
    for (int64_t r = 0; r < TILE; r++)
        #pragma GCC unroll 4
        for (int64_t m = 0; m < MAX_ROWS; m++)
            if (split) acc[r][m] = _mm512_add_ps(acc[r][m], acc_second[r][m]);
    #pragma GCC unroll 4
    for (int64_t r = 0; r < tile; r++) {
        /* the min terms, sum_g min_g * xsum[m][g], into the same accumulators: one reduction */
        for (int64_t g = 0; g < groups && !symmetric; g += 16) {
            const __mmask16 mask = groups - g >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (groups - g)) - 1);
            const __m512 low = scale_vector(mins + r * groups + g, mask, bf16);
            #pragma GCC unroll 4
            for (int64_t m = 0; m < m_rows; m++)
                acc[r][m] = _mm512_fmadd_ps(low, _mm512_maskz_loadu_ps(mask, xsum + m * groups + g), acc[r][m]);
        }
        #pragma GCC unroll 4
        for (int64_t m = 0; m < m_rows; m++) out[m * out_stride + r] = _mm512_reduce_add_ps(acc[r][m]);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc[TILE][MAX_ROWS], acc_second[TILE][MAX_ROWS];
    #pragma GCC unroll 4
    for (int64_t r = 0; r < TILE; r++)
        #pragma GCC unroll 4
        for (int64_t m = 0; m < MAX_ROWS; m++) acc[r][m] = acc_second[r][m] = _mm256_setzero_ps();
    const int split = m_rows == 1;
    const __m256i low_mask = _mm256_set1_epi16(0x0f), eight = _mm256_set1_epi16(8), sixteen = _mm256_set1_epi16(16);
    /* lane l's bit, to spread 16 fifth bits over 16 lanes */
    const __m256i lane_bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                               (short)0x8000);
    #pragma GCC unroll 4
    for (int64_t r = 0; r < tile; r++) {
        /* unrolled: a block's chain (load, madd, add, convert, FMA) is ~20 cycles on a Zen 1
         * core, whose small FP scheduler overlaps little of the next block's otherwise */
        #pragma GCC unroll 4
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *block = levels + r * row_bytes + b * BLOCK_BYTES(bits);
            _mm_prefetch((const char *)block + PREFETCH_AHEAD, _MM_HINT_T0);
            /* the block's 64 levels as four runs of 16, 16 bits each: inputs 0-15, 16-31 (the
             * first group), 32-47, 48-63 (the second) */
            __m256i w[4];
            if (bits == 4 || bits == 5) {
                const __m256i bytes_lo = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)block));
                const __m256i bytes_hi = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)block + 1));
                w[0] = _mm256_and_si256(bytes_lo, low_mask);
                w[1] = _mm256_and_si256(bytes_hi, low_mask);
                w[2] = _mm256_srli_epi16(bytes_lo, 4);
                w[3] = _mm256_srli_epi16(bytes_hi, 4);
                if (bits == 5) {
                    /* run i's fifth bits are bits 16 i .. 16 i + 15 of the block's mask */
                    const uint64_t high = fifth_bits(block);
                    for (int i = 0; i < 4; i++) {
                        const __m256i spread = _mm256_and_si256(_mm256_set1_epi16((short)(high >> (16 * i))), lane_bit);
                        const __m256i set = _mm256_cmpeq_epi16(spread, lane_bit);
                        w[i] = symmetric ? _mm256_sub_epi16(w[i], _mm256_andnot_si256(set, sixteen))
                                         : _mm256_add_epi16(w[i], _mm256_and_si256(set, sixteen));
                    }
                } else if (symmetric) { /* the signed levels q = nibble - 8: no minimum's term */
                    for (int i = 0; i < 4; i++) w[i] = _mm256_sub_epi16(w[i], eight);
                }
            } else if (symmetric) { /* signed levels, weight = level * scale */
                for (int i = 0; i < 4; i++) w[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)block + i));
            } else {
                for (int i = 0; i < 4; i++) w[i] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)block + i));
            }
            #pragma GCC unroll 4
            for (int64_t m = 0; m < m_rows; m++) {
                const __m256i *q = (const __m256i *)(xq + m * k + b * BLOCK);
                const float *f = factor + (r * m_rows + m) * groups + 2 * b;
                const __m256i dot_first = _mm256_add_epi32(_mm256_madd_epi16(w[0], _mm256_loadu_si256(q)),
                                                           _mm256_madd_epi16(w[1], _mm256_loadu_si256(q + 1)));
                const __m256i dot_second = _mm256_add_epi32(_mm256_madd_epi16(w[2], _mm256_loadu_si256(q + 2)),
                                                            _mm256_madd_epi16(w[3], _mm256_loadu_si256(q + 3)));
                acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_first), _mm256_broadcast_ss(f), acc[r][m]);
                if (split)
                    acc_second[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_second), _mm256_broadcast_ss(f + 1),
                                                       acc_second[r][m]);
                else
                    acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_second), _mm256_broadcast_ss(f + 1),
                                                acc[r][m]);
            }
        }
    }
    #pragma GCC unroll 4
    for (int64_t r = 0; r < TILE; r++)
        #pragma GCC unroll 4
        for (int64_t m = 0; m < MAX_ROWS; m++)
            if (split) acc[r][m] = _mm256_add_ps(acc[r][m], acc_second[r][m]);
    #pragma GCC unroll 4
    for (int64_t r = 0; r < tile; r++)
        #pragma GCC unroll 4
        for (int64_t m = 0; m < m_rows; m++) {
            const __m128 four = _mm_add_ps(_mm256_castps256_ps128(acc[r][m]), _mm256_extractf128_ps(acc[r][m], 1));
            const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
            out[m * out_stride + r] = _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1))) +
                                      (symmetric ? 0.0f : min_term(mins + r * groups, xsum + m * groups, groups, bf16));
        }
#else
    #pragma GCC unroll 4
    for (int64_t r = 0; r < tile; r++)
        #pragma GCC unroll 4
        for (int64_t m = 0; m < m_rows; m++) {
            const float *f = factor + (r * m_rows + m) * groups;
            float total = 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                int32_t first, second;
                block_dots(levels + r * row_bytes + b * BLOCK_BYTES(bits), bits, symmetric, xq + m * k + b * BLOCK,
                           &first, &second);
                total += (float)first * f[2 * b] + (float)second * f[2 * b + 1];
            }
            out[m * out_stride + r] = total + (symmetric ? 0.0f : min_term(mins + r * groups, xsum + m * groups,
                                                                            groups, bf16));
        }
#endif
}

#define TILE_CASE(BITS, T, M)                                                                               \
    tile_dot(levels, row_bytes, BITS, scales, mins, k, xq, d, xsum, T, M, out, out_stride, factor, bf16); \
    break;

/* tile_dot with the tile's size and the activation rows as literals: whole tiles, then the
 * last, partial one (n % TILE output rows) one row at a time. */
#define DEFINE_TILE_DOT(BITS)                                                                          \
static void tile_dot_##BITS(const uint8_t *levels, int64_t row_bytes, const uint16_t *scales,          \
                            const uint16_t *mins, int64_t k, const int16_t *xq, const float *d,        \
                            const float *xsum, int64_t tile, int64_t m_rows, float *out,               \
                            int64_t out_stride, float *factor, int bf16) {                             \
    if (tile == TILE) {                                                                                \
        switch (m_rows) {                                                                              \
        case 1: TILE_CASE(BITS, TILE, 1)                                                               \
        case 2: TILE_CASE(BITS, TILE, 2)                                                               \
        case 3: TILE_CASE(BITS, TILE, 3)                                                               \
        default: TILE_CASE(BITS, TILE, 4)                                                              \
        }                                                                                              \
        return;                                                                                        \
    }                                                                                                  \
    for (int64_t r = 0; r < tile; r++, levels += row_bytes, scales += k / GROUP,                       \
         mins = mins == NULL ? NULL : mins + k / GROUP, out++)                                         \
        switch (m_rows) {                                                                              \
        case 1: TILE_CASE(BITS, 1, 1)                                                                  \
        case 2: TILE_CASE(BITS, 1, 2)                                                                  \
        case 3: TILE_CASE(BITS, 1, 3)                                                                  \
        default: TILE_CASE(BITS, 1, 4)                                                                 \
        }                                                                                              \
}
DEFINE_TILE_DOT(4)
DEFINE_TILE_DOT(5)
DEFINE_TILE_DOT(8)

/* Scratch of this many elements or fewer lives on the stack: a call's own buffers were a
 * malloc and free each (three for the activations, one a thread), and in a one-token step on
 * the 2-core Zen 5 EPYC the calling thread spent ~3% of its time in the allocator while the
 * other waited. */
#define STACK_ELEMENTS 16384

/* Output columns [lo, hi) of every activation row from their fp32 products: plus the
 * residual where given, in fp32, or in bf16 as torch's bf16 ops round them (the product
 * rounded to bf16, the sum rounded again). */
static void finish_columns(const float *products, const void *residual, void *out, int bf16, int64_t m_rows,
                           int64_t n, int64_t lo, int64_t hi) {
    for (int64_t m = 0; m < m_rows; m++) {
        const int64_t base = m * n;
        if (!bf16) {
            float *target = (float *)out + base;
            const float *add = (const float *)residual + base;
            for (int64_t i = lo; i < hi; i++) target[i] = add[i] + products[base + i];
        } else if (residual == NULL) {
            uint16_t *target = (uint16_t *)out + base;
            for (int64_t i = lo; i < hi; i++) target[i] = to_bf16(products[base + i]);
        } else {
            uint16_t *target = (uint16_t *)out + base;
            const uint16_t *add = (const uint16_t *)residual + base;
            for (int64_t i = lo; i < hi; i++)
                target[i] = to_bf16(from_bf16(add[i]) + from_bf16(to_bf16(products[base + i])));
        }
    }
}

/* Quantize x's rows (fp32, or bf16 where `bf16`) for the tiles. */
static void quantize_rows(const void *x, int bf16, int64_t m_rows, int64_t k, int16_t *xq, float *d, float *xsum) {
    const int64_t groups = k / GROUP;
    for (int64_t m = 0; m < m_rows; m++) {
        if (bf16)
            quantize_row_bf16((const uint16_t *)x + m * k, k, xq + m * k, d + m * groups, xsum + m * groups);
        else
            quantize_row((const float *)x + m * k, k, xq + m * k, d + m * groups, xsum + m * groups);
    }
}

/* One thread's part of a product: output rows (tiles) [first, last) of every activation row
 * into `products` (the output itself where nothing is `staged`), then, staged, those columns
 * finished into out (finish_columns). Returns 0, or -1 when its scratch ran out. */
static int lowbit_part(int bits, const uint8_t *levels, const uint16_t *scales, const uint16_t *mins, int scale_bf16,
                       const int16_t *xq, const float *d, const float *xsum, float *products, const void *residual,
                       void *out, int bf16, int staged, int64_t m_rows, int64_t n, int64_t k, int64_t first,
                       int64_t last) {
    const int64_t groups = k / GROUP, row_bytes = bits * k / 8;
    const int factor_small = TILE * MAX_ROWS * groups <= STACK_ELEMENTS;
    float factor_stack[factor_small ? TILE * MAX_ROWS * groups : 1];
    float *factor = factor_small ? factor_stack : malloc(sizeof(float) * (size_t)(TILE * MAX_ROWS * groups));
    if (factor == NULL) return -1;
    for (int64_t t = first; t < last; t++) {
        const int64_t row = t * TILE, tile = n - row < TILE ? n - row : TILE;
        for (int64_t m = 0; m < m_rows; m += MAX_ROWS) {
            const int64_t rows = m_rows - m < MAX_ROWS ? m_rows - m : MAX_ROWS;
            (bits == 4 ? tile_dot_4 : bits == 5 ? tile_dot_5 : tile_dot_8)(
                levels + row * row_bytes, row_bytes, scales + row * groups, mins == NULL ? NULL : mins + row * groups,
                k, xq + m * k, d + m * groups, xsum + m * groups, tile, rows, products + m * n + row, n, factor,
                scale_bf16);
        }
    }
    if (staged) finish_columns(products, residual, out, bf16, m_rows, n, first * TILE, last * TILE < n ? last * TILE : n);
    if (!factor_small) free(factor);
    return 0;
}

/* A product computed by the caller's team: every thread of the enclosing parallel region
 * calls it with the same arguments, quantizes the rows itself (a one-row input is ~0.1 us:
 * cheaper than waiting for one thread to do it), takes its share of the tiles, and waits for
 * the others at the team's barrier, so the whole output is there when it returns. What it
 * saves is the region: a decode stack that keeps one team for several products
 * (decode_stack.c) pays a barrier between them instead of a fork and a join. Scratch is each
 * thread's own. Returns 0, or -1 where this thread's scratch ran out (the barrier is still
 * met, so the team stays in step). */
static int lowbit_team(int bits, const uint8_t *levels, const uint16_t *scales, const uint16_t *mins, int scale_bf16,
                       const void *x, const void *residual, void *out, int bf16, int64_t m_rows, int64_t n,
                       int64_t k) {
    const int64_t groups = k / GROUP, tiles = (n + TILE - 1) / TILE;
    const int small = m_rows * k <= STACK_ELEMENTS;
    int16_t xq_stack[small ? m_rows * k : 1];
    float d_stack[small ? m_rows * groups : 1], xsum_stack[small ? m_rows * groups : 1];
    int16_t *xq = small ? xq_stack : malloc(sizeof(int16_t) * (size_t)(m_rows * k));
    float *d = small ? d_stack : malloc(sizeof(float) * (size_t)(m_rows * groups));
    float *xsum = small ? xsum_stack : malloc(sizeof(float) * (size_t)(m_rows * groups));
    const int staged = bf16 || residual != NULL, staged_small = m_rows * n <= STACK_ELEMENTS;
    float products_stack[staged && staged_small ? m_rows * n : 1];
    float *products = !staged ? (float *)out
                      : staged_small ? products_stack : malloc(sizeof(float) * (size_t)(m_rows * n));
    int failed = xq == NULL || d == NULL || xsum == NULL || (staged && products == NULL);
    if (!failed) {
        quantize_rows(x, bf16, m_rows, k, xq, d, xsum);
        const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
        failed = lowbit_part(bits, levels, scales, mins, scale_bf16, xq, d, xsum, products, residual, out, bf16,
                             staged, m_rows, n, k, tiles * me / threads, tiles * (me + 1) / threads) != 0;
    }
    if (!small) {
        free(xq);
        free(d);
        free(xsum);
    }
    if (staged && !staged_small) free(products);
#pragma omp barrier
    return failed ? -1 : 0;
}

/* out [m_rows, n] = x [m_rows, k] @ W.T (+ residual [m_rows, n] where not NULL: a layer's
 * o_proj and down_proj add the residual stream, one torch op less a call); x, residual and
 * out fp32, or bf16 where `bf16`. bf16 rows are widened as they are quantized, and each
 * thread rounds (and adds the residual to) its own columns after its tiles: before, whole
 * rows were widened into a copy and the products rounded in passes on the calling thread
 * while the others waited, around buffers that were a malloc and a free each. On the 2-core
 * Zen 5 EPYC, SmolLM2's projections in bf16, one row, two threads: gate/up 23.5 -> 20.5 us,
 * qkv 8.2 -> 7.3, o 5.5 -> 4.8, down 9.5 -> 9.2; one stream through the engine, five runs
 * each alternating, 331 -> 344 tok/s (medians). Called inside a parallel region (by all of
 * its threads), it is the team's product instead (lowbit_team). Returns 0, or -1 when
 * scratch memory ran out. */
static int lowbit_gemm_scaled(int bits, const uint8_t *levels, const uint16_t *scales, const uint16_t *mins,
                              int scale_bf16, const void *x, const void *residual, void *out, int bf16,
                              int64_t m_rows, int64_t n, int64_t k, int num_threads) {
    if (m_rows <= 0 || n <= 0) return 0; /* nothing to compute (an empty batch's out may be NULL) */
    if (omp_in_parallel()) return lowbit_team(bits, levels, scales, mins, scale_bf16, x, residual, out, bf16, m_rows, n, k);
    const int64_t groups = k / GROUP, tiles = (n + TILE - 1) / TILE;
    const int small = m_rows * k <= STACK_ELEMENTS;
    int16_t xq_stack[small ? m_rows * k : 1];
    float d_stack[small ? m_rows * groups : 1], xsum_stack[small ? m_rows * groups : 1];
    int16_t *xq = small ? xq_stack : malloc(sizeof(int16_t) * (size_t)(m_rows * k));
    float *d = small ? d_stack : malloc(sizeof(float) * (size_t)(m_rows * groups));
    float *xsum = small ? xsum_stack : malloc(sizeof(float) * (size_t)(m_rows * groups));
    /* the fp32 products, where they are not the output itself */
    const int staged = bf16 || residual != NULL, staged_small = m_rows * n <= STACK_ELEMENTS;
    float products_stack[staged && staged_small ? m_rows * n : 1];
    float *products = !staged ? (float *)out
                      : staged_small ? products_stack : malloc(sizeof(float) * (size_t)(m_rows * n));
    int failed = xq == NULL || d == NULL || xsum == NULL || (staged && products == NULL);
    if (!failed) quantize_rows(x, bf16, m_rows, k, xq, d, xsum);
    if (!failed)
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        /* each thread's tiles in one run, as a static schedule gives them, so that it can
         * finish those columns itself */
        const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
        failed = lowbit_part(bits, levels, scales, mins, scale_bf16, xq, d, xsum, products, residual, out, bf16,
                             staged, m_rows, n, k, tiles * me / threads, tiles * (me + 1) / threads) != 0;
    }
    if (!small) {
        free(xq);
        free(d);
        free(xsum);
    }
    if (staged && !staged_small) free(products);
    return failed ? -1 : 0;
}

static int lowbit_gemm(int bits, const uint8_t *levels, const uint16_t *scales, const uint16_t *mins, const float *x,
                       const float *residual, float *out, int64_t m_rows, int64_t n, int64_t k, int num_threads) {
    return lowbit_gemm_scaled(bits, levels, scales, mins, 0, x, residual, out, 0, m_rows, n, k, num_threads);
}

/* 4-bit levels with bf16 scales (`scale_bf16`) and/or no minimums (`mins` NULL: symmetric). */
int tandem_q4_gemm_scaled(const uint8_t *nibbles, const uint16_t *scales, const uint16_t *mins, int scale_bf16,
                          const float *x, const float *residual, float *out, int64_t m_rows, int64_t n, int64_t k,
                          int num_threads) {
    return lowbit_gemm_scaled(4, nibbles, scales, mins, scale_bf16, x, residual, out, 0, m_rows, n, k, num_threads);
}

/* One (expert, tile of output rows) pair of a grouped GEMM. */
typedef struct {
    int64_t expert;
    int64_t row;
} moe_item;

/* out[rows of e] = x[rows of e] @ W_e.T for every expert e with rows, W_e [n, k] the e-th of
 * `levels` (`level_stride` bytes apart; scales `scale_stride` values apart, mins likewise or
 * NULL), x already quantized (xq, d, xsum). Called inside a parallel region: its `omp for`
 * shares the items among the team, and ends on the team's barrier. */
static void moe_grouped(const uint8_t *levels, int64_t level_stride, const uint16_t *scales, const uint16_t *mins,
                        int64_t scale_stride, int scale_bf16, const int64_t *offsets, const moe_item *items,
                        int64_t num_items, const int16_t *xq, const float *d, const float *xsum, float *out, int64_t n,
                        int64_t k, float *factor) {
    const int64_t groups = k / GROUP, row_bytes = k / 2;
#pragma omp for schedule(dynamic, 4)
    for (int64_t i = 0; i < num_items; i++) {
        const int64_t e = items[i].expert, row = items[i].row, tile = n - row < TILE ? n - row : TILE;
        const uint8_t *w = levels + e * level_stride + row * row_bytes;
        const uint16_t *s = scales + e * scale_stride + row * groups;
        const uint16_t *mn = mins == NULL ? NULL : mins + e * scale_stride + row * groups;
        for (int64_t m = offsets[e]; m < offsets[e + 1]; m += MAX_ROWS) {
            const int64_t rows = offsets[e + 1] - m < MAX_ROWS ? offsets[e + 1] - m : MAX_ROWS;
            tile_dot_4(w, row_bytes, s, mn, k, xq + m * k, d + m * groups, xsum + m * groups, tile, rows,
                       out + m * n + row, n, factor, scale_bf16);
        }
    }
}

/* The (expert, tile) items of the experts that have rows, for an output of n rows. */
static int64_t moe_items(const int64_t *offsets, int64_t experts, int64_t n, moe_item *items) {
    int64_t count = 0;
    for (int64_t e = 0; e < experts; e++)
        if (offsets[e + 1] > offsets[e])
            for (int64_t row = 0; row < n; row += TILE) items[count++] = (moe_item){e, row};
    return count;
}

/* A MoE layer's routed experts, 4-bit: x [M, hidden] fp32, its rows sorted by expert (expert
 * e's are offsets[e] .. offsets[e + 1]); w13 [E, 2 inter, hidden] (gate rows, then up rows),
 * w2 [E, hidden, inter], each with its scales (and mins, or NULL for symmetric levels).
 * out [M, hidden] = down_e(silu(gate_e x) * up_e x) for each row's expert. Returns 0, or -1
 * when scratch memory ran out. */
int tandem_q4_moe(const uint8_t *w13, const uint16_t *s13, const uint16_t *m13, const uint8_t *w2,
                  const uint16_t *s2, const uint16_t *m2, int scale_bf16, const float *x, const int64_t *offsets,
                  float *out, int64_t experts, int64_t hidden, int64_t inter, int num_threads) {
    const int64_t rows = offsets[experts], wide = 2 * inter;
    const int64_t hidden_groups = hidden / GROUP, inter_groups = inter / GROUP;
    const int64_t most_groups = hidden_groups > inter_groups ? hidden_groups : inter_groups;
    int16_t *xq = malloc(sizeof(int16_t) * (size_t)(rows * hidden));
    float *d = malloc(sizeof(float) * (size_t)(rows * most_groups));
    float *xsum = malloc(sizeof(float) * (size_t)(rows * most_groups));
    float *gate_up = malloc(sizeof(float) * (size_t)(rows * wide));
    int16_t *hq = malloc(sizeof(int16_t) * (size_t)(rows * inter));
    moe_item *first = malloc(sizeof(moe_item) * (size_t)(experts * (wide / TILE + 1)));
    moe_item *second = malloc(sizeof(moe_item) * (size_t)(experts * (hidden / TILE + 1)));
    int failed = xq == NULL || d == NULL || xsum == NULL || gate_up == NULL || hq == NULL || first == NULL ||
                 second == NULL;
    if (!failed) {
        for (int64_t m = 0; m < rows; m++)
            quantize_row(x + m * hidden, hidden, xq + m * hidden, d + m * hidden_groups, xsum + m * hidden_groups);
        const int64_t first_items = moe_items(offsets, experts, wide, first);
        const int64_t second_items = moe_items(offsets, experts, hidden, second);
        int unready = 0; /* threads whose scratch could not be allocated */
#pragma omp parallel num_threads(num_threads)
        {
            float *factor = malloc(sizeof(float) * (size_t)(TILE * MAX_ROWS * most_groups));
            float *act = malloc(sizeof(float) * (size_t)inter);
            if (factor == NULL || act == NULL) {
#pragma omp atomic write
                unready = 1;
            }
            /* every thread takes part in each `omp for` below or none does: a failed
             * allocation anywhere is seen by all before the first */
#pragma omp barrier
            int go;
#pragma omp atomic read
            go = unready;
            go = !go;
            if (go) {
                moe_grouped(w13, wide * hidden / 2, s13, m13, wide * hidden_groups, scale_bf16, offsets, first,
                            first_items, xq, d, xsum, gate_up, wide, hidden, factor);
#pragma omp for schedule(static)
                for (int64_t m = 0; m < rows; m++) {
                    const float *gate = gate_up + m * wide, *up = gate + inter;
                    for (int64_t i = 0; i < inter; i++) act[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
                    quantize_row(act, inter, hq + m * inter, d + m * inter_groups, xsum + m * inter_groups);
                }
                moe_grouped(w2, hidden * inter / 2, s2, m2, hidden * inter_groups, scale_bf16, offsets, second,
                            second_items, hq, d, xsum, out, hidden, inter, factor);
            }
            free(factor);
            free(act);
        }
        failed = unready;
    }
    free(xq);
    free(d);
    free(xsum);
    free(gate_up);
    free(hq);
    free(first);
    free(second);
    return failed ? -1 : 0;
}

int tandem_q4_gemm(const uint8_t *nibbles, const uint16_t *scales, const uint16_t *mins, const float *x,
                   const float *residual, float *out, int64_t m_rows, int64_t n, int64_t k, int num_threads) {
    return lowbit_gemm(4, nibbles, scales, mins, x, residual, out, m_rows, n, k, num_threads);
}

int tandem_q5_gemm(const uint8_t *levels, const uint16_t *scales, const uint16_t *mins, const float *x,
                   const float *residual, float *out, int64_t m_rows, int64_t n, int64_t k, int num_threads) {
    return lowbit_gemm(5, levels, scales, mins, x, residual, out, m_rows, n, k, num_threads);
}

int tandem_q8_gemm(const uint8_t *levels, const uint16_t *scales, const uint16_t *mins, const float *x,
                   const float *residual, float *out, int64_t m_rows, int64_t n, int64_t k, int num_threads) {
    return lowbit_gemm(8, levels, scales, mins, x, residual, out, m_rows, n, k, num_threads);
}


/* bf16 rows in and out (a bf16 model's activations), widened and rounded to nearest even by
 * the kernel instead of two torch casts around every call, which at one token cost about as
 * much as the GEMM's own overhead; the residual, where given, is added as torch's bf16 add
 * would: to the product rounded to bf16, the sum rounded again. */
static int lowbit_gemm_bf16(int bits, const uint8_t *levels, const uint16_t *scales, const uint16_t *mins,
                            const uint16_t *x, const uint16_t *residual, uint16_t *out, int64_t m_rows, int64_t n,
                            int64_t k, int num_threads) {
    return lowbit_gemm_scaled(bits, levels, scales, mins, 0, x, residual, out, 1, m_rows, n, k, num_threads);
}

int tandem_q4_gemm_bf16(const uint8_t *nibbles, const uint16_t *scales, const uint16_t *mins, const uint16_t *x,
                        const uint16_t *residual, uint16_t *out, int64_t m_rows, int64_t n, int64_t k,
                        int num_threads) {
    return lowbit_gemm_bf16(4, nibbles, scales, mins, x, residual, out, m_rows, n, k, num_threads);
}

int tandem_q5_gemm_bf16(const uint8_t *levels, const uint16_t *scales, const uint16_t *mins, const uint16_t *x,
                        const uint16_t *residual, uint16_t *out, int64_t m_rows, int64_t n, int64_t k,
                        int num_threads) {
    return lowbit_gemm_bf16(5, levels, scales, mins, x, residual, out, m_rows, n, k, num_threads);
}

int tandem_q8_gemm_bf16(const uint8_t *levels, const uint16_t *scales, const uint16_t *mins, const uint16_t *x,
                        const uint16_t *residual, uint16_t *out, int64_t m_rows, int64_t n, int64_t k,
                        int num_threads) {
    return lowbit_gemm_bf16(8, levels, scales, mins, x, residual, out, m_rows, n, k, num_threads);
}

/* which integer dot product this build uses, for the log */
const char *tandem_q4_gemm_isa(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
    return "avx512-vnni";
#elif defined(__AVX2__) && defined(__FMA__)
    return "avx2";
#else
    return "portable C";
#endif
}
