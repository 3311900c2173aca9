/* A stack of decoder layers over a few rows in one call: the CPU decode and verify step.
 *
 * Run from Python, a layer is about fifteen tensor operations (two norms, four products, the
 * rotary embedding, the KV store, attention, two residual adds, the gated activation), and on
 * a 2-core CPU each costs 5-20 us of dispatch before any arithmetic: 0.3-0.5 ms per layer,
 * as much as a small model's products. `decoder_layers` runs every layer of the stack in one
 * call, each step through the kernel the Python path calls for it (rms_norm_rows, gemv_bf16 /
 * gemm_bf16 / outer_gemm_bf16 or quant_matmul[_int], rotary_rows, store_kv_rows, paged_attention,
 * silu_mul_rows / gelu_tanh_mul_rows) and the residual adds rounded as torch's adds round, so
 * the stack gives the same bits as specserve/model/architectures.py's layers on the C kernels
 * (the tests compare the two) and keeps their row-count invariance.
 *
 * Per layer, x [T, H] the residual stream (updated in place), in the activations' dtype:
 *   h = rms_norm(x) ; qkv = h Wqkv^T (+ b) ; [rms_norm each q and k head] ; rotate q, k
 *   store k, v ; a = attention(q) (over the layer's window on a sliding layer)
 *   x = x + a Wo^T ; h = rms_norm(x) ; g = h Wgu^T ; x = x + (act(g[:I]) * g[I:]) Wd^T
 * act is silu (SwiGLU) or gelu's tanh form (GeGLU). Gemma 3's block normalises the attention
 * and MLP outputs before their adds, with its own norm before the MLP (its "sandwich" norms):
 *   x = x + rms_norm(a Wo^T) ; h = rms_norm(x) ; ... ; x = x + rms_norm((act * up) Wd^T)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"
#include "cpu_exp.h"
#include "cpu_kernels.h"

enum { LINEAR_BF16 = 0, LINEAR_QUANT = 1 };
#define MAX_PARTS 3 /* a fused q/k/v: one part per block format at most */

/* One product of a projection: y [T, n] = x [T, k] W^T (+ bias). */
typedef struct {
    int32_t kind;       /* LINEAR_BF16: weight bf16 [n, k]; LINEAR_QUANT: GGUF blocks [n, .] */
    int32_t fmt;        /* the block format (cpu_quant.c's FMT_*) of a LINEAR_QUANT weight */
    int32_t group;      /* its row order (cpu_quant.c's `group`: 1 or ROW_GROUP) */
    const void *weight;
    const void *bias;   /* [n] in the activations' dtype, or NULL */
    int64_t n;
} part_desc;

/* One projection: y [T, n] = x [T, k] W^T (+ bias), W made of num_parts parts stacked by rows,
 * each its own product written into its own columns of y (a Q4_K_M file's q/k in Q4_K beside
 * a v in Q6_K: model/quant.py's QuantizedParts). */
typedef struct {
    part_desc parts[MAX_PARTS];
    int32_t num_parts;
    int64_t n, k;       /* n: the parts' n summed */
} linear_desc;

/* Every norm weight in the activations' dtype, as the model holds it (Gemma's 1 + w already
 * added at load). */
typedef struct {
    const void *input_norm;             /* [H] before attention */
    const void *post_norm;              /* [H] before the MLP; on the attention output when
                                         * pre_ff_norm is set (Gemma 3) */
    const void *pre_ff_norm, *post_ff_norm; /* [H] Gemma 3's MLP input and output norms, or NULL */
    const void *q_norm, *k_norm;        /* [D] each q / k head's norm (Qwen3, Gemma 3), or NULL */
    linear_desc qkv, o, gate_up, down;  /* qkv rows: q heads, k heads, v heads; gate_up: gate, up */
    const float *cos, *sin;             /* this layer's rotary tables [max_positions, D / 2] fp32 */
    int64_t window;                     /* sliding window (positions), or 0: global attention */
} layer_desc;

enum { GATE_SILU = 0, GATE_GELU_TANH = 1 };

typedef struct {
    const layer_desc *layers;
    int64_t num_layers, hidden, intermediate, num_heads, num_kv_heads, head_dim;
    float eps, scale;                    /* RMSNorm epsilon; softmax scale */
    int64_t max_positions;               /* rows of every layer's rotary tables */
    int32_t f32;                         /* activations fp32 (else bf16) */
    int32_t gemm_min_rows;               /* bf16 products of this many rows take gemm_bf16, */
    int32_t outer_min_rows;              /* of this many outer_gemm_bf16 (cpu_linear.py's choice) */
    int32_t activation;                  /* GATE_SILU or GATE_GELU_TANH */
} decoder_desc;

/* One forward's inputs, as paged_attention and store_kv_rows take them. */
typedef struct {
    const int64_t *positions, *slot_mapping;  /* [T] */
    const int32_t *block_tables;              /* [B, max_blocks] */
    const int32_t *query_start_loc;           /* [B + 1] */
    const int32_t *context_lens;              /* [B] */
    const uint8_t *local_mask;                /* [T, max_query_len], or NULL: causal */
    int64_t T, num_requests, max_blocks, max_query_len;
    void *kv_cache;                           /* [L, 2, num_blocks, block_size, Hkv, D] */
    int64_t num_blocks, block_size;
    int32_t act_bits;                         /* quantized products: 0 fp32 activations, 8, 16 */
} step_desc;

/* Values per unit of work of the gated activation, and the fewest values worth a second
 * thread: about 2 ns a value on a 2-core Zen 3 (a 4096-wide row: 9 us alone, 5 us on two). */
#define GATE_CHUNK 1024
#define GATE_PARALLEL_MIN 4096

/* Values [i0, i1) of row t (constant f32 and gelu, so the loop vectorizes for each). */
static inline __attribute__((always_inline)) void gated_span(const void *gate_up, void *y,
                                                              int64_t t, int64_t i0, int64_t i1,
                                                              int64_t I, const int f32,
                                                              const int gelu) {
    for (int64_t i = i0; i < i1; i++) {
        const float g = act_load(gate_up, t * 2 * I + i, f32);
        /* silu: g sigmoid(g). gelu's tanh form, 0.5 g (1 + tanh(u)) with u = sqrt(2 / pi)
         * (g + 0.044715 g^3), as g sigmoid(2u): the same function (1 + tanh u = 2 sigmoid(2u))
         * without the cancellation of 1 + tanh u where u is far below zero. */
        const float z = gelu ? 2.0f * (0.797884561f * (g + 0.044715f * (g * g * g))) : g;
        const float gated = g / (1.0f + exp_f32(-z));
        const float up = act_load(gate_up, t * 2 * I + I + i, f32);
        /* torch's activation returns the activations' dtype: round before the product. */
        act_save(y, t * I + i, act_round(gated, f32) * up, f32);
    }
}

static void gated_rows(const void *gate_up, void *y, int64_t T, int64_t I, int f32, int gelu,
                       int num_threads) {
    const int64_t per_row = (I + GATE_CHUNK - 1) / GATE_CHUNK;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * I >= GATE_PARALLEL_MIN)
    for (int64_t c = 0; c < T * per_row; c++) {
        const int64_t t = c / per_row, i0 = c % per_row * GATE_CHUNK;
        const int64_t i1 = I - i0 < GATE_CHUNK ? I : i0 + GATE_CHUNK;
        if (f32 && gelu) gated_span(gate_up, y, t, i0, i1, I, 1, 1);
        else if (f32) gated_span(gate_up, y, t, i0, i1, I, 1, 0);
        else if (gelu) gated_span(gate_up, y, t, i0, i1, I, 0, 1);
        else gated_span(gate_up, y, t, i0, i1, I, 0, 0);
    }
}

/* y [T, I] = silu(gate) * up, gate_up [T, 2I] (gate then up in each row); bf16, or fp32 when
 * f32. As torch's F.silu(gate) * up: silu in fp32 (g / (1 + e^-g); exp_f32 may differ from
 * torch's vectorised exp in the last bits), rounded to the dtype, the product rounded again.
 * Each value on its own: the same results on any number of threads. */
void silu_mul_rows(const void *gate_up, void *y, int64_t T, int64_t I, int f32,
                   int num_threads) {
    gated_rows(gate_up, y, T, I, f32, 0, num_threads);
}

/* As silu_mul_rows with F.gelu(gate, approximate="tanh") (Gemma's GeGLU): within a few ulp of
 * torch's in fp32 where torch's own 1 + tanh does not cancel. */
void gelu_tanh_mul_rows(const void *gate_up, void *y, int64_t T, int64_t I, int f32,
                        int num_threads) {
    gated_rows(gate_up, y, T, I, f32, 1, num_threads);
}

/* x += y over n values, each sum rounded to the dtype once (as torch's add). */
static void add_in_place(void *x, const void *y, int64_t n, const int f32) {
    if (f32) {
        float *a = x;
        const float *b = y;
        for (int64_t i = 0; i < n; i++) a[i] = a[i] + b[i];
    } else {
        uint16_t *a = x;
        const uint16_t *b = y;
        for (int64_t i = 0; i < n; i++) a[i] = f32_to_bf16(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
    }
}

static int product(const decoder_desc *m, const step_desc *s, const part_desc *w, int64_t k,
                   const void *x, void *y, int num_threads) {
    const int64_t T = s->T;
    if (w->kind == LINEAR_BF16)
        return (T >= m->outer_min_rows ? outer_gemm_bf16
                : T >= m->gemm_min_rows ? gemm_bf16 : gemv_bf16)(x, w->weight, w->bias, NULL, y,
                                                                 T, w->n, k, num_threads);
    if (s->act_bits == 0)
        return quant_matmul(x, !m->f32, w->weight, w->fmt, w->group, w->bias, y, !m->f32, T,
                            w->n, k, num_threads);
    return quant_matmul_int(x, !m->f32, w->weight, w->fmt, w->group, w->bias, y, !m->f32, T,
                            w->n, k, s->act_bits, num_threads);
}

/* y [T, w->n] = x W^T. A projection of several parts runs each part's product alone into
 * `scratch` [T, part n], then copies it into the part's columns of y: the bits of that part
 * run by itself, as QuantizedParts concatenates them. The copy is a few KB against the
 * product's tens of microseconds, so the kernels keep their one output layout. */
static int project(const decoder_desc *m, const step_desc *s, const linear_desc *w,
                   const void *x, void *y, void *scratch, int num_threads) {
    if (w->num_parts == 1) return product(m, s, &w->parts[0], w->k, x, y, num_threads);
    const size_t elem = m->f32 ? sizeof(float) : sizeof(uint16_t);
    int64_t col = 0;
    for (int i = 0; i < w->num_parts; i++) {
        const part_desc *part = &w->parts[i];
        if (product(m, s, part, w->k, x, scratch, num_threads)) return -1;
        for (int64_t t = 0; t < s->T; t++)
            memcpy((char *)y + (t * w->n + col) * elem, (char *)scratch + t * part->n * elem,
                   (size_t)part->n * elem);
        col += part->n;
    }
    return 0;
}

/* Runs every layer of m over x [T, hidden] (bf16, or fp32 when m->f32), in place. Returns 0;
 * -1 when a buffer cannot be allocated, -2 for a position outside the rotary tables, -3 for
 * a slot past the cache (the last two found by the first layer's rotary and store, which check
 * before they write, so x and the cache are untouched then). */
int decoder_layers(const decoder_desc *m, const step_desc *s, void *x, int num_threads) {
    const int f32 = m->f32;
    const size_t elem = f32 ? sizeof(float) : sizeof(uint16_t);
    const int64_t T = s->T, H = m->hidden, D = m->head_dim, I = m->intermediate;
    const int64_t q_len = m->num_heads * D, kv_len = m->num_kv_heads * D;
    const int64_t qkv_len = q_len + 2 * kv_len;
    const int64_t num_slots = s->num_blocks * s->block_size;
    const int64_t cache_len = num_slots * kv_len; /* one K (or V) cache, in values */
    /* Scratch in one allocation, each part 64-byte aligned: h [T, H], qkv [T, qkv_len],
     * q and a [T, q_len], p [T, H], g [T, 2I], act [T, I], and one part's product of a
     * projection made of several (at most the widest output). */
    enum { H_, QKV, Q, A, P, G, ACT, PART, PARTS };
    int64_t widest = qkv_len > H ? qkv_len : H;
    if (2 * I > widest) widest = 2 * I;
    const int64_t values[PARTS] = {T * H, T * qkv_len, T * q_len, T * q_len, T * H, T * 2 * I,
                                   T * I, T * widest};
    size_t offset[PARTS + 1] = {0};
    for (int i = 0; i < PARTS; i++)
        offset[i + 1] = offset[i] + ((size_t)values[i] * elem + 63) / 64 * 64;
    char *buf = aligned_alloc(64, offset[PARTS]);
    if (!buf) return -1;
    char *h = buf + offset[H_], *qkv = buf + offset[QKV], *q = buf + offset[Q];
    char *a = buf + offset[A], *p = buf + offset[P], *g = buf + offset[G];
    char *act = buf + offset[ACT], *part = buf + offset[PART];
    int status = 0;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const layer_desc *layer = &m->layers[l];
        char *k_cache = (char *)s->kv_cache + (size_t)(2 * l) * cache_len * elem;
        char *v_cache = k_cache + (size_t)cache_len * elem;
        rms_norm_rows(x, layer->input_norm, h, T, H, m->eps, f32);
        if (project(m, s, &layer->qkv, h, qkv, part, num_threads)) { status = -1; break; }
        if (layer->q_norm) /* in place: each head's sum of squares is read before it is written */
            for (int64_t t = 0; t < T; t++) {
                char *row = qkv + t * qkv_len * elem;
                rms_norm_rows(row, layer->q_norm, row, m->num_heads, D, m->eps, f32);
                row += q_len * elem;
                rms_norm_rows(row, layer->k_norm, row, m->num_kv_heads, D, m->eps, f32);
            }
        if (rotary_rows(qkv, T, qkv_len, m->num_heads + m->num_kv_heads, D, layer->cos,
                        layer->sin, m->max_positions, s->positions, f32)) { status = -2; break; }
        if (store_kv_rows(qkv + q_len * elem, qkv + (q_len + kv_len) * elem, qkv_len, k_cache,
                          v_cache, s->slot_mapping, T, kv_len, num_slots, (int64_t)elem)) {
            status = -3;
            break;
        }
        for (int64_t t = 0; t < T; t++) /* attention reads q [T, Hq, D] contiguous */
            memcpy(q + t * q_len * elem, qkv + t * qkv_len * elem, (size_t)q_len * elem);
        if (paged_attention(q, k_cache, v_cache, f32, s->block_tables, s->max_blocks,
                            s->query_start_loc, s->context_lens, s->local_mask,
                            s->max_query_len, s->num_requests, m->num_heads, m->num_kv_heads, D,
                            s->block_size, m->scale, s->positions, layer->window, a, num_threads)
            || project(m, s, &layer->o, a, p, part, num_threads)) {
            status = -1;
            break;
        }
        const int sandwich = layer->pre_ff_norm != NULL;
        if (sandwich) rms_norm_rows(p, layer->post_norm, h, T, H, m->eps, f32);
        add_in_place(x, sandwich ? h : p, T * H, f32);
        rms_norm_rows(x, sandwich ? layer->pre_ff_norm : layer->post_norm, h, T, H, m->eps, f32);
        if (project(m, s, &layer->gate_up, h, g, part, num_threads)) { status = -1; break; }
        (m->activation == GATE_GELU_TANH ? gelu_tanh_mul_rows : silu_mul_rows)(g, act, T, I, f32,
                                                                              num_threads);
        if (project(m, s, &layer->down, act, p, part, num_threads)) { status = -1; break; }
        if (sandwich) rms_norm_rows(p, layer->post_ff_norm, h, T, H, m->eps, f32);
        add_in_place(x, sandwich ? h : p, T * H, f32);
    }
    free(buf);
    return status;
}
