/* bf16 matrix products on CPU: decode and verify steps (a few activation rows), and prompt
 * chunks up to cpu_gemm.c's row threshold (see cpu_linear.py).
 *
 * y[m, n] = sum_k x[m, k] * w[n, k]   (x [M, K] bf16, w [N, K] bf16 row-major, y [M, N] fp32)
 *
 * At decode a step has a few rows (one token, a chain or a small tree of draft tokens), so the
 * product is bound by reading w once. Threads split w into contiguous blocks of rows; for each
 * chunk of up to MR_MAX activation rows (balanced: 8 rows run as 4 + 4) a micro-kernel walks K
 * in dot steps (cpu_simd.h) against one weight row, keeping MR x DOT_U accumulators in
 * registers (DOT_U: independent accumulators per output, to hide the multiply-add latency).
 * The activations are converted to dot steps once per call (on AVX2 bf16 -> fp32 even/odd
 * lanes), so the inner loop only widens weights: 5 rows ran 25% faster than converting them
 * per weight row.
 *
 * Row-count invariance: every output element is summed in the same order whatever M, NR or MR
 * are (cpu_dot_order.h: k steps dealt round-robin to DOT_U accumulators, leftover whole steps
 * and the K tail to the first, then the accumulators added in order), the order the blocked
 * GEMM for prompt chunks (cpu_gemm.c) uses too, so a row's results are bit-identical whether it
 * is computed alone or among other rows, by either kernel. The order depends only on K and the
 * ISA.
 *
 * Two shapes, both one weight row at a time (reading several rows' streams at once ran slower
 * than one: about half the bandwidth, measured on AVX-512):
 * - whole rows, while a chunk's activations fit in L1 (X_L1_BYTES): each thread reads its block
 *   of w as one sequential stream, ROW_BLOCK weight rows at a time against every chunk;
 * - K-blocked, from 3 rows on when they do not (an MLP down projection, K = 4096): panels of
 *   PANEL_ROWS weight rows, walked one block of steps at a time (the chunk's activations for the
 *   block stay in L1 while the panel's rows pass), with the accumulators carried between blocks
 *   (the same step order, so the same bits). AVX2, 2-core Zen 3, the widened model's down
 *   projection at 5 rows, one run: 14.2 -> 12.2 ms per 24 layers, where the block ran 3 + 2
 *   activation rows against two weight rows at a time, re-reading both for the second chunk.
 *
 * The micro-kernel is always inlined with constant MR and DOT_U, so the compiler unrolls
 * its loops and keeps every accumulator in a register (with run-time sizes it spills them).
 *
 * Results are written in fp32, or in bf16 with the bias added (the layer output in one pass).
 *
 * Built and loaded by cpu_build.py; its PyTorch reference is F.linear in fp32.
 */
#include <stdint.h>
#include <stdlib.h>

#include "cpu_amx.h"
#include "cpu_dot_order.h"
#include "cpu_kernels.h"
#include "cpu_simd.h"

/* Activation rows per micro-kernel call, from the register file: MR_MAX x DOT_U accumulators
 * (a dot_acc is two registers on AVX2 and portable C) beside one weight step. AVX2 measured on
 * a 2-core Zen 3, from cache, per core: 1 row 21 GFLOP/s, 5 rows 66 (MR 4, so 3 + 2: 53). */
#if defined(SPECSERVE_ISA_PORTABLE)
#define MR_MAX 3
#else
#define MR_MAX 6
#endif
#define X_L1_BYTES (24 * 1024) /* a chunk's activations up to this stay in L1: whole rows */
#define PANEL_ROWS 8           /* weight rows a K-block of activations meets while in L1 */
#define ROW_BLOCK 8            /* whole weight rows per scheduled item: 16 KB at K = 1024 */
#define X_BLOCK_BYTES (256 * 1024)
#define PARALLEL_MIN_MACS (1 << 18)
/* Weights fetched ahead of the products, once per 64-byte line: into L1 PREFETCH_VALUES ahead,
 * and with SPECSERVE_L2_PREFETCH (cpu_build.py sets it on Intel CPUs) into L2 FAR_VALUES
 * further on, by chunks of FAR_ROWS_FROM activation rows or more. At a few rows the products
 * take long enough that the hardware prefetchers fall behind (the widened model's 96 products
 * from memory, AVX2, no software prefetch: 5 rows 57 ms against 35), and the L1 prefetches
 * alone keep too few lines in flight; the L2 ones add more without holding L1's fill buffers.
 * 2-vCPU Sapphire Rapids class, the 96 products, best of 15 in one run, against the L1
 * prefetch alone once per step: AVX2 1 row 27.7 -> 22.7 ms, 5 rows 37.6 -> 34.2; AVX-512 1 row
 * 27.3 -> 24.8, 5 rows 41.0 -> 32.7 (2048 or 8192 values ahead: no better; AVX-512's one-row
 * kernel ran 28.7 ms with the L2 prefetch). On a 2-core Zen 3 the L1 prefetch took 1 row 30.5
 * -> 27.9 ms, 5 rows 43.8 -> 41.2. */
#define PREFETCH_VALUES 512
#define FAR_VALUES 4096
#if !defined(SPECSERVE_L2_PREFETCH)
#define FAR_ROWS_FROM 0 /* none */
#elif defined(SPECSERVE_ISA_AVX512)
#define FAR_ROWS_FROM 2
#else
#define FAR_ROWS_FROM 1
#endif
#define LINE_VALUES 32 /* bf16 values per 64-byte cache line */
/* Steps per prefetching iteration of the main loop: whole rounds of DOT_U steps covering whole
 * lines (AVX2 2 steps = 1 line, AVX-512 2 = 2 lines, portable 4 = 1 line). */
#define BLOCK_STEPS (DOT_K * DOT_U >= LINE_VALUES ? DOT_U : LINE_VALUES / DOT_K)
#define BLOCK_LINES (BLOCK_STEPS * DOT_K / LINE_VALUES)

/* x [M, K] in dot_vec form, each row zero-padded to whole steps: converted once per call
 * (AVX2 and portable widen bf16 to fp32 here, not once per weight row). */
typedef struct {
    const dot_vec *v;
    int64_t steps; /* dot_vec per row: ceil(K / DOT_K) */
} Prepared;

/* Steps [s0, s1) of MR activation rows (x, row stride x_steps) against one weight row w of K
 * values: acc[i] (row i's DOT_U accumulators) in and out, in cpu_dot_order.h's order (s0 a
 * multiple of DOT_U). `ahead` moves with the steps and is prefetched (maybe also FAR_VALUES
 * past it, into L2): the weights this thread reads after these. */
static inline __attribute__((always_inline)) void micro_kernel(
    const int MR, const dot_vec *x, int64_t x_steps, const uint16_t *w, const uint16_t *ahead,
    dot_acc (*acc)[DOT_U], int64_t s0, int64_t s1, int64_t main_steps, int64_t K) {
    dot_acc a[MR_MAX][DOT_U];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
        for (int u = 0; u < DOT_U; u++) a[i][u] = acc[i][u];
    const int64_t round_end = s1 < main_steps ? s1 : main_steps;
    int64_t s = s0;
    for (; s + BLOCK_STEPS <= round_end; s += BLOCK_STEPS) {
#pragma GCC unroll 4
        for (int l = 0; l < BLOCK_LINES; l++) {
            const uint16_t *line = ahead + (s - s0) * DOT_K + l * LINE_VALUES;
            __builtin_prefetch(line);
            if (FAR_ROWS_FROM && MR >= FAR_ROWS_FROM)
                __builtin_prefetch(line + FAR_VALUES, 0, 1); /* prefetcht2: into L2 */
        }
#pragma GCC unroll 8
        for (int u = 0; u < BLOCK_STEPS; u++) {
            const dot_vec wv = dot_load(w + (s + u) * DOT_K);
#pragma GCC unroll 8
            for (int i = 0; i < MR; i++)
                a[i][u % DOT_U] = dot_step(a[i][u % DOT_U], x[i * x_steps + s + u], wv);
        }
    }
    for (; s < round_end; s += DOT_U) { /* a last round short of a block: not prefetched */
#pragma GCC unroll 8
        for (int u = 0; u < DOT_U; u++) {
            const dot_vec wv = dot_load(w + (s + u) * DOT_K);
#pragma GCC unroll 8
            for (int i = 0; i < MR; i++) a[i][u] = dot_step(a[i][u], x[i * x_steps + s + u], wv);
        }
    }
    for (; s < s1; s++) { /* leftover whole steps, then the tail, into accumulator 0 */
        const dot_vec wv = dot_load_step(w, s, K);
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) a[i][0] = dot_step(a[i][0], x[i * x_steps + s], wv);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
        for (int u = 0; u < DOT_U; u++) acc[i][u] = a[i][u];
}

/* CALL(MR) with the chunk's row count mr (1 <= mr <= MR_MAX) as a constant: each call site is
 * inlined with its own MR. */
#define MR_CASES_1_TO_3(CALL) \
    case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break;
#if MR_MAX > 3
#define MR_CASES_4_TO_6(CALL) \
    case 4: CALL(4); break; case 5: CALL(5); break; case 6: CALL(6); break;
#else
#define MR_CASES_4_TO_6(CALL)
#endif
#define WITH_CONSTANT_MR(mr, CALL) \
    switch (mr) { MR_CASES_1_TO_3(CALL) MR_CASES_4_TO_6(CALL) default: break; }

/* One activation chunk of mr rows: micro_kernel with a constant MR. */
static void chunk_steps(int mr, const dot_vec *x, int64_t x_steps, const uint16_t *w,
                        const uint16_t *ahead, dot_acc (*acc)[DOT_U], int64_t s0, int64_t s1,
                        int64_t main_steps, int64_t K) {
#define CHUNK(MR) micro_kernel(MR, x, x_steps, w, ahead, acc, s0, s1, main_steps, K)
    WITH_CONSTANT_MR(mr, CHUNK)
#undef CHUNK
}

/* Rows [m0, m0 + mr) of the c-th of `chunks` balanced chunks of M rows. */
static inline int chunk_rows(int64_t M, int64_t chunks, int64_t c, int64_t *m0) {
    *m0 = M * c / chunks;
    return (int)(M * (c + 1) / chunks - *m0);
}

static inline void zero(dot_acc (*acc)[DOT_U], int rows) {
    for (int i = 0; i < rows; i++)
        for (int u = 0; u < DOT_U; u++) acc[i][u] = dot_zero();
}

/* Weight rows [n0, n1) against activation rows [m0, m0 + MR), whole rows at a time: one weight
 * row's accumulators live in registers from zero to its stores, and the loop over rows runs
 * inside one inlined kernel (per weight row, a call, the chunk's bounds and the accumulators'
 * trip through memory cost 6-10% of a 5-row product from L2). */
static inline __attribute__((always_inline)) void row_range(
    const int MR, Prepared x, const uint16_t *w, Output y, int64_t N, int64_t K, int64_t m0,
    int64_t n0, int64_t n1, int64_t main_steps) {
    for (int64_t n = n0; n < n1; n++) {
        const uint16_t *wn = w + n * K;
        dot_acc acc[MR_MAX][DOT_U];
        zero(acc, MR);
        micro_kernel(MR, x.v + m0 * x.steps, x.steps, wn, wn + PREFETCH_VALUES, acc, 0, x.steps,
                     main_steps, K);
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) store(y, (m0 + i) * N + n, n, dot_total(acc[i]));
    }
}

/* Weight rows [n0, n1) against every row of x, chunk by chunk. */
static void whole_rows(Prepared x, const uint16_t *w, Output y, int64_t M, int64_t N, int64_t K,
                       int64_t n0, int64_t n1, int64_t chunks, int64_t main_steps) {
    for (int64_t c = 0; c < chunks; c++) {
        int64_t m0;
        const int mr = chunk_rows(M, chunks, c, &m0);
#define ROWS(MR) row_range(MR, x, w, y, N, K, m0, n0, n1, main_steps)
        WITH_CONSTANT_MR(mr, ROWS)
#undef ROWS
    }
}

/* Weight rows [n0, n0 + nr) (nr <= PANEL_ROWS) against every row of x, one block of kb steps
 * at a time: a chunk's activations for a block stay in L1 while the panel's rows pass. */
static void panel(Prepared x, const uint16_t *w, Output y, int64_t M, int64_t N, int64_t K,
                  int64_t n0, int nr, int64_t chunks, int64_t kb, int64_t main_steps) {
    for (int64_t c = 0; c < chunks; c++) {
        int64_t m0;
        const int mr = chunk_rows(M, chunks, c, &m0);
        dot_acc acc[PANEL_ROWS][MR_MAX][DOT_U];
        for (int r = 0; r < nr; r++) zero(acc[r], mr);
        for (int64_t s0 = 0; s0 < x.steps; s0 += kb) {
            const int64_t s1 = x.steps - s0 < kb ? x.steps : s0 + kb;
            for (int r = 0; r < nr; r++) {
                /* Read next: the panel's next row in this block, else its first row's next
                 * block, else the next panel. */
                const uint16_t *next = r + 1 < nr ? w + (n0 + r + 1) * K + s0 * DOT_K
                                       : s1 < x.steps ? w + n0 * K + s1 * DOT_K
                                                      : w + (n0 + nr) * K;
                chunk_steps(mr, x.v + m0 * x.steps, x.steps, w + (n0 + r) * K, next, acc[r], s0,
                            s1, main_steps, K);
            }
        }
        for (int r = 0; r < nr; r++)
            for (int i = 0; i < mr; i++)
                store(y, (m0 + i) * N + n0 + r, n0 + r, dot_total(acc[r][i]));
    }
}

/* The calling thread's buffer for prepared activations, grown as needed and kept: a fresh
 * allocation of this size per call would be an mmap and page faults every layer. */
static const dot_vec *prepare(const uint16_t *x, int64_t M, int64_t K, int64_t steps) {
    static __thread dot_vec *buffer;
    static __thread int64_t capacity;
    if (M * steps > capacity) {
        free(buffer);
        capacity = M * steps;
        buffer = aligned_alloc(64, ((size_t)capacity * sizeof(dot_vec) + 63) / 64 * 64);
        if (buffer == NULL) {
            capacity = 0;
            return NULL;
        }
    }
    for (int64_t i = 0; i < M; i++)
        for (int64_t s = 0; s < steps; s++) buffer[i * steps + s] = dot_load_step(x + i * K, s, K);
    return buffer;
}

/* y_f32 or y_bf16 (the other NULL) [M, N]; bias [N] bf16 or NULL. Returns 0, or -1 when the
 * activation buffer could not be allocated. */
int gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, float *y_f32,
              uint16_t *y_bf16, int64_t M, int64_t N, int64_t K, int num_threads) {
#if defined(SPECSERVE_AMX) /* tiles: a few rows cost what one does (cpu_amx.c) */
    return amx_product(x, w, bias, y_f32, y_bf16, M, N, K, num_threads);
#endif
    const Output y = {y_f32, y_bf16, bias};
    const int64_t steps = (K + DOT_K - 1) / DOT_K, main_steps = DOT_MAIN_STEPS(K);
    const Prepared xp = {prepare(x, M, K, steps), steps};
    if (xp.v == NULL) return -1;
    /* Many rows (a prompt chunk): a block of rows at a time, so the activations each weight
     * block meets stay in L2 instead of streaming from memory once per weight block. */
    int64_t m_block = X_BLOCK_BYTES / (steps * (int64_t)sizeof(dot_vec));
    if (m_block < MR_MAX) m_block = MR_MAX;
    /* A small product (the demo model's layers) is done before other threads would wake. */
#pragma omp parallel num_threads(num_threads) if (M * N * K >= PARALLEL_MIN_MACS)
    for (int64_t m0 = 0; m0 < M; m0 += m_block) {
        const int64_t rows = M - m0 < m_block ? M - m0 : m_block;
        const Prepared xs = {xp.v + m0 * steps, steps};
        const Output ys = output_at(y, m0 * N, 0);
        const int64_t chunks = (rows + MR_MAX - 1) / MR_MAX;
        const int64_t chunk_bytes = (rows + chunks - 1) / chunks * steps * (int64_t)sizeof(dot_vec);
        /* No barrier between row blocks (they write different rows): one join per call, and
         * static scheduling gives each thread the same weight rows in every row block. */
        if (rows <= 2 || chunk_bytes <= X_L1_BYTES) {
            const int64_t blocks = (N + ROW_BLOCK - 1) / ROW_BLOCK;
#pragma omp for schedule(static) nowait
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t n0 = b * ROW_BLOCK, n1 = N - n0 < ROW_BLOCK ? N : n0 + ROW_BLOCK;
                whole_rows(xs, w, ys, rows, N, K, n0, n1, chunks, main_steps);
            }
        } else {
            /* Blocks of steps holding half of L1's budget of activations, whole rounds. */
            int64_t kb = X_L1_BYTES / 2 / (chunk_bytes / steps) / DOT_U * DOT_U;
            if (kb < DOT_U) kb = DOT_U;
            const int64_t panels = (N + PANEL_ROWS - 1) / PANEL_ROWS;
#pragma omp for schedule(static) nowait
            for (int64_t p = 0; p < panels; p++) {
                const int64_t n0 = p * PANEL_ROWS;
                const int nr = N - n0 < PANEL_ROWS ? (int)(N - n0) : PANEL_ROWS;
                panel(xs, w, ys, rows, N, K, n0, nr, chunks, kb, main_steps);
            }
        }
    }
    return 0;
}
