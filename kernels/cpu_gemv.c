/* bf16 matrix-vector products for decode on x86 CPUs with AVX-512 BF16.
 *
 * y[m, n] = sum_k x[m, k] * w[n, k]   (x [M, K] bf16, w [N, K] bf16 row-major, y [M, N] fp32)
 *
 * At decode a step has a few rows (one token, or a token tree of up to a few dozen nodes), so
 * the product is bound by reading w once. Each thread takes blocks of ROWS weight rows (ROWS
 * independent streams keep the prefetchers busy) and, for every chunk of MCHUNK activation
 * rows, walks K in steps of 32 with VDPBF16PS (bf16 pairs multiplied, accumulated in fp32).
 * A weight block (ROWS * K * 2 bytes) stays in L1/L2 across activation chunks, so w comes from
 * memory once whatever M is. Tails of K use masked loads, so any K works.
 *
 * Built and loaded by cpu_linear.py; its PyTorch reference is F.linear in fp32.
 */
#include <immintrin.h>
#include <stdint.h>

#define ROWS 4
#define MCHUNK 4

static inline __m512bh load_bf16(const uint16_t *p, __mmask32 mask) {
    return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

void gemv_bf16(const uint16_t *x, const uint16_t *w, float *y, int64_t M, int64_t N, int64_t K,
               int num_threads) {
    const int64_t num_blocks = (N + ROWS - 1) / ROWS;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t n0 = b * ROWS;
        const int64_t nr = N - n0 < ROWS ? N - n0 : ROWS;
        for (int64_t m0 = 0; m0 < M; m0 += MCHUNK) {
            const int64_t mr = M - m0 < MCHUNK ? M - m0 : MCHUNK;
            __m512 acc[MCHUNK][ROWS];
            for (int i = 0; i < MCHUNK; i++)
                for (int r = 0; r < ROWS; r++) acc[i][r] = _mm512_setzero_ps();
            for (int64_t k = 0; k < K; k += 32) {
                const __mmask32 mask =
                    K - k >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (K - k)) - 1u);
                __m512bh wv[ROWS];
                for (int r = 0; r < ROWS; r++)
                    wv[r] = r < nr ? load_bf16(w + (n0 + r) * K + k, mask)
                                   : (__m512bh)_mm512_setzero_si512();
                for (int i = 0; i < MCHUNK && i < mr; i++) {
                    const __m512bh xv = load_bf16(x + (m0 + i) * K + k, mask);
                    for (int r = 0; r < ROWS; r++) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], xv, wv[r]);
                }
            }
            for (int i = 0; i < mr; i++)
                for (int r = 0; r < nr; r++) y[(m0 + i) * N + n0 + r] = _mm512_reduce_add_ps(acc[i][r]);
        }
    }
}
