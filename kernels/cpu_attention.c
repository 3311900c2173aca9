/* Paged attention on CPU: decode tokens, token trees, prompt chunks (any ISA, cpu_simd.h).
 *
 * The same contract as paged_attention_reference (reference.py): query row t of request b
 * (local index i) attends to the request's cached positions [0, context_lens[b]) and to new
 * position context_lens[b] + j when local_mask[t, j] (j <= i when there is no mask), K/V read
 * through the block table. Scores, softmax and the weighted sum are in fp32 (q.k products of
 * bf16 values are exact in fp32, computed as IEEE fp32 multiply-adds like the reference; only
 * the summation order differs), probabilities are normalised before the weighted sum, and
 * the output is rounded to bf16 as the reference's `.to(q.dtype)` does. Masked positions are
 * never read.
 *
 * A query row's result depends only on its own visible positions, read in position order, so
 * it is the same whatever other rows share the call (row-count invariance): a chain's last row
 * verified with its draft equals the same token decoded alone over the same cache.
 *
 * One work item is one (query row, query head); on CPU a step's attention is small next to its
 * matmuls, and what the PyTorch reference costs there is per-op overhead (~0.2 ms per layer for
 * one decode token), which this removes.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_simd.h"

#define PARALLEL_MIN_MACS (1 << 20) /* q.k multiply-adds below which one thread does it all */

/* q.k in fp32 with IEEE products (VDPBF16PS would flush denormals and round differently). */
static inline float dot_bf16(const uint16_t *a, const uint16_t *b, int64_t D) {
    vf acc = vf_zero();
    for (int64_t d = 0; d < D; d += VF) acc = vf_fmadd(vf_load_bf16(a + d), vf_load_bf16(b + d), acc);
    return vf_reduce_add(acc);
}

/* Returns 0, or -1 when a scratch buffer could not be allocated. */
int paged_attention_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                         const int32_t *block_tables, int64_t max_blocks,
                         const int32_t *query_start_loc, const int32_t *context_lens,
                         const uint8_t *local_mask, int64_t max_query_len, int64_t num_requests,
                         int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                         int64_t block_size, float scale, uint16_t *out, int num_threads) {
    const int64_t T = query_start_loc[num_requests];
    int64_t max_len = 1; /* positions any query can see: the scratch buffers' size */
    int64_t work = 0;    /* q.k products, at most */
    for (int64_t b = 0; b < num_requests; b++) {
        const int64_t n_new = query_start_loc[b + 1] - query_start_loc[b];
        const int64_t len = context_lens[b] + n_new;
        if (len > max_len) max_len = len;
        work += n_new * len;
    }
    const int64_t group = num_q_heads / num_kv_heads;
    const int64_t D = head_dim;
    int failed = 0;
    /* A decode step over a short context is tens of microseconds of work: waking the other
     * threads and joining them costs a good part of that, and far more on a busy machine
     * where a thread waits for its time slice. */
    const int parallel = work * num_q_heads * head_dim >= PARALLEL_MIN_MACS;
#pragma omp parallel num_threads(num_threads) if (parallel)
    {
        float *scores = malloc(sizeof(float) * (size_t)max_len);
        int64_t *slots = malloc(sizeof(int64_t) * (size_t)max_len);
        if (scores == NULL || slots == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < T * num_q_heads; item++) {
            if (scores == NULL || slots == NULL) continue;
            const int64_t t = item / num_q_heads, h = item % num_q_heads;
            int64_t b = 0;
            while (query_start_loc[b + 1] <= t) b++;
            const int64_t i = t - query_start_loc[b];
            const int64_t ctx = context_lens[b];
            const int64_t n_new = query_start_loc[b + 1] - query_start_loc[b];
            const int32_t *table = block_tables + b * max_blocks;
            const int64_t kv_head = h / group;
            const uint16_t *qv = q + (t * num_q_heads + h) * D;

            /* Visible positions and their scores. */
            int64_t n = 0;
            float best = -INFINITY;
            for (int64_t p = 0; p < ctx + n_new; p++) {
                if (p >= ctx) {
                    const int64_t j = p - ctx;
                    const int visible = local_mask ? local_mask[t * max_query_len + j] : j <= i;
                    if (!visible) continue;
                }
                const int64_t slot = (int64_t)table[p / block_size] * block_size + p % block_size;
                const float s =
                    dot_bf16(qv, k_cache + (slot * num_kv_heads + kv_head) * D, D) * scale;
                slots[n] = slot;
                scores[n++] = s;
                if (s > best) best = s;
            }
            float total = 0.0f;
            for (int64_t s = 0; s < n; s++) total += scores[s] = expf(scores[s] - best);
            /* Probabilities first, then their weighted sum, as the reference computes them. */
            const float inv_total = 1.0f / total;
            for (int64_t s = 0; s < n; s++) scores[s] *= inv_total;

            /* Weighted sum of V, VF dims at a time (head_dim is a multiple of 16). */
            uint16_t *o = out + (t * num_q_heads + h) * D;
            for (int64_t d = 0; d < D; d += VF) {
                vf acc = vf_zero();
                for (int64_t s = 0; s < n; s++) {
                    const uint16_t *vv = v_cache + (slots[s] * num_kv_heads + kv_head) * D;
                    acc = vf_fmadd(vf_set1(scores[s]), vf_load_bf16(vv + d), acc);
                }
                vf_store_bf16(o + d, acc);
            }
        }
        free(scores);
        free(slots);
    }
    return failed ? -1 : 0;
}
