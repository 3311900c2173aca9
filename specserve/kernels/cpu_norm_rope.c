/* RMSNorm and rotary embedding for bf16 or fp32 activations on CPU, one call per layer op.
 *
 * Both follow the PyTorch code they replace (specserve/model/layers.py) step for step, in
 * fp32 with the same roundings (to bf16 for bf16 activations), so results match it to fp32
 * summation order (rms_norm's sum of squares, in SUM_LANES partial sums) or bit for bit
 * (rotary):
 *   rms_norm:  y = w * round(x * 1/sqrt(mean(x^2) + eps))   (round: to the activations' dtype,
 *                                                            and the product rounded again)
 *   rotary:    (x1, x2) halves of each head -> (x1 cos - x2 sin, x2 cos + x1 sin), rounded
 * On CPU each of these is a handful of tiny tensor ops whose dispatch costs more than the
 * arithmetic (tens of microseconds per layer); here it is one pass over the row. `f32` selects
 * the element type: each entry point calls its body with a constant, so both are specialized.
 */
#include <math.h>
#include <stdint.h>

#include "cpu_bf16.h"
#include "cpu_kernels.h"

/* Partial sums of the sum of squares: value h goes to lane h % SUM_LANES, the lanes are added
 * pairwise at the end. A fixed order whatever the ISA (the compiler vectorizes across lanes,
 * each lane a chain in index order); one serial chain took 2 us per 1024 values, as long as
 * the rest of the norm many times over. */
#define SUM_LANES 16

/* Sum of x[row + h]^2 over h in [0, H). */
static inline __attribute__((always_inline)) float sum_of_squares(const void *x, int64_t row,
                                                                  int64_t H, const int f32) {
    float lane[SUM_LANES] = {0};
    int64_t h = 0;
    for (; h + SUM_LANES <= H; h += SUM_LANES)
        for (int j = 0; j < SUM_LANES; j++) {
            const float v = act_load(x, row + h + j, f32);
            lane[j] += v * v;
        }
    for (int j = 0; h + j < H; j++) {
        const float v = act_load(x, row + h + j, f32);
        lane[j] += v * v;
    }
    for (int width = SUM_LANES / 2; width > 0; width /= 2)
        for (int j = 0; j < width; j++) lane[j] += lane[j + width];
    return lane[0];
}

static inline __attribute__((always_inline)) void rms_norm_body(
    const void *x, const void *w, void *y, int64_t T, int64_t H, float eps, const int f32) {
    for (int64_t t = 0; t < T; t++) {
        const float sum = sum_of_squares(x, t * H, H, f32);
        const float inv = 1.0f / sqrtf(sum / (float)H + eps);
        for (int64_t h = 0; h < H; h++) {
            const float normed = act_round(act_load(x, t * H + h, f32) * inv, f32);
            act_save(y, t * H + h, act_load(w, h, f32) * normed, f32);
        }
    }
}

/* x, y [T, H]; w [H]; all bf16, or all fp32 when f32. */
void rms_norm_rows(const void *x, const void *w, void *y, int64_t T, int64_t H, float eps,
                   int f32) {
    if (f32) rms_norm_body(x, w, y, T, H, eps, 1);
    else rms_norm_body(x, w, y, T, H, eps, 0);
}

static inline __attribute__((always_inline)) void rotary_body(
    void *x, int64_t T, int64_t row_stride, int64_t num_heads, int64_t head_dim,
    const float *cos_table, const float *sin_table, const int64_t *positions, const int f32) {
    const int64_t half = head_dim / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_table + positions[t] * half, *s = sin_table + positions[t] * half;
        for (int64_t h = 0; h < num_heads; h++) {
            const int64_t at = t * row_stride + h * head_dim;
            for (int64_t d = 0; d < half; d++) {
                const float x1 = act_load(x, at + d, f32);
                const float x2 = act_load(x, at + d + half, f32);
                act_save(x, at + d, x1 * c[d] - x2 * s[d], f32);
                act_save(x, at + d + half, x2 * c[d] + x1 * s[d], f32);
            }
        }
    }
}

/* In place on x [T, row_stride] (bf16, or fp32 when f32): heads [0, num_heads) of head_dim
 * values each, starting at the row start; cos, sin [max_positions, head_dim / 2] fp32;
 * positions [T] int64. Returns -1, changing nothing, when a position is outside the tables. */
int rotary_rows(void *x, int64_t T, int64_t row_stride, int64_t num_heads, int64_t head_dim,
                const float *cos_table, const float *sin_table, int64_t max_positions,
                const int64_t *positions, int f32) {
    for (int64_t t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= max_positions) return -1;
    if (f32) rotary_body(x, T, row_stride, num_heads, head_dim, cos_table, sin_table, positions, 1);
    else rotary_body(x, T, row_stride, num_heads, head_dim, cos_table, sin_table, positions, 0);
    return 0;
}
