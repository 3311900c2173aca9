/* bf16 matrix products on Intel AMX tiles: gemv_bf16 and gemm_bf16 on the `amx` path (the
 * AVX-512 BF16 build plus AMX-BF16; cpu_build.py defines SPECSERVE_AMX). Elsewhere this file
 * compiles to nothing.
 *
 * y[m, n] = sum_k x[m, k] * w[n, k]   (x [M, K] bf16, w [N, K] bf16 row-major, y [M, N])
 *
 * Why tiles for a few rows: VDPBF16PS issues one per two cycles on these cores, so with the
 * dot-step kernel (cpu_gemv.c) 5 activation rows cost 1.5x one row though both read the same
 * weights. One TDPBF16PS multiplies a 16 x 32 block of weights by up to 16 rows' 32 values in
 * about 16 cycles, far faster than memory delivers the block, so up to 16 rows cost about what
 * one does. 2-vCPU Xeon with AMX, the widened model's 96 products (weights in huge pages, best
 * of 15), 1 / 5 / 16 rows: avx512 24.1 / 35.6 / 73.6 ms, amx 24.3 / 25.3 / 28.0 ms.
 *
 * The product is computed transposed, y^T = w x^T, so the weights are the A tile and load
 * straight from their row-major rows (16 rows of 32 values, stride K), and the activations are
 * the B tile, whose rows are pairs of k and whose columns are activation rows: packed once per
 * call ([steps][16 pairs][cols][2] bf16 per block of up to 16 rows: a 16 x 16 transpose of
 * 32-bit pairs per step). The last block of M % 16 rows has tiles only that wide (no zero
 * columns to pack or multiply), and one row's packed form is the row itself, so a decode step
 * packs nothing. A thread owns groups of 16 weight rows; for each group it walks every K step
 * once against up to FULL_BLOCKS blocks of 16 rows and the narrow block (one C tile each), so
 * the weights are read once for up to 64 rows.
 * (Two groups at a time, or software prefetches of the weights into L1 or L2, ran slower.)
 * An A tile's 16 rows are 16 interleaved weight streams per thread, which the 2-vCPU Xeon reads
 * slower than one (plain loads of 716 MB on two threads: one stream each 31.0 GB/s, 16 each
 * 25.5), so one row costs more here than on the dot-step paths, which read one stream: 26.6
 * against 22.0 ms for the widened model's products on avx2. Weights stored in tile order would
 * be one stream; not done, as the prompt path (F.linear) reads them row-major. A C tile holds
 * 16 outputs of each activation row in a column: stored, then transposed back into one vector
 * per row (one load at one row) and written out a group late (reading a tile's memory right
 * after TILESTORED waits for the store; 16 scalar reads there cost 10% of a decode step's
 * products, a gather per row 3%).
 *
 * Row-count invariance: an output element is its C tile element, accumulated over the K steps
 * in order, each step summed inside TDPBF16PS the same way whatever the other rows of the tile
 * hold; so a row's results do not depend on M, its position in a block, the blocking or the
 * thread count, and gemv_bf16 and gemm_bf16 (both this kernel on this path) agree bit for bit.
 * TDPBF16PS treats bf16 subnormal inputs as zero and flushes subnormal results (the only other
 * difference from fp32 sums in some order).
 *
 * Off the tile grid (test shapes, not those of the supported model families): the last group
 * of N % 16 rows is copied into 16 zero-padded rows, and a K % 32 tail step multiplies
 * zero-padded copies of the group's tails and of the activations' (packed).
 */
#if defined(SPECSERVE_AMX)
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_amx.h"
#include "cpu_dot_order.h"
#include "cpu_simd.h"

#define GROUP_N 16    /* weight rows per A tile and C tile */
#define STEP_K 32     /* bf16 values per A tile row: one TDPBF16PS step */
#define STEP_PAIRS 16 /* B tile rows */
#define BLOCK_M 16    /* activation rows per full B tile (C tile columns) */
#define FULL_BLOCKS 3 /* full-width C tiles per pass, beside the narrow one */
#define PARALLEL_MIN_MACS (1 << 18)

/* Tiles: C for full blocks 0-2, C for the narrow block 3, A 4, full B 5, narrow B 6. GCC's tile
 * intrinsics paste their tile numbers into the instruction text unexpanded, so they are
 * literals here and the wrappers below let names expand first. */
#define C_NARROW 3
#define TILE_A 4
#define B_FULL 5
#define B_NARROW 6
#define TILE_LOAD(t, p, stride) _tile_loadd(t, p, stride)
#define TILE_DP(c, a, b) _tile_dpbf16ps(c, a, b)
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_STORE(t, p, stride) _tile_stored(t, p, stride)

/* The LDTILECFG operand (palette 1). */
typedef struct __attribute__((aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Every tile 16 rows; C and B tiles as wide as their block (narrow: `narrow` columns). */
static void configure_tiles(int narrow) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t <= B_NARROW; t++) {
        config.rows[t] = 16;
        config.colsb[t] = 4 * BLOCK_M;
    }
    if (narrow) config.colsb[C_NARROW] = config.colsb[B_NARROW] = (uint16_t)(4 * narrow);
    _tile_loadconfig(&config);
}

/* r[i][j] -> r[j][i] for a 16 x 16 matrix of 32-bit values, one row per register: pairs of
 * rows interleaved by 32 then 64 bits (4 x 4 blocks transposed inside each 128-bit lane), then
 * the 128-bit lanes transposed across each set of four registers. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    /* u[4g + c], 128-bit lane L: rows 4g .. 4g + 3 of column 4L + c. */
    __m512i u[16];
    for (int g = 0; g < 16; g += 4) {
        u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
        u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
        u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
        u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);  /* lanes 0, 1 of each */
        const __m512i v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);  /* lanes 2, 3 */
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
        const __m512i v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
        r[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);       /* lane 0 of all four */
        r[4 + c] = _mm512_shuffle_i32x4(v0, v2, 0xDD);   /* lane 1 */
        r[8 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);   /* lane 2 */
        r[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xDD);  /* lane 3 */
    }
}

/* Activations as B tiles. Block b (cols rows from 16b) at b * steps * 16 * 32 values, step s
 * at s * 16 * cols * 2 in it: [pair p][row i][element e] = x[16b + i, 32s + 2p + e], zero from
 * K on. */
typedef struct {
    const uint16_t *v;
    int64_t steps, full, narrow; /* full blocks of 16 rows; rows in the narrow block (0-15) */
} Packed;

static inline int64_t tile_offset(Packed x, int64_t b, int64_t s) {
    const int64_t cols = b < x.full ? BLOCK_M : x.narrow;
    return b * x.steps * STEP_K * BLOCK_M + s * STEP_K * cols;
}

static Packed pack_activations(const uint16_t *x, int64_t M, int64_t K) {
    static __thread uint16_t *buffer;
    static __thread int64_t capacity;
    const int64_t steps = (K + STEP_K - 1) / STEP_K;
    Packed p = {x, steps, M / BLOCK_M, M % BLOCK_M};
    if (M == 1 && K % STEP_K == 0) return p; /* [steps][16 pairs][1 row][2]: the row itself */
    const int64_t values = M * steps * STEP_K;
    if (values > capacity) {
        free(buffer);
        capacity = values;
        buffer = aligned_alloc(64, ((size_t)values * sizeof(uint16_t) + 63) / 64 * 64);
        if (buffer == NULL) {
            capacity = 0;
            p.v = NULL;
            return p;
        }
    }
    p.v = buffer;
    for (int64_t b = 0; b * BLOCK_M < M; b++) {
        const int64_t cols = b < p.full ? BLOCK_M : p.narrow;
        const __mmask16 store_mask = (__mmask16)((1u << cols) - 1u);
        for (int64_t s = 0; s < steps; s++) {
            const int64_t k0 = s * STEP_K, n = K - k0 < STEP_K ? K - k0 : STEP_K;
            const __mmask32 load_mask = (__mmask32)(n == STEP_K ? ~0u : (1u << n) - 1u);
            __m512i pairs[16]; /* [row][pair], zero past K and past the block's rows */
            for (int i = 0; i < 16; i++) {
                const uint16_t *row = x + (b * BLOCK_M + i) * K + k0;
                pairs[i] = i < cols ? _mm512_maskz_loadu_epi16(load_mask, row)
                                    : _mm512_setzero_si512();
            }
            transpose16(pairs); /* [pair][row] */
            uint16_t *tile = buffer + tile_offset(p, b, s); /* [16 pairs][cols][2] */
            for (int q = 0; q < STEP_PAIRS; q++)
                _mm512_mask_storeu_epi32(tile + q * cols * 2, store_mask, pairs[q]);
        }
    }
    return p;
}

/* A group's 16 weight rows: whole steps from `a` (row stride a_stride values), the K tail (if
 * any) from `tail` ([16][32], zero-padded). */
typedef struct {
    const uint16_t *a, *tail;
    int64_t a_stride, whole_steps;
} Group;

/* One step of block b into C tile C with B tile B. */
#define DP(C, B, b)                                                                        \
    do {                                                                                   \
        TILE_LOAD(B, x.v + tile_offset(x, b, s), (B) == B_FULL ? 4 * BLOCK_M : 4 * x.narrow); \
        TILE_DP(C, TILE_A, B);                                                             \
    } while (0)

/* The group against full blocks [b0, b0 + full) (full <= FULL_BLOCKS) and, if `narrow`, the
 * narrow block: C tiles stored to c[j][n][i] (j = 3 the narrow block). */
static void group_pass(Group g, Packed x, int64_t b0, int full, int narrow,
                       float c[FULL_BLOCKS + 1][GROUP_N][BLOCK_M]) {
    if (full > 0) TILE_ZERO(0);
    if (full > 1) TILE_ZERO(1);
    if (full > 2) TILE_ZERO(2);
    if (narrow) TILE_ZERO(C_NARROW);
    for (int64_t s = 0; s < x.steps; s++) {
        if (s < g.whole_steps)
            TILE_LOAD(TILE_A, g.a + s * STEP_K, g.a_stride * (int64_t)sizeof(uint16_t));
        else
            TILE_LOAD(TILE_A, g.tail, STEP_K * (int64_t)sizeof(uint16_t));
        if (full > 0) DP(0, B_FULL, b0);
        if (full > 1) DP(1, B_FULL, b0 + 1);
        if (full > 2) DP(2, B_FULL, b0 + 2);
        if (narrow) DP(C_NARROW, B_NARROW, x.full);
    }
    const int64_t row_bytes = BLOCK_M * sizeof(float); /* rows of a C tile stored back to back */
    if (full > 0) TILE_STORE(0, c[0], row_bytes);
    if (full > 1) TILE_STORE(1, c[1], row_bytes);
    if (full > 2) TILE_STORE(2, c[2], row_bytes);
    if (narrow) TILE_STORE(C_NARROW, c[C_NARROW], 4 * x.narrow);
}
#undef DP

/* Rows [m0, m0 + cols) of y for the group's nr weight rows from n0, from a C tile stored as
 * c[r * cols + i] (weight row n0 + r, activation row m0 + i). */
static void emit(Output y, const float *c, int64_t m0, int64_t cols, int64_t n0, int nr,
                 int64_t N) {
    if (nr < GROUP_N) {
        for (int r = 0; r < nr; r++)
            for (int64_t i = 0; i < cols; i++)
                store(y, (m0 + i) * N + n0 + r, n0 + r, c[r * cols + i]);
        return;
    }
    /* A row's 16 outputs are one vector (VF = 16): the tile's columns. */
    __m512i rows[16];
    if (cols == 1) {
        rows[0] = _mm512_loadu_si512(c);
    } else {
        const __mmask16 mask = (__mmask16)((1u << cols) - 1u);
        for (int r = 0; r < 16; r++) rows[r] = _mm512_maskz_loadu_epi32(mask, c + r * cols);
        transpose16(rows);
    }
    const vf bias = y.bias ? vf_load_bf16(y.bias + n0) : vf_zero();
    for (int64_t i = 0; i < cols; i++) {
        vf v = _mm512_castsi512_ps(rows[i]);
        if (y.bias) v = vf_add(v, bias); /* as store(): the bias in fp32, then one rounding */
        if (y.bf16) vf_store_bf16(y.bf16 + (m0 + i) * N + n0, v);
        else vf_store(y.f32 + (m0 + i) * N + n0, v);
    }
}

/* A stored pass: full blocks [b0, b0 + full) and maybe the narrow block, against weight rows
 * [n0, n0 + nr) (nr = 0: none). */
typedef struct {
    int64_t b0, n0;
    int full, narrow, nr;
} Pass;

static void emit_pass(Output y, Packed x, Pass p, float c[FULL_BLOCKS + 1][GROUP_N][BLOCK_M],
                      int64_t N) {
    for (int j = 0; j < p.full; j++)
        emit(y, c[j][0], (p.b0 + j) * BLOCK_M, BLOCK_M, p.n0, p.nr, N);
    if (p.narrow) emit(y, c[C_NARROW][0], x.full * BLOCK_M, x.narrow, p.n0, p.nr, N);
}

/* The A source of the group of nr weight rows from n0; `padded` ([16][steps * 32]) holds a
 * ragged last group, `tail` ([16][32]) the K tail. */
static Group group_at(const uint16_t *w, int64_t K, int64_t steps, int64_t n0, int nr,
                      uint16_t *padded, uint16_t *tail) {
    Group g = {w + n0 * K, NULL, K, K / STEP_K};
    if (nr < GROUP_N) {
        memset(padded, 0, (size_t)GROUP_N * steps * STEP_K * sizeof(uint16_t));
        for (int r = 0; r < nr; r++)
            memcpy(padded + r * steps * STEP_K, w + (n0 + r) * K, (size_t)K * sizeof(uint16_t));
        g.a = padded;
        g.a_stride = steps * STEP_K;
        g.whole_steps = steps;
    } else if (K % STEP_K) {
        memset(tail, 0, (size_t)GROUP_N * STEP_K * sizeof(uint16_t));
        for (int r = 0; r < GROUP_N; r++)
            memcpy(tail + r * STEP_K, w + (n0 + r) * K + g.whole_steps * STEP_K,
                   (size_t)(K % STEP_K) * sizeof(uint16_t));
        g.tail = tail;
    }
    return g;
}

int amx_product(const uint16_t *x, const uint16_t *w, const uint16_t *bias, float *y_f32,
                uint16_t *y_bf16, int64_t M, int64_t N, int64_t K, int num_threads) {
    const Output y = {y_f32, y_bf16, bias};
    const Packed xp = pack_activations(x, M, K);
    if (xp.v == NULL) return -1;
    const int64_t steps = xp.steps, groups = (N + GROUP_N - 1) / GROUP_N;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (M * N * K >= PARALLEL_MIN_MACS)
    {
        /* The ragged group's copy and the tail tile; only off the tile grid. */
        uint16_t *padded =
            N % GROUP_N ? malloc((size_t)GROUP_N * steps * STEP_K * sizeof(uint16_t)) : NULL;
        uint16_t tail[GROUP_N * STEP_K];
        if (N % GROUP_N && padded == NULL) {
#pragma omp atomic write
            failed = 1;
        } else {
            configure_tiles((int)xp.narrow);
            /* A pass's results are written out after the next pass has run: reading a C tile's
             * memory right after TILESTORED waits for the store. */
            float c[2][FULL_BLOCKS + 1][GROUP_N][BLOCK_M];
            int cur = 0;
            Pass pending = {0};
#pragma omp for schedule(static)
            for (int64_t gi = 0; gi < groups; gi++) {
                const int64_t n0 = gi * GROUP_N;
                const int nr = N - n0 < GROUP_N ? (int)(N - n0) : GROUP_N;
                const Group g = group_at(w, K, steps, n0, nr, padded, tail);
                /* Full blocks FULL_BLOCKS at a time; the narrow block joins the last pass. */
                for (int64_t b0 = 0; b0 < xp.full || (b0 == 0 && xp.narrow); b0 += FULL_BLOCKS) {
                    const int full = xp.full - b0 < FULL_BLOCKS ? (int)(xp.full - b0) : FULL_BLOCKS;
                    const int narrow = xp.narrow && b0 + full == xp.full;
                    group_pass(g, xp, b0, full, narrow, c[cur]);
                    if (pending.nr) emit_pass(y, xp, pending, c[cur ^ 1], N);
                    pending = (Pass){b0, n0, full, narrow, nr};
                    cur ^= 1;
                }
            }
            if (pending.nr) emit_pass(y, xp, pending, c[cur ^ 1], N);
            _tile_release();
        }
        free(padded);
    }
    return failed ? -1 : 0;
}
#endif
