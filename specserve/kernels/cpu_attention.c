/* Paged attention on CPU: decode tokens, token trees, prompt chunks (any ISA, cpu_simd.h).
 *
 * The same contract as paged_attention_reference (reference.py): query row t of request b
 * (local index i) attends to the request's cached positions [0, context_lens[b]) and to new
 * position context_lens[b] + j when local_mask[t, j] (j <= i when there is no mask), K/V read
 * through the block table; on a sliding-window layer (window > 0: Gemma 3's local layers) a
 * query at rotary position P sees only keys at positions > P - window, a cached position i
 * being at i and a new one at its own row's position (a tree node sits at root + depth), as
 * masked_attention (specserve/model/attention.py) masks them. Scores, softmax and the
 * weighted sum are in fp32 (q.k products of
 * bf16 values are exact in fp32, computed as IEEE fp32 multiply-adds like the reference; only
 * the summation order differs), probabilities are normalised before the weighted sum, and
 * the output is rounded to bf16 as the reference's `.to(q.dtype)` does. Masked positions never
 * enter a score or a sum (bf16 ones of this step's tree may be widened beside the visible ones,
 * and are left unused; cached positions past a row's context are never touched).
 *
 * A query row's result depends only on its own visible positions, read in position order, so
 * it is the same whatever other rows share the call (row-count invariance): a chain's last row
 * verified with its draft equals the same token decoded alone over the same cache.
 *
 * One work item is one (request, KV head, block of up to ROW_BLOCK of its new rows): the K and V
 * rows those rows may see are widened to fp32 once and read by every row of the block and the
 * KV head's `group` query heads (grouped-query attention), up to HEADS_PER_PASS of those heads
 * at a time sharing every K and V row load (attend_heads_n). Every score and output value is
 * summed in the same order as one head at a time, dimension by dimension, would sum it. 2-core
 * Zen 3, AVX2, the widened model's heads (16 query, 2 KV, 64 dims), one thread per layer: a
 * 512-token prompt 57 -> 29 ms, a 5-token verify over 300 cached positions 1.02 -> 0.33 ms.
 * The softmax's exponentials are cpu_exp.h's, vectorized (libm's expf took a quarter of the
 * time left); q.k runs DOTS positions at a time (one position's dot is a chain of dependent
 * multiply-adds); fp32 K and V rows are read in place.
 * Against the kernel before these three changes, one run: a decode step over 100 positions,
 * SmolLM2's heads (9 query, 3 KV, fp32) 23 -> 14 us, the widened model's 28 -> 19 us; a 5-row
 * chain 84 -> 46 and 110 -> 61 us. Heads attended together (Zen 5, AVX-512, fp32, bits
 * unchanged), one call from Python, 2 threads: SmolLM2's heads over 2000 positions 95 -> 64 us,
 * 5 rows over 500 positions 84 -> 60 us; the widened model's 122 -> 70 and 116 -> 72 us.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_exp.h"
#include "cpu_kernels.h"
#include "cpu_simd.h"

/* q.k multiply-adds below which one thread does it all: a decode step over 100 positions with
 * SmolLM2's 9 heads (58K) runs 22 -> 19 us on both threads, the widened model's 16 heads 37 ->
 * 26 us (the product kernels keep the other thread awake between layers). */
#define PARALLEL_MIN_MACS (1 << 15)
/* New rows of a request per work item: they share one widening of their KV head's bf16 rows
 * (a 5-row verify widened the same cached positions five times), and a prompt chunk still
 * splits into enough items for every thread. The widened model's heads, against one row per
 * item, one run (median of 200 calls): 5 rows over 100 / 400 cached positions 49.6 -> 44.5 /
 * 179.7 -> 155.5 us; 64 rows 716 -> 629 / 3299 -> 2702 us. */
#define ROW_BLOCK 8
/* New rows of a request at most that paged_attention counts as a decode or verify step. */
#define FEW_ROWS 16

/* q.k in fp32 with IEEE products (VDPBF16PS would flush denormals and round differently), both
 * already widened to fp32 (exact): head_dim / VF multiply-adds in order, then the reduction. */
static inline float dot_f32(const float *a, const float *b, int64_t D) {
    vf acc = vf_zero();
    for (int64_t d = 0; d < D; d += VF) acc = vf_fmadd(vf_load(a + d), vf_load(b + d), acc);
    return vf_reduce_add(acc);
}

/* One row of D values into fp32: bf16 widened (exact), or fp32 copied. */
static inline void widen(const void *src, int is_f32, float *dst, int64_t D) {
    if (is_f32) {
        memcpy(dst, src, (size_t)D * sizeof(float));
        return;
    }
    const uint16_t *bf = src;
    for (int64_t d = 0; d < D; d += VF) vf_store(dst + d, vf_load_bf16(bf + d));
}

/* Positions whose q.k run side by side: independent multiply-add chains, each summed exactly
 * as dot_f32 sums it (a decode step's q.k was latency-bound: 8 dependent multiply-adds per
 * position). */
#define DOTS 4

/* K and V rows are fetched this many positions ahead of their use: a cached row sits a whole
 * KV row (every KV head) from the next, and a decode step finds them in memory, not cache
 * (the layers' weights went through it since). SmolLM2's heads, fp32, 30 layers' caches
 * after a flush, 2 threads, Zen 5, both builds in one process, the same bits: 1 / 2 / 5 rows
 * over 200 positions 16.4 / 23.9 / 36.1 -> 15.1 / 21.7 / 35.5 us a layer, over 1000 positions
 * 68.1 / 97.8 / 174.4 -> 62.2 / 87.7 / 166.7. */
#define PREFETCH_AHEAD 16

static inline void prefetch_row(const float *row, int64_t D) {
    for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(row + d, 0, 3);
}

/* Query heads of one KV head attended together (grouped-query attention): HEADS_PER_PASS at a
 * time share each K and V row load, and their independent chains interleave. One head alone is
 * latency-bound at head_dim 64: its q.k is 4 dependent multiply-adds per position, its running
 * total one dependent add per position, each weighted-sum lane one multiply-add per position.
 * Registers: HEADS_PER_PASS * DOTS score accumulators, HEADS_PER_PASS * PV_CHUNK output ones. */
#define HEADS_PER_PASS 4 /* also on AVX2: 2 there ran slower at 2000 positions (106 vs 87 us) */
#define PV_CHUNK 4 /* output vectors per head accumulated in registers per pass over V */
/* A pass's q.k sums, rounded up to whole vectors for vf_reduce_add_each. */
#define SUM_SLOTS ((HEADS_PER_PASS * DOTS + VF - 1) / VF * VF)

/* hp <= HEADS_PER_PASS query heads over the same n visible positions: k_rows, v_rows [n]
 * pointers to their D fp32 values (in the cache itself for fp32, widened copies for bf16),
 * qf [hp][D] fp32; scores [hp][stride] scratch (stride >= n); outs[h] [D] bf16, or fp32 when
 * is_f32. Each head's scores, softmax and output are computed exactly as for that head alone:
 * every value by the same operations in the same order (q.k over D in VF-lane steps then
 * halves added pairwise; the total over positions in order; probabilities normalised before
 * the weighted sum; each output value summed over positions in order). Inlined with a
 * constant hp, so the per-head arrays below live in registers. cold_v: the V rows are in
 * memory, not cache (a request's first row), so they are fetched beside the K rows while the
 * scores are computed, not only once the weighted sum reaches them (1-5 rows over 200 or
 * 1000 cached positions: 0.93-0.97x the time; on later rows, which find them in cache, the
 * extra prefetches cost up to 1.05x). */
SIMD_INLINE void attend_heads_n(const int hp, const float *qf, const float *const *k_rows,
                                const float *const *v_rows, int64_t n, int64_t D, float scale,
                                float *scores, int64_t stride, void *const *outs, int is_f32,
                                int cold_v) {
    int64_t s = 0;
    for (; s + DOTS <= n; s += DOTS) {
        for (int r = 0; r < DOTS && s + PREFETCH_AHEAD + r < n; r++) {
            prefetch_row(k_rows[s + PREFETCH_AHEAD + r], D);
            if (cold_v) prefetch_row(v_rows[s + PREFETCH_AHEAD + r], D);
        }
        vf acc[HEADS_PER_PASS][DOTS];
#pragma GCC unroll 4
        for (int h = 0; h < hp; h++)
#pragma GCC unroll 4
            for (int r = 0; r < DOTS; r++) acc[h][r] = vf_zero();
        for (int64_t d = 0; d < D; d += VF) {
            vf kv[DOTS];
#pragma GCC unroll 4
            for (int r = 0; r < DOTS; r++) kv[r] = vf_load(k_rows[s + r] + d);
#pragma GCC unroll 4
            for (int h = 0; h < hp; h++) {
                const vf qv = vf_load(qf + h * D + d);
#pragma GCC unroll 4
                for (int r = 0; r < DOTS; r++) acc[h][r] = vf_fmadd(qv, kv[r], acc[h][r]);
            }
        }
        /* The hp * DOTS sums VF at a time: vf_reduce_add's additions, each serving VF sums
         * (with 2: 0.94-0.98x the time at 9-64 rows, the same bits). */
        vf all[SUM_SLOTS];
        float sums[SUM_SLOTS];
#pragma GCC unroll 16
        for (int k = 0; k < SUM_SLOTS; k++)
            all[k] = k < hp * DOTS ? acc[k / DOTS][k % DOTS] : vf_zero();
#pragma GCC unroll 4
        for (int k = 0; k < hp * DOTS; k += VF) vf_reduce_add_each(all + k, sums + k);
#pragma GCC unroll 4
        for (int h = 0; h < hp; h++)
#pragma GCC unroll 4
            for (int r = 0; r < DOTS; r++) scores[h * stride + s + r] = sums[h * DOTS + r] * scale;
    }
    for (; s < n; s++)
#pragma GCC unroll 4
        for (int h = 0; h < hp; h++)
            scores[h * stride + s] = dot_f32(qf + h * D, k_rows[s], D) * scale;

    float best[HEADS_PER_PASS], total[HEADS_PER_PASS];
#pragma GCC unroll 4
    for (int h = 0; h < hp; h++) best[h] = -INFINITY, total[h] = 0.0f;
    for (s = 0; s < n; s++)
#pragma GCC unroll 4
        for (int h = 0; h < hp; h++) {
            const float x = scores[h * stride + s];
            best[h] = x > best[h] ? x : best[h];
        }
    for (int h = 0; h < hp; h++) {
        float *sc = scores + h * stride;
        for (s = 0; s < n; s++) sc[s] = exp_f32(sc[s] - best[h]); /* vectorized */
    }
    for (s = 0; s < n; s++)
#pragma GCC unroll 4
        for (int h = 0; h < hp; h++) total[h] += scores[h * stride + s];
    /* Probabilities first, then their weighted sum, as the reference computes them. */
    for (int h = 0; h < hp; h++) {
        const float inv_total = 1.0f / total[h];
        float *sc = scores + h * stride;
        for (s = 0; s < n; s++) sc[s] *= inv_total;
    }

    /* Weighted sum of V: one pass over the positions per PV_CHUNK output vectors of every
     * head, each output value summed over the positions in order. */
    for (int64_t d0 = 0; d0 < D; d0 += PV_CHUNK * VF) {
        const int chunk = D - d0 < PV_CHUNK * VF ? (int)((D - d0) / VF) : PV_CHUNK;
        vf acc[HEADS_PER_PASS][PV_CHUNK];
#pragma GCC unroll 4
        for (int h = 0; h < hp; h++)
#pragma GCC unroll 4
            for (int c = 0; c < PV_CHUNK; c++) acc[h][c] = vf_zero();
        for (s = 0; s < n; s++) {
            if (d0 == 0 && s + PREFETCH_AHEAD < n) prefetch_row(v_rows[s + PREFETCH_AHEAD], D);
            const float *vv = v_rows[s] + d0;
            if (chunk == PV_CHUNK) {
                vf v[PV_CHUNK];
#pragma GCC unroll 4
                for (int c = 0; c < PV_CHUNK; c++) v[c] = vf_load(vv + c * VF);
#pragma GCC unroll 4
                for (int h = 0; h < hp; h++) {
                    const vf p = vf_set1(scores[h * stride + s]);
#pragma GCC unroll 4
                    for (int c = 0; c < PV_CHUNK; c++) acc[h][c] = vf_fmadd(p, v[c], acc[h][c]);
                }
            } else {
#pragma GCC unroll 4
                for (int h = 0; h < hp; h++) {
                    const vf p = vf_set1(scores[h * stride + s]);
                    for (int c = 0; c < chunk; c++)
                        acc[h][c] = vf_fmadd(p, vf_load(vv + c * VF), acc[h][c]);
                }
            }
        }
#pragma GCC unroll 4
        for (int h = 0; h < hp; h++)
            for (int c = 0; c < chunk; c++) {
                if (is_f32)
                    vf_store((float *)outs[h] + d0 + c * VF, acc[h][c]);
                else
                    vf_store_bf16((uint16_t *)outs[h] + d0 + c * VF, acc[h][c]);
            }
    }
}

/* attend_heads_n with hp made a constant for each count. */
static void attend_heads(int hp, const float *qf, const float *const *k_rows,
                         const float *const *v_rows, int64_t n, int64_t D, float scale,
                         float *scores, int64_t stride, void *const *outs, int is_f32,
                         int cold_v) {
#define ATTEND(HP) \
    attend_heads_n(HP, qf, k_rows, v_rows, n, D, scale, scores, stride, outs, is_f32, cold_v)
    switch (hp) {
    case 1: ATTEND(1); break;
    case 2: ATTEND(2); break;
    case 3: ATTEND(3); break;
    case 4: ATTEND(4); break;
    }
#undef ATTEND
}

/* Cache slots of positions from, from + 1, .. through a block table, in order, with no division
 * per position: a 5-row verify looked up 200 positions for each of its 15 (row, KV head) items,
 * each through a 64-bit division by the runtime block size (without: 0.96-0.98x the time at
 * 2-64 rows). */
typedef struct {
    const int32_t *table;
    int64_t block_size, p, block, offset; /* p = block * block_size + offset */
} SlotWalk;

static inline SlotWalk slot_walk(const int32_t *table, int64_t block_size, int64_t from) {
    return (SlotWalk){table, block_size, from, from / block_size, from % block_size};
}

static inline int64_t slot_of(const SlotWalk *w) {
    return (int64_t)w->table[w->block] * w->block_size + w->offset;
}

static inline void slot_next(SlotWalk *w) {
    w->p++;
    if (++w->offset == w->block_size) w->offset = 0, w->block++;
}

/* q, caches and out all bf16 (is_f32 = 0) or all fp32 (is_f32 = 1: the default GGUF model runs
 * its non-quantized tensors in fp32); the arithmetic is the same fp32 either way. window: 0 for
 * global attention, else the sliding window, positions [T] then the rows' rotary positions
 * (NULL allowed without a window). Returns 0, or -1 when a scratch buffer could not be
 * allocated. */
int paged_attention(const void *q, const void *k_cache, const void *v_cache, int is_f32,
                    const int32_t *block_tables, int64_t max_blocks,
                    const int32_t *query_start_loc, const int32_t *context_lens,
                    const uint8_t *local_mask, int64_t max_query_len, int64_t num_requests,
                    int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                    int64_t block_size, float scale, const int64_t *positions, int64_t window,
                    void *out, int num_threads) {
    const size_t elem = is_f32 ? sizeof(float) : sizeof(uint16_t);
    const char *qb = q, *kb = k_cache, *vb = v_cache;
    char *ob = out;
    int64_t max_len = 1; /* positions any query can see: the scratch buffers' size */
    int64_t work = 0;    /* q.k products, at most */
    for (int64_t b = 0; b < num_requests; b++) {
        const int64_t n_new = query_start_loc[b + 1] - query_start_loc[b];
        const int64_t len = context_lens[b] + n_new;
        if (len > max_len) max_len = len;
        work += n_new * len;
    }
    const int64_t group = num_q_heads / num_kv_heads;
    const int64_t D = head_dim;
    /* A decode step over a short context is tens of microseconds of work: waking the other
     * threads and joining them costs a good part of that, and far more on a busy machine
     * where a thread waits for its time slice. */
    const int parallel = work * num_q_heads * head_dim >= PARALLEL_MIN_MACS;
    /* Work items: (request, KV head, block of up to row_block of its new rows), numbered from
     * first_item[b] for request b. Blocks of rows only where they share a widening and keep
     * the threads evenly busy (fp32 rows are read in place; 3 KV heads on 2 threads would
     * leave one idle a third of a verify step). */
    const int64_t threads = parallel ? num_threads : 1;
    const int64_t row_block = !is_f32 && num_kv_heads % threads == 0 ? ROW_BLOCK : 1;
    int64_t *first_item = malloc(sizeof(int64_t) * (size_t)(num_requests + 1));
    if (first_item == NULL) return -1;
    first_item[0] = 0;
    for (int64_t b = 0; b < num_requests; b++) {
        const int64_t n_new = query_start_loc[b + 1] - query_start_loc[b];
        first_item[b + 1] = first_item[b] + (n_new + row_block - 1) / row_block * num_kv_heads;
    }
    const int64_t items = first_item[num_requests];
    /* Which thread runs which item (a request's items are numbered KV head by KV head): a few
     * rows of a request (decode, verify) go in contiguous runs, so a KV head's rows are read
     * by one thread, from its core's cache after the first; a prompt chunk's go round-robin,
     * since under a causal mask later rows see more positions, and contiguous halves would
     * leave one thread with three quarters of the work. SmolLM2's heads, fp32, 30 layers'
     * caches after a flush, 2 threads, Zen 5, both builds in one process, three runs: 2 / 5 /
     * 9 rows over 200 positions 0.85-0.99x / 0.87-0.95x / 0.91-0.97x the time, over 1000
     * positions 0.86-0.96x / 0.79-0.89x / 0.87-0.91x; 1 row and 64-row chunks unchanged. */
    const int64_t chunk = max_query_len > FEW_ROWS ? 1 : (items + threads - 1) / threads;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (parallel)
    {
        float *scores = malloc(sizeof(float) * HEADS_PER_PASS * (size_t)max_len);
        /* The visible K and V rows of one query row for the KV head's `group` query heads:
         * fp32 rows where they lie in the cache, bf16 rows widened to fp32 (kf, vf_copy, by
         * position) once per work item, for all its rows. */
        const float **k_rows = malloc(sizeof(float *) * (size_t)max_len);
        const float **v_rows = malloc(sizeof(float *) * (size_t)max_len);
        const size_t copy_bytes = ((size_t)max_len * D * sizeof(float) + 63) / 64 * 64;
        float *kf = is_f32 ? NULL : aligned_alloc(64, copy_bytes);
        float *vf_copy = is_f32 ? NULL : aligned_alloc(64, copy_bytes);
        float *qf = aligned_alloc(64, (HEADS_PER_PASS * (size_t)D * sizeof(float) + 63) / 64 * 64);
        const int ok = scores && k_rows && v_rows && (is_f32 || (kf && vf_copy)) && qf;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static, chunk)
        for (int64_t item = 0; item < items; item++) {
            if (!ok) continue;
            int64_t b = 0;
            while (first_item[b + 1] <= item) b++;
            const int64_t ctx = context_lens[b];
            const int64_t n_new = query_start_loc[b + 1] - query_start_loc[b];
            const int64_t blocks = (n_new + row_block - 1) / row_block;
            const int64_t kv_head = (item - first_item[b]) / blocks;
            const int64_t i0 = (item - first_item[b]) % blocks * row_block;
            const int64_t i1 = n_new - i0 < row_block ? n_new : i0 + row_block;
            const int32_t *table = block_tables + b * max_blocks;
            const int64_t first_row = query_start_loc[b] + i0;
            /* Positions any of rows [i0, i1) may see: causal, up to the last row's own; under a
             * mask, any new position; in a window, no cached one at or before the lowest row
             * position minus the window. */
            const int64_t seen = ctx + (local_mask ? n_new : i1);
            int64_t from = 0;
            if (window > 0) {
                int64_t lowest = positions[first_row];
                for (int64_t t = first_row + 1; t < first_row + (i1 - i0); t++)
                    lowest = positions[t] < lowest ? positions[t] : lowest;
                from = lowest - window + 1;
                from = from < 0 ? 0 : (from > ctx ? ctx : from);
            }
            if (!is_f32)
                for (SlotWalk w = slot_walk(table, block_size, from); w.p < seen; slot_next(&w)) {
                    const int64_t at = (slot_of(&w) * num_kv_heads + kv_head) * D;
                    widen(kb + at * elem, 0, kf + w.p * D, D);
                    widen(vb + at * elem, 0, vf_copy + w.p * D, D);
                }
            for (int64_t i = i0; i < i1; i++) {
                const int64_t t = query_start_loc[b] + i;
                /* Visible positions, in position order. */
                int64_t n = 0;
                for (SlotWalk w = slot_walk(table, block_size, from); w.p < seen; slot_next(&w)) {
                    const int64_t p = w.p;
                    if (p >= ctx) {
                        const int64_t j = p - ctx;
                        const int visible = local_mask ? local_mask[t * max_query_len + j] : j <= i;
                        if (!visible) continue;
                    }
                    if (window > 0) {
                        const int64_t key = p < ctx ? p : positions[query_start_loc[b] + p - ctx];
                        if (positions[t] - key >= window) continue;
                    }
                    if (is_f32) {
                        const int64_t at = (slot_of(&w) * num_kv_heads + kv_head) * D;
                        k_rows[n] = (const float *)(kb + at * elem);
                        v_rows[n] = (const float *)(vb + at * elem);
                    } else {
                        k_rows[n] = kf + p * D;
                        v_rows[n] = vf_copy + p * D;
                    }
                    n++;
                }
                for (int64_t g0 = 0; g0 < group; g0 += HEADS_PER_PASS) {
                    const int hp = group - g0 < HEADS_PER_PASS ? (int)(group - g0)
                                                               : HEADS_PER_PASS;
                    void *outs[HEADS_PER_PASS];
                    for (int j = 0; j < hp; j++) {
                        const int64_t row = (t * num_q_heads + kv_head * group + g0 + j) * D;
                        widen(qb + row * elem, is_f32, qf + j * D, D);
                        outs[j] = ob + row * elem;
                    }
                    attend_heads(hp, qf, k_rows, v_rows, n, D, scale, scores, max_len, outs,
                                 is_f32, is_f32 && i == 0);
                }
            }
        }
        free(scores);
        free(k_rows);
        free(v_rows);
        free(kf);
        free(vf_copy);
        free(qf);
    }
    free(first_item);
    return failed ? -1 : 0;
}

/* This step's K and V into their cache slots, as store_kv_reference: key, value [T] rows of
 * row_len values of elem_bytes each (bf16 or fp32), row_stride values apart (views into the
 * fused qkv projection output); caches [num_slots, row_len] of the same type; slot_mapping [T],
 * negative = padding (skipped). Returns -1, writing nothing, when a slot is past the cache. */
int store_kv_rows(const void *key, const void *value, int64_t row_stride, void *k_cache,
                  void *v_cache, const int64_t *slot_mapping, int64_t T, int64_t row_len,
                  int64_t num_slots, int64_t elem_bytes) {
    for (int64_t t = 0; t < T; t++)
        if (slot_mapping[t] >= num_slots) return -1;
    const size_t bytes = (size_t)(row_len * elem_bytes), stride = (size_t)(row_stride * elem_bytes);
    for (int64_t t = 0; t < T; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        memcpy((char *)k_cache + (size_t)slot * bytes, (const char *)key + (size_t)t * stride, bytes);
        memcpy((char *)v_cache + (size_t)slot * bytes, (const char *)value + (size_t)t * stride,
               bytes);
    }
    return 0;
}
