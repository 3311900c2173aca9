/* The entry points the CPU kernel files export (ctypes signatures in cpu_build.py), declared
 * once so that cpu_decoder.c can call them and each defining file is checked against them. */
#ifndef SPECSERVE_CPU_KERNELS_H
#define SPECSERVE_CPU_KERNELS_H

#include <stdint.h>

int gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, float *y_f32,
              uint16_t *y_bf16, int64_t M, int64_t N, int64_t K, int num_threads);
int gemm_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, float *y_f32,
              uint16_t *y_bf16, int64_t M, int64_t N, int64_t K, int num_threads);
int outer_gemm_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, float *y_f32,
                    uint16_t *y_bf16, int64_t M, int64_t N, int64_t K, int num_threads);
int quant_matmul(const void *x, int x_bf16, const uint8_t *w, int fmt, int group,
                 const void *bias, void *y, int y_bf16, int64_t M, int64_t N, int64_t K,
                 int num_threads);
int quant_matmul_int(const void *x, int x_bf16, const uint8_t *w, int fmt, int group,
                     const void *bias, void *y, int y_bf16, int64_t M, int64_t N, int64_t K,
                     int act, int num_threads);
void rms_norm_rows(const void *x, const void *w, void *y, int64_t T, int64_t H, float eps,
                   int f32);
int rotary_rows(void *x, int64_t T, int64_t row_stride, int64_t num_heads, int64_t head_dim,
                const float *cos_table, const float *sin_table, int64_t max_positions,
                const int64_t *positions, int f32);
void silu_mul_rows(const void *gate_up, void *y, int64_t T, int64_t I, int f32,
                   int num_threads);
void gelu_tanh_mul_rows(const void *gate_up, void *y, int64_t T, int64_t I, int f32,
                        int num_threads);
int paged_attention(const void *q, const void *k_cache, const void *v_cache, int is_f32,
                    const int32_t *block_tables, int64_t max_blocks,
                    const int32_t *query_start_loc, const int32_t *context_lens,
                    const uint8_t *local_mask, int64_t max_query_len, int64_t num_requests,
                    int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                    int64_t block_size, float scale, const int64_t *positions, int64_t window,
                    void *out, int num_threads);
int store_kv_rows(const void *key, const void *value, int64_t row_stride, void *k_cache,
                  void *v_cache, const int64_t *slot_mapping, int64_t T, int64_t row_len,
                  int64_t num_slots, int64_t elem_bytes);

#endif
