/* Paged attention of one query group (the query heads sharing a kv head) against the first len
 * positions of a sequence, read in place through its block table; shared by cpu_ops.c and
 * decode_step.c. The cache may be float32, float16 or bfloat16 (kv_rows.h); softmax runs online
 * over chunks of positions, in float32.
 *
 * Split positions (flash-decoding): a row's positions are cut into splits of split_len, each an
 * independent task that leaves a partial (running max m, sum l, unnormalized acc) per head;
 * merge_splits then combines them in split order. The cut depends only on the row's length,
 * never on the thread count or on the rest of the batch, so a row's result is the same bits
 * however many threads run and whatever shares its batch. A row of one split (len <= split_len)
 * computes exactly what a single sweep does.
 */
#ifndef PREFIXRAG_PAGED_ATTENTION_H
#define PREFIXRAG_PAGED_ATTENTION_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kv_rows.h"

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define CHUNK 32

/* floats of one head's partial: acc [d], then m and l */
static inline int64_t partial_width(int64_t d) { return d + 2; }

static inline int64_t num_splits(int64_t len, int64_t split_len) {
    return (len + split_len - 1) / split_len;
}

/* off[r] = the first split of row r (off[rows] = all of them); returns the total */
static inline int64_t split_offsets(const int32_t *lens, int64_t rows, int64_t split_len,
                                    int64_t *off) {
    off[0] = 0;
    for (int64_t r = 0; r < rows; r++) off[r + 1] = off[r] + num_splits(lens[r], split_len);
    return off[rows];
}

/* the row whose splits hold global split u: off[r] <= u < off[r + 1] */
static inline int64_t split_row(const int64_t *off, int64_t rows, int64_t u) {
    int64_t lo = 0, hi = rows - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (off[mid] <= u)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* Positions [begin, end) of one sequence for query group qg [group, d] (contiguous) against kv
 * head g; caches [num_blocks, bs, hkv, d] of `kind`. Writes each head's partial to
 * part [group][d + 2]. */
static inline void attend_range(const float *qg, int64_t group, const void *k_cache,
                                const void *v_cache, int32_t kind, int64_t hkv, int64_t g,
                                int64_t d, int64_t bs, const int32_t *table, int64_t begin,
                                int64_t end, float scale, float *part) {
    const int64_t row = hkv * d; /* elements per cache slot */
    float acc[MAX_GROUP][MAX_HEAD_DIM], m[MAX_GROUP], l[MAX_GROUP], sc[MAX_GROUP][CHUNK];
    float buf[MAX_HEAD_DIM];
    for (int64_t h = 0; h < group; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
        memset(acc[h], 0, (size_t)d * sizeof(float));
    }
    for (int64_t p0 = begin; p0 < end; p0 += CHUNK) {
        const int64_t n = end - p0 < CHUNK ? end - p0 : CHUNK;
        for (int64_t i = 0; i < n; i++) {
            const int64_t p = p0 + i;
            const int64_t at = ((int64_t)table[p / bs] * bs + p % bs) * row + g * d;
            const float *kr = kv_load(k_cache, kind, at, d, buf);
            for (int64_t h = 0; h < group; h++) {
                const float *qh = qg + h * d;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int64_t j = 0; j < d; j++) s += qh[j] * kr[j];
                sc[h][i] = s * scale;
            }
        }
        for (int64_t h = 0; h < group; h++) {
            float mx = m[h];
            for (int64_t i = 0; i < n; i++) mx = sc[h][i] > mx ? sc[h][i] : mx;
            const float correction = expf(m[h] - mx); /* 0 on the first chunk */
            l[h] *= correction;
            for (int64_t j = 0; j < d; j++) acc[h][j] *= correction;
            for (int64_t i = 0; i < n; i++) {
                sc[h][i] = expf(sc[h][i] - mx);
                l[h] += sc[h][i];
            }
            m[h] = mx;
        }
        for (int64_t i = 0; i < n; i++) {
            const int64_t p = p0 + i;
            const int64_t at = ((int64_t)table[p / bs] * bs + p % bs) * row + g * d;
            const float *vr = kv_load(v_cache, kind, at, d, buf);
            for (int64_t h = 0; h < group; h++) {
                const float w = sc[h][i];
                float *a = acc[h];
#pragma omp simd
                for (int64_t j = 0; j < d; j++) a[j] += w * vr[j];
            }
        }
    }
    const int64_t pw = partial_width(d);
    for (int64_t h = 0; h < group; h++) {
        memcpy(part + h * pw, acc[h], (size_t)d * sizeof(float));
        part[h * pw + d] = m[h];
        part[h * pw + d + 1] = l[h];
    }
}

/* parts: [splits][group][d + 2] of one (row, kv head), merged in split order into out
 * [group, d]. One split: out = acc * (1 / l), exactly as a single sweep ends. */
static inline void merge_splits(const float *parts, int64_t splits, int64_t group, int64_t d,
                                float *out) {
    const int64_t pw = partial_width(d), stride = group * pw;
    for (int64_t h = 0; h < group; h++) {
        const float *first = parts + h * pw;
        float mx = first[d];
        for (int64_t s = 1; s < splits; s++) {
            const float ms = parts[s * stride + h * pw + d];
            mx = ms > mx ? ms : mx;
        }
        float *o = out + h * d;
        float l = 0.0f;
        memset(o, 0, (size_t)d * sizeof(float));
        for (int64_t s = 0; s < splits; s++) {
            const float *p = parts + s * stride + h * pw;
            const float c = expf(p[d] - mx); /* exactly 1 for the split holding the max */
            l += p[d + 1] * c;
            for (int64_t j = 0; j < d; j++) o[j] += p[j] * c;
        }
        const float inv = 1.0f / l;
        for (int64_t j = 0; j < d; j++) o[j] *= inv;
    }
}

#endif
