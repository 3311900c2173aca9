/* The summation order of a bf16 linear layer's output element, shared by the matrix-vector
 * kernel (cpu_gemv.c, a few activation rows) and the blocked GEMM (cpu_gemm.c, prompt
 * chunks), and where each result goes.
 *
 * y[m, n] = sum_k x[m, k] * w[n, k] is summed in dot steps of DOT_K values (cpu_simd.h): steps
 * dealt round-robin to DOT_U accumulators while a whole round of DOT_U steps is left
 * (DOT_MAIN_STEPS), the remaining whole steps and the zero-padded K tail into accumulator 0,
 * then the accumulators added in order and summed with dot_sum. The order depends only on K
 * and the ISA, so both kernels give every output bit-identical results, whatever the number of
 * rows or the blocking: a row's logits do not depend on which kernel or how many other rows
 * computed them.
 */
#ifndef SPECSERVE_CPU_DOT_ORDER_H
#define SPECSERVE_CPU_DOT_ORDER_H

#include <stdint.h>

#include "cpu_simd.h"

/* Independent accumulators per output: 2 where one multiply-add chain per output would leave
 * a single row latency-bound (AVX-512, portable); AVX2's even/odd dot_acc is already two. */
#if defined(SPECSERVE_ISA_AVX2)
#define DOT_U 1
#else
#define DOT_U 2
#endif

/* Steps [0, DOT_MAIN_STEPS(K)) go round-robin to the DOT_U accumulators. */
#define DOT_MAIN_STEPS(K) ((K) / (DOT_K * DOT_U) * DOT_U)

/* Where results go: y fp32, or bf16 (rounded to nearest even) with the bias (bf16, may be
 * NULL) added first in fp32, as F.linear on bf16 tensors computes it. Pointers are advanced
 * to the block being written. */
typedef struct {
    float *f32;
    uint16_t *bf16;
    const uint16_t *bias;
} Output;

static inline Output output_at(Output o, int64_t y_offset, int64_t bias_offset) {
    if (o.f32) o.f32 += y_offset;
    if (o.bf16) o.bf16 += y_offset;
    if (o.bias) o.bias += bias_offset;
    return o;
}

static inline void store(Output o, int64_t y_index, int64_t column, float value) {
    if (o.bias) value += bf16_to_f32(o.bias[column]);
    if (o.bf16) o.bf16[y_index] = f32_to_bf16(value);
    else o.f32[y_index] = value;
}

/* The DOT_U accumulators of one output, added in order. */
static inline dot_acc dot_merged(const dot_acc acc[DOT_U]) {
    dot_acc total = acc[0];
    for (int u = 1; u < DOT_U; u++) total = dot_add(total, acc[u]);
    return total;
}

/* The DOT_U accumulators of one output, added in order and summed. */
static inline float dot_total(const dot_acc acc[DOT_U]) { return dot_sum(dot_merged(acc)); }

/* Step s of a row of K values (n < DOT_K values in the tail step, zero-padded). */
static inline dot_vec dot_load_step(const uint16_t *row, int64_t s, int64_t K) {
    const int64_t k = s * DOT_K;
    return K - k >= DOT_K ? dot_load(row + k) : dot_load_tail(row + k, K - k);
}

#endif
