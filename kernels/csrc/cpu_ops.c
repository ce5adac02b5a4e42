/* The small per-layer ops of a CPU step, float32, one call each instead of a chain of torch ops.
 *
 * At batch 1 a decode step is ~30 layers x a dozen tiny ops, and each torch op costs a few
 * microseconds of dispatch whatever its size; these loops do the same arithmetic in one pass:
 *   rms_norm:   optional residual add, then x * rsqrt(mean(x^2) + eps) * weight;
 *   rope:       rotate-half RoPE of q and k in place, cos/sin read from the cache by position;
 *   write_kv:   this step's k and v rows into their slots of the paged cache (float32, or
 *               rounded to its float16 / bfloat16);
 *   paged_attention: query rows against their sequences' cached K/V, read in place through
 *               the block tables (decode rows, and short extends after a cached prefix);
 *   silu_mul:   silu(gate) * up of a fused gate/up output.
 * Tensors are row-major; a "stride" is the distance in floats between consecutive rows, so q and
 * k may be column slices of the fused qkv output.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "paged_attention.h"
#include "row_ops.h"

void rms_norm(const float *x, const float *residual, const float *weight, float eps,
              float *out, float *sum_out, int64_t rows, int64_t h) {
#pragma omp parallel for schedule(static) if (rows > 8)
    for (int64_t r = 0; r < rows; r++)
        rms_norm_row(x + r * h, residual ? residual + r * h : NULL, weight, eps, out + r * h,
                     sum_out + r * h, h);
}

/* q: [T, hq, d] rows q_stride apart, k: [T, hkv, d] rows k_stride apart; cos_sin: [P, d].
 * Returns -1, touching nothing, if a position is outside [0, P). */
int rope(float *q, int64_t q_stride, float *k, int64_t k_stride, const int64_t *positions,
         const float *cos_sin, int64_t num_positions, int64_t tokens, int64_t hq, int64_t hkv,
         int64_t d) {
    const int64_t half = d / 2;
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= num_positions) return -1;
#pragma omp parallel for schedule(static) if (tokens > 8)
    for (int64_t t = 0; t < tokens; t++) {
        const float *cs = cos_sin + positions[t] * d;
        for (int64_t h = 0; h < hq; h++) rotate_half(q + t * q_stride + h * d, cs, half);
        for (int64_t h = 0; h < hkv; h++) rotate_half(k + t * k_stride + h * d, cs, half);
    }
    return 0;
}

/* k, v: [T, width] rows k_stride / v_stride apart; caches: [num_slots, width], width = hkv * d,
 * of kv_kind (kv_rows.h), rounded on store. Returns -1, writing nothing, if a slot is outside
 * [0, num_slots) or the kind is not supported. */
int write_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, void *k_cache,
             void *v_cache, int32_t kv_kind, const int64_t *slots, int64_t num_slots,
             int64_t tokens, int64_t width) {
    if (!kv_kind_ok(kv_kind)) return -1;
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
    for (int64_t t = 0; t < tokens; t++) {
        kv_store(k_cache, kv_kind, slots[t] * width, k + t * k_stride, width);
        kv_store(v_cache, kv_kind, slots[t] * width, v + t * v_stride, width);
    }
    return 0;
}

/* Attention for a list of query rows: row r_i = row_ids[i] of q ([T, hq, d], rows q_stride
 * apart) sees the first row_lens[i] positions of sequence row_seqs[i], whose block table is row
 * row_seqs[i] of block_tables (int32 [num_seqs, max_blocks]); out[r_i] ([T, hq, d], contiguous)
 * gets the result. A decode row sees its whole sequence; an extend row at position p, p + 1.
 * The caches are of kv_kind (kv_rows.h). Each (row, split of split_len positions, kv head) is
 * one task (paged_attention.h), then each (row, kv head) merges its splits. Returns -1 for
 * unsupported shapes or kinds, -2 if a row is out of range, sees no position or more than its
 * table holds, or its table names a block outside [0, num_blocks); nothing is read then; -3
 * if scratch memory could not be had. */
int paged_attention(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                    int32_t kv_kind, int64_t num_blocks, const int32_t *block_tables,
                    int64_t num_seqs, int64_t max_blocks, const int64_t *row_ids,
                    const int32_t *row_seqs, const int32_t *row_lens, int64_t num_rows,
                    int64_t num_q_rows, float *out, int64_t hq, int64_t hkv, int64_t d,
                    int64_t bs, float scale, int64_t split_len) {
    const int64_t group = hq / hkv;
    if (hkv < 1 || hq % hkv || group > MAX_GROUP || d > MAX_HEAD_DIM || hkv * d > TILE ||
        !kv_kind_ok(kv_kind) || split_len < CHUNK || split_len % CHUNK)
        return -1;
    for (int64_t i = 0; i < num_rows; i++) {
        const int64_t len = row_lens[i], used = (len + bs - 1) / bs, s = row_seqs[i];
        if (row_ids[i] < 0 || row_ids[i] >= num_q_rows || s < 0 || s >= num_seqs || len < 1 ||
            used > max_blocks)
            return -2;
        for (int64_t j = 0; j < used; j++) {
            const int32_t blk = block_tables[s * max_blocks + j];
            if (blk < 0 || blk >= num_blocks) return -2;
        }
    }
    int64_t *off = malloc((size_t)(num_rows + 1) * sizeof(int64_t));
    if (!off) return -3;
    const int64_t total = split_offsets(row_lens, num_rows, split_len, off);
    const int64_t part_size = group * partial_width(d); /* floats per (split, kv head) */
    float *parts = malloc((size_t)(total * hkv * part_size) * sizeof(float));
    if (!parts) {
        free(off);
        return -3;
    }
#pragma omp parallel
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < total; u++) {
            /* one task per split, every kv head; a row's partials are kept kv head by kv head,
             * each head's splits side by side for its merge */
            const int64_t i = split_row(off, num_rows, u);
            const int64_t s = u - off[i], splits = off[i + 1] - off[i];
            const int64_t begin = s * split_len;
            const int64_t end = begin + split_len < row_lens[i] ? begin + split_len : row_lens[i];
            attend_range(q + row_ids[i] * q_stride, hq, k_cache, v_cache, kv_kind, hkv, d, bs,
                         block_tables + (int64_t)row_seqs[i] * max_blocks, begin, end, scale,
                         parts + (off[i] * hkv + s) * part_size, splits * part_size);
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < num_rows * hkv; t++) {
            const int64_t i = t / hkv, g = t % hkv, splits = off[i + 1] - off[i];
            merge_splits(parts + (off[i] * hkv + g * splits) * part_size, splits, group, d,
                         out + (row_ids[i] * hq + g * group) * d);
        }
    }
    free(parts);
    free(off);
    return 0;
}

/* gate_up: [T, 2 * inter] (gate columns first); out: [T, inter]. */
void silu_mul(const float *gate_up, float *out, int64_t tokens, int64_t inter) {
#pragma omp parallel for schedule(static) if (tokens > 8)
    for (int64_t t = 0; t < tokens; t++) {
        const float *g = gate_up + t * 2 * inter, *u = g + inter;
        float *o = out + t * inter;
        for (int64_t i = 0; i < inter; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
