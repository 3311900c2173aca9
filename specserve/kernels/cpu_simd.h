/* Per-ISA vector primitives for the CPU kernels: the kernels are written once against these.
 *
 * cpu_build.py defines exactly one of SPECSERVE_ISA_AVX512 (AVX-512 F/BW/VL + BF16),
 * SPECSERVE_ISA_AVX2 (AVX2 + FMA) or SPECSERVE_ISA_PORTABLE (GCC/Clang vector extensions, no
 * -m flags). Every primitive gives the same result each time it runs on the same ISA (fixed
 * lane and reduction order); results may differ between ISAs in fp32 summation order only.
 *
 * fp32 vectors, VF lanes (vf):
 *   vf_zero() vf_set1(a) vf_add(a, b) vf_mul(a, b)
 *   vf_fmadd(a, b, c) = a * b + c: one rounding on AVX2/AVX-512, two in portable C
 *   vf_load(p) vf_store(p, v)            fp32 memory
 *   vf_load_bf16(p)                      VF bf16 values widened to fp32 (exact)
 *   vf_store_bf16(p, v)                  rounded to nearest even, NaN kept a quiet NaN (as torch)
 *   vf_reduce_add(v)                     horizontal sum, halves added pairwise
 *   vf_reduce_add_each(v, out)           out[k] = vf_reduce_add(v[k]) for VF vectors at once,
 *                                        bit for bit: the same additions in each lane, transposed
 *                                        so one add serves every vector (AVX2, AVX-512)
 *
 * bf16 dot-product steps (matrix-vector products): a dot_acc sums the products of two bf16
 * vectors DOT_K values per step, always in the same order:
 *   dot_load(p)            DOT_K bf16 values as a dot_vec
 *   dot_load_tail(p, n)    the first n < DOT_K values, the rest zero
 *   dot_zero() dot_step(acc, x, w) dot_add(a, b) dot_sum(acc) -> float
 *   dot_collapse(acc) -> vf      the vector whose vf_reduce_add is dot_sum(acc)
 * AVX-512 BF16 multiplies bf16 pairs with VDPBF16PS; AVX2 and portable C split each 16 values
 * into even and odd lanes (a shift and a mask widen bf16 to fp32 with no shuffles) with one
 * fp32 accumulator each. A dot_vec is a plain value: arrays of them hold activations converted
 * once and reused across weight rows.
 */
#ifndef SPECSERVE_CPU_SIMD_H
#define SPECSERVE_CPU_SIMD_H

#include <stdint.h>
#include <string.h>

#include "cpu_bf16.h"

#if defined(SPECSERVE_ISA_AVX512) + defined(SPECSERVE_ISA_AVX2) + defined(SPECSERVE_ISA_PORTABLE) != 1
#error "define exactly one of SPECSERVE_ISA_AVX512, SPECSERVE_ISA_AVX2, SPECSERVE_ISA_PORTABLE"
#endif

#define SIMD_INLINE static inline __attribute__((always_inline))

#if defined(SPECSERVE_ISA_AVX512)
#include <immintrin.h>

#define VF 16
typedef __m512 vf;
SIMD_INLINE vf vf_zero(void) { return _mm512_setzero_ps(); }
SIMD_INLINE vf vf_set1(float a) { return _mm512_set1_ps(a); }
SIMD_INLINE vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
SIMD_INLINE vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
SIMD_INLINE vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
SIMD_INLINE vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
SIMD_INLINE void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
SIMD_INLINE vf vf_load_bf16(const uint16_t *p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
SIMD_INLINE void vf_store_bf16(uint16_t *p, vf v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i magnitude = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7f800000));
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    const __m512i bits = _mm512_mask_blend_epi32(nan, rounded, quiet);
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(bits));
}
SIMD_INLINE float vf_reduce_add(vf v) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
/* vf_reduce_add's steps (upper half onto lower, the lower the first operand) on 16 vectors:
 * each step adds two shuffles of vector pairs, so one add serves 16 sums where vf_reduce_add
 * spends a chain of shuffles and adds on each. */
SIMD_INLINE void vf_reduce_add_each(const vf v[16], float out[16]) {
    vf h[8], q[4], t[2];
    for (int j = 0; j < 8; j++) /* [256-bit halves of v[2j] added | of v[2j + 1]] */
        h[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0xEE));
    for (int j = 0; j < 4; j++) /* 128-bit quarter k: v[4j + k]'s 128-bit halves added */
        q[j] = _mm512_add_ps(_mm512_shuffle_f32x4(h[2 * j], h[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(h[2 * j], h[2 * j + 1], 0xDD));
    for (int j = 0; j < 2; j++) /* quarter k: lanes 0 + 2, 1 + 3 of v[8j + k], of v[8j + 4 + k] */
        t[j] = _mm512_add_ps(_mm512_shuffle_ps(q[2 * j], q[2 * j + 1], 0x44),
                             _mm512_shuffle_ps(q[2 * j], q[2 * j + 1], 0xEE));
    float f[16]; /* quarter k, lane e: the sum of v[4e + k] */
    _mm512_storeu_ps(f, _mm512_add_ps(_mm512_shuffle_ps(t[0], t[1], 0x88),
                                      _mm512_shuffle_ps(t[0], t[1], 0xDD)));
    for (int k = 0; k < 16; k++) out[k] = f[k % 4 * 4 + k / 4];
}

#define DOT_K 32
typedef __m512bh dot_vec;
typedef __m512 dot_acc;
SIMD_INLINE dot_vec dot_load(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512(p); }
SIMD_INLINE dot_vec dot_load_tail(const uint16_t *p, int64_t n) {
    return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1u << n) - 1u), p);
}
SIMD_INLINE dot_acc dot_zero(void) { return _mm512_setzero_ps(); }
SIMD_INLINE dot_acc dot_step(dot_acc acc, dot_vec x, dot_vec w) {
    return _mm512_dpbf16_ps(acc, x, w);
}
SIMD_INLINE dot_acc dot_add(dot_acc a, dot_acc b) { return _mm512_add_ps(a, b); }
SIMD_INLINE vf dot_collapse(dot_acc acc) { return acc; }

#elif defined(SPECSERVE_ISA_AVX2)
#include <immintrin.h>

#define VF 8
typedef __m256 vf;
SIMD_INLINE vf vf_zero(void) { return _mm256_setzero_ps(); }
SIMD_INLINE vf vf_set1(float a) { return _mm256_set1_ps(a); }
SIMD_INLINE vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
SIMD_INLINE vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
SIMD_INLINE vf vf_fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
SIMD_INLINE vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
SIMD_INLINE void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
SIMD_INLINE vf vf_load_bf16(const uint16_t *p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
SIMD_INLINE void vf_store_bf16(uint16_t *p, vf v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i magnitude = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    /* magnitude is non-negative as int32, so a signed compare is exact. */
    const __m256i nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f800000));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i bits = _mm256_blendv_epi8(rounded, quiet, nan);
    /* Values fit 16 bits, so the saturating pack is exact; it works per 128-bit lane. */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0xD8);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}
SIMD_INLINE float vf_reduce_add(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
/* vf_reduce_add's steps on 8 vectors, as AVX-512's. */
SIMD_INLINE void vf_reduce_add_each(const vf v[8], float out[8]) {
    vf h[4], t[2];
    for (int j = 0; j < 4; j++) /* [128-bit halves of v[2j] added | of v[2j + 1]] */
        h[j] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * j], v[2 * j + 1], 0x20),
                             _mm256_permute2f128_ps(v[2 * j], v[2 * j + 1], 0x31));
    for (int j = 0; j < 2; j++) /* half k: lanes 0 + 2, 1 + 3 of v[4j + k], of v[4j + 2 + k] */
        t[j] = _mm256_add_ps(_mm256_shuffle_ps(h[2 * j], h[2 * j + 1], 0x44),
                             _mm256_shuffle_ps(h[2 * j], h[2 * j + 1], 0xEE));
    float f[8]; /* half k, lane e: the sum of v[2e + k] */
    _mm256_storeu_ps(f, _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], 0x88),
                                      _mm256_shuffle_ps(t[0], t[1], 0xDD)));
    for (int k = 0; k < 8; k++) out[k] = f[k % 2 * 4 + k / 2];
}

#define DOT_K 16
typedef struct { __m256 even, odd; } dot_vec; /* bf16 values 0, 2, .., 14 and 1, 3, .., 15 */
typedef struct { __m256 even, odd; } dot_acc;
SIMD_INLINE dot_vec dot_split(__m256i v) {
    const dot_vec d = {
        _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)),
        _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)))};
    return d;
}
SIMD_INLINE dot_vec dot_load(const uint16_t *p) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    /* One load: left alone, the compiler folds a second load of p into the mask, and a few-row
     * product is bound by loads (5 rows: 10 activation loads and 2 of the weight per 10 FMAs;
     * from cache, 5% faster with one). */
    __asm__("" : "+x"(v));
    return dot_split(v);
}
SIMD_INLINE dot_vec dot_load_tail(const uint16_t *p, int64_t n) {
    uint16_t buf[DOT_K] = {0};
    memcpy(buf, p, (size_t)n * sizeof(uint16_t));
    return dot_split(_mm256_loadu_si256((const __m256i *)buf));
}
SIMD_INLINE dot_acc dot_zero(void) {
    const dot_acc a = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    return a;
}
SIMD_INLINE dot_acc dot_step(dot_acc acc, dot_vec x, dot_vec w) {
    const dot_acc a = {_mm256_fmadd_ps(x.even, w.even, acc.even),
                       _mm256_fmadd_ps(x.odd, w.odd, acc.odd)};
    return a;
}
SIMD_INLINE dot_acc dot_add(dot_acc a, dot_acc b) {
    const dot_acc s = {_mm256_add_ps(a.even, b.even), _mm256_add_ps(a.odd, b.odd)};
    return s;
}
SIMD_INLINE vf dot_collapse(dot_acc acc) { return _mm256_add_ps(acc.even, acc.odd); }

#else /* SPECSERVE_ISA_PORTABLE */

/* 16-byte vectors: one SSE2 / NEON register each, the baseline of every 64-bit x86 and ARM. */
#define VF 4
typedef float vf __attribute__((vector_size(VF * sizeof(float))));
typedef uint32_t vu __attribute__((vector_size(VF * sizeof(uint32_t))));
typedef uint16_t vh __attribute__((vector_size(VF * sizeof(uint16_t))));
SIMD_INLINE vf vf_zero(void) { return (vf){0}; }
SIMD_INLINE vf vf_set1(float a) { return (vf){0} + a; }
SIMD_INLINE vf vf_add(vf a, vf b) { return a + b; }
SIMD_INLINE vf vf_mul(vf a, vf b) { return a * b; }
SIMD_INLINE vf vf_fmadd(vf a, vf b, vf c) { return a * b + c; } /* not contracted */
SIMD_INLINE vf vf_load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
SIMD_INLINE void vf_store(float *p, vf v) { memcpy(p, &v, sizeof v); }
SIMD_INLINE vf vf_load_bf16(const uint16_t *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
}
SIMD_INLINE void vf_store_bf16(uint16_t *p, vf v) {
    const vu u = (vu)v;
    const vu nan = (vu)((u & 0x7fffffffu) > 0x7f800000u); /* all ones where NaN */
    const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const vu quiet = (u >> 16) | 0x40u;
    const vh bits = __builtin_convertvector((rounded & ~nan) | (quiet & nan), vh);
    memcpy(p, &bits, sizeof bits);
}
SIMD_INLINE float vf_reduce_add(vf v) {
    return (v[0] + v[2]) + (v[1] + v[3]);
}
SIMD_INLINE void vf_reduce_add_each(const vf v[4], float out[4]) {
    for (int k = 0; k < 4; k++) out[k] = vf_reduce_add(v[k]);
}

/* As AVX2: 8 bf16 values split into even and odd lanes by a shift and a mask. */
#define DOT_K 8
typedef struct { vf even, odd; } dot_vec;
typedef struct { vf even, odd; } dot_acc;
SIMD_INLINE dot_vec dot_split(vu v) {
    const dot_vec d = {(vf)(v << 16), (vf)(v & 0xffff0000u)};
    return d;
}
SIMD_INLINE dot_vec dot_load(const uint16_t *p) {
    vu v;
    memcpy(&v, p, sizeof v);
    return dot_split(v);
}
SIMD_INLINE dot_vec dot_load_tail(const uint16_t *p, int64_t n) {
    uint16_t buf[DOT_K] = {0};
    memcpy(buf, p, (size_t)n * sizeof(uint16_t));
    return dot_load(buf);
}
SIMD_INLINE dot_acc dot_zero(void) {
    const dot_acc a = {{0}, {0}};
    return a;
}
SIMD_INLINE dot_acc dot_step(dot_acc acc, dot_vec x, dot_vec w) {
    const dot_acc a = {x.even * w.even + acc.even, x.odd * w.odd + acc.odd};
    return a;
}
SIMD_INLINE dot_acc dot_add(dot_acc a, dot_acc b) {
    const dot_acc s = {a.even + b.even, a.odd + b.odd};
    return s;
}
SIMD_INLINE vf dot_collapse(dot_acc acc) { return acc.even + acc.odd; }

#endif

/* Every ISA: a dot_acc summed as its collapsed vector. */
SIMD_INLINE float dot_sum(dot_acc acc) { return vf_reduce_add(dot_collapse(acc)); }

#endif
