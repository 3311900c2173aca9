/* bf16 matrix products on CPU: decode and verify steps (a few activation rows), and prompt
 * chunks up to cpu_gemm.c's row threshold (see cpu_linear.py).
 *
 * y[m, n] = sum_k x[m, k] * w[n, k]   (x [M, K] bf16, w [N, K] bf16 row-major, y [M, N] fp32)
 *
 * At decode a step has a few rows (one token, a chain or a small tree of draft tokens), so the
 * product is bound by reading w once. Threads split w into contiguous blocks of NR rows; for
 * each chunk of up to MR activation rows (balanced: 5 rows with MR 3 run as 3 + 2) a
 * micro-kernel walks K in dot steps (cpu_simd.h), keeping MR x NR x DOT_U accumulators in
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
 * Two shapes:
 * - one or two activation rows, or up to SEQUENTIAL_ROWS rows of fewer than WIDE_K features:
 *   NR = 1, so each thread reads w as one sequential stream (about twice the bandwidth of
 *   interleaving several rows' streams, measured on AVX-512);
 * - otherwise NR = WIDE_NR, so each activation chunk loaded feeds several weight rows: with wide
 *   rows (an MLP down projection, K = 4096) the activations no longer fit in L1, so reading
 *   them once per weight row would double the time (AVX-512, 5 rows x 4096: 31 -> 17 ms per
 *   400 MB of weights).
 *
 * The micro-kernel is always inlined with constant MR, NR and DOT_U, so the compiler unrolls
 * its loops and keeps every accumulator in a register (with run-time sizes it spills them).
 *
 * Results are written in fp32, or in bf16 with the bias added (the layer output in one pass).
 *
 * Built and loaded by cpu_build.py; its PyTorch reference is F.linear in fp32.
 */
#include <stdint.h>
#include <stdlib.h>

#include "cpu_dot_order.h"
#include "cpu_kernels.h"
#include "cpu_simd.h"

/* Blocking per ISA, from its register file: AVX-512 has 32 vector registers, AVX2 16 (a dot_acc
 * is two), portable C 16 SSE-sized ones (a dot_acc is two); DOT_U: cpu_dot_order.h. AVX2
 * measured on a 2-core Zen 3, from cache, per core: 1 row 21 GFLOP/s, 5 rows 66 (MR_NARROW 4,
 * so 3 + 2: 53). */
#if defined(SPECSERVE_ISA_AVX512)
#define WIDE_NR 4
#define MR_NARROW 6 /* MR with NR = 1 */
#define MR_WIDE 3   /* MR with NR = WIDE_NR */
#elif defined(SPECSERVE_ISA_AVX2)
#define WIDE_NR 2
#define MR_NARROW 6
#define MR_WIDE 3
#else
#define WIDE_NR 2
#define MR_NARROW 3
#define MR_WIDE 1
#endif
#define SEQUENTIAL_ROWS 8
#define WIDE_K 2048
#define X_BLOCK_BYTES (256 * 1024)
#define PARALLEL_MIN_MACS (1 << 18)
/* Weights fetched this many values ahead of the products, per weight row: at a few activation
 * rows the products take long enough that the hardware prefetchers fall behind. 2-core Zen 3,
 * AVX2, the widened model's 24 layers from memory, one run: 1 row 30.5 -> 27.9 ms, 5 rows
 * 43.8 -> 41.2 ms (256 and 1024 values ahead: no better). */
#define PREFETCH_VALUES 512

/* x [M, K] in dot_vec form, each row zero-padded to whole steps: converted once per call
 * (AVX2 and portable widen bf16 to fp32 here, not once per weight row). */
typedef struct {
    const dot_vec *v;
    int64_t steps; /* dot_vec per row: ceil(K / DOT_K) */
} Prepared;

static inline __attribute__((always_inline)) void micro_kernel(
    const int MR, const int NR, const dot_vec *x, int64_t x_steps, const uint16_t *w, Output y,
    int64_t N, int64_t K) {
    dot_acc acc[6][WIDE_NR][DOT_U]; /* MR <= 6 */
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
        for (int r = 0; r < NR; r++)
#pragma GCC unroll 8
            for (int u = 0; u < DOT_U; u++) acc[i][r][u] = dot_zero();
    int64_t k = 0, s = 0;
    for (; k + DOT_K * DOT_U <= K; k += DOT_K * DOT_U, s += DOT_U) {
#pragma GCC unroll 8
        for (int u = 0; u < DOT_U; u++) {
            dot_vec wv[WIDE_NR];
#pragma GCC unroll 8
            for (int r = 0; r < NR; r++) {
                if (u == 0) __builtin_prefetch(w + r * K + k + PREFETCH_VALUES);
                wv[r] = dot_load(w + r * K + k + DOT_K * u);
            }
#pragma GCC unroll 8
            for (int i = 0; i < MR; i++) {
                const dot_vec xv = x[i * x_steps + s + u];
#pragma GCC unroll 8
                for (int r = 0; r < NR; r++) acc[i][r][u] = dot_step(acc[i][r][u], xv, wv[r]);
            }
        }
    }
    for (; k < K; k += DOT_K, s++) { /* leftover whole steps, then the tail, into accumulator 0 */
        const int64_t n = K - k < DOT_K ? K - k : DOT_K;
        dot_vec wv[WIDE_NR];
#pragma GCC unroll 8
        for (int r = 0; r < NR; r++)
            wv[r] = n == DOT_K ? dot_load(w + r * K + k) : dot_load_tail(w + r * K + k, n);
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            const dot_vec xv = x[i * x_steps + s];
#pragma GCC unroll 8
            for (int r = 0; r < NR; r++) acc[i][r][0] = dot_step(acc[i][r][0], xv, wv[r]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
        for (int r = 0; r < NR; r++) {
            dot_acc total = acc[i][r][0];
#pragma GCC unroll 8
            for (int u = 1; u < DOT_U; u++) total = dot_add(total, acc[i][r][u]);
            store(y, i * N + r, r, dot_sum(total));
        }
}

/* One activation chunk of mr rows against NR weight rows (mr never exceeds the MR of NR). */
#define DISPATCH_MR(NR)                                                    \
    switch (mr) {                                                          \
        case 1: micro_kernel(1, NR, xs, x.steps, ws, ys, N, K); break;     \
        case 2: micro_kernel(2, NR, xs, x.steps, ws, ys, N, K); break;     \
        case 3: micro_kernel(3, NR, xs, x.steps, ws, ys, N, K); break;     \
        case 4: micro_kernel(4, NR, xs, x.steps, ws, ys, N, K); break;     \
        case 5: micro_kernel(5, NR, xs, x.steps, ws, ys, N, K); break;     \
        default: micro_kernel(6, NR, xs, x.steps, ws, ys, N, K); break;    \
    }

/* Weight rows [n0, n0 + nr) against every row of x, in balanced chunks of at most mr_max. */
static void weight_block(Prepared x, const uint16_t *w, Output y, int64_t M, int64_t N,
                         int64_t K, int64_t n0, int nr, int block_rows) {
    const int mr_max = block_rows == 1 ? MR_NARROW : MR_WIDE;
    const int64_t chunks = (M + mr_max - 1) / mr_max;
    int64_t m0 = 0;
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t left = M - m0, parts = chunks - c;
        const int mr = (int)((left + parts - 1) / parts);
        const dot_vec *xs = x.v + m0 * x.steps;
        const uint16_t *ws = w + n0 * K;
        Output ys = output_at(y, m0 * N + n0, n0);
        m0 += mr;
        if (block_rows == 1) {
            DISPATCH_MR(1)
        } else if (nr == WIDE_NR) {
            DISPATCH_MR(WIDE_NR)
        } else { /* ragged edge of w: one row at a time */
            for (int r = 0; r < nr; r++, ws += K, ys = output_at(ys, 1, 1)) DISPATCH_MR(1)
        }
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
        for (int64_t s = 0; s < steps; s++) {
            const int64_t k = s * DOT_K, n = K - k < DOT_K ? K - k : DOT_K;
            buffer[i * steps + s] =
                n == DOT_K ? dot_load(x + i * K + k) : dot_load_tail(x + i * K + k, n);
        }
    return buffer;
}

/* y_f32 or y_bf16 (the other NULL) [M, N]; bias [N] bf16 or NULL. Returns 0, or -1 when the
 * activation buffer could not be allocated. */
int gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, float *y_f32,
              uint16_t *y_bf16, int64_t M, int64_t N, int64_t K, int num_threads) {
    const Output y = {y_f32, y_bf16, bias};
    const int64_t steps = (K + DOT_K - 1) / DOT_K;
    const Prepared xp = {prepare(x, M, K, steps), steps};
    if (xp.v == NULL) return -1;
    const int block_rows = M <= 2 || (M <= SEQUENTIAL_ROWS && K < WIDE_K) ? 1 : WIDE_NR;
    const int64_t num_blocks = (N + block_rows - 1) / block_rows;
    /* Many rows (a prompt chunk): a block of rows at a time, so the activations each weight
     * block meets stay in L2 instead of streaming from memory once per weight block. */
    int64_t m_block = X_BLOCK_BYTES / (steps * (int64_t)sizeof(dot_vec));
    if (m_block < MR_NARROW) m_block = MR_NARROW;
    /* A small product (the demo model's layers) is done before other threads would wake. */
#pragma omp parallel num_threads(num_threads) if (M * N * K >= PARALLEL_MIN_MACS)
    for (int64_t m0 = 0; m0 < M; m0 += m_block) {
        const int64_t rows = M - m0 < m_block ? M - m0 : m_block;
        const Prepared xs = {xp.v + m0 * steps, steps};
        const Output ys = output_at(y, m0 * N, 0);
        /* No barrier between row blocks (they write different rows): one join per call, and
         * static scheduling gives each thread the same weight blocks in every row block. */
#pragma omp for schedule(static) nowait
        for (int64_t b = 0; b < num_blocks; b++) {
            const int64_t n0 = b * block_rows;
            const int nr = N - n0 < block_rows ? (int)(N - n0) : block_rows;
            weight_block(xs, w, ys, rows, N, K, n0, nr, block_rows);
        }
    }
    return 0;
}
