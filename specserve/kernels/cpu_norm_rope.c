/* RMSNorm and rotary embedding for bf16 activations on CPU, one call per layer op.
 *
 * Both follow the PyTorch code they replace (specserve/model/layers.py) step for step, in
 * fp32 with the same roundings to bf16, so results match it to fp32 summation order:
 *   rms_norm:  y = bf16(w * bf16(x * 1/sqrt(mean(x^2) + eps)))
 *   rotary:    (x1, x2) halves of each head -> (x1 cos - x2 sin, x2 cos + x1 sin), rounded
 * On CPU each of these is a handful of tiny tensor ops whose dispatch costs more than the
 * arithmetic (tens of microseconds per layer); here it is one pass over the row.
 */
#include <math.h>
#include <stdint.h>

#include "cpu_bf16.h"

/* x, y [T, H] bf16; w [H] bf16. */
void rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t T, int64_t H,
                   float eps) {
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *xr = x + t * H;
        uint16_t *yr = y + t * H;
        float sum = 0.0f;
        for (int64_t h = 0; h < H; h++) {
            const float v = bf16_to_f32(xr[h]);
            sum += v * v;
        }
        const float inv = 1.0f / sqrtf(sum / (float)H + eps);
        for (int64_t h = 0; h < H; h++) {
            const float normed = bf16_to_f32(f32_to_bf16(bf16_to_f32(xr[h]) * inv));
            yr[h] = f32_to_bf16(bf16_to_f32(w[h]) * normed);
        }
    }
}

/* In place on x [T, row_stride] bf16: heads [0, num_heads) of head_dim values each, starting at
 * the row start; cos, sin [max_positions, head_dim / 2] fp32; positions [T] int64. Returns -1,
 * changing nothing, when a position is outside the tables. */
int rotary_bf16(uint16_t *x, int64_t T, int64_t row_stride, int64_t num_heads, int64_t head_dim,
                const float *cos_table, const float *sin_table, int64_t max_positions,
                const int64_t *positions) {
    const int64_t half = head_dim / 2;
    for (int64_t t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= max_positions) return -1;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_table + positions[t] * half, *s = sin_table + positions[t] * half;
        for (int64_t h = 0; h < num_heads; h++) {
            uint16_t *v = x + t * row_stride + h * head_dim;
            for (int64_t d = 0; d < half; d++) {
                const float x1 = bf16_to_f32(v[d]), x2 = bf16_to_f32(v[d + half]);
                v[d] = f32_to_bf16(x1 * c[d] - x2 * s[d]);
                v[d + half] = f32_to_bf16(x2 * c[d] + x1 * s[d]);
            }
        }
    }
    return 0;
}
