/* Blocked bf16 GEMM on CPU for prompt chunks (many activation rows): the same products and
 * the same summation order as cpu_gemv.c (cpu_dot_order.h), blocked for caches instead of
 * for reading the weights once.
 *
 * y[m, n] = sum_k x[m, k] * w[n, k]   (x [M, K] bf16, w [N, K] bf16 row-major, y [M, N])
 *
 * Threads split w into tiles of GEMM_NR rows. A thread packs its tile one K-block at a time
 * (KC_BYTES of dot steps: on AVX2 bf16 widened to fp32 even/odd lanes, once per tile and
 * block instead of once per activation row), so the packed block stays in L1 while every
 * activation row streams past it, TILE_MR rows against TILE_NR weight rows at a time with
 * their accumulators in registers, one of an output's DOT_U at a time (on AVX2 one row's dot
 * step feeds six outputs). Across K-blocks a row's accumulators wait in a per-thread buffer
 * ([M][GEMM_NR][DOT_U] dot_acc, in L2); after the last block each tile's outputs are summed
 * and stored at once. While the rows compute against one block, the lines the next pack reads
 * are fetched (Lookahead). The widened model's products, Zen 5, 2 threads, ms before -> after
 * at 16 / 32 rows: AVX-512 17.8 -> 14.5 / 25.9 -> 22.7, AVX2 39.6 -> 31.0 / 64.6 -> 54.6,
 * 512 rows unchanged (Lookahead); AVX-512 12.6 -> 11.4 / 20.5 -> 16.7, AVX2 unchanged (28.4
 * -> 28.5 / 50.8 -> 51.2), 512 rows no slower (the 4 x 6 tile, the vector sums, the
 * fetch without a divide; fastest of 11-15 per product, the CPU shared with other work). AVX2,
 * 2-core Zen 3, the widened model's products at 512 rows, one thread: 52-65 GFLOP/s where the
 * matrix-vector kernel ran 42-49 and torch's fp32 GEMM (weights already fp32) 55-68, side by
 * side under the same load.
 *
 * Why dot steps and not an outer-product micro-kernel (broadcast x, vectors over n): each
 * output is summed exactly as the matrix-vector kernel sums it, so a row gives bit-identical
 * results through either kernel, alone or among any number of rows (row-count invariance
 * across the row threshold where cpu_linear.py switches kernels).
 *
 * Built and loaded by cpu_build.py; its PyTorch reference is F.linear in fp32.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_amx.h"
#include "cpu_dot_order.h"
#include "cpu_kernels.h"
#include "cpu_simd.h"

/* Register tile: TILE_MR activation rows x TILE_NR weight rows, TILE_MR x TILE_NR accumulators
 * (one of each output's DOT_U at a time) plus the tile's activation steps in registers.
 * AVX-512: 24 + 4 + 1 of 32 zmm, 10 loads per 24 multiply-adds (the 2 x 4 tile with both
 * accumulators of each output, 16 + 2, loaded 6 per 8); from L1 the loop issues 2 VDPBF16PS a
 * cycle on Zen 5, and GEMM_NR 6 ran 5-12% faster than 12 (x reloaded once per tile).
 * AVX2: 12 + 2 of 16 ymm, weight steps as memory operands, 13 loads per 12 multiply-adds; a
 * 2 x 2 tile with its weight steps pinned in registers, 6 loads per 8, ran 15-25% slower: 8
 * accumulators barely cover the multiply-add latency. A packed block is GEMM_NR weight rows. */
#if defined(SPECSERVE_ISA_AVX512)
#define TILE_MR 4
#define TILE_NR 6
#define GEMM_NR 6
#elif defined(SPECSERVE_ISA_AVX2)
#define TILE_MR 1
#define TILE_NR 6
#define GEMM_NR 6
#else
#define TILE_MR 1
#define TILE_NR 2
#define GEMM_NR 4
#endif
#define KC_BYTES (24 * 1024) /* one packed K-block of GEMM_NR rows: L1 beside the x stream */
#define PARALLEL_MIN_MACS (1 << 18)

/* One K-block of a thread's tile of GEMM_NR weight rows, and where the tile's outputs go. */
typedef struct {
    const uint16_t *x; /* activations [M, K] */
    int64_t K, s0, s1; /* the block's steps [s0, s1); s0 is a multiple of DOT_U */
    int64_t main_steps;
    int last;          /* the tile's last K-block: its outputs are then complete */
    Output y;          /* at the tile's first column */
    int64_t N;         /* y's row stride */
    int nr;            /* weight rows of the tile that exist (the rest are zero padding) */
} Block;

/* Register tile sums, rounded up to whole vectors for vf_reduce_add_each. */
#define TILE_SUMS ((TILE_MR * TILE_NR + VF - 1) / VF * VF)

/* sums[i * TILE_NR + r] = dot_total(acc[m + i][c + r]), rows [m, m + MR): the accumulators
 * added in order, then dot_sum's reduction VF outputs at a time. */
static inline __attribute__((always_inline)) void tile_sums(
    const int MR, dot_acc (*acc)[GEMM_NR][DOT_U], int64_t m, int c, float sums[TILE_SUMS]) {
    vf t[TILE_SUMS];
    for (int k = MR * TILE_NR; k < TILE_SUMS; k++) t[k] = vf_zero();
    for (int i = 0; i < MR; i++)
        for (int r = 0; r < TILE_NR; r++)
            t[i * TILE_NR + r] = dot_collapse(dot_merged(acc[m + i][c + r]));
    for (int k = 0; k < MR * TILE_NR; k += VF) vf_reduce_add_each(t + k, sums + k);
}

/* Rows [m, m + MR) against weight rows [c, c + TILE_NR) of the packed block (wp
 * [s1 - s0][GEMM_NR]); acc[m + i][c + r] the accumulators of row m + i and weight row c + r.
 * One accumulator at a time: its steps (every DOT_U-th) in order, so a tile needs TILE_MR x
 * TILE_NR registers, not DOT_U times that; accumulator 0 last, then the leftover steps and the
 * tail. The first block starts from zero; after the last, the outputs are summed and stored
 * while their accumulators are in L1. */
static inline __attribute__((always_inline)) void tile(
    const int MR, const Block *b, int64_t m, const dot_vec *wp, int c,
    dot_acc (*acc)[GEMM_NR][DOT_U]) {
    const int64_t K = b->K, s0 = b->s0, s1 = b->s1;
    const uint16_t *x = b->x + m * K;
    const int64_t round_end = s1 < b->main_steps ? s1 : b->main_steps;
    for (int u = DOT_U - 1; u >= 0; u--) {
        dot_acc a[TILE_MR][TILE_NR];
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
            for (int r = 0; r < TILE_NR; r++) a[i][r] = s0 == 0 ? dot_zero() : acc[m + i][c + r][u];
        int64_t s = s0 + u;
        for (; s < round_end; s += DOT_U) {
            dot_vec xv[TILE_MR];
#pragma GCC unroll 8
            for (int i = 0; i < MR; i++) xv[i] = dot_load(x + i * K + s * DOT_K);
            const dot_vec *ws = wp + (s - s0) * GEMM_NR + c;
#pragma GCC unroll 8
            for (int r = 0; r < TILE_NR; r++) {
                const dot_vec wv = ws[r];
#pragma GCC unroll 8
                for (int i = 0; i < MR; i++) a[i][r] = dot_step(a[i][r], xv[i], wv);
            }
        }
        if (u == 0)
            for (s = round_end > s0 ? round_end : s0; s < s1; s++) {
                dot_vec xv[TILE_MR];
#pragma GCC unroll 8
                for (int i = 0; i < MR; i++) xv[i] = dot_load_step(x + i * K, s, K);
                const dot_vec *ws = wp + (s - s0) * GEMM_NR + c;
#pragma GCC unroll 8
                for (int r = 0; r < TILE_NR; r++) {
                    const dot_vec wv = ws[r];
#pragma GCC unroll 8
                    for (int i = 0; i < MR; i++) a[i][r] = dot_step(a[i][r], xv[i], wv);
                }
            }
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
            for (int r = 0; r < TILE_NR; r++) acc[m + i][c + r][u] = a[i][r];
    }
    if (b->last) {
        float sums[TILE_SUMS];
        tile_sums(MR, acc, m, c, sums);
        for (int i = 0; i < MR; i++)
            for (int r = 0; r < TILE_NR && c + r < b->nr; r++)
                store(b->y, (m + i) * b->N + c + r, c + r, sums[i * TILE_NR + r]);
    }
}

/* The weight lines the next pack will read, fetched a share at a time while the rows compute
 * against the current block: pack() otherwise waits on memory with no arithmetic to overlap,
 * which at a few dozen rows (batched decode) is a third of the time. The non-temporal hint
 * (pack reads each line once) measured 1-5% faster than the L2 hint, AVX-512 and AVX2. */
typedef struct {
    const uint16_t *w; /* the next block's first row, at its first step, or NULL */
    int64_t row_elems; /* K: elements between rows */
    int rows;
    int64_t lines_per_row;
    int row;      /* the next line to fetch: row, line within it (counters: a 64-bit divide */
    int64_t line; /* and remainder per line were a fifth of a 4-row product from cache) */
} Lookahead;

static inline void fetch_ahead(Lookahead *a, int64_t lines) {
    for (; lines > 0 && a->row < a->rows; lines--) {
        __builtin_prefetch((const char *)(a->w + a->row * a->row_elems) + a->line * 64, 0, 0);
        if (++a->line == a->lines_per_row) {
            a->line = 0;
            a->row++;
        }
    }
}

/* Every activation row against one packed K-block: row groups of TILE_MR, each against the
 * block's TILE_NR-row tiles while its steps stay in L1, then the last rows in pairs (where
 * TILE_MR > 2) and one; the next block's weights are fetched a share per row group. */
static void block_rows(const Block *b, int64_t M, const dot_vec *wp,
                       dot_acc (*acc)[GEMM_NR][DOT_U], Lookahead *ahead) {
    const int64_t rest = M % TILE_MR;
    const int64_t groups = M / TILE_MR + (TILE_MR > 2 ? rest / 2 + rest % 2 : rest);
    const int64_t share = ahead->w ? (ahead->rows * ahead->lines_per_row + groups - 1) / groups : 0;
    int64_t m = 0;
    for (; m + TILE_MR <= M; m += TILE_MR) {
        fetch_ahead(ahead, share);
        for (int c = 0; c < GEMM_NR; c += TILE_NR) tile(TILE_MR, b, m, wp, c, acc);
    }
    for (; TILE_MR > 2 && m + 2 <= M; m += 2) {
        fetch_ahead(ahead, share);
        for (int c = 0; c < GEMM_NR; c += TILE_NR) tile(TILE_MR > 2 ? 2 : 1, b, m, wp, c, acc);
    }
    for (; m < M; m++) {
        fetch_ahead(ahead, share);
        for (int c = 0; c < GEMM_NR; c += TILE_NR) tile(1, b, m, wp, c, acc);
    }
}

/* Weight rows [n0, n0 + nr) as dot steps [s0, s1), interleaved by step: wp[(s - s0) * GEMM_NR
 * + r]; rows past nr (the ragged edge of w) are zero and their outputs never stored. */
static void pack(const uint16_t *w, int64_t K, int64_t n0, int nr, int64_t s0, int64_t s1,
                 dot_vec *wp) {
    for (int64_t s = s0; s < s1; s++)
        for (int r = 0; r < GEMM_NR; r++) {
            dot_vec *slot = wp + (s - s0) * GEMM_NR + r;
            if (r < nr) *slot = dot_load_step(w + (n0 + r) * K, s, K);
            else memset(slot, 0, sizeof *slot);
        }
}

/* y_f32 or y_bf16 (the other NULL) [M, N]; bias [N] bf16 or NULL. Returns 0, or -1 when a
 * thread's buffers could not be allocated. */
int gemm_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, float *y_f32,
              uint16_t *y_bf16, int64_t M, int64_t N, int64_t K, int num_threads) {
#if defined(SPECSERVE_AMX) /* tiles: a few rows cost what one does (cpu_amx.c) */
    return amx_product(x, w, bias, y_f32, y_bf16, M, N, K, num_threads);
#endif
    const Output y = {y_f32, y_bf16, bias};
    const int64_t steps = (K + DOT_K - 1) / DOT_K, main_steps = DOT_MAIN_STEPS(K);
    int64_t kc = KC_BYTES / (GEMM_NR * (int64_t)sizeof(dot_vec)) / DOT_U * DOT_U;
    if (kc >= steps) kc = steps;
    const int64_t tiles = (N + GEMM_NR - 1) / GEMM_NR;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (M * N * K >= PARALLEL_MIN_MACS)
    {
        dot_vec *wp = aligned_alloc(64, ((size_t)kc * GEMM_NR * sizeof(dot_vec) + 63) / 64 * 64);
        dot_acc(*acc)[GEMM_NR][DOT_U] = aligned_alloc(
            64, ((size_t)M * GEMM_NR * DOT_U * sizeof(dot_acc) + 63) / 64 * 64);
        if (wp == NULL || acc == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (wp == NULL || acc == NULL) continue;
            const int64_t n0 = t * GEMM_NR;
            const int nr = N - n0 < GEMM_NR ? (int)(N - n0) : GEMM_NR;
            Block b = {x, K, 0, 0, main_steps, 0, output_at(y, n0, n0), N, nr};
            for (int64_t s0 = 0; s0 < steps; s0 += kc) {
                const int64_t s1 = steps - s0 < kc ? steps : s0 + kc;
                pack(w, K, n0, nr, s0, s1, wp);
                /* next: this tile's next K-block, else the next tile's first (the static
                 * schedule gives a thread consecutive tiles) */
                const int64_t next_s0 = s1 < steps ? s1 : 0, next_n0 = s1 < steps ? n0 : n0 + GEMM_NR;
                const int64_t next_s1 = steps - next_s0 < kc ? steps : next_s0 + kc;
                const int64_t left = N - next_n0;
                Lookahead ahead = {NULL, K, 0, 0, 0, 0};
                if (left > 0) {
                    ahead.w = w + next_n0 * K + next_s0 * DOT_K;
                    ahead.rows = left < GEMM_NR ? (int)left : GEMM_NR;
                    const int64_t elems = (next_s1 - next_s0) * DOT_K;
                    ahead.lines_per_row = ((next_s1 < steps ? elems : K - next_s0 * DOT_K) *
                                           (int64_t)sizeof(uint16_t) + 63) / 64;
                }
                b.s0 = s0;
                b.s1 = s1;
                b.last = s1 == steps;
                block_rows(&b, M, wp, acc, &ahead);
            }
        }
        free(wp);
        free(acc);
    }
    return failed ? -1 : 0;
}
