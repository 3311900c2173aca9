/* The exponential the CPU kernels use (silu, softmax), written so loops over it vectorize.
 * The build's -fno-trapping-math (cpu_build.py) lets its selects become vector blends. */
#ifndef SPECSERVE_CPU_EXP_H
#define SPECSERVE_CPU_EXP_H

#include <math.h>
#include <stdint.h>

/* e^x in fp32 arithmetic that the compiler vectorizes in a loop (libm's expf is a call per
 * value: the gated activation's 4096 values took 55 us per row and layer). x = n ln2 + r,
 * |r| <= ln2 / 2, n rounded to nearest with the 1.5 * 2^23 trick; e^r by its Taylor series to
 * r^7 (truncation below 4e-9 relative, under half an ulp), then times 2^(n-1) built in the
 * exponent bits and 2 (so n = 128 just below the overflow threshold stays finite). Within 2 ulp
 * of expf for x in [-86, ln(FLT_MAX)]; +inf above (as expf overflows); e^-86 below (expf:
 * smaller, down to 0; what the kernels add it to, 1 in silu and a softmax total of at least
 * 1, is the same either way); NaN stays NaN (r carries it). */
static inline float exp_f32(float x) {
    const float hi = 88.7228394f, lo = -86.0f; /* hi: ln(FLT_MAX) */
    const float clamped = x > hi ? hi : x < lo ? lo : x;
    const float round = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    const float n = (clamped * 1.44269504f + round) - round;
    /* ln 2 in two parts: n * LN2_HI is exact for |n| < 2^9 (LN2_HI has 9 significant bits). */
    const float r = (clamped - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.0f / 5040;
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { uint32_t u; float f; } half_scale = {(uint32_t)((int32_t)n + 126) << 23};
    return x > hi ? INFINITY : p * half_scale.f * 2.0f;
}

#endif
