/* This CPU's arithmetic ceilings for the kernels' inner instructions, so a benchmark can state
 * each kernel's fraction of what the core can do (bench/quant.py). Not used by the model.
 *
 * Each probe runs `iters` rounds of ACCS independent accumulator chains on every thread (one
 * OpenMP team of num_threads) and returns the operations done; the caller times the call:
 *   ceiling_fma     fp32 multiply-adds: vf_fmadd, cpu_simd.h's vector width (the bf16 and
 *                   fp32-activation kernels' arithmetic after widening)
 *   ceiling_madd16  int16 pair multiply-adds into int32 lanes (the Q16 quantized kernels'
 *                   VPMADDWD + VPADDD, 256-bit; 512-bit VPDPWSSD on the AVX-512 build, as its
 *                   tiled kernels use)
 *   ceiling_dot     bf16 multiply-adds through cpu_simd.h's dot_step, the bf16 kernels' inner
 *                   operation (VDPBF16PS on the AVX-512 build; two fp32 FMAs over the widened
 *                   even and odd halves elsewhere)
 * Enough chains hide every latency, so the time is the issue throughput alone. Each operation
 * takes its chain's previous result (a loop-invariant product would be hoisted out of the loop),
 * and the results are folded into a value the caller receives, so no loop can be dropped. */
#include <stdint.h>
#include <string.h>

#include "cpu_simd.h"

#define ACCS 8

/* Returns the fp32 multiply-adds done (iters * ACCS * VF per thread, summed). */
int64_t ceiling_fma(int64_t iters, float *sink, int num_threads) {
    int64_t total = 0;
#pragma omp parallel num_threads(num_threads) reduction(+ : total)
    {
        vf acc[ACCS];
        const vf a = vf_set1(0.999f), b = vf_set1(1e-3f);
        for (int j = 0; j < ACCS; j++) acc[j] = vf_set1((float)j);
        for (int64_t i = 0; i < iters; i++)
#pragma GCC unroll 8
            for (int j = 0; j < ACCS; j++) acc[j] = vf_fmadd(acc[j], a, b);
        vf sum = vf_zero();
        for (int j = 0; j < ACCS; j++) sum = vf_add(sum, acc[j]);
#pragma omp critical
        *sink += vf_reduce_add(sum);
        total += iters * ACCS * VF;
    }
    return total;
}

/* The int16 probe's step per path, on vectors of MADD16_LANES int32 lanes read as int16 pairs
 * (the kernels' instruction, the same chains otherwise): */
#if defined(SPECSERVE_ISA_AVX512)
#define MADD16_LANES 16
typedef __m512i madd_vec;
SIMD_INLINE madd_vec madd_splat(int32_t v) { return _mm512_set1_epi32(v); }
/* x + madd(x, 3): one 512-bit VPDPWSSD */
SIMD_INLINE madd_vec madd_step(madd_vec x) {
    return _mm512_dpwssd_epi32(x, x, _mm512_set1_epi16(3));
}
#elif defined(SPECSERVE_ISA_AVX2)
#define MADD16_LANES 8
typedef __m256i madd_vec;
SIMD_INLINE madd_vec madd_splat(int32_t v) { return _mm256_set1_epi32(v); }
/* madd(x, 3) - 2: VPMADDWD + VPADDD */
SIMD_INLINE madd_vec madd_step(madd_vec x) {
    return _mm256_add_epi32(_mm256_madd_epi16(x, _mm256_set1_epi16(3)), _mm256_set1_epi32(-2));
}
#else
/* 16 bytes: a wider vector passed by value without AVX changes the ABI (gcc's -Wpsabi) */
#define MADD16_LANES 4
typedef int32_t madd_vec __attribute__((vector_size(16)));
SIMD_INLINE madd_vec madd_splat(int32_t v) { return (madd_vec){0} + v; }
/* madd(x, 3) - 2 in plain C */
SIMD_INLINE madd_vec madd_step(madd_vec acc) {
    typedef int16_t v16 __attribute__((vector_size(16)));
    typedef uint32_t uv4 __attribute__((vector_size(16)));
    const v16 x = (v16)acc;
    madd_vec sums = {0};
    for (int l = 0; l < MADD16_LANES; l++) /* |each product| < 2^17: the pair's sum is exact */
        sums[l] = (int32_t)x[2 * l] * 3 + (int32_t)x[2 * l + 1] * 3;
    return (madd_vec)((uv4)sums - 2u); /* wraps as VPADDD does */
}
#endif

/* Returns the int16 multiply-adds done (iters * ACCS * 2 * MADD16_LANES per thread, summed). */
int64_t ceiling_madd16(int64_t iters, int32_t *sink, int num_threads) {
    int64_t total = 0;
#pragma omp parallel num_threads(num_threads) reduction(+ : total)
    {
        madd_vec acc[ACCS];
        for (int j = 0; j < ACCS; j++) acc[j] = madd_splat(j);
        for (int64_t i = 0; i < iters; i++)
#pragma GCC unroll 8
            for (int j = 0; j < ACCS; j++) acc[j] = madd_step(acc[j]);
        uint32_t folded = 0; /* unsigned: the fold wraps, defined */
        for (int j = 0; j < ACCS; j++) {
            uint32_t lanes[MADD16_LANES];
            memcpy(lanes, &acc[j], sizeof lanes);
            for (int l = 0; l < MADD16_LANES; l++) folded += lanes[l];
        }
#pragma omp critical
        *sink = (int32_t)((uint32_t)*sink + folded);
        total += iters * ACCS * 2 * MADD16_LANES;
    }
    return total;
}

/* Chains for the dot probe: VDPBF16PS's latency is longer than an FMA's on some cores. */
#define DOT_ACCS 12

/* Returns the bf16 multiply-adds done (iters * DOT_ACCS * DOT_K per thread, summed). */
int64_t ceiling_dot(int64_t iters, float *sink, int num_threads) {
    int64_t total = 0;
#pragma omp parallel num_threads(num_threads) reduction(+ : total)
    {
        uint16_t ones[DOT_K], small[DOT_K];
        for (int k = 0; k < DOT_K; k++) {
            ones[k] = 0x3f80;  /* 1.0 */
            small[k] = 0x3a80; /* 2^-10 */
        }
        const dot_vec x = dot_load(ones), w = dot_load(small);
        dot_acc acc[DOT_ACCS];
        for (int j = 0; j < DOT_ACCS; j++) acc[j] = dot_zero();
        for (int64_t i = 0; i < iters; i++)
#pragma GCC unroll 12
            for (int j = 0; j < DOT_ACCS; j++) acc[j] = dot_step(acc[j], x, w);
        dot_acc sum = acc[0];
        for (int j = 1; j < DOT_ACCS; j++) sum = dot_add(sum, acc[j]);
#pragma omp critical
        *sink += dot_sum(sum);
        total += iters * DOT_ACCS * DOT_K;
    }
    return total;
}
