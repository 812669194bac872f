/*
 * A step (bf16 or fp32) through every decoder layer in one call: small steps (one to a few
 * tokens) over the small-step copies, larger ones over the weights packed for tandem's dense
 * GEMM (dense_gemm.c); decode tokens, and prefill chunks where the prefill kernel is given.
 *
 * At one token a layer's C kernels (the 4-bit GEMMs, norm, rotary, KV write, decode attention,
 * silu-and-mul) take about 150 us together, and the Python around them (module calls, views,
 * ctypes, output tensors) as much again: measured on the 2-core AVX-512 EPYC, SmolLM2 in
 * bf16 with 4-bit decode weights, 9.3 ms a token of which the kernels are about half. This
 * file only sequences those same kernels, passed in as function pointers from the libraries
 * that already hold them (q4_gemm.c or dense_gemv.c, layer_ops.c, paged_decode_attention.c),
 * in the order the Python layer calls them and with the same arguments: in bf16 the result
 * is bit-identical to the layer-by-layer path, and no kernel is written twice. fp32 runs the
 * same sequence on fp32 rows with the fp32 GEMV and the C fp32 norm (the layer path's norm
 * is torch's, summed in another order). A bf16 model's own plain rows (`--decode-weights
 * bfloat16`) go through the bf16 GEMV, which rounds as the layer path's call of it does.
 * A batch of decode tokens spends the same serial time between kernels, twice over: while
 * the calling thread runs Python, the other OpenMP threads wait (11.8% of a bf16
 * decode-heavy run in libgomp, 4.7% in the interpreter). Its matrices are the packed ones
 * (bits PACKED), and gate/up the gated layout whose epilogue writes silu(gate) * up itself
 * (PACKED_GATED), as the layer path's GateUpLinear does: no silu-and-mul pass. Under
 * `--quantization int8` they are the packed 8-bit matrices (INT8): each product quantizes its
 * rows (int8_rows.c), then the int8 GEMM dequantizes in its epilogue (int8_gemm.c), and
 * gate/up's pairs (INT8_GATED) give the fp32 middle the down projection quantizes, as
 * layers/int8.py's `gated_mlp` does.
 *
 * A step with prefill chunks (a prompt's chunk, or decode tokens and chunks together) runs the
 * same sequence, its attention as the CPU backend's: the decode rows in one decode-attention
 * call, then every chunk in one tandem_prefill_attention_spans call (prefill_attention.c), each
 * over its sequence's cached context, each writing its rows. The Python between a prefill step's
 * kernels was 5% of a bf16 or exact prefill-heavy pass, 15% in the default mode.
 *
 * Per layer, for T tokens with hidden size H (elements of `element_bytes` each):
 *   normed = rms_norm(hidden)                     input_layernorm
 *   qkv    = normed @ Wqkv.T                      [T, (heads + 2 kv_heads) * head_dim]
 *   rotary(q and k heads of qkv, in place)
 *   write k, v of qkv into the paged cache        at the step's slots
 *   attn   = attention(q of qkv)                  [T, heads * head_dim]: decode rows, then chunks
 *   hidden = hidden + attn @ Wo.T                 (the GEMM adds the residual, in place)
 *   normed = rms_norm(hidden)                     post_attention_layernorm
 *   act    = silu_mul(normed @ Wgate_up.T)        [T, intermediate]
 *   hidden = hidden + act @ Wdown.T
 */
#include <stdint.h>
#include <stdlib.h>

#include <omp.h>

/* Rows are bf16 (uint16_t) or fp32, as the step's element size says: `void *` here. */
typedef int (*gemm_fn)(const uint8_t *levels, const uint16_t *scales, const uint16_t *mins, const void *x,
                       const void *residual, void *out, int64_t m_rows, int64_t n, int64_t k, int num_threads);
typedef void (*gemv_fn)(const float *w, const float *bias, const float *x, const float *residual, float *out,
                        int64_t m_rows, int64_t n, int64_t k, int num_threads);
typedef void (*coded_gemv_fn)(const uint8_t *w, const float *bias, const float *x, const float *residual,
                              float *out, int64_t m_rows, int64_t n, int64_t k, int num_threads);
typedef int (*gemv16_fn)(const uint16_t *w, const float *bias, const uint16_t *x, const uint16_t *residual,
                         uint16_t *out, int64_t m_rows, int64_t n, int64_t k, int num_threads);
typedef void (*norm_fn)(const void *x, int64_t x_stride, const void *weight, void *out, int64_t rows,
                        int64_t hidden, float eps, int num_threads);
typedef void (*rotary_fn)(void *x, int64_t tokens, int64_t heads, int64_t token_stride, int64_t head_dim,
                          const void *cos, const void *sin, int num_threads);
typedef void (*silu_mul_fn)(const void *gate_up, void *out, int64_t rows, int64_t inter, int num_threads);
typedef void (*write_kv_fn)(const char *key, const char *value, char *kv_cache, const int64_t *slots,
                            int64_t num_tokens, int64_t key_stride, int64_t value_stride, int64_t num_kv_heads,
                            int64_t head_dim, int64_t num_slots, int64_t element_bytes, int num_threads);
/* tandem_write_kv_i8 and tandem_write_kv_bf16: rows rounded into an int8 or a bf16 cache */
typedef void (*round_kv_fn)(const void *key, const void *value, int src_bf16, void *kv_cache, const int64_t *slots,
                            int64_t num_tokens, int64_t key_stride, int64_t value_stride, int64_t num_kv_heads,
                            int64_t head_dim, int64_t num_slots, int num_threads);
/* tandem_write_kv_f8: rows times one over the layer's scales, rounded into an fp8 cache */
typedef void (*fp8_kv_fn)(const void *key, const void *value, int src_bf16, void *kv_cache, const int64_t *slots,
                          int64_t num_tokens, int64_t key_stride, int64_t value_stride, int64_t num_kv_heads,
                          int64_t head_dim, int64_t num_slots, float key_multiplier, float value_multiplier,
                          int num_threads);
typedef int (*dense_gemm_fn)(const void *x, int64_t x_stride, int64_t m, int64_t k, const void *packed, int kind,
                             const void *bias, const void *residual, void *out, int64_t n, int num_threads);
typedef int (*dense_silu_mul_fn)(const void *x, int64_t x_stride, int64_t m, int64_t k, const void *packed,
                                 int kind, const void *bias, void *out, int64_t intermediate, int num_threads);
typedef void (*quantize_fn)(const void *x, int kind, int64_t rows, int64_t cols, int64_t stride, int8_t *q,
                            float *scales, int64_t outliers, int32_t *outlier_index, float *outlier_value,
                            int num_threads);
typedef int (*int8_dequantize_fn)(const int8_t *a, int64_t a_stride, int64_t m, int64_t k, const int8_t *packed,
                                  const int32_t *compensation, int64_t n, const float *row_scales,
                                  const float *col_scales, int64_t outliers, const int32_t *outlier_index,
                                  const float *outlier_value, const int8_t *weight_t, const void *bias,
                                  const void *residual, void *out, int kind, int num_threads);
typedef int (*int8_gated_fn)(const int8_t *a, int64_t a_stride, int64_t m, int64_t k, const int8_t *packed,
                             const int32_t *compensation, int64_t n, const float *row_scales, const float *col_scales,
                             int64_t outliers, const int32_t *outlier_index, const float *outlier_value,
                             const int8_t *weight_t, float *h, int kind, int num_threads);
typedef int (*attend_fn)(const void *q, int q_bf16, int64_t q_stride, const void *kv_cache, int kv_kind,
                         const int64_t *block_tables, const int64_t *context_lens, void *out, int64_t num_seqs,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                         int64_t num_blocks, int64_t table_stride, int64_t heads_per_item, float scale,
                         int num_threads);

typedef int (*attend_in_team_fn)(int q_bf16, int kv_kind, int64_t head_dim, int64_t heads_per_item);
typedef int (*prefill_spans_fn)(const void *q, const void *kv_cache, const int64_t *block_tables, int64_t table_stride,
                                const int64_t *span_start, const int64_t *span_len, const int64_t *span_context,
                                int64_t spans, void *out, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                int64_t block_size, int64_t num_blocks, int64_t q_stride, int64_t out_stride, int kind,
                                float scale, int num_threads);

/* The kernels, from the libraries that hold them, for the step's element type. */
struct Kernels {
    gemm_fn gemm4, gemm5, gemm8; /* tandem_q4_gemm_bf16, tandem_q5_gemm_bf16, tandem_q8_gemm_bf16 (bf16 rows) */
    gemv_fn gemv32;       /* tandem_f32_gemv (fp32 rows) */
    gemv16_fn gemv16;     /* tandem_bf16_gemv (bf16 rows) */
    norm_fn rms_norm;
    rotary_fn rotary;
    silu_mul_fn silu_mul;
    write_kv_fn write_kv;
    attend_fn attend;
    dense_gemm_fn dense_gemm;         /* tandem_dense_gemm (packed matrices) */
    dense_silu_mul_fn dense_silu_mul; /* tandem_dense_gemm_silu_mul (the gated layout) */
    quantize_fn quantize_rows;        /* tandem_quantize_rows (int8 matrices' rows) */
    int8_dequantize_fn int8_dequantize; /* tandem_int8_gemm_dequantize */
    int8_gated_fn int8_gated;         /* tandem_int8_gemm_gated */
    round_kv_fn write_i8, write_bf16; /* a cache in another dtype than the rows' (Step.kv_kind) */
    fp8_kv_fn write_f8;
    coded_gemv_fn gemv_coded; /* tandem_coded_gemv (fp32 rows, CODED matrices) */
    attend_in_team_fn attend_in_team; /* tandem_decode_attention_in_team: whether `attend` runs as a team's */
    prefill_spans_fn prefill_spans;   /* tandem_prefill_attention_spans (steps with prefill chunks) */
};

/* A matrix in q4_gemm.c's layout, [n, k] at 4, 5 or 8 bits a level, or (bits 32 / 16) plain
 * fp32 / bf16 rows for dense_gemv.c, or (PACKED) dense_gemm.c's packed blocks in the rows'
 * dtype, or (PACKED_GATED) its gate/up layout with n = 2 x intermediate, or (INT8) int8_gemm.c's
 * packed 8-bit blocks with what its epilogue reads, or (INT8_GATED) its gate/up pairs, or
 * (CODED) fp32 rows as dense_gemv.c's lossless codes, or (PACKED_W8, PACKED_W8_GATED) the packed
 * layouts with 8-bit weights for bf16 rows (`--quantization w8a16`). */
/* (apart from the bit counts 4, 5, 8, 16 and 32) */
#define PACKED 101
#define PACKED_GATED 102
#define INT8 103
#define INT8_GATED 104
#define CODED 105
#define PACKED_W8 106       /* PACKED and PACKED_GATED with 8-bit weights: dense_gemm.c's kind 3 */
#define PACKED_W8_GATED 107
#define KIND_BF16_W8 3
struct Matrix {
    const uint8_t *levels; /* bits 32 / 16: the fp32 / bf16 [n, k] rows; CODED: their codes; PACKED*, INT8*: the packed blocks */
    const uint16_t *scales, *mins;
    int64_t n, k, bits;
    /* INT8*: 128 x each column's sum, the columns' scales, the [k, n] matrix (the outliers'
     * rows) and how many outliers a row of its input sets aside */
    const int32_t *compensation;
    const float *col_scales;
    const int8_t *columns;
    int64_t outliers;
    /* NULL, or the projection's bias as the layer path adds it: in the rows' dtype for the
     * packed and 8-bit kinds (their epilogues add it before rounding), fp32 for the GEMVs,
     * bf16 added after the 4/8-bit GEMM's rounding (as torch's `out + bias`) */
    const void *bias;
};

/* out [rows, n] bf16 += bias [n] bf16, each sum rounded to bf16 (torch's bf16 add). */
static void add_bias_bf16(uint16_t *out, const uint16_t *bias, int64_t rows, int64_t n) {
    for (int64_t i = 0; i < rows * n; i++) {
        union { uint32_t u; float f; } a = {.u = (uint32_t)out[i] << 16}, b = {.u = (uint32_t)bias[i % n] << 16};
        a.f += b.f;
        a.u += 0x7FFFu + ((a.u >> 16) & 1u); /* round to nearest even */
        out[i] = (uint16_t)(a.u >> 16);
    }
}

/* An int8 product's input rows, quantized: values [tokens, widest input], a scale a row,
 * and each row's outliers. */
struct Quantized {
    int8_t *values;
    float *scales;
    int32_t *outlier_index;
    float *outlier_value;
};

/* out [rows, n] (+ residual, in place where out is residual) = x @ the int8 matrix, x in
 * `x_kind` (0 fp32, 1 bf16), out in `kind`: rows quantized, then dequantized in the GEMM's
 * epilogue, as layers/int8.py's `Int8Weight.matmul` does. */
static int int8_product(const struct Kernels *kernels, const struct Matrix *matrix, const void *x, int x_kind,
                        const void *residual, void *out, int64_t rows, int kind, const struct Quantized *q,
                        int num_threads) {
    kernels->quantize_rows(x, x_kind, rows, matrix->k, matrix->k, q->values, q->scales, matrix->outliers,
                           q->outlier_index, q->outlier_value, num_threads);
    return kernels->int8_dequantize(q->values, matrix->k, rows, matrix->k, (const int8_t *)matrix->levels,
                                    matrix->compensation, matrix->n, q->scales, matrix->col_scales, matrix->outliers,
                                    q->outlier_index, q->outlier_value, matrix->columns, matrix->bias, residual, out,
                                    kind, num_threads);
}

struct Layer {
    const void *input_norm, *post_norm; /* [hidden], in the rows' dtype */
    struct Matrix qkv, o, gate_up, down;
    char *kv_cache; /* [2, kv_heads, num_blocks, block_size, head_dim] */
    float k_scale, v_scale; /* an fp8 cache's (layers/attention.py), else 1 */
};

/* What every layer shares: the model's shape and this step's inputs. */
struct Step {
    int64_t tokens, hidden, heads, kv_heads, head_dim, intermediate;
    int64_t block_size, num_blocks, table_stride;
    int64_t element_bytes; /* 2: bf16 rows, weights of norms, tables and cache; 4: fp32 */
    float eps, scale;
    const void *cos, *sin;                                   /* [tokens, head_dim / 2] */
    const int64_t *slots, *block_tables, *context_lens;      /* one decode token a sequence */
    int num_threads;
    /* The step's rows: its decode tokens first (one a sequence: block_tables, context_lens),
     * then `spans` prefill chunks, chunk i rows [span_start[i], + span_len[i]) of a sequence
     * whose first span_context[i] tokens (the chunk's own last) the cache holds, its block ids
     * row i of span_blocks ([spans, span_table_stride]). A decode step: decodes = tokens. */
    int64_t decodes, spans, span_table_stride;
    const int64_t *span_start, *span_len, *span_context, *span_blocks;
    /* The cache's element kind (paged_decode_attention.c's KV_*): 0 fp32 and 1 bf16, the rows'
     * own or a bf16 cache under fp32 rows; 2 int8 rows with their scales, 3 fp8. A cache in
     * another dtype than the rows' takes decode steps only (the prefill kernel reads its own). */
    int64_t kv_kind;
};

enum { KV_FP32 = 0, KV_BF16 = 1, KV_INT8 = 2, KV_FP8 = 3 };

/* This step's keys and values into the layer's cache: copied where it holds the rows' dtype,
 * else rounded into it (an fp8 cache's values divided by the layer's scales first, as
 * layers/attention.py divides them). */
static void write_kv(const struct Kernels *kernels, const struct Step *step, const struct Layer *layer,
                     const char *key, const char *value, int64_t width) {
    const int bf16 = step->element_bytes == 2;
    const int64_t slots = step->num_blocks * step->block_size;
    if (step->kv_kind == KV_FP8)
        kernels->write_f8(key, value, bf16, layer->kv_cache, step->slots, step->tokens, width, width, step->kv_heads,
                          step->head_dim, slots, 1.0f / layer->k_scale, 1.0f / layer->v_scale, step->num_threads);
    else if (step->kv_kind == KV_INT8)
        kernels->write_i8(key, value, bf16, layer->kv_cache, step->slots, step->tokens, width, width, step->kv_heads,
                          step->head_dim, slots, step->num_threads);
    else if (step->kv_kind != bf16) /* a bf16 cache under fp32 rows */
        kernels->write_bf16(key, value, 0, layer->kv_cache, step->slots, step->tokens, width, width, step->kv_heads,
                            step->head_dim, slots, step->num_threads);
    else
        kernels->write_kv(key, value, layer->kv_cache, step->slots, step->tokens, width, width, step->kv_heads,
                          step->head_dim, slots, step->element_bytes, step->num_threads);
}

/* out [rows, width] *= factor, a power of two (an fp8 layer's value scale): exact in fp32,
 * and in bf16 too (widened, multiplied, narrowed back unchanged but for the exponent). */
static void scale_rows(void *out, int64_t count, float factor, int bf16) {
    if (bf16) {
        uint16_t *x = out;
        for (int64_t i = 0; i < count; i++) {
            union { uint32_t u; float f; } bits = {.u = (uint32_t)x[i] << 16};
            bits.f *= factor;
            x[i] = (uint16_t)(bits.u >> 16);
        }
        return;
    }
    float *x = out;
    for (int64_t i = 0; i < count; i++) x[i] *= factor;
}

static int gemm(const struct Kernels *kernels, const struct Matrix *matrix, const void *x, const void *residual,
                void *out, int64_t rows, int bf16, const struct Quantized *q, int num_threads) {
    if (matrix->bits == INT8) return int8_product(kernels, matrix, x, bf16, residual, out, rows, bf16, q, num_threads);
    if (matrix->bits == PACKED || matrix->bits == PACKED_W8)
        return kernels->dense_gemm(x, matrix->k, rows, matrix->k, matrix->levels,
                                   matrix->bits == PACKED_W8 ? KIND_BF16_W8 : bf16, matrix->bias, residual, out,
                                   matrix->n, num_threads);
    if (matrix->bits == CODED) {
        kernels->gemv_coded(matrix->levels, matrix->bias, x, residual, out, rows, matrix->n,
                            matrix->k, num_threads);
        return 0;
    }
    if (matrix->bits == 32) {
        kernels->gemv32((const float *)matrix->levels, matrix->bias, x, residual, out, rows, matrix->n, matrix->k,
                        num_threads);
        return 0;
    }
    if (matrix->bits == 16)
        return kernels->gemv16((const uint16_t *)matrix->levels, matrix->bias, x, residual, out, rows, matrix->n,
                               matrix->k, num_threads);
    const gemm_fn entry = matrix->bits == 4 ? kernels->gemm4 : matrix->bits == 5 ? kernels->gemm5 : kernels->gemm8;
    /* a bias comes only with no residual here (the layer path adds it to the rounded product) */
    const int status = entry(matrix->levels, matrix->scales, matrix->mins, x, residual, out, rows, matrix->n,
                             matrix->k, num_threads);
    if (status == 0 && matrix->bias != NULL) add_bias_bf16(out, matrix->bias, rows, matrix->n);
    return status;
}

/* The attention of one layer, as the CPU backend runs a step: the decode rows in one call,
 * then the prefill chunks in one call (a step of many short prompts made a call each), each
 * over its sequence's cached context (its own keys and values were written first), each
 * writing its rows of `attn`. */
static int attention(const struct Kernels *kernels, const struct Step *step, const struct Layer *layer,
                     const char *qkv, char *attn, int64_t heads_per_item) {
    const char *kv_cache = layer->kv_cache;
    const int64_t width = (step->heads + 2 * step->kv_heads) * step->head_dim, q_width = step->heads * step->head_dim;
    const int bf16 = step->element_bytes == 2;
    int status = 0;
    if (step->decodes > 0) {
        status = kernels->attend(qkv, bf16, width, kv_cache, (int)step->kv_kind, step->block_tables,
                                 step->context_lens, attn, step->decodes, step->heads, step->kv_heads, step->head_dim,
                                 step->block_size, step->num_blocks, step->table_stride, heads_per_item,
                                 step->scale * layer->k_scale, step->num_threads);
        if (status == 0 && layer->v_scale != 1.0f) scale_rows(attn, step->decodes * q_width, layer->v_scale, bf16);
    }
    if (step->spans > 0 && status == 0)
        status = kernels->prefill_spans(qkv, kv_cache, step->span_blocks, step->span_table_stride, step->span_start,
                                        step->span_len, step->span_context, step->spans, attn, step->heads,
                                        step->kv_heads, step->head_dim, step->block_size, step->num_blocks, width,
                                        q_width, bf16, step->scale, step->num_threads);
    return status;
}

static int64_t widest(int64_t a, int64_t b) { return a > b ? a : b; }

/* A step's scratch rows, on 64-byte lines (free() releases them). malloc's blocks this large
 * start 16 bytes into a page, which put each 64-byte row of an AMX tile load, and of every
 * vector load, across two lines: SmolLM2's products at 2,048 rows ran at ~2,000 GFLOP/s from
 * such rows against ~2,950 from aligned ones (the same kernel, one process). */
static void *scratch(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

/*
 * A small decode step's layers with one team of threads between two attentions, instead of
 * a parallel region for each kernel. At one token a layer's 4-bit GEMVs are a few
 * microseconds each, and each opened and closed a region of its own after the calling thread
 * had quantized its input alone: on the 2-core Zen 5 EPYC a fork and a join were ~1.5 us, and
 * the other thread, started last, finished last (~1 us). Here the team meets at barriers:
 * q4_gemm.c's products run as the team's when called inside a region (lowbit_team), each
 * thread normalizes the rows (and takes silu(gate) * up) into its own buffer, which is
 * cheaper than a barrier for one row, and one thread adds a bias, rotates and writes the
 * keys and values. Attention keeps its own region (paged_decode_attention.c), so a layer
 * has two regions, not five. The kernels and their arguments are the per-kernel path's, so
 * the bits are too.
 */

/* Whether a step takes the team path: decode rows only, few enough for one pass of the
 * GEMVs' activation rows, and every matrix one of q4_gemm.c's (whose products run as a team's). */
static int team_step(const struct Layer *layers, int64_t num_layers, const struct Step *step) {
    if (step->num_threads < 2 || step->spans > 0 || step->tokens != step->decodes || step->tokens > 4
        || step->tokens < 1)
        return 0;
    for (int64_t i = 0; i < num_layers; i++) {
        const struct Matrix *m[4] = {&layers[i].qkv, &layers[i].o, &layers[i].gate_up, &layers[i].down};
        for (int j = 0; j < 4; j++)
            if (m[j]->bits != 4 && m[j]->bits != 5 && m[j]->bits != 8) return 0;
    }
    return 1;
}

/* Inside the team: one 4/5/8-bit product by every thread (the team's, returning when all of
 * it is there), and its bias added by one. */
static int team_gemm(const struct Kernels *kernels, const struct Matrix *matrix, const void *x, const void *residual,
                     void *out, int64_t rows) {
    const gemm_fn entry = matrix->bits == 4 ? kernels->gemm4 : matrix->bits == 5 ? kernels->gemm5 : kernels->gemm8;
    const int status = entry(matrix->levels, matrix->scales, matrix->mins, x, residual, out, rows, matrix->n,
                             matrix->k, 1);
    if (matrix->bias != NULL) {
#pragma omp single
        add_bias_bf16(out, matrix->bias, rows, matrix->n);
    }
    return status;
}

/* Inside the team: layer `layer`'s input norm (into this thread's `normed`), its q/k/v
 * product, and by one thread the rotation and the cache write. */
static int team_before_attention(const struct Kernels *kernels, const struct Step *step, const struct Layer *layer,
                                 void *hidden, char *normed, char *qkv) {
    const int64_t t = step->tokens, width = (step->heads + 2 * step->kv_heads) * step->head_dim;
    const int64_t q_width = step->heads * step->head_dim, kv_width = step->kv_heads * step->head_dim;
    kernels->rms_norm(hidden, step->hidden, layer->input_norm, normed, t, step->hidden, step->eps, 1);
    const int status = team_gemm(kernels, &layer->qkv, normed, NULL, qkv, t);
#pragma omp single
    {
        kernels->rotary(qkv, t, step->heads + step->kv_heads, width, step->head_dim, step->cos, step->sin, 1);
        const char *key = qkv + step->element_bytes * q_width, *value = key + step->element_bytes * kv_width;
        struct Step one = *step;
        one.num_threads = 1;
        write_kv(kernels, &one, layer, key, value, width);
    }
    return status;
}

/* Inside the team: layer `layer`'s output projection (adding the residual), its MLP (each
 * thread's own norm and silu(gate) * up rows), and the next layer's part before attention. */
static int team_after_attention(const struct Kernels *kernels, const struct Step *step, const struct Layer *layer,
                                const struct Layer *next, void *hidden, const char *attn, char *normed,
                                char *gate_up, char *act, char *qkv) {
    const int64_t t = step->tokens;
    int status = team_gemm(kernels, &layer->o, attn, hidden, hidden, t);
    kernels->rms_norm(hidden, step->hidden, layer->post_norm, normed, t, step->hidden, step->eps, 1);
    status |= team_gemm(kernels, &layer->gate_up, normed, NULL, gate_up, t);
    kernels->silu_mul(gate_up, act, t, step->intermediate, 1);
    status |= team_gemm(kernels, &layer->down, act, hidden, hidden, t);
    if (next != NULL) status |= team_before_attention(kernels, step, next, hidden, normed, qkv);
    return status;
}

/* Inside the team: layer `layer`'s attention over the decode rows, where the attention kernel
 * runs as a team's (Kernels.attend_in_team). */
static int team_attention(const struct Kernels *kernels, const struct Step *step, const struct Layer *layer,
                          const char *qkv, char *attn, int64_t heads_per_item) {
    const int64_t width = (step->heads + 2 * step->kv_heads) * step->head_dim;
    const int status = kernels->attend(qkv, step->element_bytes == 2, width, layer->kv_cache, (int)step->kv_kind,
                                       step->block_tables, step->context_lens, attn, step->decodes, step->heads,
                                       step->kv_heads, step->head_dim, step->block_size, step->num_blocks,
                                       step->table_stride, heads_per_item, step->scale * layer->k_scale,
                                       step->num_threads);
    if (layer->v_scale != 1.0f) {
#pragma omp single
        scale_rows(attn, step->decodes * step->heads * step->head_dim, layer->v_scale, step->element_bytes == 2);
    }
    return status;
}

/* The layers of a step that takes the team path (team_step). Returns 0, or -1 when scratch
 * memory ran out (the attention's, or a thread's). */
static int team_layers(const struct Kernels *kernels, const struct Layer *layers, int64_t num_layers,
                       const struct Step *step, void *hidden) {
    const int64_t t = step->tokens, width = (step->heads + 2 * step->kv_heads) * step->head_dim;
    const int64_t q_width = step->heads * step->head_dim, threads = step->num_threads;
    const size_t bytes = (size_t)step->element_bytes;
    const int64_t group = step->heads / step->kv_heads;
    const int64_t heads_per_item = step->decodes * step->kv_heads < 2 * threads ? 1 : group;
    /* shared: q/k/v, attention and gate/up rows; each thread's own: normed and act rows */
    const size_t normed_bytes = bytes * (size_t)(t * step->hidden), act_bytes = bytes * (size_t)(t * step->intermediate);
    char *qkv = scratch(bytes * (size_t)(t * width));
    char *attn = scratch(bytes * (size_t)(t * q_width));
    char *gate_up = scratch(bytes * (size_t)(t * 2 * step->intermediate));
    char *own = scratch((normed_bytes + act_bytes) * (size_t)threads);
    int status = qkv && attn && gate_up && own ? 0 : -1;
    const int joined = status == 0 && kernels->attend_in_team != NULL
        && kernels->attend_in_team(step->element_bytes == 2, (int)step->kv_kind, step->head_dim, heads_per_item);
    if (joined) { /* one team through the whole step: every thread meets every barrier */
        int failed = 0;
#pragma omp parallel num_threads((int)threads) reduction(| : failed)
        {
            char *normed = own + (normed_bytes + act_bytes) * (size_t)omp_get_thread_num();
            char *act = normed + normed_bytes;
            failed = team_before_attention(kernels, step, layers, hidden, normed, qkv) != 0;
            for (int64_t i = 0; i < num_layers; i++) {
                failed |= team_attention(kernels, step, layers + i, qkv, attn, heads_per_item) != 0;
                failed |= team_after_attention(kernels, step, layers + i, i + 1 < num_layers ? layers + i + 1 : NULL,
                                               hidden, attn, normed, gate_up, act, qkv) != 0;
            }
        }
        status = failed ? -1 : 0;
    }
    for (int64_t i = -1; i < num_layers && status == 0 && !joined; i++) {
        if (i >= 0) status = attention(kernels, step, layers + i, qkv, attn, heads_per_item);
        if (status != 0) break;
        int failed = 0;
#pragma omp parallel num_threads((int)threads) reduction(| : failed)
        {
            char *normed = own + (normed_bytes + act_bytes) * (size_t)omp_get_thread_num();
            char *act = normed + normed_bytes;
            if (i < 0)
                failed = team_before_attention(kernels, step, layers, hidden, normed, qkv) != 0;
            else
                failed = team_after_attention(kernels, step, layers + i, i + 1 < num_layers ? layers + i + 1 : NULL,
                                              hidden, attn, normed, gate_up, act, qkv) != 0;
        }
        status = failed ? -1 : 0;
    }
    free(qkv);
    free(attn);
    free(gate_up);
    free(own);
    return status;
}

/* hidden [tokens, hidden] (bf16 or fp32), updated in place through every layer. Returns 0, or
 * the first kernel's nonzero status (scratch memory ran out), or -1 for its own. */
int tandem_decode_stack(const struct Kernels *kernels, const struct Layer *layers, int64_t num_layers,
                        const struct Step *step, void *hidden) {
    const int64_t t = step->tokens, width = (step->heads + 2 * step->kv_heads) * step->head_dim;
    const int64_t q_width = step->heads * step->head_dim, kv_width = step->kv_heads * step->head_dim;
    const int threads = step->num_threads;
    if (team_step(layers, num_layers, step)) return team_layers(kernels, layers, num_layers, step, hidden);
    /* as the Python backend picks it: few sequences, one work item per query head (or, their
     * contexts long enough, spans the attention kernel cuts itself: span_count) */
    const int64_t group = step->heads / step->kv_heads;
    const int64_t heads_per_item = step->decodes * step->kv_heads < 2 * threads ? 1 : group;
    const size_t bytes = (size_t)step->element_bytes;
    const int bf16 = step->element_bytes == 2;
    int64_t outliers = 0;
    for (int64_t i = 0; i < num_layers; i++) {
        const struct Matrix *m[4] = {&layers[i].qkv, &layers[i].o, &layers[i].gate_up, &layers[i].down};
        for (int j = 0; j < 4; j++) outliers = widest(outliers, m[j]->outliers);
    }
    const int64_t inputs = widest(widest(step->hidden, q_width), step->intermediate);
    char *normed = scratch(bytes * (size_t)(t * step->hidden));
    char *qkv = scratch(bytes * (size_t)(t * width));
    char *attn = scratch(bytes * (size_t)(t * q_width));
    char *gate_up = scratch(bytes * (size_t)(t * 2 * step->intermediate));
    /* the gated middle: in the rows' dtype, or fp32 for the 8-bit down projection */
    char *act = scratch(sizeof(float) * (size_t)(t * step->intermediate));
    const struct Quantized q = {scratch((size_t)(t * inputs)), scratch(sizeof(float) * (size_t)t),
                                scratch(sizeof(int32_t) * (size_t)(t * widest(outliers, 1))),
                                scratch(sizeof(float) * (size_t)(t * widest(outliers, 1)))};
    int status = normed && qkv && attn && gate_up && act && q.values && q.scales && q.outlier_index
        && q.outlier_value ? 0 : -1;
    for (int64_t i = 0; i < num_layers && status == 0; i++) {
        const struct Layer *layer = layers + i;
        kernels->rms_norm(hidden, step->hidden, layer->input_norm, normed, t, step->hidden, step->eps, threads);
        if ((status = gemm(kernels, &layer->qkv, normed, NULL, qkv, t, bf16, &q, threads)) != 0) break;
        kernels->rotary(qkv, t, step->heads + step->kv_heads, width, step->head_dim, step->cos, step->sin, threads);
        const char *key = qkv + bytes * (size_t)q_width, *value = key + bytes * (size_t)kv_width;
        write_kv(kernels, step, layer, key, value, width);
        if ((status = attention(kernels, step, layer, qkv, attn, heads_per_item)) != 0) break;
        /* the residual GEMMs read `residual` only in their last, elementwise pass: in place */
        if ((status = gemm(kernels, &layer->o, attn, hidden, hidden, t, bf16, &q, threads)) != 0) break;
        kernels->rms_norm(hidden, step->hidden, layer->post_norm, normed, t, step->hidden, step->eps, threads);
        const struct Matrix *up = &layer->gate_up, *down = &layer->down;
        if (up->bits == INT8_GATED) {
            kernels->quantize_rows(normed, bf16, t, up->k, up->k, q.values, q.scales, up->outliers, q.outlier_index,
                                   q.outlier_value, threads);
            if ((status = kernels->int8_gated(q.values, up->k, t, up->k, (const int8_t *)up->levels,
                                              up->compensation, up->n, q.scales, up->col_scales, up->outliers,
                                              q.outlier_index, q.outlier_value, up->columns, (float *)act, bf16,
                                              threads)) != 0)
                break;
            status = int8_product(kernels, down, act, 0, hidden, hidden, t, bf16, &q, threads);
            continue;
        }
        if (up->bits == PACKED_GATED || up->bits == PACKED_W8_GATED) {
            if ((status = kernels->dense_silu_mul(normed, step->hidden, t, step->hidden, up->levels,
                                                  up->bits == PACKED_W8_GATED ? KIND_BF16_W8 : bf16, up->bias,
                                                  act, step->intermediate, threads)) != 0)
                break;
        } else {
            if ((status = gemm(kernels, up, normed, NULL, gate_up, t, bf16, &q, threads)) != 0) break;
            kernels->silu_mul(gate_up, act, t, step->intermediate, threads);
        }
        status = gemm(kernels, down, act, hidden, hidden, t, bf16, &q, threads);
    }
    free(normed);
    free(qkv);
    free(attn);
    free(gate_up);
    free(act);
    free(q.values);
    free(q.scales);
    free(q.outlier_index);
    free(q.outlier_value);
    return status;
}
