/* Paged attention of one query group (the query heads sharing a kv head) against the first len
 * positions of a sequence, read in place through its block table; shared by cpu_ops.c and
 * decode_step.c. Softmax runs online over chunks of positions, in float32.
 */
#ifndef PREFIXRAG_PAGED_ATTENTION_H
#define PREFIXRAG_PAGED_ATTENTION_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define CHUNK 32

/* qg: [group, d] contiguous; caches [num_blocks, bs, hkv, d]; g: the kv head; out: [group, d] */
static inline void attend_group(const float *qg, int64_t group, const float *k_cache,
                                const float *v_cache, int64_t hkv, int64_t g, int64_t d,
                                int64_t bs, const int32_t *table, int64_t len, float scale,
                                float *out) {
    const int64_t row = hkv * d; /* floats per cache slot */
    float acc[MAX_GROUP][MAX_HEAD_DIM], m[MAX_GROUP], l[MAX_GROUP], sc[MAX_GROUP][CHUNK];
    for (int64_t h = 0; h < group; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
        memset(acc[h], 0, (size_t)d * sizeof(float));
    }
    for (int64_t p0 = 0; p0 < len; p0 += CHUNK) {
        const int64_t n = len - p0 < CHUNK ? len - p0 : CHUNK;
        for (int64_t i = 0; i < n; i++) {
            const int64_t p = p0 + i;
            const float *kr = k_cache + ((int64_t)table[p / bs] * bs + p % bs) * row + g * d;
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
            const float *vr = v_cache + ((int64_t)table[p / bs] * bs + p % bs) * row + g * d;
            for (int64_t h = 0; h < group; h++) {
                const float w = sc[h][i];
                float *a = acc[h];
#pragma omp simd
                for (int64_t j = 0; j < d; j++) a[j] += w * vr[j];
            }
        }
    }
    for (int64_t h = 0; h < group; h++) {
        const float inv = 1.0f / l[h];
        for (int64_t j = 0; j < d; j++) out[h * d + j] = acc[h][j] * inv;
    }
}

#endif
