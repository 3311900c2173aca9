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
 * One source, three builds: compiled with AVX-512F/BW/VL it uses 16-lane vectors, with AVX2 +
 * FMA + F16C 8-lane vectors, and with neither, plain C (the portable build). Built and loaded by
 * kernels/quant_cpu.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

enum { FMT_Q8_0 = 0, FMT_Q4_0 = 1, FMT_Q4_1 = 2 };
#define QK 32

static inline int block_bytes(int fmt) { return fmt == FMT_Q8_0 ? 34 : fmt == FMT_Q4_0 ? 18 : 20; }

static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400u)) { man <<= 1; exp--; }
        bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
    union { uint32_t u; float f; } c = {bits};
    return c.f;
#endif
}

static inline uint16_t read_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* Scale d and offset m of a block: w = q * d + m with q unsigned for the 4-bit formats
 * (Q4_0's offset is -8 d, exact), w = q * d for Q8_0 (m unused). */
static inline void block_scale(const uint8_t *b, int fmt, float *d, float *m) {
    *d = f16_to_f32(read_u16(b));
    *m = fmt == FMT_Q4_1 ? f16_to_f32(read_u16(b + 2)) : -8.0f * *d;
}

#define MR_MAX 6

#if defined(__AVX512F__) || defined(__AVX2__)

#if defined(__AVX512F__)
#define VLEN 16
typedef __m512 vec;
#define vzero() _mm512_setzero_ps()
#define vset1(v) _mm512_set1_ps(v)
#define vload(p) _mm512_loadu_ps(p)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vmul(a, b) _mm512_mul_ps(a, b)
static inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }

/* Weights [16 g, 16 g + 16) of block b as fp32 (g in 0, 1). */
static inline vec dequant(const uint8_t *b, int fmt, int g, vec d, vec m) {
    if (fmt == FMT_Q8_0) {
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2 + 16 * g));
        return vmul(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d);
    }
    const __m128i packed = _mm_loadu_si128((const __m128i *)(b + (fmt == FMT_Q4_1 ? 4 : 2)));
    const __m128i q = _mm_and_si128(g ? _mm_srli_epi16(packed, 4) : packed, _mm_set1_epi8(0x0f));
    return vfma(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)), d, m);
}
#else
#define VLEN 8
typedef __m256 vec;
#define vzero() _mm256_setzero_ps()
#define vset1(v) _mm256_set1_ps(v)
#define vload(p) _mm256_loadu_ps(p)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vmul(a, b) _mm256_mul_ps(a, b)
static inline float vsum(vec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Weights [8 g, 8 g + 8) of block b as fp32 (g in 0..3). */
static inline vec dequant(const uint8_t *b, int fmt, int g, vec d, vec m) {
    if (fmt == FMT_Q8_0) {
        const __m128i q = _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * g));
        return vmul(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
    }
    /* Weights 0..15 are the low nibbles of bytes 0..15, weights 16..31 the high nibbles. */
    __m128i q = _mm_loadl_epi64((const __m128i *)(b + (fmt == FMT_Q4_1 ? 4 : 2) + 8 * (g & 1)));
    if (g >= 2) q = _mm_srli_epi16(q, 4);
    q = _mm_and_si128(q, _mm_set1_epi8(0x0f));
    return vfma(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), d, m);
}
#endif

#define GROUPS (QK / VLEN)

/* MR activation rows x NR weight rows over all K (x padded with zeros to whole blocks):
 * acc[i][r] sums row i's products with weight row r, one vector per output. */
static inline __attribute__((always_inline)) void micro_kernel(
    const int MR, const int NR, const int fmt, const float *x, int64_t kp, const uint8_t *w,
    int64_t row_bytes, int64_t nb, float out[MR_MAX][4]) {
    const int bb = block_bytes(fmt);
    vec acc[MR_MAX][4];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) acc[i][r] = vzero();
    for (int64_t blk = 0; blk < nb; blk++) {
        vec d[4], m[4];
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            float ds, ms;
            block_scale(w + r * row_bytes + blk * bb, fmt, &ds, &ms);
            d[r] = vset1(ds);
            m[r] = vset1(ms);
        }
#pragma GCC unroll 4
        for (int g = 0; g < GROUPS; g++) {
            const int64_t k = blk * QK + g * VLEN;
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) {
                const vec wv = dequant(w + r * row_bytes + blk * bb, fmt, g, d[r], m[r]);
#pragma GCC unroll 8
                for (int i = 0; i < MR; i++) acc[i][r] = vfma(vload(x + i * kp + k), wv, acc[i][r]);
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) out[i][r] = vsum(acc[i][r]);
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

#else /* portable C: one output at a time, the same fixed k order for every row count */

static void chunk(const float *xs, int mr, const uint8_t *ws, int nr, int fmt, int64_t kp,
                  int64_t row_bytes, int64_t nb, float out[MR_MAX][4]) {
    const int bb = block_bytes(fmt);
    for (int r = 0; r < nr; r++) {
        for (int i = 0; i < mr; i++) {
            const float *x = xs + i * kp;
            float lanes[8] = {0};
            for (int64_t blk = 0; blk < nb; blk++) {
                const uint8_t *b = ws + r * row_bytes + blk * bb;
                float d, m, wv[QK];
                block_scale(b, fmt, &d, &m);
                if (fmt == FMT_Q8_0) {
                    for (int j = 0; j < QK; j++) wv[j] = (float)(int8_t)b[2 + j] * d;
                } else {
                    const uint8_t *q = b + (fmt == FMT_Q4_1 ? 4 : 2);
                    for (int j = 0; j < QK / 2; j++) {
                        wv[j] = (float)(q[j] & 0x0f) * d + m;
                        wv[j + QK / 2] = (float)(q[j] >> 4) * d + m;
                    }
                }
                for (int j = 0; j < QK; j++) lanes[j % 8] += x[blk * QK + j] * wv[j];
            }
            out[i][r] = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
                        ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
        }
    }
}

#endif

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
