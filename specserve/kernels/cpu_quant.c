/* Weight-only quantized matrix products for decode on x86 CPUs (AVX-512, AVX2) and anywhere
 * (portable C).
 *
 * y[m, n] = sum_k x[m, k] * dequant(w)[n, k] (+ bias[n])
 *   x [M, K] bf16 or fp32; w [N, ceil(K / 32)] blocks (K / 256 super-blocks for the k-quants,
 *   whose K must be a multiple of 256) in GGUF's own byte format, the rows in
 *   one of three orders (`group`): 1, GGUF's own (row by row, so a .gguf file's Q8_0 / Q4_0 /
 *   Q4_1 / Q4_K / Q6_K rows can run as they are); ROW_GROUP: each group of ROW_GROUP consecutive rows (the
 *   last may hold fewer) stored block by block, the group's rows' block 0, then their block 1,
 *   ... (quant_reference.py: QuantizedWeight.with_row_group). A thread then reads its weights
 *   as one sequential stream instead of one short stream per row of a tile: 2-core Zen 3, the
 *   widened model's 24 layers of Q8_0 from memory at one activation row, about 23 -> 19 ms. Or
 *   TILE_ROWS, for integer activations only: groups of sixteen rows, block by block, each block
 *   of the group interleaved word by word (see "the tiled row order" below).
 *   y [M, N] bf16 or fp32.
 *
 * Block formats, 32 weights each (ggml-common.h):
 *   Q8_0: fp16 d, int8 q[32]                              w = q * d
 *   Q4_0: fp16 d, uint8 q[16] (byte j: weight j in the low nibble, weight j + 16 in the high)
 *                                                         w = (q - 8) * d
 *   Q4_1: fp16 d, fp16 m, uint8 q[16] (as Q4_0)           w = q * d + m
 * and the k-quants, super-blocks of 256 weights in sub-blocks with integer scales:
 *   Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit sc[8], m[8] (q4_k_scale_min),
 *     128 bytes of nibbles (bytes 32c .. 32c + 31: sub-block 2c low, 2c + 1 high)
 *                                     w = (d sc[j]) q - (dmin m[j]),  j = the 32-weight sub-block
 *   Q6_K (210 bytes): ql[128] (4 low bits), qh[64] (2 high bits), int8 sc[16], fp16 d (k_weight)
 *                                     w = (d sc[i / 16]) (q - 32)
 *   d sc and dmin m are exact in fp32, so every k-quant weight is too (Q4_K: one rounding, in
 *   the -, as the reference's). The kernels walk a k-quant row in 32-weight blocks like the
 *   others (the activations' blocks): block b is sub-block b % 8 of super-block b / 8, with its
 *   own d and m (Q6_K: a d per half of the block); the row orders interleave whole
 *   super-blocks.
 *
 * Two ways to take the activations, one entry point each (specserve/kernels/quant_cpu.py picks one):
 *
 * quant_matmul: activations in fp32. Every dequantized weight is exact in fp32 (q * d needs at
 * most 18 significant bits; Q4_1 rounds once, in the + m, as the reference does), so the only
 * difference from the reference (dequantize, then an fp32 matmul: specserve/kernels/quant_reference.py)
 * is the order of the fp32 sums. One fp32 FMA per weight and row.
 *
 * quant_matmul_int: activations quantized once per call to integer blocks, 8 or 16 bits (Q8 as
 * llama.cpp's q8_0 / q8_1 products do), then an integer dot product per pair of blocks and a
 * few fp32 operations per block. With L = 127 (Q8) or 32767 (Q16), per activation row and block
 * b of 32 values x (zero-padded past K):
 *   dx = amax|x| / L, xq = round_half_even(x * (1 / dx)) (0 when dx is 0), sx = sum xq
 * and per output, over the blocks in k order, each operation rounded to fp32:
 *   isum = sum xq * q   (Q4_0: sum xq * (q - 8))      exact in int32 (|isum| < 2^28)
 *   v    = (dw * dx) * isum  (Q4_1: v + m * (dx * sx))
 *   acc  = acc + v
 * Q4_K is Q4_1's sequence with the sub-block's dw = d sc[j] and m = -(dmin m[j]) (both exact;
 * |isum| <= 32 * 15 * 32767 < 2^24). Q6_K's two scales per block keep its halves apart:
 *   isa, isb = sum xq * (q - 32) over weights 0..15, 16..31   each exact in fp32 (< 2^24)
 *   v    = (da * isa + db * isb) * dx                         da, db = d sc of each half
 *   acc  = acc + v
 * The k-quants take the activations as int16 (Q8 values too: their blocks are widened to
 * int16), so Q8 changes only the activations' rounding for them, except in the tiled order on
 * AVX2, which multiplies Q8 bytes (Q4_K from 2 rows, Q6_K from 5: q4_k_byte_kernel,
 * many_rows_kernel).
 * The integers are exact and the fp32 operations are the same, in the same order, on every
 * path, so every path computes the same bits, and so does the PyTorch model of these numerics
 * (quant_reference.quant_linear_int_reference); only the quantized activations differ from the
 * dequantize-then-matmul reference. Q16 moves an activation by at most amax / 65534 of its
 * block, below bf16's own rounding of the block's largest values (2^-9 relative), so it keeps
 * the activations' precision while the products stay integer. On AVX2, 32 Q8 products cost one
 * maddubs (unsigned x signed bytes to int16 pairs; Q8_0 moves the weight's sign onto the
 * activation first) and one madd (int16 pairs to int32); 32 Q16 products two madds over the
 * weights widened to int16 once per block. A horizontal add tree turns four weight rows'
 * partial sums into one vector of four isums, scaled and accumulated in four fp32 lanes.
 *
 * Decode steps have a few activation rows (a token, a chain, a small draft tree), so the product
 * is bound by reading w. Each weight block is read from memory once per call and unpacked once
 * per chunk of up to MR_MAX activation rows, in registers, then multiplied into every row of
 * the chunk: M rows cost about what one row costs until the arithmetic catches up with memory.
 *
 * Row-count invariance: each output is summed in an order fixed by K alone (one vector
 * accumulator in k order reduced in a fixed lane order; or one fp32 lane per output in block
 * order), and activation rows are quantized one by one. Neither the number of rows M nor the
 * chunking changes that order, so a row's output is bit-identical alone or among k rows
 * (greedy speculation then equals plain decoding exactly).
 *
 * Written once over cpu_simd.h's fp32 vectors; only the unpacking of a block into vectors and
 * the integer dot products differ per ISA (the AVX-512 build runs the 256-bit AVX2 integer code,
 * which its -m flags include, with AVX-512 VNNI's dot instructions in place of each multiply-add
 * pair: VPDPBUSD for maddubs + madd, VPDPWSSD for madd + add; both sum exactly the same
 * integers, and neither saturates; the tiled order alone has 512-bit kernels of its own, a
 * whole 16-row group per vector). Built by cpu_build.py; called through
 * specserve/kernels/quant_cpu.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "cpu_simd.h"

enum { FMT_Q8_0 = 0, FMT_Q4_0 = 1, FMT_Q4_1 = 2, FMT_Q4_K = 3, FMT_Q6_K = 4 };
#define QK 32
#define QK_K 256 /* weights per k-quant super-block */
#define SUBS (QK_K / QK) /* 32-weight sub-blocks per super-block */
#define GROUPS (QK / VF) /* vectors per block */
#define MR_MAX 6
#define ROW_GROUP 4 /* the grouped row order's group */
#define TILE_ROWS 16 /* the tiled row order's group (integer activations only, N % 16 == 0) */

static inline int block_bytes(int fmt) {
    switch (fmt) {
        case FMT_Q8_0: return 34;
        case FMT_Q4_0: return 18;
        case FMT_Q4_1: return 20;
        case FMT_Q4_K: return 144;
        default: return 210;
    }
}
static inline int is_k_quant(int fmt) { return fmt == FMT_Q4_K || fmt == FMT_Q6_K; }
/* Bytes of one row of w: whole blocks of 32 weights, or of 256 for the k-quants. */
static inline int64_t row_bytes_of(int fmt, int64_t nb) {
    return (is_k_quant(fmt) ? nb / SUBS : nb) * block_bytes(fmt);
}

/* fp16 bits -> fp32, exact for every finite value (scales are finite): the bits shifted into
 * fp32 position read as 2^-112 times the value (subnormals included), and one multiply
 * rescales. The portable path and the fp32-activation path's per-row scales use it; the
 * integer path's four-lane conversion (f16x4_to_f32) uses F16C. */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t magnitude = (uint32_t)(h & 0x7fffu) << 13;
    float f;
    memcpy(&f, &magnitude, sizeof f);
    f *= 0x1p112f;
    return (h & 0x8000u) ? -f : f;
}

static inline float f16_at(const uint8_t *p) { return f16_to_f32((uint16_t)(p[0] | (p[1] << 8))); }

/* Q4_K's 6-bit scale sc and min m of sub-block j from its 12 packed bytes s (ggml-common.h):
 * j < 4 in the low 6 bits of s[j] and s[j + 4]; j >= 4 a nibble of s[j + 4] (sc low, m high)
 * and the top two bits of s[j - 4] (sc) and s[j] (m). */
static inline void q4_k_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Weight i (< 256) of a k-quant super-block b as an integer: Q4_K its nibble (sub-block
 * 2c + e: nibble e of byte 32c + i % 32), Q6_K q - 32 (i = 128 h + 32 s + l: the low 4 bits
 * from nibble s / 2 of ql[64 h + 32 (s % 2) + l], the high 2 from bits 2s of qh[32 h + l]). */
static inline int k_weight(const uint8_t *b, int fmt, int i) {
    if (fmt == FMT_Q4_K) return (b[16 + 32 * (i / 64) + i % 32] >> (4 * (i / 32 % 2))) & 15;
    const int h = i / 128, s = i / 32 % 4, l = i % 32;
    const int low = (b[64 * h + 32 * (s % 2) + l] >> (4 * (s / 2))) & 15;
    const int high = (b[128 + 32 * h + l] >> (2 * s)) & 3;
    return (low | (high << 4)) - 32;
}

/* Scales and offset of 32-weight block `sub` of block b (sub > 0 only in a k-quant's
 * super-block): w = q * d[half] + m, with q unsigned for the 4-bit formats (Q4_0's offset is
 * -8 d, exact; Q4_K's d = d sc, m = -(dmin m), both exact), q - 32 for Q6_K (d = d sc of each
 * half of the block, m 0), signed for Q8_0 (m unused). */
static inline void block_scale(const uint8_t *b, int fmt, int sub, float d[2], float *m) {
    if (fmt == FMT_Q4_K) {
        int sc, mn;
        q4_k_scale_min(b + 4, sub, &sc, &mn);
        d[0] = d[1] = f16_at(b) * (float)sc;
        *m = -(f16_at(b + 2) * (float)mn);
    } else if (fmt == FMT_Q6_K) {
        const float dd = f16_at(b + 208);
        d[0] = dd * (float)(int8_t)b[192 + 2 * sub];
        d[1] = dd * (float)(int8_t)b[193 + 2 * sub];
        *m = 0.0f;
    } else {
        d[0] = d[1] = f16_at(b);
        *m = fmt == FMT_Q4_1 ? f16_at(b + 2) : -8.0f * d[0];
    }
}

/* Weights [VF g, VF g + VF) of 32-weight block `sub` of a k-quant super-block b as fp32 (d the
 * scale of their half of the block: VF divides 16). Exact, as dequant's. */
SIMD_INLINE vf dequant_k(const uint8_t *b, const int fmt, const int sub, const int g, vf d, vf m) {
    const int l0 = VF * g; /* first weight's place in the block */
#if defined(SPECSERVE_ISA_AVX512) || defined(SPECSERVE_ISA_AVX2)
#if defined(SPECSERVE_ISA_AVX512)
#define LOAD_VF_BYTES(p) _mm_loadu_si128((const __m128i *)(p))
#else /* VF bytes only: a wider load could read past the last super-block */
#define LOAD_VF_BYTES(p) _mm_loadl_epi64((const __m128i *)(p))
#endif
    const __m128i mask = _mm_set1_epi8(0x0f);
    __m128i q;
    if (fmt == FMT_Q4_K) {
        q = LOAD_VF_BYTES(b + 16 + 32 * (sub / 2) + l0);
        q = _mm_and_si128(_mm_srl_epi16(q, _mm_cvtsi32_si128(4 * (sub % 2))), mask);
    } else {
        const int h = sub / 4, s = sub % 4;
        const __m128i low = LOAD_VF_BYTES(b + 64 * h + 32 * (s % 2) + l0);
        const __m128i high = LOAD_VF_BYTES(b + 128 + 32 * h + l0);
        /* (high >> 2s & 3) << 4, in 16-bit lanes: no bit crosses into the next byte */
        const __m128i top = _mm_slli_epi16(
            _mm_and_si128(_mm_srl_epi16(high, _mm_cvtsi32_si128(2 * s)), _mm_set1_epi8(3)), 4);
        q = _mm_or_si128(_mm_and_si128(_mm_srl_epi16(low, _mm_cvtsi32_si128(4 * (s / 2))), mask),
                         top);
        q = _mm_sub_epi8(q, _mm_set1_epi8(32));
    }
#if defined(SPECSERVE_ISA_AVX512)
    const vf qf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
#else
    const vf qf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
#endif
#undef LOAD_VF_BYTES
#else
    vf qf;
    for (int j = 0; j < VF; j++) qf[j] = (float)k_weight(b, fmt, QK * sub + l0 + j);
#endif
    return fmt == FMT_Q4_K ? vf_fmadd(qf, d, m) : vf_mul(qf, d);
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

/* Weight rows [n0, n0 + nr) of a tile: block blk of row n0 + r starts at
 * base + r * row_step + blk * block_step. Tiles never straddle a row group (their sizes divide
 * ROW_GROUP and they start at multiples of their size). */
typedef struct {
    const uint8_t *base;
    int64_t row_step, block_step;
} tile_rows;

static inline tile_rows weight_rows(const uint8_t *w, int group, int64_t n0, int64_t N,
                                    int64_t row_bytes, int bb) {
    if (group == 1) return (tile_rows){w + n0 * row_bytes, row_bytes, bb};
    const int64_t g0 = n0 / group * group, rows = N - g0 < group ? N - g0 : group;
    return (tile_rows){w + g0 * row_bytes + (n0 - g0) * bb, bb, rows * bb};
}

SIMD_INLINE const uint8_t *block_at(tile_rows t, int r, int64_t blk) {
    return t.base + r * t.row_step + blk * t.block_step;
}

/* MR activation rows x NR weight rows over all K (x padded with zeros to whole blocks):
 * acc[i][r] sums row i's products with weight row r, one vector per output. */
SIMD_INLINE void micro_kernel(const int MR, const int NR, const int fmt, const float *x,
                              int64_t kp, tile_rows w, int64_t nb, float out[MR_MAX][TILE_ROWS]) {
    vf acc[MR_MAX][4];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) acc[i][r] = vf_zero();
    const int kq = is_k_quant(fmt);
    for (int64_t blk = 0; blk < nb; blk++) {
        /* the block holding these 32 weights (a k-quant's super-block) and their place in it */
        const int64_t at = kq ? blk / SUBS : blk;
        const int sub = kq ? (int)(blk % SUBS) : 0;
        vf d[4][2], m[4];
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            float ds[2], ms;
            block_scale(block_at(w, r, at), fmt, sub, ds, &ms);
            d[r][0] = vf_set1(ds[0]);
            d[r][1] = vf_set1(ds[1]);
            m[r] = vf_set1(ms);
        }
#pragma GCC unroll 4
        for (int g = 0; g < GROUPS; g++) {
            const int64_t k = blk * QK + g * VF;
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) {
                const uint8_t *b = block_at(w, r, at);
                const vf wv = kq ? dequant_k(b, fmt, sub, g, d[r][g * VF / 16], m[r])
                                 : dequant(b, fmt, g, d[r][0], m[r]);
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
        case 1: micro_kernel(1, NR, FMT, xs, kp, ws, nb, out); break;                 \
        case 2: micro_kernel(2, NR, FMT, xs, kp, ws, nb, out); break;                 \
        case 3: micro_kernel(3, NR, FMT, xs, kp, ws, nb, out); break;                 \
        case 4: micro_kernel(4, NR, FMT, xs, kp, ws, nb, out); break;                 \
        case 5: micro_kernel(5, NR, FMT, xs, kp, ws, nb, out); break;                 \
        default: micro_kernel(6, NR, FMT, xs, kp, ws, nb, out); break;                \
    }
#define DISPATCH(NR)                                          \
    switch (fmt) {                                            \
        case FMT_Q8_0: DISPATCH_MR(NR, FMT_Q8_0) break;       \
        case FMT_Q4_0: DISPATCH_MR(NR, FMT_Q4_0) break;       \
        case FMT_Q4_1: DISPATCH_MR(NR, FMT_Q4_1) break;       \
        case FMT_Q4_K: DISPATCH_MR(NR, FMT_Q4_K) break;       \
        default: DISPATCH_MR(NR, FMT_Q6_K) break;             \
    }

/* Sums of mr activation rows (fp32, row stride kp) against nr weight rows. */
static void chunk(const float *xs, int mr, tile_rows ws, int nr, int fmt, int64_t kp, int64_t nb,
                  float out[MR_MAX][TILE_ROWS]) {
    switch (nr) {
        case 4: DISPATCH(4) break;
        case 3: DISPATCH(3) break;
        case 2: DISPATCH(2) break;
        default: DISPATCH(1) break;
    }
}

/* ---- the shared driver -------------------------------------------------------------------- */

/* Computes out[i][r] = the sums of activation rows m0 .. m0 + mr - 1 with weight rows
 * n0 .. n0 + nr - 1 (mr <= MR_MAX, nr <= 4). */
typedef void (*tile_fn)(const void *ctx, int64_t m0, int mr, int64_t n0, int nr,
                        float out[MR_MAX][TILE_ROWS]);

/* y[m0 + i, n0 + r] = out[i][r] (+ bias[n0 + r], bias [N] or NULL) for i < mr, r < nr, in
 * bf16 if y_bf16, else fp32 (y [M, N]). */
static void store_rows(const float (*out)[TILE_ROWS], int64_t m0, int mr, int64_t n0, int nr,
                       const void *bias, void *y, int y_bf16, int64_t N) {
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
}

/* Runs fn over tiles of `tile` weight rows (split across threads) and, inside each tile, over
 * chunks of at most MR_MAX activation rows; adds bias [N] (or NULL) and stores y [M, N] in
 * bf16 if y_bf16, else fp32. */
static void run_tiles(tile_fn fn, const void *ctx, int tile, const void *bias, void *y,
                      int y_bf16, int64_t M, int64_t N, int num_threads) {
    const int64_t tiles = (N + tile - 1) / tile, chunks = (M + MR_MAX - 1) / MR_MAX;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * tile;
        const int nr = N - n0 < tile ? (int)(N - n0) : tile;
        int64_t m0 = 0;
        for (int64_t c = 0; c < chunks; c++) { /* balanced: 7 rows run as 4 + 3 */
            const int64_t left = M - m0, parts = chunks - c;
            const int mr = (int)((left + parts - 1) / parts);
            float out[MR_MAX][TILE_ROWS];
            fn(ctx, m0, mr, n0, nr, out);
            store_rows(out, m0, mr, n0, nr, bias, y, y_bf16, N);
            m0 += mr;
        }
    }
}

/* Row i of x [M, K] (bf16 if x_bf16, else fp32) as fp32, zero-padded to kp values. */
static void row_to_f32(const void *x, int x_bf16, int64_t i, int64_t K, int64_t kp, float *dst) {
    if (x_bf16) {
        const uint16_t *src = (const uint16_t *)x + i * K;
        for (int64_t k = 0; k < K; k++) dst[k] = bf16_to_f32(src[k]);
    } else {
        memcpy(dst, (const float *)x + i * K, (size_t)K * sizeof(float));
    }
    memset(dst + K, 0, (size_t)(kp - K) * sizeof(float));
}

/* ---- fp32 activations ----------------------------------------------------------------------- */

typedef struct {
    const float *x; /* [M, kp] */
    const uint8_t *w;
    int fmt, group;
    int64_t N, kp, row_bytes, nb;
} f32_ctx;

static void f32_tile(const void *ctx, int64_t m0, int mr, int64_t n0, int nr,
                     float out[MR_MAX][TILE_ROWS]) {
    const f32_ctx *c = ctx;
    chunk(c->x + m0 * c->kp, mr,
          weight_rows(c->w, c->group, n0, c->N, c->row_bytes, block_bytes(c->fmt)), nr, c->fmt,
          c->kp, c->nb, out);
}

/* x [M, K] (bf16 if x_bf16, else fp32); w [N, row_bytes] GGUF blocks of format fmt, rows in
 * the order `group` names (1 or ROW_GROUP, see the header); bias [N] or NULL and y [M, N] in
 * bf16 if y_bf16, else fp32. Returns 0, -1 when the activation buffer cannot be allocated, -3
 * for another group, or -4 for a k-quant whose K is not whole super-blocks (nothing written in
 * any case). */
int quant_matmul(const void *x, int x_bf16, const uint8_t *w, int fmt, int group,
                 const void *bias, void *y, int y_bf16, int64_t M, int64_t N, int64_t K,
                 int num_threads) {
    if (group != 1 && group != ROW_GROUP) return -3;
    if (is_k_quant(fmt) && K % QK_K) return -4;
    const int64_t nb = (K + QK - 1) / QK, kp = nb * QK, row_bytes = row_bytes_of(fmt, nb);
    /* The activations in fp32, zero-padded to whole blocks: read once per weight block. */
    float *xf = aligned_alloc(64, (size_t)((M * kp * sizeof(float) + 63) / 64 * 64));
    if (!xf) return -1;
    for (int64_t i = 0; i < M; i++) row_to_f32(x, x_bf16, i, K, kp, xf + i * kp);
    const f32_ctx ctx = {xf, w, fmt, group, N, kp, row_bytes, nb};
    /* Two rows or fewer: 4 weight rows per tile give the FMAs enough independent sums;
     * more rows: 2 weight rows per tile leave registers for up to MR_MAX rows. */
    run_tiles(f32_tile, &ctx, M <= 2 ? 4 : 2, bias, y, y_bf16, M, N, num_threads);
    free(xf);
    return 0;
}

/* ---- integer activations (Q8 or Q16 blocks), integer dot products --------------------------- */

/* Activation formats: the levels a block's largest magnitude maps to, and the integer width. */
enum { ACT_Q8 = 8, ACT_Q16 = 16 };

typedef struct {
    const void *q;      /* [M, kp] quantized activations: int8 (ACT_Q8) or int16 (ACT_Q16) */
    const float *d;     /* [M, nb] block scales dx */
    const float *s;     /* [M, nb] dx * sx (Q4_1's min term) */
    const int32_t *sum; /* [M, nb] sx = sum of the block's q */
    const int32_t *sum16; /* [M, 2 nb] the sums of each block's halves (filled for tiled Q6_K) */
    const uint8_t *w;
    int fmt, act, group, wide; /* wide: q holds int16 (Q16, or Q8 values taken as int16) */
    int64_t N, kp, row_bytes, nb;
} int_ctx;

/* The portable paths' integers of 32-weight block `sub` of block b (sub > 0 only in a
 * k-quant's super-block), as quant_reference.block_integers models them: Q8_0 signed, Q4_0
 * q - 8, Q4_1 and Q4_K the nibble, Q6_K q - 32. */
static inline void block_ints(const uint8_t *b, int fmt, int sub, int32_t q[QK]) {
    const uint8_t *values = b + (fmt == FMT_Q4_1 ? 4 : 2);
    for (int j = 0; j < QK; j++) {
        if (is_k_quant(fmt)) {
            q[j] = k_weight(b, fmt, QK * sub + j);
        } else {
            const int nibble = j < 16 ? values[j] & 0x0f : values[j - 16] >> 4;
            q[j] = fmt == FMT_Q8_0 ? (int8_t)values[j] : fmt == FMT_Q4_0 ? nibble - 8 : nibble;
        }
    }
}

/* acc + v for one block pair, the header's fp32 operations in order: isa and isb the exact
 * isums of the block's two halves, d[2] and m block_scale's, dx and s = dx * sx the
 * activation block's. */
static inline float block_update(int fmt, float acc, int32_t isa, int32_t isb, const float d[2],
                                 float m, float dx, float s) {
    float v;
    if (fmt == FMT_Q6_K) {
        v = (d[0] * (float)isa + d[1] * (float)isb) * dx;
    } else {
        v = (d[0] * dx) * (float)(isa + isb);
        if (fmt == FMT_Q4_1 || fmt == FMT_Q4_K) v = v + m * s;
    }
    return acc + v;
}

/* One activation row (kp fp32 values, whole blocks) to integer blocks, as the header defines:
 * levels L = 127 (act ACT_Q8) or 32767 (ACT_Q16), stored as int16 when `wide` (always for
 * ACT_Q16; the tiled order's kernels multiply int16 pairs, so they take Q8 values as int16
 * too, except the byte kernels for Q4_0 / Q4_1 (AVX-512, AVX2) and the k-quants (AVX2)), else
 * int8.
 * |x * id| <= L (1 + 2^-23)^2, so every value rounds into [-L, L]; rounding is the default
 * mode's, half to even (lrintf, or cvtps2dq under the default MXCSR). */
static void quantize_row(const float *x, int64_t nb, const int act, const int wide, void *q,
                         float *d, float *s, int32_t *sum) {
    const float levels = act == ACT_Q16 ? 32767.0f : 127.0f;
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * QK;
#if defined(SPECSERVE_ISA_AVX512) || defined(SPECSERVE_ISA_AVX2)
        const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        __m256 v[4], m = _mm256_setzero_ps();
        for (int g = 0; g < 4; g++) {
            v[g] = _mm256_loadu_ps(xb + 8 * g);
            m = _mm256_max_ps(m, _mm256_and_ps(v[g], magnitude));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        const float db = amax / levels, id = db != 0.0f ? 1.0f / db : 0.0f;
        __m256i iv[4];
        for (int g = 0; g < 4; g++) iv[g] = _mm256_cvtps_epi32(_mm256_mul_ps(v[g], _mm256_set1_ps(id)));
        /* Saturating packs are exact here; they interleave per 128-bit lane, so restore k order. */
        const __m256i w01 = _mm256_packs_epi32(iv[0], iv[1]), w23 = _mm256_packs_epi32(iv[2], iv[3]);
        if (wide) {
            int16_t *qb = (int16_t *)q + b * QK;
            _mm256_storeu_si256((__m256i *)qb, _mm256_permute4x64_epi64(w01, 0xd8));
            _mm256_storeu_si256((__m256i *)(qb + 16), _mm256_permute4x64_epi64(w23, 0xd8));
        } else {
            _mm256_storeu_si256((__m256i *)((int8_t *)q + b * QK),
                                _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23),
                                                            _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        }
        const __m256i lanes = _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]),
                                               _mm256_add_epi32(iv[2], iv[3]));
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(lanes), _mm256_extracti128_si256(lanes, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
        const int32_t total = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1)));
#else
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) {
            const float a = xb[j] < 0.0f ? -xb[j] : xb[j];
            amax = a > amax ? a : amax;
        }
        const float db = amax / levels, id = db != 0.0f ? 1.0f / db : 0.0f;
        int32_t total = 0;
        for (int j = 0; j < QK; j++) {
            const long v = lrintf(xb[j] * id);
            if (wide) ((int16_t *)q)[b * QK + j] = (int16_t)v;
            else ((int8_t *)q)[b * QK + j] = (int8_t)v;
            total += (int32_t)v;
        }
#endif
        d[b] = db;
        sum[b] = total;
        s[b] = db * (float)total;
    }
}

/* Each block of a row of nb byte activations from k order to the order of a tiled 4-bit word's
 * nibbles (group_micro_kernel's bytes): bytes 4j .. 4j + 3 hold x 2j, 2j + 1, 2j + 16, 2j + 17. */
static void nibble_order(int8_t *q, int64_t nb) {
    for (int64_t b = 0; b < nb; b++) {
        int8_t *block = q + b * QK, k_order[QK];
        memcpy(k_order, block, QK);
        for (int j = 0; j < QK / 4; j++) {
            block[4 * j] = k_order[2 * j];
            block[4 * j + 1] = k_order[2 * j + 1];
            block[4 * j + 2] = k_order[2 * j + 16];
            block[4 * j + 3] = k_order[2 * j + 17];
        }
    }
}

#if defined(SPECSERVE_ISA_AVX512) || defined(SPECSERVE_ISA_AVX2)
/* The 32 values of block b as bytes: Q8_0 signed, Q4_0 / Q4_1 the unsigned nibbles. */
SIMD_INLINE __m256i block_bytes_vec(const uint8_t *b, const int fmt) {
    if (fmt == FMT_Q8_0) return _mm256_loadu_si256((const __m256i *)(b + 2));
    const __m128i packed = _mm_loadu_si128((const __m128i *)(b + (fmt == FMT_Q4_0 ? 2 : 4)));
    const __m128i low = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), low),
                            _mm_and_si128(packed, low));
}

/* Eight int32 partial sums of xq * w over one block. Q8_0: maddubs wants one unsigned operand,
 * so the weight's magnitude (aw, 0..128) meets the activation with the weight's sign (|xq| <=
 * 127, so no pair of int16 products saturates: 2 * 128 * 127 < 2^15); nibbles are unsigned
 * already (2 * 15 * 127). */
SIMD_INLINE __m256i block_dot(const int fmt, __m256i wv, __m256i aw, __m256i xv) {
#if defined(SPECSERVE_ISA_AVX512)
    const __m256i zero = _mm256_setzero_si256();
    return fmt == FMT_Q8_0 ? _mm256_dpbusd_epi32(zero, aw, _mm256_sign_epi8(xv, wv))
                           : _mm256_dpbusd_epi32(zero, wv, xv);
#else
    const __m256i pairs = fmt == FMT_Q8_0 ? _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wv))
                                          : _mm256_maddubs_epi16(wv, xv);
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}

/* The four totals of four vectors of eight int32 each, by a transpose of unpacks and adds:
 * single-uop shuffles, where a horizontal add is several on AMD cores (integer sums are exact,
 * so the order does not matter). */
SIMD_INLINE __m128i sum4(__m256i a, __m256i b, __m256i c, __m256i d) {
    /* ab: a0+a2 b0+b2 a1+a3 b1+b3 | the same of lanes 4..7; cd likewise */
    const __m256i ab = _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
    const __m256i cd = _mm256_add_epi32(_mm256_unpacklo_epi32(c, d), _mm256_unpackhi_epi32(c, d));
    /* a b c d each summed over lanes 0..3 | over lanes 4..7 */
    const __m256i s = _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd),
                                       _mm256_unpackhi_epi64(ab, cd));
    return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

/* fp16 bits in the low half of each int32 lane -> fp32, exact (F16C: the x86 builds require
 * it; f16_to_f32 gives the same values). */
SIMD_INLINE __m128 f16x4_to_f32(__m128i h) {
    const __m128i low_halves = _mm_shuffle_epi8(
        h, _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1));
    return _mm_cvtph_ps(low_halves);
}

/* The first four header bytes of a block as one int32 (d's bits low, Q4_1's m's bits high). */
SIMD_INLINE int32_t header_bits(const uint8_t *b) {
    int32_t v;
    memcpy(&v, b, sizeof v);
    return v;
}

/* The 32 weights of block b as int16, in k order (weights 0..15, then 16..31), widened straight
 * from memory: a 4-bit block's 16 bytes widen once, and each int16 lane (one byte, 0..255)
 * splits into its low nibble (weight j) and its high nibble (weight j + 16). */
SIMD_INLINE void block_words(const uint8_t *b, const int fmt, __m256i words[2]) {
    if (fmt == FMT_Q8_0) {
        words[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 2)));
        words[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 18)));
        return;
    }
    const __m256i bytes = _mm256_cvtepu8_epi16(
        _mm_loadu_si128((const __m128i *)(b + (fmt == FMT_Q4_0 ? 2 : 4))));
    words[0] = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0f));
    words[1] = _mm256_srli_epi16(bytes, 4);
}

/* Eight int32 partial sums of xq * w over one block of int16 activations (x: 32 of them); no
 * pair of products overflows (2 * 128 * 32767 < 2^31). */
SIMD_INLINE __m256i block_dot16(const __m256i words[2], const int16_t *x) {
    const __m256i x0 = _mm256_loadu_si256((const __m256i *)x);
    const __m256i x1 = _mm256_loadu_si256((const __m256i *)(x + 16));
#if defined(SPECSERVE_ISA_AVX512)
    return _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(_mm256_setzero_si256(), words[0], x0),
                               words[1], x1);
#else
    return _mm256_add_epi32(_mm256_madd_epi16(words[0], x0), _mm256_madd_epi16(words[1], x1));
#endif
}

/* acc + the products of int16 weights w and activations xp, summed in int32 pairs (VNNI: one
 * VPDPWSSD). The tiled kernels pass eight rows' weight pairs (one row per int32 lane) and a
 * broadcast activation pair (pair_at). */
SIMD_INLINE __m256i pair_dot(__m256i acc, __m256i w, __m256i xp) {
#if defined(SPECSERVE_ISA_AVX512)
    return _mm256_dpwssd_epi32(acc, w, xp);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w, xp));
#endif
}

/* The 32 weights of block `sub` of a k-quant super-block b as int16 in k order (as
 * block_words): Q4_K the nibbles, Q6_K q - 32. */
SIMD_INLINE void k_block_words(const uint8_t *b, const int fmt, const int sub, __m256i words[2]) {
    for (int e = 0; e < 2; e++) { /* weights 16 e .. 16 e + 15 */
        if (fmt == FMT_Q4_K) {
            const __m256i bytes = _mm256_cvtepu8_epi16(
                _mm_loadu_si128((const __m128i *)(b + 16 + 32 * (sub / 2) + 16 * e)));
            words[e] = _mm256_and_si256(_mm256_srl_epi16(bytes, _mm_cvtsi32_si128(4 * (sub % 2))),
                                        _mm256_set1_epi16(15));
        } else {
            const int h = sub / 4, s = sub % 4;
            const __m256i low = _mm256_cvtepu8_epi16(
                _mm_loadu_si128((const __m128i *)(b + 64 * h + 32 * (s % 2) + 16 * e)));
            const __m256i high = _mm256_cvtepu8_epi16(
                _mm_loadu_si128((const __m128i *)(b + 128 + 32 * h + 16 * e)));
            const __m256i q = _mm256_or_si256(
                _mm256_and_si256(_mm256_srl_epi16(low, _mm_cvtsi32_si128(4 * (s / 2))),
                                 _mm256_set1_epi16(15)),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(high, _mm_cvtsi32_si128(2 * s)),
                                                   _mm256_set1_epi16(3)), 4));
            words[e] = _mm256_sub_epi16(q, _mm256_set1_epi16(32));
        }
    }
}

/* int_micro_kernel for the k-quants: the activations are int16 (Q16, or Q8 taken as int16:
 * c->wide), each 32-weight block of a super-block is widened to int16 and its scales decoded
 * per row; Q6_K keeps the isums of the block's halves apart (one scale each). */
SIMD_INLINE void int_k_micro_kernel(const int MR, const int NR, const int fmt, const int_ctx *c,
                                    int64_t m0, tile_rows w, float out[MR_MAX][TILE_ROWS]) {
    __m128 acc[MR_MAX];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) acc[i] = _mm_setzero_ps();
    const int bb = block_bytes(fmt);
    for (int64_t blk = 0; blk < c->nb; blk++) {
        const int sub = (int)(blk % SUBS);
        __m256i words[4][2];
        float d[4][2] = {{0}}, m[4] = {0};
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            if (r < NR) {
                const uint8_t *b = block_at(w, r, blk / SUBS);
                __builtin_prefetch(b + ROW_GROUP * c->row_bytes + sub * bb / SUBS);
                k_block_words(b, fmt, sub, words[r]);
                block_scale(b, fmt, sub, d[r], &m[r]);
            } else {
                words[r][0] = words[r][1] = _mm256_setzero_si256();
            }
        }
        const __m128 dav = _mm_setr_ps(d[0][0], d[1][0], d[2][0], d[3][0]);
        const __m128 dbv = _mm_setr_ps(d[0][1], d[1][1], d[2][1], d[3][1]);
        const __m128 mwv = _mm_setr_ps(m[0], m[1], m[2], m[3]);
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            const int64_t row = m0 + i, at = row * c->nb + blk;
            const int16_t *xq = (const int16_t *)c->q + row * c->kp + blk * QK;
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)xq);
            const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + 16));
            const __m256i zero = _mm256_setzero_si256();
            __m128 v;
            if (fmt == FMT_Q6_K) {
                __m256i pa[4], pb[4];
#pragma GCC unroll 4
                for (int r = 0; r < 4; r++) {
                    pa[r] = pair_dot(zero, words[r][0], x0);
                    pb[r] = pair_dot(zero, words[r][1], x1);
                }
                const __m128 fa = _mm_cvtepi32_ps(sum4(pa[0], pa[1], pa[2], pa[3]));
                const __m128 fb = _mm_cvtepi32_ps(sum4(pb[0], pb[1], pb[2], pb[3]));
                v = _mm_mul_ps(_mm_add_ps(_mm_mul_ps(dav, fa), _mm_mul_ps(dbv, fb)),
                               _mm_set1_ps(c->d[at]));
            } else {
                __m256i p[4];
#pragma GCC unroll 4
                for (int r = 0; r < 4; r++) p[r] = pair_dot(pair_dot(zero, words[r][0], x0), words[r][1], x1);
                const __m128i isum = sum4(p[0], p[1], p[2], p[3]);
                v = _mm_mul_ps(_mm_mul_ps(dav, _mm_set1_ps(c->d[at])), _mm_cvtepi32_ps(isum));
                v = _mm_add_ps(v, _mm_mul_ps(mwv, _mm_set1_ps(c->s[at])));
            }
            acc[i] = _mm_add_ps(acc[i], v);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) _mm_storeu_ps(out[i], acc[i]);
}

/* MR activation rows x NR weight rows over all blocks: one fp32 lane per output. */
SIMD_INLINE void int_micro_kernel(const int MR, const int NR, const int fmt, const int act,
                                  const int_ctx *c, int64_t m0, tile_rows w,
                                  float out[MR_MAX][TILE_ROWS]) {
    if (is_k_quant(fmt)) {
        int_k_micro_kernel(MR, NR, fmt, c, m0, w, out);
        return;
    }
    __m128 acc[MR_MAX];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) acc[i] = _mm_setzero_ps();
    for (int64_t blk = 0; blk < c->nb; blk++) {
        __m256i wv[4], aw[4], words[4][2];
        int32_t header[4] = {0};
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            if (r < NR) {
                const uint8_t *b = block_at(w, r, blk);
                /* The next tile's block (ROW_GROUP rows on, in either row order): row by row,
                 * each row of a tile is a short stream the hardware prefetchers barely catch;
                 * grouped, it still gains (the widened model: 20.5 ms without, 19 with). */
                __builtin_prefetch(b + ROW_GROUP * c->row_bytes);
                if (act == ACT_Q16) {
                    block_words(b, fmt, words[r]);
                } else {
                    wv[r] = block_bytes_vec(b, fmt);
                    aw[r] = fmt == FMT_Q8_0 ? _mm256_sign_epi8(wv[r], wv[r]) : wv[r];
                }
                header[r] = header_bits(b);
            } else {
                wv[r] = aw[r] = words[r][0] = words[r][1] = _mm256_setzero_si256();
            }
        }
        /* Built from registers: a vector load of the four just-stored ints would stall on
         * store forwarding every block. */
        const __m128i headers = _mm_setr_epi32(header[0], header[1], header[2], header[3]);
        const __m128 dwv = f16x4_to_f32(headers);
        const __m128 mwv = fmt == FMT_Q4_1 ? f16x4_to_f32(_mm_srli_epi32(headers, 16))
                                           : _mm_setzero_ps();
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            const int64_t row = m0 + i, at = row * c->nb + blk, k0 = row * c->kp + blk * QK;
            __m256i p[4];
            if (act == ACT_Q16) {
                const int16_t *xq = (const int16_t *)c->q + k0;
#pragma GCC unroll 4
                for (int r = 0; r < 4; r++)
                    p[r] = r < NR ? block_dot16(words[r], xq) : _mm256_setzero_si256();
            } else {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)((const int8_t *)c->q + k0));
#pragma GCC unroll 4
                for (int r = 0; r < 4; r++)
                    p[r] = r < NR ? block_dot(fmt, wv[r], aw[r], xv) : _mm256_setzero_si256();
            }
            __m128i isum = sum4(p[0], p[1], p[2], p[3]);
            if (fmt == FMT_Q4_0) isum = _mm_sub_epi32(isum, _mm_set1_epi32(8 * c->sum[at]));
            __m128 v = _mm_mul_ps(_mm_mul_ps(dwv, _mm_set1_ps(c->d[at])), _mm_cvtepi32_ps(isum));
            if (fmt == FMT_Q4_1) v = _mm_add_ps(v, _mm_mul_ps(mwv, _mm_set1_ps(c->s[at])));
            acc[i] = _mm_add_ps(acc[i], v);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) _mm_storeu_ps(out[i], acc[i]);
}
#else
/* Portable C: the same integers, one output at a time, and the same fp32 operations. */
SIMD_INLINE void int_micro_kernel(const int MR, const int NR, const int fmt, const int act,
                                  const int_ctx *c, int64_t m0, tile_rows w,
                                  float out[MR_MAX][TILE_ROWS]) {
    (void)act; /* c->wide says how the activations are stored */
    const int kq = is_k_quant(fmt);
    float acc[MR_MAX][4] = {{0}};
    for (int64_t blk = 0; blk < c->nb; blk++) {
        for (int r = 0; r < NR; r++) {
            const uint8_t *b = block_at(w, r, kq ? blk / SUBS : blk);
            const int sub = kq ? (int)(blk % SUBS) : 0;
            int32_t q[QK];
            float dw[2], mw;
            block_ints(b, fmt, sub, q);
            block_scale(b, fmt, sub, dw, &mw);
            for (int i = 0; i < MR; i++) {
                const int64_t row = m0 + i, at = row * c->nb + blk, k0 = row * c->kp + blk * QK;
                int32_t isum[2] = {0, 0};
                for (int j = 0; j < QK; j++)
                    isum[j / 16] += q[j] * (c->wide ? ((const int16_t *)c->q)[k0 + j]
                                                    : ((const int8_t *)c->q)[k0 + j]);
                acc[i][r] = block_update(fmt, acc[i][r], isum[0], isum[1], dw, mw, c->d[at],
                                         c->s[at]);
            }
        }
    }
    for (int i = 0; i < MR; i++)
        for (int r = 0; r < NR; r++) out[i][r] = acc[i][r];
}
#endif

#define INT_DISPATCH_MR(NR, FMT, ACT)                                                 \
    switch (mr) {                                                                     \
        case 1: int_micro_kernel(1, NR, FMT, ACT, c, m0, ws, out); break;             \
        case 2: int_micro_kernel(2, NR, FMT, ACT, c, m0, ws, out); break;             \
        case 3: int_micro_kernel(3, NR, FMT, ACT, c, m0, ws, out); break;             \
        case 4: int_micro_kernel(4, NR, FMT, ACT, c, m0, ws, out); break;             \
        case 5: int_micro_kernel(5, NR, FMT, ACT, c, m0, ws, out); break;             \
        default: int_micro_kernel(6, NR, FMT, ACT, c, m0, ws, out); break;            \
    }
#define INT_DISPATCH_FMT(NR, ACT)                                     \
    switch (c->fmt) {                                                 \
        case FMT_Q8_0: INT_DISPATCH_MR(NR, FMT_Q8_0, ACT) break;      \
        case FMT_Q4_0: INT_DISPATCH_MR(NR, FMT_Q4_0, ACT) break;      \
        default: INT_DISPATCH_MR(NR, FMT_Q4_1, ACT) break;            \
    }
/* The k-quants take int16 activations whatever act (c->wide): one instance each. */
#define INT_DISPATCH(NR)                                                          \
    if (c->fmt == FMT_Q4_K) INT_DISPATCH_MR(NR, FMT_Q4_K, ACT_Q16)               \
    else if (c->fmt == FMT_Q6_K) INT_DISPATCH_MR(NR, FMT_Q6_K, ACT_Q16)          \
    else if (c->act == ACT_Q16) INT_DISPATCH_FMT(NR, ACT_Q16) else INT_DISPATCH_FMT(NR, ACT_Q8)

/* ---- the tiled row order: sixteen weight rows' blocks interleaved by 16-bit words ----------- */

/* group == TILE_ROWS (16): each group of 16 rows is stored block by block, and each block of
 * the group as the 16 rows' first 16-bit words, then their second words, ... (word t of row r's
 * block at word t * 16 + r; quant_reference.QuantizedWeight.with_row_group). Blocks are 34, 18
 * or 20 bytes, whole words, so every format interleaves alike and the bytes are the same.
 *
 * Why: one 16-byte load then holds weights k, k + 1 of eight rows, a half of the group (the
 * 256-bit kernels below take a group as two halves; the AVX-512 ones further down load all 16
 * rows' word at once) (Q8_0: word j is weights
 * 2j, 2j + 1; 4-bit: word j's low nibbles are weights 2j, 2j + 1 and its high nibbles 2j + 16,
 * 2j + 17), so widened to int16 and multiplied by one activation pair broadcast to every lane
 * (VPMADDWD), each int32 lane sums one row's products. A block's eight dot products accumulate
 * vertically, one lane per output, with no horizontal reduction, and the eight rows' scales are
 * one 16-byte load too. The grouped kernel's reduction of four rows' partial sums (sum4) cost
 * about as many instructions as its products; on a first-generation Zen, whose one 128-bit
 * integer multiplier bounds the products, that halves what many rows get through.
 *
 * The numbers are the integer path's: the same exact isums, then v = (dw dx) isum (+ m s) and
 * acc + v per block in k order, so the tiled and grouped orders give the same bits. */
#if defined(SPECSERVE_ISA_AVX512) || defined(SPECSERVE_ISA_AVX2)
/* The activation pair at x (two int16) in every int32 lane. */
SIMD_INLINE __m256i pair_at(const int16_t *x) {
    int32_t pair;
    memcpy(&pair, x, sizeof pair);
    return _mm256_set1_epi32(pair);
}

/* MR activation rows (int16 blocks) x NG halves of a tiled group from half h0 on (8 weight
 * rows each): out[i][8 h + r] for i < MR. The dispatch (TILED_DISPATCH_MR) runs both halves at
 * once, up to 3 rows a pass, so each activation broadcast feeds both; the signature is the
 * portable kernel's, whose k-quant passes take one half at a time. */
SIMD_INLINE void tiled_micro_kernel(const int MR, const int NG, const int h0, const int fmt,
                                    const int_ctx *c, int64_t m0, const uint8_t *group,
                                    float (*out)[TILE_ROWS]) {
    const int bb = block_bytes(fmt), header = fmt == FMT_Q4_1 ? 4 : 2;
    __m256 acc[MR_MAX][2];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
        for (int h = 0; h < NG; h++) acc[i][h] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < c->nb; blk++) {
        const uint8_t *t = group + blk * TILE_ROWS * bb;
        for (int line = 0; line < TILE_ROWS * bb; line += 64)
            __builtin_prefetch(t + TILE_ROWS * c->row_bytes + line);
        __m256 dw[2], mw[2];
        for (int h = 0; h < NG; h++) {
            const int half = 16 * (h0 + h); /* bytes: 8 rows' words */
            dw[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + half)));
            mw[h] = fmt == FMT_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + 32 + half)))
                                    : _mm256_setzero_ps();
        }
        const uint8_t *values = t + TILE_ROWS * header + 16 * h0;
        const int16_t *x[MR_MAX];
        __m256i isum[MR_MAX][2];
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            x[i] = (const int16_t *)c->q + (m0 + i) * c->kp + blk * QK;
            for (int h = 0; h < NG; h++) isum[i][h] = _mm256_setzero_si256();
        }
        if (fmt == FMT_Q8_0) {
#pragma GCC unroll 4
            for (int j = 0; j < 16; j++) {
                __m256i w[2];
                for (int h = 0; h < NG; h++)
                    w[h] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(values + 32 * j + 16 * h)));
#pragma GCC unroll 8
                for (int i = 0; i < MR; i++) {
                    const __m256i xp = pair_at(x[i] + 2 * j);
                    for (int h = 0; h < NG; h++) isum[i][h] = pair_dot(isum[i][h], w[h], xp);
                }
            }
        } else {
#pragma GCC unroll 4
            for (int j = 0; j < 8; j++) {
                __m256i low[2], high[2];
                for (int h = 0; h < NG; h++) {
                    const __m256i bytes = _mm256_cvtepu8_epi16(
                        _mm_loadu_si128((const __m128i *)(values + 32 * j + 16 * h)));
                    low[h] = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0f));
                    high[h] = _mm256_srli_epi16(bytes, 4);
                }
#pragma GCC unroll 8
                for (int i = 0; i < MR; i++) {
                    const __m256i xl = pair_at(x[i] + 2 * j), xh = pair_at(x[i] + 16 + 2 * j);
                    for (int h = 0; h < NG; h++) {
                        isum[i][h] = pair_dot(isum[i][h], low[h], xl);
                        isum[i][h] = pair_dot(isum[i][h], high[h], xh);
                    }
                }
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            const int64_t at = (m0 + i) * c->nb + blk;
            const __m256 dx = _mm256_set1_ps(c->d[at]);
            for (int h = 0; h < NG; h++) {
                __m256i is = isum[i][h];
                if (fmt == FMT_Q4_0) is = _mm256_sub_epi32(is, _mm256_set1_epi32(8 * c->sum[at]));
                __m256 v = _mm256_mul_ps(_mm256_mul_ps(dw[h], dx), _mm256_cvtepi32_ps(is));
                if (fmt == FMT_Q4_1) v = _mm256_add_ps(v, _mm256_mul_ps(mw[h], _mm256_set1_ps(c->s[at])));
                acc[i][h] = _mm256_add_ps(acc[i][h], v);
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
        for (int h = 0; h < NG; h++) _mm256_storeu_ps(out[i] + 8 * (h0 + h), acc[i][h]);
}

/* Word w (16 bits) of the 8 rows of half h of a tiled group's block t, one int16 lane each. */
SIMD_INLINE __m128i tiled_words(const uint8_t *t, int w, int h) {
    return _mm_loadu_si128((const __m128i *)(t + 32 * w + 16 * h));
}

/* Q4_K, tiled: the 8 rows of half h's scale d sc (D[j]) and offset -(dmin m) (Mn[j]) of every
 * sub-block j as fp32 lanes (d, dmin: the rows' fp16 fields as fp32). Scale byte k of every row
 * is byte k % 2 of word 2 + k / 2, each extracted once; the 6-bit fields unpack as
 * q4_k_scale_min does. */
SIMD_INLINE void q4_k_tiled_scales(const uint8_t *t, int h, __m256 d, __m256 dmin,
                                   __m256 D[SUBS], __m256 Mn[SUBS]) {
    __m128i bytes[12];
    for (int w = 0; w < 6; w++) {
        const __m128i words = tiled_words(t, 2 + w, h);
        bytes[2 * w] = _mm_and_si128(words, _mm_set1_epi16(0xff));
        bytes[2 * w + 1] = _mm_srli_epi16(words, 8);
    }
    for (int j = 0; j < SUBS; j++) {
        __m128i sc, m;
        if (j < 4) {
            sc = _mm_and_si128(bytes[j], _mm_set1_epi16(63));
            m = _mm_and_si128(bytes[j + 4], _mm_set1_epi16(63));
        } else {
            sc = _mm_or_si128(_mm_and_si128(bytes[j + 4], _mm_set1_epi16(15)),
                              _mm_slli_epi16(_mm_srli_epi16(bytes[j - 4], 6), 4));
            m = _mm_or_si128(_mm_srli_epi16(bytes[j + 4], 4),
                             _mm_slli_epi16(_mm_srli_epi16(bytes[j], 6), 4));
        }
        D[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(sc)));
        Mn[j] = _mm256_xor_ps(_mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(m))),
                              _mm256_set1_ps(-0.0f));
    }
}

/* Q6_K, tiled: the 8 rows of half h's d sc of 16-weight sub-block u as fp32 lanes (the int8
 * scale: byte u % 2 of word 96 + u / 2, sign-extended). */
SIMD_INLINE __m256 q6_k_tiled_scale(const uint8_t *t, int h, int u, __m256 d) {
    const __m128i words = tiled_words(t, 96 + u / 2, h);
    const __m128i sc = u % 2 ? _mm_srai_epi16(words, 8) : _mm_srai_epi16(_mm_slli_epi16(words, 8), 8);
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(sc)));
}

/* Q6_K's fp32 step after half `part` of a 32-weight block, for 8 rows' lanes: prod = d sc isum;
 * the first half's waits in *first, the second's gives acc + (first + prod) dx (dx read then
 * only). The reference's order, which every register-accumulator Q6_K kernel keeps. */
SIMD_INLINE __m256 q6_k_half_step(int part, __m256 ds, __m256i isum, __m256 *first, __m256 acc,
                                  const float *dx) {
    const __m256 prod = _mm256_mul_ps(ds, _mm256_cvtepi32_ps(isum));
    if (part == 0) {
        *first = prod;
        return acc;
    }
    return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_add_ps(*first, prod), _mm256_set1_ps(*dx)));
}

/* Q6_K, tiled: weights 2j, 2j + 1 of 32-weight block `sub` of the 8 rows of half h, unsigned
 * (q, 0..63; the - 32 is the caller's) as int16. Block 4 hh + s takes nibble s / 2 of ql word
 * 32 hh + 16 (s % 2) + j and bits 2s of qh word 64 + 16 hh + j; the bits are picked in bytes
 * (the 16-bit shifts move no kept bit across a byte), then widened. */
SIMD_INLINE __m256i q6_k_tiled_values(const uint8_t *t, int h, int sub, int j) {
    const int hh = sub / 4, s = sub % 4;
    const __m128i ql = tiled_words(t, 32 * hh + 16 * (s % 2) + j, h);
    const __m128i qh = tiled_words(t, 64 + 16 * hh + j, h);
    const __m128i low = _mm_and_si128(s < 2 ? ql : _mm_srli_epi16(ql, 4), _mm_set1_epi8(15));
    const __m128i high = s == 0 ? _mm_slli_epi16(qh, 4)
                         : s == 1 ? _mm_slli_epi16(qh, 2)
                         : s == 2 ? qh : _mm_srli_epi16(qh, 2);
    return _mm256_cvtepu8_epi16(_mm_or_si128(low, _mm_and_si128(high, _mm_set1_epi8(0x30))));
}

/* The tiled order's kernel for the k-quants: MR activation rows x NG halves of a tiled group
 * from half h0 on. Per super-block and half, the rows' fp16 fields and scales come from a few
 * 16-byte loads (one word of 8 rows each) and are decoded in int16 lanes.
 * Q4_K: word 8 + 16 c + j of a super-block holds bytes 2j, 2j + 1 of chunk c: weights 2j,
 * 2j + 1 of sub-block 2c in its low nibbles and of sub-block 2c + 1 in its high nibbles, so
 * one load feeds two blocks' products (as a Q4_1 block's low and high nibbles).
 * Q6_K: block by block in k order (q6_k_tiled_values), the isums of j < 8 and j >= 8 (the
 * halves of a block, one scale each) one after the other, so one isum per row and half is live
 * and each block's v goes straight into acc. The weights are taken unsigned (0..63) and each
 * isum starts at -32 times its 16 activations' sum (c->sum16): the same exact integer as
 * sum xq (q - 32), for one broadcast per 16 weights instead of a subtract per weight. Beside
 * the two-blocks-per-load order it replaced (which kept every block's first half and v live,
 * spilled past 16 registers), first-generation Zen, one thread, 8 widened layers: 5 rows
 * 71 -> 57 ms, 1 row 20 -> 19 ms. */
SIMD_INLINE void tiled_k_micro_kernel(const int MR, const int NG, const int h0, const int fmt,
                                      const int_ctx *c, int64_t m0, const uint8_t *group,
                                      float (*out)[TILE_ROWS]) {
    const int bb = block_bytes(fmt);
    __m256 acc[MR_MAX][2];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
        for (int h = 0; h < NG; h++) acc[i][h] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < c->nb / SUBS; sb++) {
        const uint8_t *t = group + sb * TILE_ROWS * bb;
        /* the next group's super-block, a quarter at each of the four steps below: issued at
         * once, its 36 or 53 lines overflow the core's outstanding-miss slots */
        const uint8_t *next = t + TILE_ROWS * c->row_bytes;
        const int quarter = TILE_ROWS * bb / 4;
        const int16_t *x[MR_MAX];
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) x[i] = (const int16_t *)c->q + (m0 + i) * c->kp + sb * QK_K;
        const int64_t blk0 = sb * SUBS; /* the super-block's first 32-weight block */
        if (fmt == FMT_Q4_K) {
            __m256 D[2][SUBS], Mn[2][SUBS];
            for (int h = 0; h < NG; h++)
                q4_k_tiled_scales(t, h0 + h, _mm256_cvtph_ps(tiled_words(t, 0, h0 + h)),
                                  _mm256_cvtph_ps(tiled_words(t, 1, h0 + h)), D[h], Mn[h]);
            /* Rolled: four copies of the chunk (each holding MR rows' j loop) cost more in code
             * than the loop saves, first-generation Zen, 8 widened layers: 5 rows 54 -> 49 ms,
             * 3 rows 31 -> 29, 1 row unchanged. */
#pragma GCC unroll 1
            for (int cc = 0; cc < 4; cc++) {
                for (int line = 0; line < quarter; line += 64) __builtin_prefetch(next + cc * quarter + line);
                __m256i isum[MR_MAX][2][2]; /* [row][half][low / high nibbles] */
#pragma GCC unroll 8
                for (int i = 0; i < MR; i++)
                    for (int h = 0; h < NG; h++) isum[i][h][0] = isum[i][h][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
                for (int j = 0; j < 16; j++) {
                    __m256i low[2], high[2];
                    for (int h = 0; h < NG; h++) {
                        const __m256i bytes = _mm256_cvtepu8_epi16(tiled_words(t, 8 + 16 * cc + j, h0 + h));
                        low[h] = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0f));
                        high[h] = _mm256_srli_epi16(bytes, 4);
                    }
#pragma GCC unroll 8
                    for (int i = 0; i < MR; i++) {
                        const __m256i xl = pair_at(x[i] + 64 * cc + 2 * j);
                        const __m256i xh = pair_at(x[i] + 64 * cc + 32 + 2 * j);
                        for (int h = 0; h < NG; h++) {
                            isum[i][h][0] = pair_dot(isum[i][h][0], low[h], xl);
                            isum[i][h][1] = pair_dot(isum[i][h][1], high[h], xh);
                        }
                    }
                }
#pragma GCC unroll 2
                for (int e = 0; e < 2; e++) { /* sub-blocks 2cc, 2cc + 1 in k order */
                    const int sub = 2 * cc + e;
#pragma GCC unroll 8
                    for (int i = 0; i < MR; i++) {
                        const int64_t at = (m0 + i) * c->nb + blk0 + sub;
                        const __m256 dx = _mm256_set1_ps(c->d[at]), sx = _mm256_set1_ps(c->s[at]);
                        for (int h = 0; h < NG; h++) {
                            __m256 v = _mm256_mul_ps(_mm256_mul_ps(D[h][sub], dx),
                                                     _mm256_cvtepi32_ps(isum[i][h][e]));
                            v = _mm256_add_ps(v, _mm256_mul_ps(Mn[h][sub], sx));
                            acc[i][h] = _mm256_add_ps(acc[i][h], v);
                        }
                    }
                }
            }
        } else {
            __m256 d[2];
            for (int h = 0; h < NG; h++) d[h] = _mm256_cvtph_ps(tiled_words(t, 104, h0 + h));
#pragma GCC unroll 8
            for (int sub = 0; sub < SUBS; sub++) { /* the super-block's blocks in k order */
                if (sub % 2 == 0)
                    for (int line = 0; line < quarter; line += 64)
                        __builtin_prefetch(next + sub / 2 * quarter + line);
                const int64_t blk = blk0 + sub;
                __m256 first[MR_MAX][2]; /* da isa, the block's first half */
#pragma GCC unroll 2
                for (int part = 0; part < 2; part++) { /* weights 16 part .. 16 part + 15 */
                    /* sum xq (q - 32) = sum xq q - 32 sum xq: the offset starts each isum */
                    __m256i isum[MR_MAX][2];
#pragma GCC unroll 8
                    for (int i = 0; i < MR; i++) {
                        const __m256i start = _mm256_set1_epi32(-32 * c->sum16[2 * ((m0 + i) * c->nb + blk) + part]);
                        for (int h = 0; h < NG; h++) isum[i][h] = start;
                    }
#pragma GCC unroll 4
                    for (int j = 8 * part; j < 8 * part + 8; j++) {
                        __m256i q[2];
                        for (int h = 0; h < NG; h++) q[h] = q6_k_tiled_values(t, h0 + h, sub, j);
#pragma GCC unroll 8
                        for (int i = 0; i < MR; i++) {
                            const __m256i xp = pair_at(x[i] + QK * sub + 2 * j);
                            for (int h = 0; h < NG; h++) isum[i][h] = pair_dot(isum[i][h], q[h], xp);
                        }
                    }
                    __m256 ds[2];
                    for (int h = 0; h < NG; h++) ds[h] = q6_k_tiled_scale(t, h0 + h, 2 * sub + part, d[h]);
#pragma GCC unroll 8
                    for (int i = 0; i < MR; i++)
                        for (int h = 0; h < NG; h++)
                            acc[i][h] = q6_k_half_step(part, ds[h], isum[i][h], &first[i][h],
                                                       acc[i][h], &c->d[(m0 + i) * c->nb + blk]);
                }
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
        for (int h = 0; h < NG; h++) _mm256_storeu_ps(out[i] + 8 * (h0 + h), acc[i][h]);
}
#else
/* Portable C: the same integers and the same fp32 operations, one output at a time (every
 * format: each row's block is put back in GGUF's byte order first). */
SIMD_INLINE void tiled_micro_kernel(const int MR, const int NG, const int h0, const int fmt,
                                    const int_ctx *c, int64_t m0, const uint8_t *group,
                                    float (*out)[TILE_ROWS]) {
    const int bb = block_bytes(fmt), subs = is_k_quant(fmt) ? SUBS : 1;
    float acc[MR_MAX][TILE_ROWS] = {{0}};
    for (int64_t blk = 0; blk < c->nb / subs; blk++) {
        const uint8_t *t = group + blk * TILE_ROWS * bb;
        for (int r = 8 * h0; r < 8 * (h0 + NG); r++) {
            uint8_t b[210]; /* row r's block, back in GGUF's byte order */
            for (int word = 0; word < bb / 2; word++) memcpy(b + 2 * word, t + 2 * (word * TILE_ROWS + r), 2);
            for (int sub = 0; sub < subs; sub++) {
                int32_t q[QK];
                float dw[2], mw;
                block_ints(b, fmt, sub, q);
                block_scale(b, fmt, sub, dw, &mw);
                for (int i = 0; i < MR; i++) {
                    const int64_t row = m0 + i, at = row * c->nb + blk * subs + sub;
                    const int16_t *x = (const int16_t *)c->q + row * c->kp + (blk * subs + sub) * QK;
                    int32_t isum[2] = {0, 0};
                    for (int j = 0; j < QK; j++) isum[j / 16] += q[j] * x[j];
                    acc[i][r] = block_update(fmt, acc[i][r], isum[0], isum[1], dw, mw, c->d[at],
                                             c->s[at]);
                }
            }
        }
    }
    for (int i = 0; i < MR; i++)
        for (int r = 8 * h0; r < 8 * (h0 + NG); r++) out[i][r] = acc[i][r];
}
#endif

#if defined(SPECSERVE_ISA_AVX512)
/* ---- the tiled order on AVX-512: a whole 16-row group per vector ----------------------------
 *
 * The kernels above take a tiled group as two 8-row halves in 256-bit vectors. With 512-bit
 * vectors the group's 16 rows fill one: a word of all 16 rows (32 bytes) widens to 32 int16
 * lanes, one row's pair per int32 lane, and one VPDPWSSD adds 32 products where the 256-bit
 * kernel needs two, while the fp32 part (one lane per output) halves too. The integers and the
 * fp32 operations per lane are the 256-bit kernels', in the same order, so the bits are the
 * same (Zen 5, 2 threads, 24 widened layers of Q4_0 at 5 rows: see bench/RESULTS.md). Each row
 * keeps two integer chains (the nibbles' halves, or even and odd words) so one activation row
 * is not bound by VPDPWSSD's latency. */

/* The activation pair at x (two int16) in every int32 lane of a 512-bit vector. */
SIMD_INLINE __m512i pair_at16(const int16_t *x) {
    int32_t pair;
    memcpy(&pair, x, sizeof pair);
    return _mm512_set1_epi32(pair);
}

/* Word w of all 16 rows of a tiled group's block t (32 bytes: rows 0..15). */
SIMD_INLINE __m256i group_words(const uint8_t *t, int w) {
    return _mm256_loadu_si256((const __m256i *)(t + 32 * w));
}

/* The 16 rows' fp16 field at word w as fp32 lanes. */
SIMD_INLINE __m512 group_f16(const uint8_t *t, int w) { return _mm512_cvtph_ps(group_words(t, w)); }

/* MR activation rows x a whole tiled group (Q8_0, Q4_0, Q4_1): out[i][r]. The activations are
 * int16 blocks, or with `bytes` (Q4_0 and Q4_1 against Q8 activations, c->wide == 0) bytes:
 * then VPDPBUSD multiplies four unsigned nibbles by four signed activation bytes per int32
 * lane, 64 products an instruction where VPDPWSSD's int16 pairs give 32, so each activation row
 * beyond the first costs half the multiplies. A tiled word j holds each row's weights 2j, 2j + 1
 * in its low nibbles and 2j + 16, 2j + 17 in its high ones; one VPERMW puts the four side by side
 * in each row's lane, and the activations are stored in that order (nibble_order: bytes
 * 4j .. 4j + 3 of a block are x 2j, 2j + 1, 2j + 16, 2j + 17). The integers are the same either
 * way, and so are the fp32 operations: the bits of every other path with the same activations. */
SIMD_INLINE void group_micro_kernel(const int MR, const int fmt, const int bytes,
                                    const int_ctx *c, int64_t m0, const uint8_t *group,
                                    float out[MR_MAX][TILE_ROWS]) {
    const int bb = block_bytes(fmt), header = fmt == FMT_Q4_1 ? 2 : 1; /* words */
    /* word 2r: word r of the low half (row r's low nibbles), 2r + 1: word r of the high half */
    const __m512i side_by_side = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
        23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m256i nibble = _mm256_set1_epi8(0x0f);
    __m512 acc[MR_MAX];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < c->nb; blk++) {
        const uint8_t *t = group + blk * TILE_ROWS * bb;
        for (int line = 0; line < TILE_ROWS * bb; line += 64)
            __builtin_prefetch(t + TILE_ROWS * c->row_bytes + line);
        const __m512 dw = group_f16(t, 0);
        const __m512 mw = fmt == FMT_Q4_1 ? group_f16(t, 1) : _mm512_setzero_ps();
        const uint8_t *values = t + 32 * header;
        const int16_t *x[MR_MAX];
        const int8_t *xb[MR_MAX];
        __m512i isum[MR_MAX][2];
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            x[i] = (const int16_t *)c->q + (m0 + i) * c->kp + blk * QK;
            xb[i] = (const int8_t *)c->q + (m0 + i) * c->kp + blk * QK;
            isum[i][0] = isum[i][1] = _mm512_setzero_si512();
        }
        if (bytes) {
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                const __m256i words = group_words(values, j);
                const __m512i w = _mm512_permutexvar_epi16(side_by_side, _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_and_si256(words, nibble)),
                    _mm256_and_si256(_mm256_srli_epi16(words, 4), nibble), 1));
#pragma GCC unroll 8
                for (int i = 0; i < MR; i++) {
                    int32_t quad;
                    memcpy(&quad, xb[i] + 4 * j, sizeof quad);
                    isum[i][j % 2] = _mm512_dpbusd_epi32(isum[i][j % 2], w, _mm512_set1_epi32(quad));
                }
            }
        } else if (fmt == FMT_Q8_0) {
#pragma GCC unroll 16
            for (int j = 0; j < 16; j++) {
                const __m512i w = _mm512_cvtepi8_epi16(group_words(values, j));
#pragma GCC unroll 8
                for (int i = 0; i < MR; i++)
                    isum[i][j % 2] = _mm512_dpwssd_epi32(isum[i][j % 2], w, pair_at16(x[i] + 2 * j));
            }
        } else {
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                const __m512i bytes16 = _mm512_cvtepu8_epi16(group_words(values, j));
                const __m512i low = _mm512_and_si512(bytes16, _mm512_set1_epi16(0x0f));
                const __m512i high = _mm512_srli_epi16(bytes16, 4);
#pragma GCC unroll 8
                for (int i = 0; i < MR; i++) {
                    isum[i][0] = _mm512_dpwssd_epi32(isum[i][0], low, pair_at16(x[i] + 2 * j));
                    isum[i][1] = _mm512_dpwssd_epi32(isum[i][1], high, pair_at16(x[i] + 16 + 2 * j));
                }
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            const int64_t at = (m0 + i) * c->nb + blk;
            __m512i is = _mm512_add_epi32(isum[i][0], isum[i][1]);
            if (fmt == FMT_Q4_0) is = _mm512_sub_epi32(is, _mm512_set1_epi32(8 * c->sum[at]));
            __m512 v = _mm512_mul_ps(_mm512_mul_ps(dw, _mm512_set1_ps(c->d[at])), _mm512_cvtepi32_ps(is));
            if (fmt == FMT_Q4_1) v = _mm512_add_ps(v, _mm512_mul_ps(mw, _mm512_set1_ps(c->s[at])));
            acc[i] = _mm512_add_ps(acc[i], v);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) _mm512_storeu_ps(out[i], acc[i]);
}

/* The dispatch's two shapes of it: int16 activations, and bytes (Q4_0 / Q4_1, Q8). */
SIMD_INLINE void group_int16_kernel(const int MR, const int fmt, const int_ctx *c, int64_t m0,
                                    const uint8_t *group, float out[MR_MAX][TILE_ROWS]) {
    group_micro_kernel(MR, fmt, 0, c, m0, group, out);
}
SIMD_INLINE void group_byte_kernel(const int MR, const int fmt, const int_ctx *c, int64_t m0,
                                   const uint8_t *group, float out[MR_MAX][TILE_ROWS]) {
    group_micro_kernel(MR, fmt, 1, c, m0, group, out);
}

/* Q4_K: the 16 rows' d sc (D[j]) and -(dmin m) (Mn[j]) of every sub-block j, decoded as
 * q4_k_tiled_scales does for 8 rows, in int16 lanes of 256-bit vectors. */
SIMD_INLINE void q4_k_group_scales(const uint8_t *t, __m512 D[SUBS], __m512 Mn[SUBS]) {
    const __m512 d = group_f16(t, 0), dmin = group_f16(t, 1);
    __m256i bytes[12];
    for (int w = 0; w < 6; w++) {
        const __m256i words = group_words(t, 2 + w);
        bytes[2 * w] = _mm256_and_si256(words, _mm256_set1_epi16(0xff));
        bytes[2 * w + 1] = _mm256_srli_epi16(words, 8);
    }
    for (int j = 0; j < SUBS; j++) {
        __m256i sc, m;
        if (j < 4) {
            sc = _mm256_and_si256(bytes[j], _mm256_set1_epi16(63));
            m = _mm256_and_si256(bytes[j + 4], _mm256_set1_epi16(63));
        } else {
            sc = _mm256_or_si256(_mm256_and_si256(bytes[j + 4], _mm256_set1_epi16(15)),
                                 _mm256_slli_epi16(_mm256_srli_epi16(bytes[j - 4], 6), 4));
            m = _mm256_or_si256(_mm256_srli_epi16(bytes[j + 4], 4),
                                _mm256_slli_epi16(_mm256_srli_epi16(bytes[j], 6), 4));
        }
        D[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(sc)));
        Mn[j] = _mm512_castsi512_ps(_mm512_xor_si512(
            _mm512_castps_si512(_mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(m)))),
            _mm512_set1_epi32((int)0x80000000u)));
    }
}

/* Q6_K: the 16 rows' unsigned q (0..63) of weights 2j, 2j + 1 of block `sub`, as
 * q6_k_tiled_values picks them for 8 rows. */
SIMD_INLINE __m512i q6_k_group_values(const uint8_t *t, int sub, int j) {
    const int hh = sub / 4, s = sub % 4;
    const __m256i ql = group_words(t, 32 * hh + 16 * (s % 2) + j);
    const __m256i qh = group_words(t, 64 + 16 * hh + j);
    const __m256i low = _mm256_and_si256(s < 2 ? ql : _mm256_srli_epi16(ql, 4), _mm256_set1_epi8(15));
    const __m256i high = s == 0 ? _mm256_slli_epi16(qh, 4)
                         : s == 1 ? _mm256_slli_epi16(qh, 2)
                         : s == 2 ? qh : _mm256_srli_epi16(qh, 2);
    return _mm512_cvtepu8_epi16(_mm256_or_si256(low, _mm256_and_si256(high, _mm256_set1_epi8(0x30))));
}

/* Q6_K: the 16 rows' d sc of 16-weight sub-block u (the int8 scale, sign-extended). */
SIMD_INLINE __m512 q6_k_group_scale(const uint8_t *t, int u, __m512 d) {
    const __m256i words = group_words(t, 96 + u / 2);
    const __m256i sc = u % 2 ? _mm256_srai_epi16(words, 8)
                             : _mm256_srai_epi16(_mm256_slli_epi16(words, 8), 8);
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(sc)));
}

/* The k-quants, a whole tiled group per vector: tiled_k_micro_kernel's integers and fp32
 * operations, per lane in the same order. */
SIMD_INLINE void group_k_micro_kernel(const int MR, const int fmt, const int_ctx *c, int64_t m0,
                                      const uint8_t *group, float out[MR_MAX][TILE_ROWS]) {
    const int bb = block_bytes(fmt);
    __m512 acc[MR_MAX];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < c->nb / SUBS; sb++) {
        const uint8_t *t = group + sb * TILE_ROWS * bb;
        const uint8_t *next = t + TILE_ROWS * c->row_bytes; /* a quarter per step, as above */
        const int quarter = TILE_ROWS * bb / 4;
        const int16_t *x[MR_MAX];
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) x[i] = (const int16_t *)c->q + (m0 + i) * c->kp + sb * QK_K;
        const int64_t blk0 = sb * SUBS;
        if (fmt == FMT_Q4_K) {
            __m512 D[SUBS], Mn[SUBS];
            q4_k_group_scales(t, D, Mn);
#pragma GCC unroll 1
            for (int cc = 0; cc < 4; cc++) {
                for (int line = 0; line < quarter; line += 64) __builtin_prefetch(next + cc * quarter + line);
                __m512i isum[MR_MAX][2]; /* [row][low / high nibbles: sub-blocks 2cc, 2cc + 1] */
#pragma GCC unroll 8
                for (int i = 0; i < MR; i++) isum[i][0] = isum[i][1] = _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int j = 0; j < 16; j++) {
                    const __m512i bytes = _mm512_cvtepu8_epi16(group_words(t, 8 + 16 * cc + j));
                    const __m512i low = _mm512_and_si512(bytes, _mm512_set1_epi16(0x0f));
                    const __m512i high = _mm512_srli_epi16(bytes, 4);
#pragma GCC unroll 8
                    for (int i = 0; i < MR; i++) {
                        isum[i][0] = _mm512_dpwssd_epi32(isum[i][0], low, pair_at16(x[i] + 64 * cc + 2 * j));
                        isum[i][1] = _mm512_dpwssd_epi32(isum[i][1], high, pair_at16(x[i] + 64 * cc + 32 + 2 * j));
                    }
                }
#pragma GCC unroll 2
                for (int e = 0; e < 2; e++) {
                    const int sub = 2 * cc + e;
#pragma GCC unroll 8
                    for (int i = 0; i < MR; i++) {
                        const int64_t at = (m0 + i) * c->nb + blk0 + sub;
                        __m512 v = _mm512_mul_ps(_mm512_mul_ps(D[sub], _mm512_set1_ps(c->d[at])),
                                                 _mm512_cvtepi32_ps(isum[i][e]));
                        v = _mm512_add_ps(v, _mm512_mul_ps(Mn[sub], _mm512_set1_ps(c->s[at])));
                        acc[i] = _mm512_add_ps(acc[i], v);
                    }
                }
            }
        } else {
            const __m512 d = group_f16(t, 104);
#pragma GCC unroll 1
            for (int sub = 0; sub < SUBS; sub++) {
                if (sub % 2 == 0)
                    for (int line = 0; line < quarter; line += 64)
                        __builtin_prefetch(next + sub / 2 * quarter + line);
                const int64_t blk = blk0 + sub;
                __m512i isum[MR_MAX][2]; /* [row][the block's halves: one scale each] */
#pragma GCC unroll 8
                for (int i = 0; i < MR; i++)
                    for (int part = 0; part < 2; part++)
                        isum[i][part] = _mm512_set1_epi32(-32 * c->sum16[2 * ((m0 + i) * c->nb + blk) + part]);
#pragma GCC unroll 8
                for (int j = 0; j < 8; j++) { /* the halves' words j and 8 + j side by side */
                    const __m512i qa = q6_k_group_values(t, sub, j), qb = q6_k_group_values(t, sub, 8 + j);
#pragma GCC unroll 8
                    for (int i = 0; i < MR; i++) {
                        isum[i][0] = _mm512_dpwssd_epi32(isum[i][0], qa, pair_at16(x[i] + QK * sub + 2 * j));
                        isum[i][1] = _mm512_dpwssd_epi32(isum[i][1], qb, pair_at16(x[i] + QK * sub + 16 + 2 * j));
                    }
                }
                const __m512 da = q6_k_group_scale(t, 2 * sub, d), db = q6_k_group_scale(t, 2 * sub + 1, d);
#pragma GCC unroll 8
                for (int i = 0; i < MR; i++) { /* v = (da isa + db isb) dx, then acc + v */
                    const __m512 dx = _mm512_set1_ps(c->d[(m0 + i) * c->nb + blk]);
                    const __m512 first = _mm512_mul_ps(da, _mm512_cvtepi32_ps(isum[i][0]));
                    const __m512 second = _mm512_mul_ps(db, _mm512_cvtepi32_ps(isum[i][1]));
                    acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(_mm512_add_ps(first, second), dx));
                }
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) _mm512_storeu_ps(out[i], acc[i]);
}

#define GROUP_DISPATCH_MR(KERNEL, FMT)                                      \
    switch (mr) {                                                           \
        case 1: KERNEL(1, FMT, c, m0, group, out); break;                   \
        case 2: KERNEL(2, FMT, c, m0, group, out); break;                   \
        case 3: KERNEL(3, FMT, c, m0, group, out); break;                   \
        case 4: KERNEL(4, FMT, c, m0, group, out); break;                   \
        case 5: KERNEL(5, FMT, c, m0, group, out); break;                   \
        default: KERNEL(6, FMT, c, m0, group, out); break;                  \
    }
#endif

#if defined(SPECSERVE_ISA_AVX2)
/* ---- the k-quants' tiled order at many rows (AVX2): each super-block unpacked once ----------
 *
 * tiled_k_micro_kernel unpacks a group's super-block for every chunk of up to MR_MAX rows, and
 * at 3 or more rows one half of the group at a time (two halves' isums do not fit 16
 * registers beside the fp32 sums), so batched decode pays the unpacking once per 1-3 rows:
 * Q6_K's bit assembly is about as many instructions as its products. Here each super-block of
 * a group is unpacked once, as int16 for both halves, into a buffer that stays in L1 while
 * every activation row runs against it, both halves at once; the rows' fp32 sums wait in
 * memory, touched once per block. The integers and the fp32 operations are the micro-kernel's,
 * in the same order, so the bits are too. 2-core Zen 3, 24 widened layers, best of 11, ms
 * before -> after: Q6_K 8 / 16 / 32 rows 93.0 -> 71.8, 169.6 -> 129.1, 387.5 -> 234.2 (4 and 5
 * rows alike); Q4_K 57.8 -> 53.9, 120.4 -> 94.4, 230.8 -> 188.8. */

/* One super-block of a tiled group as the many-rows kernel reads it: q[sub][j][h] holds weights
 * 2j, 2j + 1 of 32-weight block `sub` of the 8 rows of half h as int16 (Q4_K the nibble, Q6_K
 * the unsigned q), scale[h] the half's fp32 lanes: Q4_K d sc of each block (0..7) and
 * -(dmin m) (8..15), Q6_K d sc of each 16-weight sub-block. */
typedef struct {
    __m256i q[SUBS][16][2];
    __m256 scale[2][2 * SUBS];
} unpacked_super_block;

static void unpack_super_block(const uint8_t *t, int fmt, unpacked_super_block *u) {
    for (int h = 0; h < 2; h++) {
        if (fmt == FMT_Q4_K) {
            q4_k_tiled_scales(t, h, _mm256_cvtph_ps(tiled_words(t, 0, h)),
                              _mm256_cvtph_ps(tiled_words(t, 1, h)), u->scale[h], u->scale[h] + SUBS);
            for (int cc = 0; cc < 4; cc++)
                for (int j = 0; j < 16; j++) {
                    const __m256i bytes = _mm256_cvtepu8_epi16(tiled_words(t, 8 + 16 * cc + j, h));
                    u->q[2 * cc][j][h] = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0f));
                    u->q[2 * cc + 1][j][h] = _mm256_srli_epi16(bytes, 4);
                }
        } else {
            const __m256 d = _mm256_cvtph_ps(tiled_words(t, 104, h));
            for (int v = 0; v < 2 * SUBS; v++) u->scale[h][v] = q6_k_tiled_scale(t, h, v, d);
            for (int sub = 0; sub < SUBS; sub++)
                for (int j = 0; j < 16; j++) u->q[sub][j][h] = q6_k_tiled_values(t, h, sub, j);
        }
    }
}

/* ---- Q6_K at one or two rows (AVX2): both halves of a group from one 32-byte load ----------
 *
 * tiled_k_micro_kernel unpacks a Q6_K word 8 rows at a time: two 16-byte loads (low and high
 * bits) and the bit assembly per half, then a cross-lane widening. At one or two rows that
 * unpacking is most of the work. Here each word's 16 rows (32 bytes) are loaded and assembled at
 * once and widened within 128-bit lanes, so the two int16 vectors hold rows 0-3 and 8-11
 * ("lo") and rows 4-7 and 12-15 ("hi"); the scales are put in the same lane order, and the
 * sums back in row order at the end. Each lane's integers and fp32 operations are
 * tiled_k_micro_kernel's, so the bits are too. */

/* The 16 rows' fp16 field at word w of a tiled block t as fp32, in lo / hi lane order. */
SIMD_INLINE void lo_hi_f16(const uint8_t *t, int w, __m256 f[2]) {
    /* qwords 0, 2 (rows 0-3, 8-11) low, 1, 3 (rows 4-7, 12-15) high */
    const __m256i words = _mm256_permute4x64_epi64(
        _mm256_loadu_si256((const __m256i *)(t + 32 * w)), _MM_SHUFFLE(3, 1, 2, 0));
    f[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(words));
    f[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(words, 1));
}

/* A row's 16 sums from lo / hi lane order back to row order: rows 0-7, then 8-15. */
SIMD_INLINE void store_lo_hi(float *out, const __m256 acc[2]) {
    _mm256_storeu_ps(out, _mm256_permute2f128_ps(acc[0], acc[1], 0x20));
    _mm256_storeu_ps(out + 8, _mm256_permute2f128_ps(acc[0], acc[1], 0x31));
}

/* Weights 2j, 2j + 1 of block `sub` of a tiled Q6_K super-block t, unsigned (0..63), all 16
 * rows (a byte each, row r's at bytes 2r, 2r + 1), as q6_k_tiled_values picks them. */
SIMD_INLINE __m256i q6_k_pair_bytes(const uint8_t *t, int sub, int j) {
    const int hh = sub / 4, s = sub % 4;
    const __m256i ql = _mm256_loadu_si256((const __m256i *)(t + 32 * (32 * hh + 16 * (s % 2) + j)));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(t + 32 * (64 + 16 * hh + j)));
    const __m256i low = _mm256_and_si256(s < 2 ? ql : _mm256_srli_epi16(ql, 4), _mm256_set1_epi8(15));
    const __m256i high = s == 0 ? _mm256_slli_epi16(qh, 4)
                         : s == 1 ? _mm256_slli_epi16(qh, 2)
                         : s == 2 ? qh : _mm256_srli_epi16(qh, 2);
    return _mm256_or_si256(low, _mm256_and_si256(high, _mm256_set1_epi8(0x30)));
}

/* The same weights as int16, in lo / hi lane order. */
SIMD_INLINE void q6_k_pair_values(const uint8_t *t, int sub, int j, __m256i *lo, __m256i *hi) {
    const __m256i q = q6_k_pair_bytes(t, sub, j);
    *lo = _mm256_unpacklo_epi8(q, _mm256_setzero_si256());
    *hi = _mm256_unpackhi_epi8(q, _mm256_setzero_si256());
}

/* d sc of 16-weight sub-block u of all 16 rows as fp32, in lo / hi lane order (d: the rows'
 * d in that order): the int8 scale sign-extended as q6_k_tiled_scale does. */
SIMD_INLINE void q6_k_pair_scales(const uint8_t *t, int u, const __m256 d[2], __m256 ds[2]) {
    const __m256i words = _mm256_loadu_si256((const __m256i *)(t + 32 * (96 + u / 2)));
    const __m256i sc = u % 2 ? _mm256_srai_epi16(words, 8) : _mm256_srai_epi16(_mm256_slli_epi16(words, 8), 8);
    ds[0] = _mm256_mul_ps(d[0], _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_unpacklo_epi16(sc, sc), 16)));
    ds[1] = _mm256_mul_ps(d[1], _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_unpackhi_epi16(sc, sc), 16)));
}

/* MR (1 or 2: 3 spilled) activation rows x a whole tiled Q6_K group: out[i][r] for r < 16, as
 * tiled_k_micro_kernel(MR, 2, 0, FMT_Q6_K, ...) computes them. */
SIMD_INLINE void q6_k_pair_kernel(const int MR, const int_ctx *c, int64_t m0, const uint8_t *group,
                                  float (*out)[TILE_ROWS]) {
    const int bb = block_bytes(FMT_Q6_K);
    __m256 acc[MR_MAX][2]; /* [row][lo / hi] */
#pragma GCC unroll 2
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < c->nb / SUBS; sb++) {
        const uint8_t *t = group + sb * TILE_ROWS * bb;
        const uint8_t *next = t + TILE_ROWS * c->row_bytes; /* as tiled_k_micro_kernel fetches */
        const int quarter = TILE_ROWS * bb / 4;
        const int16_t *x[MR_MAX];
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) x[i] = (const int16_t *)c->q + (m0 + i) * c->kp + sb * QK_K;
        __m256 d[2]; /* the rows' d */
        lo_hi_f16(t, 104, d);
#pragma GCC unroll 8
        for (int sub = 0; sub < SUBS; sub++) {
            if (sub % 2 == 0)
                for (int line = 0; line < quarter; line += 64) __builtin_prefetch(next + sub / 2 * quarter + line);
            const int64_t blk = sb * SUBS + sub;
            __m256 first[MR_MAX][2];
#pragma GCC unroll 2
            for (int part = 0; part < 2; part++) {
                __m256i isum[MR_MAX][2];
#pragma GCC unroll 2
                for (int i = 0; i < MR; i++)
                    isum[i][0] = isum[i][1] =
                        _mm256_set1_epi32(-32 * c->sum16[2 * ((m0 + i) * c->nb + blk) + part]);
#pragma GCC unroll 4
                for (int j = 8 * part; j < 8 * part + 8; j++) {
                    __m256i q[2];
                    q6_k_pair_values(t, sub, j, &q[0], &q[1]);
#pragma GCC unroll 2
                    for (int i = 0; i < MR; i++) {
                        const __m256i xp = pair_at(x[i] + QK * sub + 2 * j);
                        isum[i][0] = pair_dot(isum[i][0], q[0], xp);
                        isum[i][1] = pair_dot(isum[i][1], q[1], xp);
                    }
                }
                __m256 ds[2];
                q6_k_pair_scales(t, 2 * sub + part, d, ds);
#pragma GCC unroll 2
                for (int i = 0; i < MR; i++)
                    for (int h = 0; h < 2; h++)
                        acc[i][h] = q6_k_half_step(part, ds[h], isum[i][h], &first[i][h],
                                                   acc[i][h], &c->d[(m0 + i) * c->nb + blk]);
            }
        }
    }
#pragma GCC unroll 2
    for (int i = 0; i < MR; i++) store_lo_hi(out[i], acc[i]);
}

/* Q6_K's 1, 2 and 4 rows (2 + 2) through q6_k_pair_kernel; from 5 rows run_many_rows takes it.
 * 2-core Zen 3, 24 widened layers, best of 11-15, ms before -> after: 1 row 16.7 -> 13.1, 2
 * rows 22.8 -> 16.3, 4 rows 47.3-52.0 -> 44.1-46.0 (run_many_rows before); 3 rows as 2 + 1,
 * 3 rows in one pass (spilled) and 5 as 2 + 2 + 1 ran alike or slower. */
static void q6_k_pairs(const int_ctx *c, int64_t m0, int mr, const uint8_t *group,
                       float (*out)[TILE_ROWS]) {
    if (mr == 1) q6_k_pair_kernel(1, c, m0, group, out);
    else for (int i = 0; i < mr; i += 2) q6_k_pair_kernel(2, c, m0 + i, group, out + i);
}
#define Q6_K_PAIRS(FMT) \
    if (FMT == FMT_Q6_K && (mr == 1 || mr == 2 || mr == 4)) q6_k_pairs(c, m0, mr, group, out); else

/* ---- Q4_0 / Q4_1 against Q8 activation bytes, tiled (AVX2) ----------------------------------
 *
 * Against int16 activations a 4-bit product costs one VPMADDWD per two weights of a row
 * (tiled_micro_kernel), so from a few activation rows an AVX2 core is bound by its integer
 * multiplier. Against Q8 activations (bytes) VPMADDUBSW multiplies four weights of a row per
 * pair of int16 lanes: a tiled word j of all 16 rows (32 bytes) splits into its low nibbles
 * (weights 2j, 2j + 1) and high ones (2j + 16, 2j + 17), interleaved by 16-bit words so that
 * each row's four weights sit side by side, in lo / hi lane order (as q6_k_pair_values), and
 * meet the activations stored in that order (nibble_order, as AVX-512's group_byte_kernel).
 * A lane's int16 sums over the block's eight words stay below 2^15 (8 x 2 x 15 x 127 =
 * 30,480; the activations are in [-127, 127]), so they add in int16 and one VPMADDWD by ones
 * per block turns each row's two lanes into its int32 isum: 9 multiplies per row, block and
 * 8 weight rows against 16. The isums are exact and the fp32 operations tiled_micro_kernel's,
 * so the bits are those of every path with Q8 activations. 2-core Zen 3, 24 widened layers
 * from memory, best of 7, Q8 activations as int16 -> as bytes: Q4_1 2 / 3 / 5 / 8 / 16 / 32
 * rows 0.88 / 0.75 / 0.74 / 0.82 / 0.84 / 0.83x the time, Q4_0 0.74-0.84x (1 row 0.91x),
 * Q4_K (with the many-rows kernel's byte form from 8 rows) 0.84 / 0.88 / 0.92 / 0.96 / 0.79 /
 * 0.70x; Q4_K's one row stays int16 (q4_k_byte_kernel reads each word twice: 1.01-1.05x). */
SIMD_INLINE void tiled_byte_kernel(const int MR, const int fmt, const int_ctx *c, int64_t m0,
                                   const uint8_t *group, float (*out)[TILE_ROWS]) {
    const int bb = block_bytes(fmt), header = fmt == FMT_Q4_1 ? 2 : 1; /* words */
    const __m256i nibble = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256 acc[MR_MAX][2]; /* [row][lo / hi] */
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < c->nb; blk++) {
        const uint8_t *t = group + blk * TILE_ROWS * bb;
        for (int line = 0; line < TILE_ROWS * bb; line += 64)
            __builtin_prefetch(t + TILE_ROWS * c->row_bytes + line);
        __m256 dw[2], mw[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        lo_hi_f16(t, 0, dw);
        if (fmt == FMT_Q4_1) lo_hi_f16(t, 1, mw);
        const uint8_t *values = t + 32 * header;
        const int8_t *xb[MR_MAX];
        __m256i s16[MR_MAX][2]; /* [row][lo / hi]: int16 pair sums */
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            xb[i] = (const int8_t *)c->q + (m0 + i) * c->kp + blk * QK;
            s16[i][0] = s16[i][1] = _mm256_setzero_si256();
        }
#pragma GCC unroll 4 /* 8 spilled the sums */
        for (int j = 0; j < 8; j++) {
            const __m256i words = _mm256_loadu_si256((const __m256i *)(values + 32 * j));
            const __m256i low = _mm256_and_si256(words, nibble);
            const __m256i high = _mm256_and_si256(_mm256_srli_epi16(words, 4), nibble);
            const __m256i w[2] = {_mm256_unpacklo_epi16(low, high), _mm256_unpackhi_epi16(low, high)};
#pragma GCC unroll 8
            for (int i = 0; i < MR; i++) {
                int32_t quad;
                memcpy(&quad, xb[i] + 4 * j, sizeof quad);
                const __m256i xq = _mm256_set1_epi32(quad);
                for (int h = 0; h < 2; h++)
                    s16[i][h] = _mm256_add_epi16(s16[i][h], _mm256_maddubs_epi16(w[h], xq));
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            const int64_t at = (m0 + i) * c->nb + blk;
            const __m256 dx = _mm256_set1_ps(c->d[at]);
            for (int h = 0; h < 2; h++) {
                __m256i is = _mm256_madd_epi16(s16[i][h], ones);
                if (fmt == FMT_Q4_0) is = _mm256_sub_epi32(is, _mm256_set1_epi32(8 * c->sum[at]));
                __m256 v = _mm256_mul_ps(_mm256_mul_ps(dw[h], dx), _mm256_cvtepi32_ps(is));
                if (fmt == FMT_Q4_1) v = _mm256_add_ps(v, _mm256_mul_ps(mw[h], _mm256_set1_ps(c->s[at])));
                acc[i][h] = _mm256_add_ps(acc[i][h], v);
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) store_lo_hi(out[i], acc[i]);
}

/* Q4_K, tiled, against Q8 bytes: the scales of all 16 rows in lo / hi lane order, scale[h][sub]
 * d sc and scale[h][SUBS + sub] -(dmin m) of sub-block sub (q4_k_tiled_scales' values). */
SIMD_INLINE void q4_k_lo_hi_scales(const uint8_t *t, __m256 scale[2][2 * SUBS]) {
    __m256 rows[2][2 * SUBS]; /* [half][...], row order */
    for (int h = 0; h < 2; h++)
        q4_k_tiled_scales(t, h, _mm256_cvtph_ps(tiled_words(t, 0, h)),
                          _mm256_cvtph_ps(tiled_words(t, 1, h)), rows[h], rows[h] + SUBS);
    for (int v = 0; v < 2 * SUBS; v++) {
        scale[0][v] = _mm256_permute2f128_ps(rows[0][v], rows[1][v], 0x20);
        scale[1][v] = _mm256_permute2f128_ps(rows[0][v], rows[1][v], 0x31);
    }
}

/* Q4_K, tiled: each row's weights 2j, 2j + 1, 2j + 16, 2j + 17 of sub-block `sub` (j < 8) as
 * bytes, in lo / hi lane order. Word 8 + 16 c + j of a super-block holds weights 2j, 2j + 1 of
 * sub-block 2c in its low nibbles and of 2c + 1 in its high ones (see tiled_k_micro_kernel), so
 * words j and j + 8 of the sub-block's chunk hold the four. */
SIMD_INLINE void q4_k_byte_words(const uint8_t *t, int sub, int j, __m256i w[2]) {
    const uint8_t *chunk = t + 32 * (8 + 16 * (sub / 2));
    const int shift = 4 * (sub % 2);
    const __m256i nibble = _mm256_set1_epi8(0x0f);
    const __m256i a = _mm256_and_si256(
        _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(chunk + 32 * j)), shift), nibble);
    const __m256i b = _mm256_and_si256(
        _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(chunk + 32 * (j + 8))), shift), nibble);
    w[0] = _mm256_unpacklo_epi16(a, b);
    w[1] = _mm256_unpackhi_epi16(a, b);
}

/* Q4_K against Q8 bytes, tiled: tiled_byte_kernel's products (q4_k_byte_words), one 32-weight
 * sub-block at a time in k order. The int16 bound is Q4_1's (nibbles 0..15); the fp32 steps are
 * tiled_k_micro_kernel's, with the scales in lo / hi lane order. */
SIMD_INLINE void q4_k_byte_kernel(const int MR, const int_ctx *c, int64_t m0, const uint8_t *group,
                                  float (*out)[TILE_ROWS]) {
    const int bb = block_bytes(FMT_Q4_K), quarter = TILE_ROWS * bb / 4;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MR_MAX][2]; /* [row][lo / hi] */
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < c->nb / SUBS; sb++) {
        const uint8_t *t = group + sb * TILE_ROWS * bb;
        const uint8_t *next = t + TILE_ROWS * c->row_bytes; /* as tiled_k_micro_kernel fetches */
        __m256 scale[2][2 * SUBS]; /* [lo / hi]: d sc of each sub-block, then -(dmin m) */
        q4_k_lo_hi_scales(t, scale);
        const int8_t *xb[MR_MAX];
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) xb[i] = (const int8_t *)c->q + (m0 + i) * c->kp + sb * QK_K;
#pragma GCC unroll 1
        for (int sub = 0; sub < SUBS; sub++) {
            if (sub % 2 == 0)
                for (int line = 0; line < quarter; line += 64) __builtin_prefetch(next + sub / 2 * quarter + line);
            __m256i s16[MR_MAX][2];
#pragma GCC unroll 8
            for (int i = 0; i < MR; i++) s16[i][0] = s16[i][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int j = 0; j < 8; j++) {
                __m256i w[2];
                q4_k_byte_words(t, sub, j, w);
#pragma GCC unroll 8
                for (int i = 0; i < MR; i++) {
                    int32_t quad;
                    memcpy(&quad, xb[i] + QK * sub + 4 * j, sizeof quad);
                    const __m256i xq = _mm256_set1_epi32(quad);
                    for (int h = 0; h < 2; h++)
                        s16[i][h] = _mm256_add_epi16(s16[i][h], _mm256_maddubs_epi16(w[h], xq));
                }
            }
#pragma GCC unroll 8
            for (int i = 0; i < MR; i++) {
                const int64_t at = (m0 + i) * c->nb + sb * SUBS + sub;
                const __m256 dx = _mm256_set1_ps(c->d[at]), sx = _mm256_set1_ps(c->s[at]);
                for (int h = 0; h < 2; h++) {
                    const __m256 is = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[i][h], ones));
                    __m256 v = _mm256_mul_ps(_mm256_mul_ps(scale[h][sub], dx), is);
                    v = _mm256_add_ps(v, _mm256_mul_ps(scale[h][SUBS + sub], sx));
                    acc[i][h] = _mm256_add_ps(acc[i][h], v);
                }
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) store_lo_hi(out[i], acc[i]);
}

/* Q6_K, tiled, against Q8 bytes (the many-rows kernel's): words j and j + 1 of a 16-weight
 * half (j even) put each row's weights 2j .. 2j + 3 side by side, in lo / hi lane order,
 * against the activations in their own k order. A VPMADDUBSW lane is at most 2 x 63 x 127 =
 * 16,002, so two quads add in int16 before VPMADDWD by ones widens them: a half's 16 weights
 * cost 4 VPMADDUBSW and 2 VPMADDWD per lo / hi vector against 8 VPMADDWD. */
SIMD_INLINE void q6_k_byte_quads(const uint8_t *t, int sub, int j, __m256i w[2]) {
    const __m256i a = q6_k_pair_bytes(t, sub, j), b = q6_k_pair_bytes(t, sub, j + 1);
    w[0] = _mm256_unpacklo_epi16(a, b);
    w[1] = _mm256_unpackhi_epi16(a, b);
}

/* Q4_K's super-block for the many-rows kernel against Q8 bytes: u->q[sub][j] (j < 8) as
 * q4_k_byte_words gives it, u->scale as q4_k_lo_hi_scales (both in lo / hi lane order). */
static void unpack_q4_k_bytes(const uint8_t *t, unpacked_super_block *u) {
    q4_k_lo_hi_scales(t, u->scale);
    for (int sub = 0; sub < SUBS; sub++)
        for (int j = 0; j < 8; j++) q4_k_byte_words(t, sub, j, u->q[sub][j]);
}

/* Q6_K's super-block for the many-rows kernel against Q8 bytes: u->q[sub][qd] (qd < 8) as
 * q6_k_byte_quads gives quad qd (weights 4 qd .. 4 qd + 3), u->scale[h][v] d sc of 16-weight
 * sub-block v (q6_k_pair_scales), in lo / hi lane order. */
static void unpack_q6_k_bytes(const uint8_t *t, unpacked_super_block *u) {
    __m256 d[2];
    lo_hi_f16(t, 104, d);
    for (int v = 0; v < 2 * SUBS; v++) {
        __m256 ds[2];
        q6_k_pair_scales(t, v, d, ds);
        u->scale[0][v] = ds[0];
        u->scale[1][v] = ds[1];
    }
    for (int sub = 0; sub < SUBS; sub++)
        for (int qd = 0; qd < 8; qd++) q6_k_byte_quads(t, sub, 2 * qd, u->q[sub][qd]);
}

/* MR rows' VPMADDUBSW sums over quads qd0 .. qd0 + n - 1 of block `sub` of an unpacked
 * super-block (bytes), from zero, in int16: s16[i][h] for lo / hi vector h. n within the
 * format's int16 bound (Q4_K 8, Q6_K 2). */
SIMD_INLINE void quads_int16(const int MR, const unpacked_super_block *u, int sub, int qd0,
                             const int n, const int8_t *const xb[MR_MAX], __m256i s16[MR_MAX][2]) {
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) s16[i][0] = s16[i][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int qd = qd0; qd < qd0 + n; qd++) {
        const __m256i w0 = u->q[sub][qd][0], w1 = u->q[sub][qd][1];
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            int32_t quad;
            memcpy(&quad, xb[i] + QK * sub + 4 * qd, sizeof quad);
            const __m256i xq = _mm256_set1_epi32(quad);
            s16[i][0] = _mm256_add_epi16(s16[i][0], _mm256_maddubs_epi16(w0, xq));
            s16[i][1] = _mm256_add_epi16(s16[i][1], _mm256_maddubs_epi16(w1, xq));
        }
    }
}

/* The many-rows kernels' fp32 step after part `part` of block blk (sub within its super-block)
 * for rows m0 .. m0 + MR - 1, from their int32 isums (both 8-lane vectors h), on the sums in
 * memory (acc) in k order: Q4_K acc + (d sc dx) isum + (-(dmin m)) s; Q6_K the first half's
 * d sc isum waits in first, the second's gives acc + (first + prod) dx. */
SIMD_INLINE void many_rows_step(const int MR, const int fmt, const int_ctx *c, int64_t m0,
                                int64_t blk, int sub, int part, const unpacked_super_block *u,
                                __m256i isum[MR_MAX][2], __m256 first[MR_MAX][2],
                                float (*acc)[TILE_ROWS]) {
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) {
        const int64_t at = (m0 + i) * c->nb + blk;
        const __m256 dx = _mm256_set1_ps(c->d[at]);
        for (int h = 0; h < 2; h++) {
            float *sums = acc[i] + 8 * h;
            const __m256 is = _mm256_cvtepi32_ps(isum[i][h]);
            if (fmt == FMT_Q4_K) {
                const __m256 v = _mm256_add_ps(
                    _mm256_mul_ps(_mm256_mul_ps(u->scale[h][sub], dx), is),
                    _mm256_mul_ps(u->scale[h][SUBS + sub], _mm256_set1_ps(c->s[at])));
                _mm256_storeu_ps(sums, _mm256_add_ps(_mm256_loadu_ps(sums), v));
            } else if (part == 0) {
                first[i][h] = _mm256_mul_ps(u->scale[h][2 * sub], is);
            } else { /* v = (da isa + db isb) dx, then acc + v */
                const __m256 prod = _mm256_mul_ps(u->scale[h][2 * sub + 1], is);
                const __m256 v = _mm256_mul_ps(_mm256_add_ps(first[i][h], prod), dx);
                _mm256_storeu_ps(sums, _mm256_add_ps(_mm256_loadu_ps(sums), v));
            }
        }
    }
}

/* MR activation rows from m0 against unpacked super-block sb of a group, both halves:
 * acc[i][r] += row m0 + i's blocks of sb, one at a time in k order (acc: the rows' fp32 sums,
 * 16 outputs each). Q4_K: one isum per block; Q6_K: one per half-block, each starting at -32
 * times its activations' sum (see tiled_k_micro_kernel). `bytes`: Q8 activation bytes against
 * unpack_q4_k_bytes' or unpack_q6_k_bytes' quads (the sums then in lo / hi lane order), the
 * integers of q4_k_byte_kernel and q6_k_byte_quads' products. Either way the fp32 steps are
 * many_rows_step's. Bytes, 2-core Zen 3, 24 widened layers from memory, best of 7, Q8 taken
 * as int16 -> as bytes: Q6_K 5 / 8 / 16 / 32 rows 0.82 / 0.81 / 0.78 / 0.78x the time (its
 * 2-4 rows as bytes, here or in a few-row kernel, ran 0.93-1.34x: not taken). */
SIMD_INLINE void many_rows_kernel(const int MR, const int fmt, const int bytes, const int_ctx *c,
                                  int64_t m0, int64_t sb, const unpacked_super_block *u,
                                  float (*acc)[TILE_ROWS]) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int16_t *x[MR_MAX];
    const int8_t *xb[MR_MAX];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) {
        x[i] = (const int16_t *)c->q + (m0 + i) * c->kp + sb * QK_K;
        xb[i] = (const int8_t *)c->q + (m0 + i) * c->kp + sb * QK_K;
    }
    /* int16 pairs per part: Q4_K all 16 of a block, Q6_K 8 (a half-block); bytes: Q4_K a block's
     * eight quads summed in int16 at once, Q6_K a half's four, two at a time */
    const int parts = fmt == FMT_Q6_K ? 2 : 1, pair_count = 16 / parts, quads = 8 / parts;
    const int in_int16 = fmt == FMT_Q6_K ? 2 : 8;
#pragma GCC unroll 1
    for (int sub = 0; sub < SUBS; sub++) {
        const int64_t blk = sb * SUBS + sub;
        __m256 first[MR_MAX][2]; /* Q6_K: da isa, the block's first half */
#pragma GCC unroll 2
        for (int part = 0; part < parts; part++) {
            __m256i isum[MR_MAX][2];
#pragma GCC unroll 8
            for (int i = 0; i < MR; i++) {
                const __m256i start =
                    fmt == FMT_Q6_K ? _mm256_set1_epi32(-32 * c->sum16[2 * ((m0 + i) * c->nb + blk) + part])
                                    : _mm256_setzero_si256();
                isum[i][0] = isum[i][1] = start;
            }
            if (bytes) {
#pragma GCC unroll 2
                for (int qd0 = quads * part; qd0 < quads * (part + 1); qd0 += in_int16) {
                    __m256i s16[MR_MAX][2];
                    quads_int16(MR, u, sub, qd0, in_int16, xb, s16);
#pragma GCC unroll 8
                    for (int i = 0; i < MR; i++)
                        for (int h = 0; h < 2; h++)
                            isum[i][h] = _mm256_add_epi32(isum[i][h], _mm256_madd_epi16(s16[i][h], ones));
                }
            } else {
#pragma GCC unroll 4
                for (int j = pair_count * part; j < pair_count * (part + 1); j++) {
                    const __m256i q0 = u->q[sub][j][0], q1 = u->q[sub][j][1];
#pragma GCC unroll 8
                    for (int i = 0; i < MR; i++) {
                        const __m256i xp = pair_at(x[i] + QK * sub + 2 * j);
                        isum[i][0] = pair_dot(isum[i][0], q0, xp);
                        isum[i][1] = pair_dot(isum[i][1], q1, xp);
                    }
                }
            }
            many_rows_step(MR, fmt, c, m0, blk, sub, part, u, isum, first, acc);
        }
    }
}

/* Activation rows per pass over a group's super-blocks (their fp32 sums on the stack), and per
 * chunk of a pass: 3 rows keep 6 isums, two weight vectors and the activation pairs in
 * registers; 4-6 spilled (2-core Zen 3, 24 widened layers of Q6_K at 16 rows, best of 7:
 * 3 rows 87.5 ms, 4 rows 108.8, 6 rows 113.8). */
#define MANY_ROWS_BATCH 64
#define MANY_ROWS_MR 3

/* From how many activation rows a format runs here rather than in tiled_k_micro_kernel: where
 * unpacking once beat unpacking per chunk (2-core Zen 3, 24 widened layers, best of 15; the
 * row counts below run alike). */
static inline int many_rows_from(int fmt) { return fmt == FMT_Q6_K ? 5 : 8; }

#define MANY_ROWS_DISPATCH(FMT, BYTES)                                                   \
    switch (mr) {                                                                        \
        case 1: many_rows_kernel(1, FMT, BYTES, c, m0, sb, u, acc + (m0 - mb0)); break;  \
        case 2: many_rows_kernel(2, FMT, BYTES, c, m0, sb, u, acc + (m0 - mb0)); break;  \
        default: many_rows_kernel(MANY_ROWS_MR, FMT, BYTES, c, m0, sb, u, acc + (m0 - mb0)); break; \
    }

/* As run_tiles with tiled_tile, for the k-quants in the tiled order: per group and batch of
 * up to MANY_ROWS_BATCH rows, each super-block unpacked once, then every chunk of the batch's
 * rows (balanced, at most MANY_ROWS_MR each) against it. */
static void run_many_rows(const int_ctx *c, const void *bias, void *y, int y_bf16, int64_t M,
                          int num_threads) {
    const int64_t groups = c->N / TILE_ROWS, sbs = c->nb / SUBS;
    const int bb = block_bytes(c->fmt);
#pragma omp parallel num_threads(num_threads)
    {
        unpacked_super_block unpacked __attribute__((aligned(32)));
        unpacked_super_block *u = &unpacked;
        float acc[MANY_ROWS_BATCH][TILE_ROWS];
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *group = c->w + g * TILE_ROWS * c->row_bytes;
            for (int64_t mb0 = 0; mb0 < M; mb0 += MANY_ROWS_BATCH) {
                const int64_t mb = M - mb0 < MANY_ROWS_BATCH ? M - mb0 : MANY_ROWS_BATCH;
                memset(acc, 0, (size_t)mb * sizeof acc[0]); /* the batch's rows only */
                const int64_t chunks = (mb + MANY_ROWS_MR - 1) / MANY_ROWS_MR;
                for (int64_t sb = 0; sb < sbs; sb++) {
                    const uint8_t *t = group + sb * TILE_ROWS * bb;
                    if (c->wide) unpack_super_block(t, c->fmt, u);
                    else if (c->fmt == FMT_Q4_K) unpack_q4_k_bytes(t, u);
                    else unpack_q6_k_bytes(t, u);
                    /* the next super-block (the next group's first, after the last) */
                    for (int line = 0; line < TILE_ROWS * bb; line += 64)
                        __builtin_prefetch(t + TILE_ROWS * bb + line);
                    int64_t m0 = mb0;
                    for (int64_t k = 0; k < chunks; k++) {
                        const int64_t left = mb0 + mb - m0, parts = chunks - k;
                        const int mr = (int)((left + parts - 1) / parts);
                        if (!c->wide && c->fmt == FMT_Q4_K) MANY_ROWS_DISPATCH(FMT_Q4_K, 1)
                        else if (!c->wide) MANY_ROWS_DISPATCH(FMT_Q6_K, 1)
                        else if (c->fmt == FMT_Q4_K) MANY_ROWS_DISPATCH(FMT_Q4_K, 0)
                        else MANY_ROWS_DISPATCH(FMT_Q6_K, 0)
                        m0 += mr;
                    }
                }
                if (!c->wide) /* back in row order */
                    for (int64_t r = 0; r < mb; r++) {
                        const __m256 lo_hi[2] = {_mm256_loadu_ps(acc[r]), _mm256_loadu_ps(acc[r] + 8)};
                        store_lo_hi(acc[r], lo_hi);
                    }
                store_rows((const float(*)[TILE_ROWS])acc, mb0, (int)mb, g * TILE_ROWS, TILE_ROWS,
                           bias, y, y_bf16, c->N);
            }
        }
    }
}
#endif

/* Both halves of the group at once, at most 3 rows a pass: 4, 5 and 6 rows run as 2 + 2,
 * 3 + 2 and 3 + 3 (the group's blocks unpacked twice, each activation broadcast feeding both
 * halves) rather than one half at a time. 2-core Zen 3, 24 widened layers, best of 11, ms
 * before -> after: Q4_1 4 / 5 / 8 / 16 / 32 rows 18.1 -> 16.9, 20.5 -> 19.1, 34.3 -> 31.8,
 * 65.5 -> 59.5, 129.4 -> 118.4; Q8_0 29.2 -> 27.4, 29.4 -> 25.2, 47.3 -> 43.5, 69.6 -> 62.6,
 * 169.9 -> 145.3; Q4_0 alike; the same bits. */
/* mr rows (up to MR_MAX) as passes of at most 3: PASS(MR, FMT, M0, OUT) each. */
#define PASSES_OF_3(PASS, FMT)                                                          \
    switch (mr) {                                                                       \
        case 1: PASS(1, FMT, m0, out); break;                                           \
        case 2: PASS(2, FMT, m0, out); break;                                           \
        case 3: PASS(3, FMT, m0, out); break;                                           \
        case 4: PASS(2, FMT, m0, out); PASS(2, FMT, m0 + 2, out + 2); break;            \
        case 5: PASS(3, FMT, m0, out); PASS(2, FMT, m0 + 3, out + 3); break;            \
        default: PASS(3, FMT, m0, out); PASS(3, FMT, m0 + 3, out + 3); break;           \
    }
#define TILED_PASS(MR, FMT, M0, OUT) tiled_micro_kernel(MR, 2, 0, FMT, c, M0, group, OUT)
#define TILED_DISPATCH_MR(FMT) PASSES_OF_3(TILED_PASS, FMT)
/* The byte kernels (AVX2) the same way: at most 3 rows a pass, the register budget of
 * tiled_micro_kernel's passes. */
#define TILED_BYTE_PASS(MR, FMT, M0, OUT) tiled_byte_kernel(MR, FMT, c, M0, group, OUT)
#define Q4_K_BYTE_PASS(MR, FMT, M0, OUT) q4_k_byte_kernel(MR, c, M0, group, OUT)

#if defined(SPECSERVE_ISA_AVX512) || defined(SPECSERVE_ISA_AVX2)
#define TILED_K tiled_k_micro_kernel
#else
#define TILED_K tiled_micro_kernel
#endif
/* k-quants: one row both halves at once; more, one half at a time (Q4_K: two isums per row
 * and half stay live in the j loop). Q6_K's one isum per row and half leaves registers for two
 * rows' both halves: 2 rows 7% faster (first-generation Zen), 5 rows 6% slower. Q4_K's 4, 5
 * and 6 rows run as 2 + 2, 3 + 2 and 3 + 3 (the group's blocks unpacked twice): with 8-12
 * isums and 4-6 sums live the kernel spilled. 2-core Zen 3, 24 widened layers, best of 11-15,
 * ms before -> after: 4 rows 24.1 -> 21.1, 5 rows 30.1 -> 26.6, 6 rows 36.6 -> 29.7, 8 rows
 * 47.8 -> 41.7, 16 rows 93.2 -> 78.0, 32 rows 174.2 -> 144.5, the same bits; Q6_K split so
 * ran 10-13% slower. */
#define TILED_K_HALVES(MR, FMT, M0, OUT) \
    for (int h = 0; h < 2; h++) TILED_K(MR, 1, h, FMT, c, M0, group, OUT)
/* MR rows: Q4_K as FIRST rows, then the rest; other formats in one pass. */
#define TILED_K_ROWS(MR, FIRST, FMT)                                                    \
    if (FMT == FMT_Q4_K) {                                                              \
        TILED_K_HALVES(FIRST, FMT, m0, out);                                            \
        TILED_K_HALVES(MR - FIRST, FMT, m0 + FIRST, out + FIRST);                       \
    } else {                                                                            \
        TILED_K_HALVES(MR, FMT, m0, out);                                               \
    }
#if !defined(SPECSERVE_ISA_AVX2)
#define Q6_K_PAIRS(FMT)
#endif
#define TILED_K_DISPATCH_MR(FMT)                                                        \
    Q6_K_PAIRS(FMT)                                                                     \
    switch (mr) {                                                                       \
        case 1: TILED_K(1, 2, 0, FMT, c, m0, group, out); break;                        \
        case 2:                                                                         \
            if (FMT == FMT_Q6_K) TILED_K(2, 2, 0, FMT, c, m0, group, out);              \
            else TILED_K_HALVES(2, FMT, m0, out);                                       \
            break;                                                                      \
        case 3: TILED_K_HALVES(3, FMT, m0, out); break;                                 \
        case 4: TILED_K_ROWS(4, 2, FMT) break;                                          \
        case 5: TILED_K_ROWS(5, 3, FMT) break;                                          \
        default: TILED_K_ROWS(6, 3, FMT) break;                                         \
    }

static void tiled_tile(const void *ctx, int64_t m0, int mr, int64_t n0, int nr,
                       float out[MR_MAX][TILE_ROWS]) {
    (void)nr; /* always TILE_ROWS: the order needs N % TILE_ROWS == 0 */
    const int_ctx *c = ctx;
    const uint8_t *group = c->w + n0 * c->row_bytes;
#if defined(SPECSERVE_ISA_AVX512)
    switch (c->fmt) {
        case FMT_Q8_0: GROUP_DISPATCH_MR(group_int16_kernel, FMT_Q8_0) break;
        case FMT_Q4_0:
            if (c->wide) GROUP_DISPATCH_MR(group_int16_kernel, FMT_Q4_0)
            else GROUP_DISPATCH_MR(group_byte_kernel, FMT_Q4_0)
            break;
        case FMT_Q4_1:
            if (c->wide) GROUP_DISPATCH_MR(group_int16_kernel, FMT_Q4_1)
            else GROUP_DISPATCH_MR(group_byte_kernel, FMT_Q4_1)
            break;
        case FMT_Q4_K: GROUP_DISPATCH_MR(group_k_micro_kernel, FMT_Q4_K) break;
        default: GROUP_DISPATCH_MR(group_k_micro_kernel, FMT_Q6_K) break;
    }
#else
    switch (c->fmt) {
        case FMT_Q8_0: TILED_DISPATCH_MR(FMT_Q8_0) break;
#if defined(SPECSERVE_ISA_AVX2)
        case FMT_Q4_0:
            if (c->wide) TILED_DISPATCH_MR(FMT_Q4_0)
            else PASSES_OF_3(TILED_BYTE_PASS, FMT_Q4_0)
            break;
        case FMT_Q4_1:
            if (c->wide) TILED_DISPATCH_MR(FMT_Q4_1)
            else PASSES_OF_3(TILED_BYTE_PASS, FMT_Q4_1)
            break;
        case FMT_Q4_K:
            if (c->wide) TILED_K_DISPATCH_MR(FMT_Q4_K)
            else PASSES_OF_3(Q4_K_BYTE_PASS, FMT_Q4_K)
            break;
#else
        case FMT_Q4_0: TILED_DISPATCH_MR(FMT_Q4_0) break;
        case FMT_Q4_1: TILED_DISPATCH_MR(FMT_Q4_1) break;
        case FMT_Q4_K: TILED_K_DISPATCH_MR(FMT_Q4_K) break;
#endif
        default: TILED_K_DISPATCH_MR(FMT_Q6_K) break;
    }
#endif
}

static void int_tile(const void *ctx, int64_t m0, int mr, int64_t n0, int nr,
                     float out[MR_MAX][TILE_ROWS]) {
    const int_ctx *c = ctx;
    const tile_rows ws = weight_rows(c->w, c->group, n0, c->N, c->row_bytes, block_bytes(c->fmt));
    switch (nr) {
        case 4: INT_DISPATCH(4) break;
        case 3: INT_DISPATCH(3) break;
        case 2: INT_DISPATCH(2) break;
        default: INT_DISPATCH(1) break;
    }
}

/* As quant_matmul, with the activations quantized to integer blocks of act bits (ACT_Q8 or
 * ACT_Q16, see the header); group may also be TILE_ROWS (the tiled order) when N is a
 * multiple of it. Returns 0, -1 when the activation buffers cannot be allocated, -2 for another
 * act, -3 for another group, or -4 for a k-quant whose K is not whole super-blocks (nothing
 * written in any case). */
int quant_matmul_int(const void *x, int x_bf16, const uint8_t *w, int fmt, int group,
                     const void *bias, void *y, int y_bf16, int64_t M, int64_t N, int64_t K,
                     int act, int num_threads) {
    if (act != ACT_Q8 && act != ACT_Q16) return -2;
    if (group != 1 && group != ROW_GROUP && !(group == TILE_ROWS && N % TILE_ROWS == 0)) return -3;
    if (is_k_quant(fmt) && K % QK_K) return -4;
    /* int16 activations for Q16, and for Q8 where the kernel multiplies int16 pairs: the tiled
     * order and the k-quants (whose blocks are widened to int16 in every order) */
#if defined(SPECSERVE_ISA_AVX512)
    /* except Q4_0 / Q4_1 in the tiled order: bytes, for group_byte_kernel */
    const int byte_quads = act == ACT_Q8 && group == TILE_ROWS && (fmt == FMT_Q4_0 || fmt == FMT_Q4_1);
#elif defined(SPECSERVE_ISA_AVX2)
    /* except Q4_0 / Q4_1 and the k-quants in the tiled order: bytes, for tiled_byte_kernel,
     * q4_k_byte_kernel (from 2 rows: one row of Q4_K runs faster as int16) and the many-rows
     * kernel (Q6_K from its threshold: below it the int16 kernels beat bytes); the same integers
     * either way */
    const int byte_quads = act == ACT_Q8 && group == TILE_ROWS &&
                           (fmt == FMT_Q4_0 || fmt == FMT_Q4_1 || (fmt == FMT_Q4_K && M > 1) ||
                            (fmt == FMT_Q6_K && M >= many_rows_from(fmt)));
#else
    const int byte_quads = 0;
#endif
    const int wide = act == ACT_Q16 || ((group == TILE_ROWS || is_k_quant(fmt)) && !byte_quads);
    const int q_width = wide ? 2 : 1;
    const int64_t nb = (K + QK - 1) / QK, kp = nb * QK, row_bytes = row_bytes_of(fmt, nb);
    /* One allocation: q [M, kp] int8 or int16, then d, s [M, nb] fp32, sum [M, nb] and
     * sum16 [M, 2 nb] int32, then one fp32 row of scratch; every part starts 64-byte aligned. */
    const size_t q_bytes = (size_t)((M * kp * q_width + 63) / 64 * 64);
    const size_t part = (size_t)((M * nb * 4 + 63) / 64 * 64);
    const size_t row = (size_t)((kp * 4 + 63) / 64 * 64);
    uint8_t *buf = aligned_alloc(64, q_bytes + 5 * part + row);
    if (!buf) return -1;
    float *d = (float *)(buf + q_bytes), *s = (float *)(buf + q_bytes + part);
    int32_t *sum = (int32_t *)(buf + q_bytes + 2 * part);
    int32_t *sum16 = (int32_t *)(buf + q_bytes + 3 * part);
    float *xf = (float *)(buf + q_bytes + 5 * part);
    const int halves = fmt == FMT_Q6_K && group == TILE_ROWS; /* the tiled Q6_K kernel's sums */
    for (int64_t i = 0; i < M; i++) {
        row_to_f32(x, x_bf16, i, K, kp, xf);
        quantize_row(xf, nb, act, wide, buf + i * kp * q_width, d + i * nb, s + i * nb,
                     sum + i * nb);
        if (byte_quads && fmt != FMT_Q6_K) nibble_order((int8_t *)buf + i * kp, nb);
        if (!halves) continue;
        for (int64_t h = 0; h < 2 * nb; h++) {
            int32_t total = 0;
            for (int j = 0; j < QK / 2; j++)
                total += wide ? ((const int16_t *)buf)[i * kp + h * (QK / 2) + j]
                              : ((const int8_t *)buf)[i * kp + h * (QK / 2) + j];
            sum16[i * 2 * nb + h] = total;
        }
    }
    const int_ctx ctx = {buf, d, s, sum, sum16, w, fmt, act, group, wide, N, kp, row_bytes, nb};
#if defined(SPECSERVE_ISA_AVX2)
    if (group == TILE_ROWS && is_k_quant(fmt) && M >= many_rows_from(fmt))
        run_many_rows(&ctx, bias, y, y_bf16, M, num_threads);
    else
#endif
    if (group == TILE_ROWS) run_tiles(tiled_tile, &ctx, TILE_ROWS, bias, y, y_bf16, M, N, num_threads);
    else run_tiles(int_tile, &ctx, 4, bias, y, y_bf16, M, N, num_threads);
    free(buf);
    return 0;
}
