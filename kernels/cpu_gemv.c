/* bf16 matrix-vector products for decode on x86 CPUs with AVX-512 BF16.
 *
 * y[m, n] = sum_k x[m, k] * w[n, k]   (x [M, K] bf16, w [N, K] bf16 row-major, y [M, N] fp32)
 *
 * At decode a step has a few rows (one token, or a token tree of a few dozen nodes), so the
 * product is bound by reading w once. Threads split w into blocks of NR rows (NR independent
 * streams keep the prefetchers busy); for each chunk of up to MR_MAX activation rows (chunks
 * balanced: 5 rows run as one chunk, 7 as 4 + 3) a micro-kernel walks K in steps of 32 with
 * VDPBF16PS (bf16 pairs multiplied, accumulated in fp32) holding MR x NR accumulators in
 * registers. A weight block (NR * K * 2 bytes) stays in L1/L2 across
 * activation chunks, so w comes from memory once whatever M is. K tails use masked loads.
 *
 * The micro-kernel is always inlined with constant MR and NR, so the compiler unrolls its
 * loops and keeps every accumulator in a register (with run-time sizes it spills them).
 *
 * Built and loaded by cpu_linear.py; its PyTorch reference is F.linear in fp32.
 */
#include <immintrin.h>
#include <stdint.h>

#define MR_MAX 6

static inline __attribute__((always_inline)) void micro_kernel(
    const int MR, const int NR, const uint16_t *x, const uint16_t *w, float *y, int64_t N,
    int64_t K) {
    __m512 acc[MR_MAX][8];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
        for (int r = 0; r < NR; r++) acc[i][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        const __mmask32 mask =
            K - k >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (K - k)) - 1u);
        __m512bh wv[8];
#pragma GCC unroll 8
        for (int r = 0; r < NR; r++)
            wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * K + k);
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + i * K + k);
#pragma GCC unroll 8
            for (int r = 0; r < NR; r++) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], xv, wv[r]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
        for (int r = 0; r < NR; r++) y[i * N + r] = _mm512_reduce_add_ps(acc[i][r]);
}

/* Rows [n0, n0 + nr) of w against every row of x, in balanced chunks of at most MR_MAX rows. */
static void weight_block(const uint16_t *x, const uint16_t *w, float *y, int64_t M, int64_t N,
                         int64_t K, int64_t n0, int nr) {
    const int64_t chunks = (M + MR_MAX - 1) / MR_MAX;
    int64_t m0 = 0;
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t left = M - m0, parts = chunks - c;
        const int mr = (int)((left + parts - 1) / parts);
        const uint16_t *xs = x + m0 * K, *ws = w + n0 * K;
        float *ys = y + m0 * N + n0;
        m0 += mr;
        if (nr == 8 && mr == 1) {
            micro_kernel(1, 8, xs, ws, ys, N, K);
        } else if (nr == 4) {
            switch (mr) {
                case 1: micro_kernel(1, 4, xs, ws, ys, N, K); break;
                case 2: micro_kernel(2, 4, xs, ws, ys, N, K); break;
                case 3: micro_kernel(3, 4, xs, ws, ys, N, K); break;
                case 4: micro_kernel(4, 4, xs, ws, ys, N, K); break;
                case 5: micro_kernel(5, 4, xs, ws, ys, N, K); break;
                default: micro_kernel(6, 4, xs, ws, ys, N, K); break;
            }
        } else { /* ragged edge of w: one row at a time */
            for (int r = 0; r < nr; r++)
                for (int i = 0; i < mr; i++)
                    micro_kernel(1, 1, xs + i * K, ws + r * K, ys + i * N + r, N, K);
        }
    }
}

void gemv_bf16(const uint16_t *x, const uint16_t *w, float *y, int64_t M, int64_t N, int64_t K,
               int num_threads) {
    /* One activation row: 8 weight streams per block; more rows: 4, leaving registers for
     * 4 x 4 accumulators. */
    const int nr = M == 1 ? 8 : 4;
    const int64_t num_blocks = (N + nr - 1) / nr;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t n0 = b * nr;
        weight_block(x, w, y, M, N, K, n0, N - n0 < nr ? (int)(N - n0) : nr);
    }
}
