/* The small per-layer ops of a CPU step, float32, one call each instead of a chain of torch ops.
 *
 * At batch 1 a decode step is ~30 layers x a dozen tiny ops, and each torch op costs a few
 * microseconds of dispatch whatever its size; these loops do the same arithmetic in one pass:
 *   rms_norm:   optional residual add, then x * rsqrt(mean(x^2) + eps) * weight;
 *   rope:       rotate-half RoPE of q and k in place, cos/sin read from the cache by position;
 *   write_kv:   this step's k and v rows into their slots of the paged cache (float32, or
 *               rounded to its float16 / bfloat16);
 *   paged_attention: query rows against their sequences' cached K/V, read in place through
 *               the block tables (decode rows, and extends of a row or two);
 *   paged_extend_attention: an extend's new rows after a cached prefix, in tiles of rows
 *               that share each chunk of cached positions (extend_tiles.h);
 *   silu_mul:   silu(gate) * up of a fused gate/up output.
 * Tensors are row-major; a "stride" is the distance in floats between consecutive rows, so q and
 * k may be column slices of the fused qkv output.
 */
#define _GNU_SOURCE /* syscall(), which asks Linux for the AMX tile state */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "extend_tiles.h"
#include "paged_attention.h"
#include "row_ops.h"
#include "amx_tiles.h"
#if AMX_BUILD && !defined(EXT_NO_AMX) /* EXT_NO_AMX: the fused multiply-adds on an AMX host */
#include "extend_amx.h"
#define EXT_AMX 1
#else
#define EXT_AMX 0
#endif

/* 1 when paged_extend_attention takes AMX (extend_amx.h) for a float16 or bfloat16 cache of
 * head_dim d: this build has it, Linux lets the process use it, and d % 32 == 0 */
int extend_amx_ready(int d) {
#if EXT_AMX
    return d % 32 == 0 && amx_permitted();
#else
    (void)d;
    return 0;
#endif
}

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
    /* the partials, then each thread's running sums (attend_range) */
    const int64_t run = run_floats(hq, d), part_floats = total * hkv * part_size;
    float *parts = alloc_parts(part_floats, run);
    if (!parts) {
        free(off);
        return -3;
    }
#pragma omp parallel
    {
        float *own = thread_run(parts, part_floats, run);
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < total; u++) {
            /* one task per split, every kv head; a row's partials are kept kv head by kv head,
             * each head's splits side by side for its merge */
            const int64_t i = split_row(off, num_rows, u);
            const int64_t s = u - off[i], splits = off[i + 1] - off[i];
            const int64_t begin = s * split_len;
            const int64_t end = begin + split_len < row_lens[i] ? begin + split_len : row_lens[i];
            attend_range(q + row_ids[i] * q_stride, hq, k_cache, v_cache, kv_kind, hkv, d, bs,
                         block_tables + (int64_t)row_seqs[i] * max_blocks, begin, end, scale, own,
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

/* Extends after a cached prefix: extend e's n = ext_lens[e] query rows are rows q_starts[e] ..
 * + n - 1 of q ([T, hq, d], rows q_stride apart); its row r sits at position prefix_lens[e] + r
 * and sees positions [0, prefix_lens[e] + r] of the sequence whose block table is row e of
 * block_tables (int32 [num_ext, max_blocks]), its own new K/V already written there. out ([T,
 * hq, d], contiguous) gets those rows; no other row is touched. One task per (extend, tile of
 * EXT_ROWS rows, kv head, split of EXT_SPLIT positions); each (tile, kv head) then merges its
 * splits. Returns -1 for unsupported shapes or kinds, -2 if an extend's rows
 * fall outside q, it has no rows, or its table is too short or names a block outside [0,
 * num_blocks) (nothing is read then), -3 if scratch memory could not be had. */
int paged_extend_attention(const float *q, int64_t q_stride, const void *k_cache,
                           const void *v_cache, int32_t kv_kind, int64_t num_blocks,
                           const int32_t *block_tables, int64_t max_blocks,
                           const int64_t *q_starts, const int32_t *prefix_lens,
                           const int32_t *ext_lens, int64_t num_ext, int64_t num_q_rows,
                           float *out, int64_t hq, int64_t hkv, int64_t d, int64_t bs,
                           float scale) {
    const int64_t group = hq / hkv, pw = partial_width(d);
    if (hkv < 1 || hq % hkv || group > MAX_GROUP || d > MAX_HEAD_DIM || !kv_kind_ok(kv_kind))
        return -1;
    int64_t num_tiles = 0;
    for (int64_t e = 0; e < num_ext; e++) {
        const int64_t n = ext_lens[e], len = (int64_t)prefix_lens[e] + n;
        const int64_t used = (len + bs - 1) / bs;
        int bad = n < 1 || prefix_lens[e] < 0 || q_starts[e] < 0 ||
                  q_starts[e] + n > num_q_rows || used > max_blocks;
        for (int64_t j = 0; !bad && j < used; j++) {
            const int32_t blk = block_tables[e * max_blocks + j];
            bad = blk < 0 || blk >= num_blocks;
        }
        if (bad) return -2;
        num_tiles += (n + EXT_ROWS - 1) / EXT_ROWS;
    }
    if (num_tiles == 0) return 0;
    /* a tile: its extend, rows [r0, r1), splits, and where its first task and partials go */
    typedef struct {
        int64_t e, r0, r1, splits, task, part;
    } tile_t;
    tile_t *tiles = malloc((size_t)num_tiles * sizeof(tile_t));
    if (!tiles) return -3;
    int64_t t = 0, tasks = 0, floats = 0, max_nq = 0;
    for (int64_t e = 0; e < num_ext; e++)
        for (int64_t r0 = 0; r0 < ext_lens[e]; r0 += EXT_ROWS, t++) {
            const int64_t r1 = r0 + EXT_ROWS < ext_lens[e] ? r0 + EXT_ROWS : ext_lens[e];
            const int64_t splits = (prefix_lens[e] + r1 + EXT_SPLIT - 1) / EXT_SPLIT;
            tiles[t] = (tile_t){e, r0, r1, splits, tasks, floats};
            max_nq = (r1 - r0) * group > max_nq ? (r1 - r0) * group : max_nq;
            tasks += hkv * splits;
            /* partials [kv head][row][split][group][d + 2], the layout merge_splits reads */
            floats += hkv * (r1 - r0) * splits * group * pw;
        }
    float *parts = malloc((size_t)floats * sizeof(float));
    int failed = !parts;
    const int amx = kv_kind != KV_F32 && extend_amx_ready(d);
    size_t scratch_bytes = (size_t)ext_scratch_floats(max_nq, d) * sizeof(float);
#if EXT_AMX
    if (amx) scratch_bytes = (size_t)xa_scratch_bytes(max_nq, d);
#endif
#pragma omp parallel if (!failed)
    {
        /* per thread: the task's scratch for the largest tile (AMX's 64-byte aligned) */
        void *scratch = failed ? NULL : aligned_alloc(64, (scratch_bytes + 63) / 64 * 64);
        const float *q_rows[EXT_ROWS];
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < tasks; u++) {
            if (!scratch) continue;
            int64_t lo = 0, hi = num_tiles - 1; /* the tile holding task u */
            while (lo < hi) {
                const int64_t mid = (lo + hi + 1) / 2;
                if (tiles[mid].task <= u)
                    lo = mid;
                else
                    hi = mid - 1;
            }
            const tile_t *tl = &tiles[lo];
            const int64_t k = u - tl->task, g = k / tl->splits, s = k % tl->splits;
            const int64_t e = tl->e, rows = tl->r1 - tl->r0, stride = tl->splits * group * pw;
            for (int64_t r = tl->r0; r < tl->r1; r++)
                q_rows[r - tl->r0] = q + (q_starts[e] + r) * q_stride;
            float *part = parts + tl->part + (g * rows * tl->splits + s) * group * pw;
#if EXT_AMX
            if (amx) {
                extend_task_amx(q_rows, tl->r0, tl->r1, prefix_lens[e], g, group, s * EXT_SPLIT,
                                (s + 1) * EXT_SPLIT, k_cache, v_cache, kv_kind, hkv, d, bs,
                                block_tables + e * max_blocks, scale, scratch, part, stride);
                continue;
            }
#endif
            extend_task(q_rows, tl->r0, tl->r1, prefix_lens[e], g, group, s * EXT_SPLIT,
                        (s + 1) * EXT_SPLIT, k_cache, v_cache, kv_kind, hkv, d, bs,
                        block_tables + e * max_blocks, scale, scratch, part, stride);
        }
        free(scratch);
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < num_tiles * hkv; i++) {
                const tile_t *tl = &tiles[i / hkv];
                const int64_t g = i % hkv, rows = tl->r1 - tl->r0, w = tl->splits * group * pw;
                for (int64_t r = 0; r < rows; r++)
                    merge_splits(parts + tl->part + (g * rows + r) * w, tl->splits, group, d,
                                 out + ((q_starts[tl->e] + tl->r0 + r) * hq + g * group) * d);
            }
        }
    }
    free(parts);
    free(tiles);
    return failed ? -3 : 0;
}

/* gate_up: [T, 2 * inter] (gate columns first); out: [T, inter]. */
void silu_mul(const float *gate_up, float *out, int64_t tokens, int64_t inter) {
#pragma omp parallel for schedule(static) if (tokens > 8)
    for (int64_t t = 0; t < tokens; t++) {
        const float *g = gate_up + t * 2 * inter, *u = g + inter;
        float *o = out + t * inter;
        silu_mul_span(g, u, o, inter);
    }
}

/* The sum of n bytes read as 64-bit words (n a multiple of 8), every thread streaming its
 * share once: the yardstick a decode step's weight reads are measured against (what a read
 * of the same bytes can reach here), not a step op. Four sums keep the adds off the loads'
 * critical path. */
uint64_t stream_sum(const uint64_t *words, int64_t n_words) {
    uint64_t total = 0;
#pragma omp parallel for schedule(static) reduction(+ : total)
    for (int64_t c = 0; c < n_words; c += 4096) {
        const int64_t end = c + 4096 < n_words ? c + 4096 : n_words;
        uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
        int64_t i = c;
        for (; i + 4 <= end; i += 4) {
            s0 += words[i];
            s1 += words[i + 1];
            s2 += words[i + 2];
            s3 += words[i + 3];
        }
        for (; i < end; i++) s0 += words[i];
        total += s0 + s1 + s2 + s3;
    }
    return total;
}
