/* Attention of an extend's query rows (new tokens after a cached prefix) against the sequence's
 * paged cache, read in place; used by cpu_ops.c's paged_extend_attention.
 *
 * The per-row kernel (paged_attention.h) widens and reads every cached position once per query
 * row, with a horizontal sum per score. Here a tile of up to EXT_ROWS rows of one kv head's
 * query group shares each chunk of EXT_KEYS positions: the chunk's keys are widened once, laid
 * out transposed (dim-major), and scored against four query vectors at a time with the scores
 * themselves in vector registers (two at a time on AVX2), so a score costs d fused
 * multiply-adds and no reduction.
 * Values are summed with the query's accumulator in registers (add_weighted_rows). Softmax
 * runs online, chunk by chunk, in float32.
 *
 * A task is (tile, kv head, split of EXT_SPLIT positions): a short extend over a long prefix
 * still gives every thread work, as flash-decoding does, and each split's partial is merged
 * in split order. A query vector's arithmetic (its scores, their order, its chunks and splits,
 * all cut from position 0) depends on nothing but its own row, so a result does not change
 * with the tile it lands in, the other rows of the call or the thread count.
 */
#ifndef PREFIXRAG_EXTEND_TILES_H
#define PREFIXRAG_EXTEND_TILES_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kv_rows.h"
#include "paged_attention.h"

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#define EXT_KEYS 32 /* positions per chunk: two AVX-512 vectors of scores */
#define EXT_ROWS 32 /* query rows per tile (each with the group's heads) */
/* query vectors scored together: on AVX-512 their 2 x EXT_QUAD score accumulators and
 * 4 x EXT_QUAD value accumulators must fit 32 registers beside a key or value row. Six, not
 * four: score_quad's 8 chains of fused multiply-adds were at the FMA latency's limit (each
 * vector's sums are the same either way). SmolLM2-135M's shape, 32 rows over 2,048 cached
 * float16 positions, 2 threads, builds interleaved on a 2-core Xeon: 1,599 -> 1,512 us a layer,
 * and 3% to 6% in three more runs; eight was no faster than four. */
#ifndef EXT_QUAD
#if defined(__AVX512F__)
#define EXT_QUAD 6
#else
#define EXT_QUAD 4
#endif
#endif
#define EXT_SPLIT 512 /* positions per task: a split's partials are merged as in decode */
/* A query vector's running max moves only when a chunk's max passes it by more than this
 * (natural-log units): the terms then stay at most e^8 (about 3,000), far from float32's
 * range, and most chunks skip the rescale of the accumulator and its expf, a fifth of the
 * softmax's cost, as FlashAttention-4 does. merge_splits takes any reference max. */
#define EXT_SLACK 8.0f

/* s[v][i] = q_v . kt[:, i] for v < EXT_QUAD, i < EXT_KEYS; kt is [d][EXT_KEYS] */
static inline void score_quad(const float *const *q, const float *kt, int64_t d,
                              float s[EXT_QUAD][EXT_KEYS]) {
#if defined(__AVX512F__)
    __m512 a[EXT_QUAD][2];
    for (int u = 0; u < EXT_QUAD; u++) a[u][0] = a[u][1] = _mm512_setzero_ps();
    for (int64_t j = 0; j < d; j++) {
        const __m512 k0 = _mm512_loadu_ps(kt + j * EXT_KEYS);
        const __m512 k1 = _mm512_loadu_ps(kt + j * EXT_KEYS + 16);
        for (int u = 0; u < EXT_QUAD; u++) {
            const __m512 b = _mm512_set1_ps(q[u][j]);
            a[u][0] = _mm512_fmadd_ps(b, k0, a[u][0]);
            a[u][1] = _mm512_fmadd_ps(b, k1, a[u][1]);
        }
    }
    for (int u = 0; u < EXT_QUAD; u++) {
        _mm512_storeu_ps(s[u], a[u][0]);
        _mm512_storeu_ps(s[u] + 16, a[u][1]);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    /* two query vectors at a time: their 8 accumulators, the 4 key vectors and a broadcast
     * fit AVX2's 16 registers */
    for (int v = 0; v < EXT_QUAD; v += 2) {
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
        __m256 b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
        const float *qa = q[v], *qb = q[v + 1];
        for (int64_t j = 0; j < d; j++) {
            const float *kj = kt + j * EXT_KEYS;
            const __m256 k0 = _mm256_loadu_ps(kj), k1 = _mm256_loadu_ps(kj + 8);
            const __m256 k2 = _mm256_loadu_ps(kj + 16), k3 = _mm256_loadu_ps(kj + 24);
            __m256 x = _mm256_broadcast_ss(qa + j);
            a0 = _mm256_fmadd_ps(x, k0, a0), a1 = _mm256_fmadd_ps(x, k1, a1);
            a2 = _mm256_fmadd_ps(x, k2, a2), a3 = _mm256_fmadd_ps(x, k3, a3);
            x = _mm256_broadcast_ss(qb + j);
            b0 = _mm256_fmadd_ps(x, k0, b0), b1 = _mm256_fmadd_ps(x, k1, b1);
            b2 = _mm256_fmadd_ps(x, k2, b2), b3 = _mm256_fmadd_ps(x, k3, b3);
        }
        _mm256_storeu_ps(s[v], a0), _mm256_storeu_ps(s[v] + 8, a1);
        _mm256_storeu_ps(s[v] + 16, a2), _mm256_storeu_ps(s[v] + 24, a3);
        _mm256_storeu_ps(s[v + 1], b0), _mm256_storeu_ps(s[v + 1] + 8, b1);
        _mm256_storeu_ps(s[v + 1] + 16, b2), _mm256_storeu_ps(s[v + 1] + 24, b3);
    }
#else
    /* the same sums in the same order (j ascending, one fused multiply-add each where the
     * target has them); the compiler vectorizes across the keys */
    for (int v = 0; v < EXT_QUAD; v++) {
        float acc[EXT_KEYS] = {0};
        for (int64_t j = 0; j < d; j++) {
            const float qj = q[v][j];
            const float *kj = kt + j * EXT_KEYS;
#pragma omp simd
            for (int i = 0; i < EXT_KEYS; i++) acc[i] = fmaf(qj, kj[i], acc[i]);
        }
        memcpy(s[v], acc, sizeof(acc));
    }
#endif
}

/* acc_a += sum over i < n of wa[i] * v[i], and acc_b likewise with wb, v [n][d] contiguous: the
 * sums of add_weighted_rows, term for term, two query vectors per pass so each value row is
 * loaded once for both (on AVX2 two accumulators' 8 registers and a value row's 4 fit its 16) */
static inline void add_weighted_rows2(float *acc_a, const float *wa, float *acc_b,
                                      const float *wb, const float *v, int64_t n, int64_t d) {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    if (d % 32 == 0) {
        for (int64_t j = 0; j < d; j += 32) {
            __m256 a0 = _mm256_loadu_ps(acc_a + j), a1 = _mm256_loadu_ps(acc_a + j + 8);
            __m256 a2 = _mm256_loadu_ps(acc_a + j + 16), a3 = _mm256_loadu_ps(acc_a + j + 24);
            __m256 b0 = _mm256_loadu_ps(acc_b + j), b1 = _mm256_loadu_ps(acc_b + j + 8);
            __m256 b2 = _mm256_loadu_ps(acc_b + j + 16), b3 = _mm256_loadu_ps(acc_b + j + 24);
            for (int64_t i = 0; i < n; i++) {
                const float *r = v + i * d + j;
                const __m256 v0 = _mm256_loadu_ps(r), v1 = _mm256_loadu_ps(r + 8);
                const __m256 v2 = _mm256_loadu_ps(r + 16), v3 = _mm256_loadu_ps(r + 24);
                __m256 w = _mm256_broadcast_ss(wa + i);
                a0 = _mm256_fmadd_ps(w, v0, a0), a1 = _mm256_fmadd_ps(w, v1, a1);
                a2 = _mm256_fmadd_ps(w, v2, a2), a3 = _mm256_fmadd_ps(w, v3, a3);
                w = _mm256_broadcast_ss(wb + i);
                b0 = _mm256_fmadd_ps(w, v0, b0), b1 = _mm256_fmadd_ps(w, v1, b1);
                b2 = _mm256_fmadd_ps(w, v2, b2), b3 = _mm256_fmadd_ps(w, v3, b3);
            }
            _mm256_storeu_ps(acc_a + j, a0), _mm256_storeu_ps(acc_a + j + 8, a1);
            _mm256_storeu_ps(acc_a + j + 16, a2), _mm256_storeu_ps(acc_a + j + 24, a3);
            _mm256_storeu_ps(acc_b + j, b0), _mm256_storeu_ps(acc_b + j + 8, b1);
            _mm256_storeu_ps(acc_b + j + 16, b2), _mm256_storeu_ps(acc_b + j + 24, b3);
        }
        return;
    }
#elif defined(__AVX512F__)
    if (d % 64 == 0) {
        for (int64_t j = 0; j < d; j += 64) {
            __m512 a0 = _mm512_loadu_ps(acc_a + j), a1 = _mm512_loadu_ps(acc_a + j + 16);
            __m512 a2 = _mm512_loadu_ps(acc_a + j + 32), a3 = _mm512_loadu_ps(acc_a + j + 48);
            __m512 b0 = _mm512_loadu_ps(acc_b + j), b1 = _mm512_loadu_ps(acc_b + j + 16);
            __m512 b2 = _mm512_loadu_ps(acc_b + j + 32), b3 = _mm512_loadu_ps(acc_b + j + 48);
            for (int64_t i = 0; i < n; i++) {
                const float *r = v + i * d + j;
                const __m512 v0 = _mm512_loadu_ps(r), v1 = _mm512_loadu_ps(r + 16);
                const __m512 v2 = _mm512_loadu_ps(r + 32), v3 = _mm512_loadu_ps(r + 48);
                __m512 w = _mm512_set1_ps(wa[i]);
                a0 = _mm512_fmadd_ps(w, v0, a0), a1 = _mm512_fmadd_ps(w, v1, a1);
                a2 = _mm512_fmadd_ps(w, v2, a2), a3 = _mm512_fmadd_ps(w, v3, a3);
                w = _mm512_set1_ps(wb[i]);
                b0 = _mm512_fmadd_ps(w, v0, b0), b1 = _mm512_fmadd_ps(w, v1, b1);
                b2 = _mm512_fmadd_ps(w, v2, b2), b3 = _mm512_fmadd_ps(w, v3, b3);
            }
            _mm512_storeu_ps(acc_a + j, a0), _mm512_storeu_ps(acc_a + j + 16, a1);
            _mm512_storeu_ps(acc_a + j + 32, a2), _mm512_storeu_ps(acc_a + j + 48, a3);
            _mm512_storeu_ps(acc_b + j, b0), _mm512_storeu_ps(acc_b + j + 16, b1);
            _mm512_storeu_ps(acc_b + j + 32, b2), _mm512_storeu_ps(acc_b + j + 48, b3);
        }
        return;
    }
#endif
    const float *rows[EXT_KEYS];
    for (int64_t i = 0; i < n; i++) rows[i] = v + i * d;
    add_weighted_rows(acc_a, wa, rows, 0, n, d);
    add_weighted_rows(acc_b, wb, rows, 0, n, d);
}

#if defined(__AVX512F__)
/* add_weighted_rows2 for EXT_QUAD query vectors (acc[u] += sum over i < n of w[u][i] * v[i]),
 * the same chains term for term: each value row is loaded once for all of them, so a load
 * feeds EXT_QUAD fused multiply-adds, not two; the 4 x EXT_QUAD accumulators, a row's 4
 * vectors and a broadcast fit AVX-512's 32 registers. d % 64 == 0. */
static inline void add_weighted_rows_quad(float *const *acc, const float (*w)[EXT_KEYS],
                                      const float *v, int64_t n, int64_t d) {
    for (int64_t j = 0; j < d; j += 64) {
        __m512 a[EXT_QUAD][4];
        for (int u = 0; u < EXT_QUAD; u++)
            for (int c = 0; c < 4; c++) a[u][c] = _mm512_loadu_ps(acc[u] + j + 16 * c);
        for (int64_t i = 0; i < n; i++) {
            const float *r = v + i * d + j;
            const __m512 v0 = _mm512_loadu_ps(r), v1 = _mm512_loadu_ps(r + 16);
            const __m512 v2 = _mm512_loadu_ps(r + 32), v3 = _mm512_loadu_ps(r + 48);
            for (int u = 0; u < EXT_QUAD; u++) {
                const __m512 x = _mm512_set1_ps(w[u][i]);
                a[u][0] = _mm512_fmadd_ps(x, v0, a[u][0]);
                a[u][1] = _mm512_fmadd_ps(x, v1, a[u][1]);
                a[u][2] = _mm512_fmadd_ps(x, v2, a[u][2]);
                a[u][3] = _mm512_fmadd_ps(x, v3, a[u][3]);
            }
        }
        for (int u = 0; u < EXT_QUAD; u++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc[u] + j + 16 * c, a[u][c]);
    }
}
#endif

/* kt[j][i] = rows[i][j] for i < EXT_KEYS, j < d: the chunk's keys laid out dim-major for
 * score_quad. In 4x4 blocks of 128-bit loads, shuffles and stores where d allows: a scalar
 * scatter costs a load and a store per element, about a tenth of the whole kernel's time at a
 * 32-row extend, and 128-bit shuffles are the cheap ones on every x86 core (a 256-bit lane
 * crossing is eight uops on Zen 1). */
static inline void transpose_keys(const float *const *rows, int64_t d, float *kt) {
#if defined(__SSE__)
    if (d % 4 == 0) {
        for (int64_t i = 0; i < EXT_KEYS; i += 4)
            for (int64_t j = 0; j < d; j += 4) {
                __m128 r0 = _mm_loadu_ps(rows[i] + j), r1 = _mm_loadu_ps(rows[i + 1] + j);
                __m128 r2 = _mm_loadu_ps(rows[i + 2] + j), r3 = _mm_loadu_ps(rows[i + 3] + j);
                _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
                _mm_storeu_ps(kt + j * EXT_KEYS + i, r0);
                _mm_storeu_ps(kt + (j + 1) * EXT_KEYS + i, r1);
                _mm_storeu_ps(kt + (j + 2) * EXT_KEYS + i, r2);
                _mm_storeu_ps(kt + (j + 3) * EXT_KEYS + i, r3);
            }
        return;
    }
#endif
    for (int64_t i = 0; i < EXT_KEYS; i++)
        for (int64_t j = 0; j < d; j++) kt[j * EXT_KEYS + i] = rows[i][j];
}

/* sc[i] *= scale for i < n (n <= EXT_KEYS); returns the larger of mx and their max. A scalar
 * max is a chain of dependent compares, as long per chunk as scoring it. */
static inline float scale_max(float *sc, int64_t n, float scale, float mx) {
#if defined(__AVX512F__)
    const __m512 k = _mm512_set1_ps(scale);
    __m512 best = _mm512_set1_ps(mx);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 live = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(live, sc + i), k);
        _mm512_mask_storeu_ps(sc + i, live, x);
        best = _mm512_mask_max_ps(best, live, best, x);
    }
    return _mm512_reduce_max_ps(best);
#elif defined(__AVX2__)
    const __m256 k = _mm256_set1_ps(scale);
    __m256 best = _mm256_set1_ps(mx);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(sc + i), k);
        _mm256_storeu_ps(sc + i, x);
        best = _mm256_max_ps(best, x);
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(best), _mm256_extractf128_ps(best, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    mx = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    for (; i < n; i++) {
        sc[i] *= scale;
        mx = sc[i] > mx ? sc[i] : mx;
    }
    return mx;
#else
    for (int64_t i = 0; i < n; i++) {
        sc[i] *= scale;
        mx = sc[i] > mx ? sc[i] : mx;
    }
    return mx;
#endif
}

/* One task: query rows [r0, r1) of an extend whose row r sits at position prefix + r and sees
 * positions [0, prefix + r], against positions [begin, end) only, for kv head g's query group.
 * q_rows[r - r0] points at row r's query heads (hq x d, contiguous). Head h of the group for
 * row r leaves its partial at part + (r - r0) * part_row_stride + h * (d + 2): the
 * unnormalized sum of values [d], then the running max m and sum l (m = -inf, l = 0 if it sees
 * none of the range); merge_splits (paged_attention.h) finishes it. kt, vt and kr are
 * scratch of d * EXT_KEYS floats each, run of EXT_ROWS * MAX_GROUP * (d + 2).
 *
 * The sums run in run, the thread's own, and reach part once, at the end: part interleaves the
 * splits of a row, so two threads on neighbouring splits would share the cache lines at their
 * edges, and every chunk's loads and stores of the sums passed those lines between the cores
 * (2 threads ran an extend of 32 rows after 2,048 positions 1.36x as fast as one). */
static inline void extend_task(const float *const *q_rows, int64_t r0, int64_t r1,
                               int64_t prefix, int64_t g, int64_t group, int64_t begin,
                               int64_t end, const void *k_cache, const void *v_cache,
                               int32_t kind, int64_t hkv, int64_t d, int64_t bs,
                               const int32_t *table, float scale, float *kt, float *vt,
                               float *kr, float *run, float *part, int64_t part_row_stride) {
    const int64_t row = hkv * d, nq = (r1 - r0) * group, pw = partial_width(d);
    const float *qv[EXT_ROWS * MAX_GROUP];
    float *acc[EXT_ROWS * MAX_GROUP];
    int64_t last[EXT_ROWS * MAX_GROUP]; /* the last position each query vector sees */
    for (int64_t v = 0; v < nq; v++) {
        qv[v] = q_rows[v / group] + (g * group + v % group) * d;
        acc[v] = run + v * pw;
        last[v] = prefix + r0 + v / group;
        float *a = acc[v];
        memset(a, 0, (size_t)d * sizeof(float));
        a[d] = -INFINITY;
        a[d + 1] = 0.0f;
    }
    static const float zeros[MAX_HEAD_DIM]; /* a missing tail key's row */
    _Alignas(64) float s[EXT_QUAD][EXT_KEYS];
    if (end > prefix + r1) end = prefix + r1; /* the tile's last row sees [0, prefix + r1) */
    for (int64_t p0 = begin; p0 < end; p0 += EXT_KEYS) {
        const int64_t n = end - p0 < EXT_KEYS ? end - p0 : EXT_KEYS;
        /* the chunk's keys transposed into kt [d][EXT_KEYS] (missing tail keys zero), its
         * values widened (or copied) into vt [EXT_KEYS][d]; a 16-bit key row is widened into
         * kr first, a float32 one is read where it lies */
        const float *krow[EXT_KEYS];
        for (int64_t i = 0; i < EXT_KEYS; i++) {
            if (i >= n) {
                krow[i] = zeros;
                continue;
            }
            const int64_t p = p0 + i;
            const int64_t at = ((int64_t)table[p / bs] * bs + p % bs) * row + g * d;
            krow[i] = kv_load(k_cache, kind, at, d, kr + i * d);
            const float *v = kv_load(v_cache, kind, at, d, vt + i * d);
            if (v != vt + i * d) memcpy(vt + i * d, v, (size_t)d * sizeof(float));
        }
        transpose_keys(krow, d, kt);
        for (int64_t v0 = 0; v0 < nq; v0 += EXT_QUAD) {
            if (last[v0 + EXT_QUAD <= nq ? v0 + EXT_QUAD - 1 : nq - 1] < p0)
                continue; /* positions ascend with v: none of these sees this chunk */
            /* a short last quad repeats its final vector; the repeats are not used */
            const float *quad[EXT_QUAD];
            for (int u = 0; u < EXT_QUAD; u++) quad[u] = qv[v0 + u < nq ? v0 + u : nq - 1];
            score_quad(quad, kt, d, s);
            int64_t vis[EXT_QUAD] = {0};
            for (int u = 0; u < EXT_QUAD && v0 + u < nq; u++) {
                const int64_t v = v0 + u, seen = last[v] - p0 + 1;
                if (seen <= 0) continue;
                vis[u] = seen < n ? seen : n;
                float *sc = s[u], *a = acc[v];
                const float mx = scale_max(sc, vis[u], scale, a[d]);
                if (mx > a[d] + EXT_SLACK) { /* always on the first chunk (a[d] = -inf) */
                    const float correction = expf(a[d] - mx); /* 0 on the first chunk */
                    a[d + 1] *= correction;
                    for (int64_t j = 0; j < d; j++) a[j] *= correction;
                    a[d] = mx;
                }
                a[d + 1] += exp_shifted(sc, vis[u], a[d]);
            }
            /* values, four or two query vectors at a time where they see the same positions */
#if defined(__AVX512F__)
            int same = v0 + EXT_QUAD <= nq && vis[0];
            for (int u = 1; u < EXT_QUAD; u++) same = same && vis[u] == vis[0];
            if (d % 64 == 0 && same) {
                add_weighted_rows_quad(acc + v0, (const float (*)[EXT_KEYS])s, vt, vis[0], d);
                continue;
            }
#endif
            for (int u = 0; u < EXT_QUAD && v0 + u < nq; u += 2) {
                const int64_t v = v0 + u;
                const int pair = u + 1 < EXT_QUAD && v + 1 < nq && vis[u + 1] == vis[u];
                if (pair && vis[u])
                    add_weighted_rows2(acc[v], s[u], acc[v + 1], s[u + 1], vt, vis[u], d);
                else
                    for (int w = u; w < u + 2 && w < EXT_QUAD && v0 + w < nq; w++) {
                        const float *rows[EXT_KEYS];
                        for (int64_t i = 0; i < vis[w]; i++) rows[i] = vt + i * d;
                        add_weighted_rows(acc[v0 + w], s[w], rows, 0, vis[w], d);
                    }
            }
        }
    }
    for (int64_t v = 0; v < nq; v++)
        memcpy(part + v / group * part_row_stride + v % group * pw, acc[v],
               (size_t)pw * sizeof(float));
}

#endif
