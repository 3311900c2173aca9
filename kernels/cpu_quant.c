/* Weight-only quantized matrix products for decode on x86 CPUs (AVX-512, AVX2) and anywhere
 * (portable C).
 *
 * y[m, n] = sum_k x[m, k] * dequant(w)[n, k] (+ bias[n])
 *   x [M, K] bf16 or fp32; w [N, ceil(K / 32)] blocks in GGUF's own byte layout (no repacking,
 *   so a .gguf file's Q8_0 / Q4_0 / Q4_1 rows run as they are); y [M, N] bf16 or fp32.
 *
 * Block formats, 32 weights each (ggml-common.h):
 *   Q8_0: fp16 d, int8 q[32]                              w = q * d
 *   Q4_0: fp16 d, uint8 q[16] (byte j: weight j in the low nibble, weight j + 16 in the high)
 *                                                         w = (q - 8) * d
 *   Q4_1: fp16 d, fp16 m, uint8 q[16] (as Q4_0)           w = q * d + m
 * Every dequantized weight is exact in fp32 (q * d needs at most 18 significant bits; Q4_1 rounds
 * once, in the + m, as the reference does), so the only difference from the reference
 * (dequantize, then an fp32 matmul: kernels/quant_reference.py) is the order of the fp32 sums.
 *
 * Decode steps have a few activation rows (a token, a chain, a small draft tree), so the product
 * is bound by reading w. Each weight block is read from memory once per call and dequantized
 * once per chunk of up to MR_MAX activation rows, in registers, then multiplied into every row
 * of the chunk: M rows cost about what one row costs until the FMAs catch up with the memory.
 *
 * Row-count invariance: each output is one vector accumulator summing the dequantized weights
 * times x in k order, reduced across lanes in a fixed order. Neither the number of rows M nor
 * the chunking changes that order, so a row's output is bit-identical alone or among k rows
 * (greedy speculation then equals plain decoding exactly).
 *
 * Written once over cpu_simd.h's fp32 vectors; only the unpacking of a block into vectors differs
 * per ISA (16 lanes on AVX-512, 8 on AVX2 and in portable C). Built by cpu_build.py; called
 * through kernels/quant_cpu.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_simd.h"

enum { FMT_Q8_0 = 0, FMT_Q4_0 = 1, FMT_Q4_1 = 2 };
#define QK 32
#define GROUPS (QK / VF) /* vectors per block */
#define MR_MAX 6

static inline int block_bytes(int fmt) { return fmt == FMT_Q8_0 ? 34 : fmt == FMT_Q4_0 ? 18 : 20; }

/* fp16 bits -> fp32, exact for every finite value (scales are finite): the bits shifted into
 * fp32 position read as 2^-112 times the value (subnormals included), and one multiply
 * rescales. Needs no F16C, which the builds do not assume. */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t magnitude = (uint32_t)(h & 0x7fffu) << 13;
    float f;
    memcpy(&f, &magnitude, sizeof f);
    f *= 0x1p112f;
    return (h & 0x8000u) ? -f : f;
}

/* Scale d and offset m of a block: w = q * d + m with q unsigned for the 4-bit formats
 * (Q4_0's offset is -8 d, exact), w = q * d for Q8_0 (m unused). */
static inline void block_scale(const uint8_t *b, int fmt, float *d, float *m) {
    *d = f16_to_f32((uint16_t)(b[0] | (b[1] << 8)));
    *m = fmt == FMT_Q4_1 ? f16_to_f32((uint16_t)(b[2] | (b[3] << 8))) : -8.0f * *d;
}

/* Weights [VF g, VF g + VF) of block b as fp32 (g < GROUPS). 4-bit formats: weights 0..15 are
 * the low nibbles of the 16 value bytes, weights 16..31 their high nibbles. Every result is
 * exact (q * d + m rounds once, in the + m, as the reference does). */
SIMD_INLINE vf dequant(const uint8_t *b, const int fmt, const int g, vf d, vf m) {
    const uint8_t *values = b + (fmt == FMT_Q8_0 ? 2 : fmt == FMT_Q4_0 ? 2 : 4);
#if defined(SPECSERVE_ISA_AVX512)
    if (fmt == FMT_Q8_0) {
        const __m128i q = _mm_loadu_si128((const __m128i *)(values + 16 * g));
        return vf_mul(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d);
    }
    const __m128i packed = _mm_loadu_si128((const __m128i *)values);
    const __m128i q = _mm_and_si128(g ? _mm_srli_epi16(packed, 4) : packed, _mm_set1_epi8(0x0f));
    return vf_fmadd(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)), d, m);
#elif defined(SPECSERVE_ISA_AVX2)
    if (fmt == FMT_Q8_0) {
        const __m128i q = _mm_loadl_epi64((const __m128i *)(values + 8 * g));
        return vf_mul(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
    }
    __m128i q = _mm_loadl_epi64((const __m128i *)(values + 8 * (g & 1)));
    if (g >= 2) q = _mm_srli_epi16(q, 4);
    q = _mm_and_si128(q, _mm_set1_epi8(0x0f));
    return vf_fmadd(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), d, m);
#else
    vf q;
    for (int j = 0; j < VF; j++) {
        const int at = VF * g + j;
        q[j] = fmt == FMT_Q8_0 ? (float)(int8_t)values[at]
               : at < 16 ? (float)(values[at] & 0x0f) : (float)(values[at - 16] >> 4);
    }
    return fmt == FMT_Q8_0 ? vf_mul(q, d) : vf_fmadd(q, d, m);
#endif
}

/* MR activation rows x NR weight rows over all K (x padded with zeros to whole blocks):
 * acc[i][r] sums row i's products with weight row r, one vector per output. */
SIMD_INLINE void micro_kernel(const int MR, const int NR, const int fmt, const float *x,
                              int64_t kp, const uint8_t *w, int64_t row_bytes, int64_t nb,
                              float out[MR_MAX][4]) {
    const int bb = block_bytes(fmt);
    vf acc[MR_MAX][4];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) acc[i][r] = vf_zero();
    for (int64_t blk = 0; blk < nb; blk++) {
        vf d[4], m[4];
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            float ds, ms;
            block_scale(w + r * row_bytes + blk * bb, fmt, &ds, &ms);
            d[r] = vf_set1(ds);
            m[r] = vf_set1(ms);
        }
#pragma GCC unroll 4
        for (int g = 0; g < GROUPS; g++) {
            const int64_t k = blk * QK + g * VF;
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) {
                const vf wv = dequant(w + r * row_bytes + blk * bb, fmt, g, d[r], m[r]);
#pragma GCC unroll 8
                for (int i = 0; i < MR; i++)
                    acc[i][r] = vf_fmadd(vf_load(x + i * kp + k), wv, acc[i][r]);
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) out[i][r] = vf_reduce_add(acc[i][r]);
}

#define DISPATCH_MR(NR, FMT)                                                          \
    switch (mr) {                                                                     \
        case 1: micro_kernel(1, NR, FMT, xs, kp, ws, row_bytes, nb, out); break;      \
        case 2: micro_kernel(2, NR, FMT, xs, kp, ws, row_bytes, nb, out); break;      \
        case 3: micro_kernel(3, NR, FMT, xs, kp, ws, row_bytes, nb, out); break;      \
        case 4: micro_kernel(4, NR, FMT, xs, kp, ws, row_bytes, nb, out); break;      \
        case 5: micro_kernel(5, NR, FMT, xs, kp, ws, row_bytes, nb, out); break;      \
        default: micro_kernel(6, NR, FMT, xs, kp, ws, row_bytes, nb, out); break;     \
    }
#define DISPATCH(NR)                                          \
    switch (fmt) {                                            \
        case FMT_Q8_0: DISPATCH_MR(NR, FMT_Q8_0) break;       \
        case FMT_Q4_0: DISPATCH_MR(NR, FMT_Q4_0) break;       \
        default: DISPATCH_MR(NR, FMT_Q4_1) break;             \
    }

/* Sums of mr activation rows (fp32, row stride kp) against nr weight rows. */
static void chunk(const float *xs, int mr, const uint8_t *ws, int nr, int fmt, int64_t kp,
                  int64_t row_bytes, int64_t nb, float out[MR_MAX][4]) {
    switch (nr) {
        case 4: DISPATCH(4) break;
        case 3: DISPATCH(3) break;
        case 2: DISPATCH(2) break;
        default: DISPATCH(1) break;
    }
}

/* x [M, K] (bf16 if x_bf16, else fp32); w [N, row_bytes] GGUF blocks of format fmt;
 * bias [N] or NULL and y [M, N] in bf16 if y_bf16, else fp32. Returns 0, or -1 when the
 * activation buffer cannot be allocated (nothing written). */
int quant_matmul(const void *x, int x_bf16, const uint8_t *w, int fmt, const void *bias,
                 void *y, int y_bf16, int64_t M, int64_t N, int64_t K, int num_threads) {
    const int64_t nb = (K + QK - 1) / QK, kp = nb * QK, row_bytes = nb * block_bytes(fmt);
    /* The activations in fp32, zero-padded to whole blocks: read once per weight block. */
    float *xf = aligned_alloc(64, (size_t)((M * kp * sizeof(float) + 63) / 64 * 64));
    if (!xf) return -1;
    for (int64_t i = 0; i < M; i++) {
        float *dst = xf + i * kp;
        if (x_bf16) {
            const uint16_t *src = (const uint16_t *)x + i * K;
            for (int64_t k = 0; k < K; k++) dst[k] = bf16_to_f32(src[k]);
        } else {
            memcpy(dst, (const float *)x + i * K, (size_t)K * sizeof(float));
        }
        memset(dst + K, 0, (size_t)(kp - K) * sizeof(float));
    }
    /* Two rows or fewer: 4 weight rows per tile give the FMAs enough independent sums;
     * more rows: 2 weight rows per tile leave registers for up to MR_MAX rows. */
    const int tile = M <= 2 ? 4 : 2;
    const int64_t tiles = (N + tile - 1) / tile, chunks = (M + MR_MAX - 1) / MR_MAX;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * tile;
        const int nr = N - n0 < tile ? (int)(N - n0) : tile;
        int64_t m0 = 0;
        for (int64_t c = 0; c < chunks; c++) { /* balanced: 7 rows run as 4 + 3 */
            const int64_t left = M - m0, parts = chunks - c;
            const int mr = (int)((left + parts - 1) / parts);
            float out[MR_MAX][4];
            chunk(xf + m0 * kp, mr, w + n0 * row_bytes, nr, fmt, kp, row_bytes, nb, out);
            for (int i = 0; i < mr; i++)
                for (int r = 0; r < nr; r++) {
                    const int64_t n = n0 + r, at = (m0 + i) * N + n;
                    float v = out[i][r];
                    if (y_bf16) {
                        if (bias) v += bf16_to_f32(((const uint16_t *)bias)[n]);
                        ((uint16_t *)y)[at] = f32_to_bf16(v);
                    } else {
                        if (bias) v += ((const float *)bias)[n];
                        ((float *)y)[at] = v;
                    }
                }
            m0 += mr;
        }
    }
    free(xf);
    return 0;
}
