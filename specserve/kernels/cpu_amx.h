/* The AMX product (cpu_amx.c), which gemv_bf16 and gemm_bf16 run on the `amx` path. */
#ifndef SPECSERVE_CPU_AMX_H
#define SPECSERVE_CPU_AMX_H

#include <stdint.h>

/* gemv_bf16's contract: y_f32 or y_bf16 (the other NULL) [M, N]; bias [N] bf16 or NULL.
 * Returns 0, or -1 when a buffer could not be allocated. */
int amx_product(const uint16_t *x, const uint16_t *w, const uint16_t *bias, float *y_f32,
                uint16_t *y_bf16, int64_t M, int64_t N, int64_t K, int num_threads);

#endif
