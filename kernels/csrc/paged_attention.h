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
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fast_exp.h"
#include "kv_rows.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define CHUNK 32
#define TILE 8192 /* floats of one chunk's keys (and of its values): kv heads * head_dim <= TILE */

/* floats of one head's partial: acc [d], then m and l */
static inline int64_t partial_width(int64_t d) { return d + 2; }

/* floats of a thread's running sums in attend_range (hq partials), in whole cache lines so
 * that two threads' sums never share one */
static inline int64_t run_floats(int64_t hq, int64_t d) {
    return (hq * partial_width(d) + 15) / 16 * 16;
}

/* part_floats of partials, then run floats for each thread of a parallel region, thread t's at
 * part_floats + t * run; 64-byte aligned (NULL if memory could not be had) */
static inline float *alloc_parts(int64_t part_floats, int64_t run) {
    const int64_t floats = (part_floats + 15) / 16 * 16 + omp_get_max_threads() * run;
    return aligned_alloc(64, (size_t)floats * sizeof(float));
}

/* thread t's running sums in an alloc_parts buffer */
static inline float *thread_run(float *parts, int64_t part_floats, int64_t run) {
    return parts + (part_floats + 15) / 16 * 16 + omp_get_thread_num() * run;
}

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


/* s[i] = e^(s[i] - mx) for i < n (s[i] <= mx, or at most EXT_SLACK above it in
 * extend_tiles.h); returns their sum, added in a fixed order */
static inline float exp_shifted(float *s, int64_t n, float mx) {
    int64_t i = 0;
    float sum = 0.0f;
#if defined(__AVX512F__)
    __m512 total = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m512 e = exp_nonpos16(_mm512_sub_ps(_mm512_loadu_ps(s + i), _mm512_set1_ps(mx)));
        _mm512_storeu_ps(s + i, e);
        total = _mm512_add_ps(total, e);
    }
    sum = _mm512_reduce_add_ps(total);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 total = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp_nonpos8(_mm256_sub_ps(_mm256_loadu_ps(s + i), _mm256_set1_ps(mx)));
        _mm256_storeu_ps(s + i, e);
        total = _mm256_add_ps(total, e);
    }
    const __m128 u = _mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps(total, 1));
    const __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
    sum = _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
#endif
    for (; i < n; i++) {
        s[i] = exp_nonpos(s[i] - mx);
        sum += s[i];
    }
    return sum;
}

/* a . b over d floats */
static inline float row_dot(const float *a, const float *b, int64_t d) {
#if defined(__AVX512F__)
    if (d % 32 == 0) { /* two chains: the FMA latency, not its throughput, bounds one */
        __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
        for (int64_t j = 0; j < d; j += 32) {
            s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + j), _mm512_loadu_ps(b + j), s0);
            s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + j + 16), _mm512_loadu_ps(b + j + 16), s1);
        }
        return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (d % 16 == 0) {
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        for (int64_t j = 0; j < d; j += 16) {
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j + 8), _mm256_loadu_ps(b + j + 8), s1);
        }
        const __m256 t = _mm256_add_ps(s0, s1);
        const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
        const __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
        return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
    }
#endif
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t j = 0; j < d; j++) s += a[j] * b[j];
    return s;
}

/* acc[0, d) += sum over i < n of w[i] * rows[i][col, col + d), in increasing i */
static inline void add_weighted_rows(float *acc, const float *w, const float *const *rows,
                                     int64_t col, int64_t n, int64_t d) {
#if defined(__AVX512F__)
    if (d % 64 == 0) { /* 64 columns at a time, held in four registers over all n rows */
        for (int64_t j = 0; j < d; j += 64) {
            __m512 a0 = _mm512_loadu_ps(acc + j), a1 = _mm512_loadu_ps(acc + j + 16);
            __m512 a2 = _mm512_loadu_ps(acc + j + 32), a3 = _mm512_loadu_ps(acc + j + 48);
            for (int64_t i = 0; i < n; i++) {
                const __m512 wi = _mm512_set1_ps(w[i]);
                const float *r = rows[i] + col + j;
                a0 = _mm512_fmadd_ps(wi, _mm512_loadu_ps(r), a0);
                a1 = _mm512_fmadd_ps(wi, _mm512_loadu_ps(r + 16), a1);
                a2 = _mm512_fmadd_ps(wi, _mm512_loadu_ps(r + 32), a2);
                a3 = _mm512_fmadd_ps(wi, _mm512_loadu_ps(r + 48), a3);
            }
            _mm512_storeu_ps(acc + j, a0), _mm512_storeu_ps(acc + j + 16, a1);
            _mm512_storeu_ps(acc + j + 32, a2), _mm512_storeu_ps(acc + j + 48, a3);
        }
        return;
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (d % 32 == 0) {
        for (int64_t j = 0; j < d; j += 32) {
            __m256 a0 = _mm256_loadu_ps(acc + j), a1 = _mm256_loadu_ps(acc + j + 8);
            __m256 a2 = _mm256_loadu_ps(acc + j + 16), a3 = _mm256_loadu_ps(acc + j + 24);
            for (int64_t i = 0; i < n; i++) {
                const __m256 wi = _mm256_set1_ps(w[i]);
                const float *r = rows[i] + col + j;
                a0 = _mm256_fmadd_ps(wi, _mm256_loadu_ps(r), a0);
                a1 = _mm256_fmadd_ps(wi, _mm256_loadu_ps(r + 8), a1);
                a2 = _mm256_fmadd_ps(wi, _mm256_loadu_ps(r + 16), a2);
                a3 = _mm256_fmadd_ps(wi, _mm256_loadu_ps(r + 24), a3);
            }
            _mm256_storeu_ps(acc + j, a0), _mm256_storeu_ps(acc + j + 8, a1);
            _mm256_storeu_ps(acc + j + 16, a2), _mm256_storeu_ps(acc + j + 24, a3);
        }
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) {
        const float wi = w[i], *r = rows[i] + col;
#pragma omp simd
        for (int64_t j = 0; j < d; j++) acc[j] += wi * r[j];
    }
}

/* positions per chunk: CHUNK, halved until a chunk's slots (row floats each) fit a tile */
static inline int64_t chunk_len(int64_t row) {
    int64_t n = CHUNK;
    while (n > 1 && n * row > TILE) n /= 2;
    return n;
}

/* Positions [begin, end) of one sequence for its query q [hq, d] (contiguous), every kv head;
 * caches [num_blocks, bs, hkv, d] of `kind`. The partial of query head h of kv head g goes to
 * part + g * head_stride + h' * (d + 2), h' = h - g * group. The sums run in run (hq * (d + 2)
 * floats, the thread's own) and reach part at the end: part holds a row's splits side by side,
 * and threads on neighbouring splits would otherwise pass the cache lines at their edges
 * between the cores on every chunk.
 *
 * A chunk of positions at a time, whole cache slots (every kv head's row) at once: within a
 * block they lie end to end, so memory streams, where reading one kv head's rows alone touches
 * a slice of each slot and runs at a third of the bandwidth. A 16-bit chunk is widened to
 * float32 once; then every query head reads it from L1: scores by row_dot, their exponentials
 * vectorized, values by add_weighted_rows with the head's accumulator in registers. The block
 * table is walked, with no division per position. */
static inline void attend_range(const float *q, int64_t hq, const void *k_cache,
                                const void *v_cache, int32_t kind, int64_t hkv, int64_t d,
                                int64_t bs, const int32_t *table, int64_t begin, int64_t end,
                                float scale, float *run, float *part, int64_t head_stride) {
    const int64_t row = hkv * d, group = hq / hkv, pw = partial_width(d), chunk = chunk_len(row);
    _Alignas(64) float k_tile[TILE], v_tile[TILE];
    float sc[CHUNK];
    const float *k_rows[CHUNK], *v_rows[CHUNK];
    for (int64_t g = 0; g < hkv; g++)
        for (int64_t h = 0; h < group; h++) {
            float *a = run + (g * group + h) * pw; /* acc [d], then m, l */
            memset(a, 0, (size_t)d * sizeof(float));
            a[d] = -INFINITY;
            a[d + 1] = 0.0f;
        }
    int64_t blk = begin / bs, in_blk = begin % bs;
    for (int64_t p0 = begin; p0 < end; p0 += chunk) {
        const int64_t n = end - p0 < chunk ? end - p0 : chunk;
        for (int64_t i = 0; i < n; i++) {
            const int64_t at = ((int64_t)table[blk] * bs + in_blk) * row;
            k_rows[i] = kv_load(k_cache, kind, at, row, k_tile + i * row);
            v_rows[i] = kv_load(v_cache, kind, at, row, v_tile + i * row);
            if (++in_blk == bs) in_blk = 0, blk++;
        }
        for (int64_t g = 0; g < hkv; g++)
            for (int64_t h = 0; h < group; h++) {
                const float *qh = q + (g * group + h) * d;
                float *a = run + (g * group + h) * pw, mx = a[d];
                for (int64_t i = 0; i < n; i++) {
                    sc[i] = row_dot(qh, k_rows[i] + g * d, d) * scale;
                    mx = sc[i] > mx ? sc[i] : mx;
                }
                const float correction = expf(a[d] - mx); /* 0 on the first chunk */
                a[d + 1] = a[d + 1] * correction + exp_shifted(sc, n, mx);
                for (int64_t j = 0; j < d; j++) a[j] *= correction;
                a[d] = mx;
                add_weighted_rows(a, sc, v_rows, g * d, n, d);
            }
    }
    for (int64_t g = 0; g < hkv; g++)
        memcpy(part + g * head_stride, run + g * group * pw, (size_t)(group * pw) * sizeof(float));
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
