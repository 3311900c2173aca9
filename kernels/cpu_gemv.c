/* bf16 matrix-vector products for decode on x86 CPUs with AVX-512 BF16.
 *
 * y[m, n] = sum_k x[m, k] * w[n, k]   (x [M, K] bf16, w [N, K] bf16 row-major, y [M, N] fp32)
 *
 * At decode a step has a few rows (one token, a chain or a small tree of draft tokens), so the
 * product is bound by reading w once. Threads split w into contiguous blocks of NR rows; for
 * each chunk of up to MR_MAX activation rows (balanced: 5 rows run as one chunk, 7 as 4 + 3) a
 * micro-kernel walks K with VDPBF16PS (bf16 pairs multiplied, accumulated in fp32), keeping
 * MR x NR x U accumulators in registers (U: independent accumulators per output, to hide the
 * instruction's latency). K tails use masked loads.
 *
 * Two shapes, measured on a 2-core AVX-512 BF16 machine:
 * - one or two activation rows, or up to SEQUENTIAL_ROWS rows of fewer than WIDE_K features:
 *   NR = 1, so each thread reads w as one sequential stream (about twice the bandwidth of
 *   interleaving several rows' streams);
 * - otherwise NR = 4, so each activation vector loaded feeds 4 weight rows: with many rows the
 *   product is compute-bound, and with wide rows (an MLP down projection, K = 4096) the
 *   activations no longer fit in L1, so reading them once per weight row would double the
 *   time (5 rows x 4096: 31 -> 17 ms per 400 MB of weights).
 *
 * The micro-kernel is always inlined with constant MR, NR and U, so the compiler unrolls its
 * loops and keeps every accumulator in a register (with run-time sizes it spills them).
 *
 * Results are written in fp32, or in bf16 with the bias added (the layer output in one pass).
 *
 * Built and loaded by cpu_build.py; its PyTorch reference is F.linear in fp32.
 */
#include <immintrin.h>
#include <stdint.h>

#include "cpu_bf16.h"

#define MR_MAX 6
#define SEQUENTIAL_ROWS 8
#define WIDE_K 2048

/* Where results go: y fp32, or bf16 (rounded to nearest even) with the bias (bf16, may be
 * NULL) added first in fp32, as F.linear on bf16 tensors computes it. Pointers are advanced
 * to the block being written. */
typedef struct {
    float *f32;
    uint16_t *bf16;
    const uint16_t *bias;
} Output;

static inline Output output_at(Output o, int64_t y_offset, int64_t bias_offset) {
    if (o.f32) o.f32 += y_offset;
    if (o.bf16) o.bf16 += y_offset;
    if (o.bias) o.bias += bias_offset;
    return o;
}

static inline void store(Output o, int64_t y_index, int64_t column, float value) {
    if (o.bias) value += bf16_to_f32(o.bias[column]);
    if (o.bf16) o.bf16[y_index] = f32_to_bf16(value);
    else o.f32[y_index] = value;
}

static inline __attribute__((always_inline)) void micro_kernel(
    const int MR, const int NR, const int U, const uint16_t *x, const uint16_t *w, Output y,
    int64_t N, int64_t K) {
    __m512 acc[MR_MAX][4][2];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
        for (int r = 0; r < NR; r++)
#pragma GCC unroll 8
            for (int u = 0; u < U; u++) acc[i][r][u] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 * U <= K; k += 32 * U) {
#pragma GCC unroll 8
        for (int u = 0; u < U; u++) {
            __m512bh wv[4];
#pragma GCC unroll 8
            for (int r = 0; r < NR; r++)
                wv[r] = (__m512bh)_mm512_loadu_si512(w + r * K + k + 32 * u);
#pragma GCC unroll 8
            for (int i = 0; i < MR; i++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * K + k + 32 * u);
#pragma GCC unroll 8
                for (int r = 0; r < NR; r++)
                    acc[i][r][u] = _mm512_dpbf16_ps(acc[i][r][u], xv, wv[r]);
            }
        }
    }
    for (; k < K; k += 32) {
        const __mmask32 mask =
            K - k >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (K - k)) - 1u);
        __m512bh wv[4];
#pragma GCC unroll 8
        for (int r = 0; r < NR; r++)
            wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * K + k);
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + i * K + k);
#pragma GCC unroll 8
            for (int r = 0; r < NR; r++) acc[i][r][0] = _mm512_dpbf16_ps(acc[i][r][0], xv, wv[r]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
        for (int r = 0; r < NR; r++) {
#pragma GCC unroll 8
            for (int u = 1; u < U; u++) acc[i][r][0] = _mm512_add_ps(acc[i][r][0], acc[i][r][u]);
            store(y, i * N + r, r, _mm512_reduce_add_ps(acc[i][r][0]));
        }
}

/* One activation chunk of mr rows against nr weight rows (nr == NR, or a ragged last block). */
#define DISPATCH_MR(NR, U)                                                 \
    switch (mr) {                                                          \
        case 1: micro_kernel(1, NR, U, xs, ws, ys, N, K); break;           \
        case 2: micro_kernel(2, NR, U, xs, ws, ys, N, K); break;           \
        case 3: micro_kernel(3, NR, U, xs, ws, ys, N, K); break;           \
        case 4: micro_kernel(4, NR, U, xs, ws, ys, N, K); break;           \
        case 5: micro_kernel(5, NR, U, xs, ws, ys, N, K); break;           \
        default: micro_kernel(6, NR, U, xs, ws, ys, N, K); break;          \
    }

/* Weight rows [n0, n0 + nr) against every row of x, in balanced chunks of at most MR_MAX. */
static void weight_block(const uint16_t *x, const uint16_t *w, Output y, int64_t M, int64_t N,
                         int64_t K, int64_t n0, int nr, int block_rows) {
    const int64_t chunks = (M + MR_MAX - 1) / MR_MAX;
    int64_t m0 = 0;
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t left = M - m0, parts = chunks - c;
        const int mr = (int)((left + parts - 1) / parts);
        const uint16_t *xs = x + m0 * K, *ws = w + n0 * K;
        Output ys = output_at(y, m0 * N + n0, n0);
        m0 += mr;
        if (block_rows == 1) {
            DISPATCH_MR(1, 2)
        } else if (nr == 4) {
            DISPATCH_MR(4, 1)
        } else { /* ragged edge of w: one row at a time */
            for (int r = 0; r < nr; r++, ws += K, ys = output_at(ys, 1, 1)) DISPATCH_MR(1, 2)
        }
    }
}

/* y_f32 or y_bf16 (the other NULL) [M, N]; bias [N] bf16 or NULL. */
void gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, float *y_f32,
               uint16_t *y_bf16, int64_t M, int64_t N, int64_t K, int num_threads) {
    const Output y = {y_f32, y_bf16, bias};
    const int block_rows =
        M <= 2 || (M <= SEQUENTIAL_ROWS && K < WIDE_K) ? 1 : 4;
    const int64_t num_blocks = (N + block_rows - 1) / block_rows;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t n0 = b * block_rows;
        const int nr = N - n0 < block_rows ? (int)(N - n0) : block_rows;
        weight_block(x, w, y, M, N, K, n0, nr, block_rows);
    }
}
