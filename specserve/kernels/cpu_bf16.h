/* Scalar bf16 <-> fp32 conversions shared by the CPU kernels, and element access to
 * activations that are bf16, or fp32 when `f32` (a constant where the kernels call these, so
 * each dtype gets its own code). */
#ifndef SPECSERVE_CPU_BF16_H
#define SPECSERVE_CPU_BF16_H

#include <stdint.h>

static inline float bf16_to_f32(uint16_t v) {
    union { uint32_t u; float f; } c = {(uint32_t)v << 16};
    return c.f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, NaN kept quiet */
    union { float f; uint32_t u; } c = {f};
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40u);
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

static inline __attribute__((always_inline)) float act_load(const void *p, int64_t i,
                                                            const int f32) {
    return f32 ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
}

static inline __attribute__((always_inline)) void act_save(void *p, int64_t i, float v,
                                                           const int f32) {
    if (f32) ((float *)p)[i] = v;
    else ((uint16_t *)p)[i] = f32_to_bf16(v);
}

/* v as the activations' dtype holds it. */
static inline __attribute__((always_inline)) float act_round(float v, const int f32) {
    return f32 ? v : bf16_to_f32(f32_to_bf16(v));
}

#endif
