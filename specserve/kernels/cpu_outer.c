/* bf16 GEMM for many rows (prompt chunks, large batches) as outer products: each output is one
 * fp32 multiply-add chain over k in order, in one vector lane.
 *
 * y[m, n] = sum_k x[m, k] * w[n, k]   (x [M, K] bf16, w [N, K] bf16 row-major, y [M, N])
 *
 * The blocked GEMM (cpu_gemm.c) sums each output in the matrix-vector kernel's order (a dot
 * step of DOT_K values, even and odd lanes apart), which keeps a row's bits the same at every
 * row count but leaves AVX2's 16 registers for six outputs of one row: 13 loads per 12 FMAs,
 * about 70% of the FMA ceiling at 512 rows. Here a register tile is OUTER_MR rows x OUTER_NR
 * outputs: per k, OUTER_MR activations broadcast against two vectors of OUTER_NR / 2 weights,
 * 2 + OUTER_MR loads per 2 x OUTER_MR FMAs (on AVX2 8 per 12). The weights are widened to fp32
 * and transposed into panels of OUTER_NR rows by KC_STEPS values of k (pack_w, in L1 for a
 * block's row tiles), the activations into panels of OUTER_MR rows (pack_x, once per call).
 *
 * The summation order differs from the matrix-vector kernel's, so cpu_linear.py hands a
 * product here only past the rows every path keeps row-count invariant (INVARIANT_ROWS), as
 * amx and avx512 hand theirs to F.linear. Among themselves rows here are invariant: an output
 * is the same chain from 0 whatever M, the blocking and the thread count.
 *
 * Built and loaded by cpu_build.py; its PyTorch reference is F.linear in fp32.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_dot_order.h"
#include "cpu_kernels.h"
#include "cpu_simd.h"

#define OUTER_MR 6
#define OUTER_NR (2 * VF)
#define KC_STEPS 256 /* k values per weight panel: OUTER_NR x KC_STEPS fp32 in L1 (16 KB on AVX2) */
#define NC_TILES 8   /* weight row tiles per block: their panels stay in L2 for the block's rows */
#define MC_TILES 8   /* activation row tiles per pass over a block's weight tiles */
#define PARALLEL_MIN_MACS (1 << 18)
/* Rows per pass: their activation panels (CHUNK_ROWS x K fp32, 6 MB at K = 4096) stay in L3
 * while every weight block streams past them. */
#define CHUNK_ROWS 384

/* Activation rows [t * OUTER_MR, + OUTER_MR) as the fp32 panel xp[t][k][OUTER_MR] for every k;
 * rows past M are zero (their outputs are never stored). */
static void pack_x(const uint16_t *x, int64_t M, int64_t K, int64_t t, float *xp) {
    float *panel = xp + t * K * OUTER_MR;
    for (int i = 0; i < OUTER_MR; i++) {
        const int64_t m = t * OUTER_MR + i;
        for (int64_t k = 0; k < K; k++)
            panel[k * OUTER_MR + i] = m < M ? bf16_to_f32(x[m * K + k]) : 0.f;
    }
}

/* Weight rows of the tile from row n0 that exist (the last tile of N may be ragged). */
static inline int tile_rows(int64_t N, int64_t n0) {
    return N - n0 < OUTER_NR ? (int)(N - n0) : OUTER_NR;
}

#if defined(SPECSERVE_ISA_AVX2)
/* r[i][j] -> r[j][i]: rows of 8 values to columns. */
SIMD_INLINE void transpose_8x8(__m256 r[8]) {
    __m256 a[8], b[8];
    for (int i = 0; i < 8; i += 2) {
        a[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);     /* r_i0 r_(i+1)0 r_i1 r_(i+1)1 | ..4 ..5 */
        a[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]); /* .. 2 .. 3 | .. 6 .. 7 */
    }
    for (int i = 0; i < 8; i += 4)
        for (int h = 0; h < 2; h++) {
            b[i + 2 * h] = _mm256_shuffle_ps(a[i + h], a[i + 2 + h], 0x44);
            b[i + 2 * h + 1] = _mm256_shuffle_ps(a[i + h], a[i + 2 + h], 0xEE);
        }
    for (int j = 0; j < 4; j++) {
        r[j] = _mm256_permute2f128_ps(b[j], b[j + 4], 0x20);
        r[j + 4] = _mm256_permute2f128_ps(b[j], b[j + 4], 0x31);
    }
}
#endif

/* Weight rows [n0, n0 + nr) at k in [k0, k1) as wp[k - k0][OUTER_NR] fp32; rows past nr zero. */
static void pack_w(const uint16_t *w, int64_t K, int64_t n0, int nr, int64_t k0, int64_t k1,
                   float *wp) {
    int64_t k = k0;
#if defined(SPECSERVE_ISA_AVX2)
    /* 8 rows x 8 values at a time: widened (exact), transposed in registers, stored by k */
    if (nr == OUTER_NR)
        for (; k + 8 <= k1; k += 8)
            for (int h = 0; h < 2; h++) {
                __m256 r[8];
                for (int i = 0; i < 8; i++) {
                    const uint16_t *at = w + (n0 + 8 * h + i) * K + k;
                    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)at));
                    r[i] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                }
                transpose_8x8(r);
                for (int j = 0; j < 8; j++)
                    _mm256_storeu_ps(wp + (k - k0 + j) * OUTER_NR + 8 * h, r[j]);
            }
#endif
    for (; k < k1; k++)
        for (int r = 0; r < OUTER_NR; r++)
            wp[(k - k0) * OUTER_NR + r] = r < nr ? bf16_to_f32(w[(n0 + r) * K + k]) : 0.f;
}

/* c[i][j] (OUTER_MR x OUTER_NR fp32, row stride OUTER_NR) += sum over the panels' steps of
 * ap[k][i] * wp[k][j], k in order; from zero when `first`. The accumulators are named
 * variables: as an array GCC kept a copy of it on the stack, stored every step. */
SIMD_INLINE void micro_tile(const float *ap, const float *wp, int64_t steps, float *c, int first) {
#define OUTER_LOAD(i)                                                                 \
    vf c##i##a = first ? vf_zero() : vf_load(c + (i) * OUTER_NR),                     \
       c##i##b = first ? vf_zero() : vf_load(c + (i) * OUTER_NR + VF);
    OUTER_LOAD(0) OUTER_LOAD(1) OUTER_LOAD(2) OUTER_LOAD(3) OUTER_LOAD(4) OUTER_LOAD(5)
    for (int64_t k = 0; k < steps; k++) {
        const vf w0 = vf_load(wp + k * OUTER_NR), w1 = vf_load(wp + k * OUTER_NR + VF);
        const float *a = ap + k * OUTER_MR;
#define OUTER_ROW(i)                                                                  \
    {                                                                                 \
        const vf xi = vf_set1(a[i]);                                                  \
        c##i##a = vf_fmadd(xi, w0, c##i##a);                                          \
        c##i##b = vf_fmadd(xi, w1, c##i##b);                                          \
    }
        OUTER_ROW(0) OUTER_ROW(1) OUTER_ROW(2) OUTER_ROW(3) OUTER_ROW(4) OUTER_ROW(5)
    }
#define OUTER_STORE(i)                                                                \
    vf_store(c + (i) * OUTER_NR, c##i##a);                                            \
    vf_store(c + (i) * OUTER_NR + VF, c##i##b);
    OUTER_STORE(0) OUTER_STORE(1) OUTER_STORE(2) OUTER_STORE(3) OUTER_STORE(4) OUTER_STORE(5)
#undef OUTER_LOAD
#undef OUTER_ROW
#undef OUTER_STORE
}

/* Rows [0, M) of outer_gemm_bf16 (at most CHUNK_ROWS). */
static int chunk_product(const uint16_t *x, const uint16_t *w, Output y, int64_t M, int64_t N,
                         int64_t K, int num_threads) {
    const int64_t mt = (M + OUTER_MR - 1) / OUTER_MR, nt = (N + OUTER_NR - 1) / OUTER_NR;
    const int64_t blocks = (nt + NC_TILES - 1) / NC_TILES;
    float *xp = malloc((size_t)mt * K * OUTER_MR * sizeof(float));
    if (xp == NULL) return -1;
    int failed = 0;
    const int parallel = M * N * K >= PARALLEL_MIN_MACS;
#pragma omp parallel num_threads(num_threads) if (parallel)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < mt; t++) pack_x(x, M, K, t, xp);
        /* one block's weight panels, and its outputs' sums for every row (in L2) */
        float *wp = aligned_alloc(64, (size_t)NC_TILES * KC_STEPS * OUTER_NR * sizeof(float));
        float *sums =
            aligned_alloc(64, (size_t)NC_TILES * mt * OUTER_MR * OUTER_NR * sizeof(float));
        if (wp == NULL || sums == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            if (wp == NULL || sums == NULL) continue;
            const int64_t t0 = b * NC_TILES, t1 = nt - t0 < NC_TILES ? nt : t0 + NC_TILES;
            for (int64_t k0 = 0; k0 < K; k0 += KC_STEPS) {
                const int64_t k1 = K - k0 < KC_STEPS ? K : k0 + KC_STEPS;
                for (int64_t t = t0; t < t1; t++) {
                    const int64_t n0 = t * OUTER_NR;
                    pack_w(w, K, n0, tile_rows(N, n0), k0, k1, wp + (t - t0) * KC_STEPS * OUTER_NR);
                }
                for (int64_t m0 = 0; m0 < mt; m0 += MC_TILES) {
                    const int64_t m1 = mt - m0 < MC_TILES ? mt : m0 + MC_TILES;
                    for (int64_t t = t0; t < t1; t++)
                        for (int64_t m = m0; m < m1; m++)
                            micro_tile(xp + (m * K + k0) * OUTER_MR,
                                       wp + (t - t0) * KC_STEPS * OUTER_NR, k1 - k0,
                                       sums + ((t - t0) * mt + m) * OUTER_MR * OUTER_NR, k0 == 0);
                }
            }
            for (int64_t t = t0; t < t1; t++) {
                const int64_t n0 = t * OUTER_NR;
                const int nr = tile_rows(N, n0);
                const float *tile_sums = sums + (t - t0) * mt * OUTER_MR * OUTER_NR;
                for (int64_t m = 0; m < M; m++)
                    for (int r = 0; r < nr; r++)
                        store(y, m * N + n0 + r, n0 + r, tile_sums[m * OUTER_NR + r]);
            }
        }
        free(wp);
        free(sums);
    }
    free(xp);
    return failed ? -1 : 0;
}

/* y_f32 or y_bf16 (the other NULL) [M, N]; bias [N] bf16 or NULL. Returns 0, or -1 when a
 * buffer could not be allocated. */
int outer_gemm_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, float *y_f32,
                    uint16_t *y_bf16, int64_t M, int64_t N, int64_t K, int num_threads) {
    const Output y = {y_f32, y_bf16, bias};
    for (int64_t m0 = 0; m0 < M; m0 += CHUNK_ROWS) {
        const int64_t rows = M - m0 < CHUNK_ROWS ? M - m0 : CHUNK_ROWS;
        if (chunk_product(x + m0 * K, w, output_at(y, m0 * N, 0), rows, N, K, num_threads) != 0)
            return -1;
    }
    return 0;
}
