/* Attention of an extend's query rows (new tokens after a cached prefix) against the sequence's
 * paged cache, read in place; used by cpu_ops.c's paged_extend_attention.
 *
 * The per-row kernel (paged_attention.h) widens and reads every cached position once per query
 * row, with a horizontal sum per score. Here a tile of up to EXT_ROWS rows of one kv head's
 * query group shares each chunk of EXT_KEYS positions, widened once. The queries are laid out
 * dim-major, one lane per query vector, and each key element is broadcast against them, so a
 * score costs d fused multiply-adds, no reduction, and the keys no transposing. The softmax
 * then runs across the lanes too: a chunk's max, exponentials and sums of 16 query vectors at
 * once, with no horizontal max or sum. Values are summed with six query vectors'
 * accumulators in registers (add_weighted_rows_quad). Softmax runs online, chunk by chunk, in
 * float32.
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

#ifndef ALWAYS_INLINE
#define ALWAYS_INLINE inline __attribute__((always_inline))
#endif

#define EXT_KEYS 32 /* positions per chunk */
#define EXT_ROWS 32 /* query rows per tile (each with the group's heads) */
/* query vectors whose values are summed together: on AVX-512 their 4 x EXT_QUAD accumulators
 * must fit 32 registers beside a value row. Six, not four: each value row is then loaded once
 * for six vectors (SmolLM2-135M's shape, 32 rows over 2,048 cached float16 positions, 2
 * threads, 2-core Xeon: 1,599 -> 1,512 us a layer); eight was no faster than four. */
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
 * range, and most chunks skip the rescale of the accumulator and its expf, as
 * FlashAttention-4 does. merge_splits takes any reference max. */
#define EXT_SLACK 8.0f

/* A vector of EXT_LANES query vectors' values at one position (one lane per query vector):
 * scores, maxima, exponentials and sums of the softmax run across query vectors, lane by lane,
 * so none of them needs a horizontal reduction, and the scores come from each key's elements
 * broadcast against the queries laid out dim-major, so the keys need no transposing. */
#if defined(__AVX512F__)
#define EXT_LANES 16
#define EXT_KB 8  /* keys scored at once: 8 x 3 accumulators, 3 query vectors and a key element */
#define EXT_GROUPS 3 /* lane groups scored at once */
typedef __m512 qv;
#define qv_load _mm512_loadu_ps
#define qv_store _mm512_storeu_ps
#define qv_set1 _mm512_set1_ps
#define qv_zero _mm512_setzero_ps
#define qv_fma _mm512_fmadd_ps
#define qv_mul _mm512_mul_ps
#define qv_add _mm512_add_ps
#define qv_sub _mm512_sub_ps
#define qv_max _mm512_max_ps
#define qv_exp exp_nonpos16
/* where pos <= last, x; elsewhere other */
static inline qv qv_keep(qv pos, qv last, qv x, qv other) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(pos, last, _CMP_LE_OQ), other, x);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define EXT_LANES 8
#define EXT_KB 4 /* 4 x 2 accumulators, 2 query vectors and a key element: 11 of 16 registers */
#define EXT_GROUPS 2
typedef __m256 qv;
#define qv_load _mm256_loadu_ps
#define qv_store _mm256_storeu_ps
#define qv_set1 _mm256_set1_ps
#define qv_zero _mm256_setzero_ps
#define qv_fma _mm256_fmadd_ps
#define qv_mul _mm256_mul_ps
#define qv_add _mm256_add_ps
#define qv_sub _mm256_sub_ps
#define qv_max _mm256_max_ps
#define qv_exp exp_nonpos8
static inline qv qv_keep(qv pos, qv last, qv x, qv other) {
    return _mm256_blendv_ps(other, x, _mm256_cmp_ps(pos, last, _CMP_LE_OQ));
}
#else
/* plain C, lane by lane: the same operations, one fused multiply-add each where the target
 * has them */
#define EXT_LANES 8
#define EXT_KB 4
#define EXT_GROUPS 2
typedef struct {
    float x[EXT_LANES];
} qv;
#define QV_MAP(expr)                                                                             \
    qv r;                                                                                        \
    for (int l = 0; l < EXT_LANES; l++) r.x[l] = (expr);                                         \
    return r
static inline qv qv_load(const float *p) { QV_MAP(p[l]); }
static inline void qv_store(float *p, qv a) { memcpy(p, a.x, sizeof(a.x)); }
static inline qv qv_set1(float a) { QV_MAP(a); }
static inline qv qv_zero(void) { QV_MAP(0.0f); }
static inline qv qv_fma(qv a, qv b, qv c) { QV_MAP(fmaf(a.x[l], b.x[l], c.x[l])); }
static inline qv qv_mul(qv a, qv b) { QV_MAP(a.x[l] * b.x[l]); }
static inline qv qv_add(qv a, qv b) { QV_MAP(a.x[l] + b.x[l]); }
static inline qv qv_sub(qv a, qv b) { QV_MAP(a.x[l] - b.x[l]); }
static inline qv qv_max(qv a, qv b) { QV_MAP(b.x[l] > a.x[l] ? b.x[l] : a.x[l]); }
static inline qv qv_exp(qv a) { QV_MAP(exp_nonpos(a.x[l])); }
static inline qv qv_keep(qv pos, qv last, qv x, qv other) {
    QV_MAP(pos.x[l] <= last.x[l] ? x.x[l] : other.x[l]);
}
#endif

/* st[i * nqp + c] = qt[:, c] . kr[i] for keys i0 <= i < i0 + EXT_KB and the query vectors c of
 * lane groups [c0 / EXT_LANES, c0 / EXT_LANES + groups): each score's sum runs over the d
 * elements in order, one fused multiply-add each, whatever lane or group its query vector
 * lands in */
static ALWAYS_INLINE void score_block(const float *qt, int64_t nqp, const float *kr, int64_t d,
                                      int64_t i0, int64_t c0, int groups, float *st) {
    qv acc[EXT_KB][EXT_GROUPS];
    for (int k = 0; k < EXT_KB; k++)
        for (int u = 0; u < groups; u++) acc[k][u] = qv_zero();
    for (int64_t j = 0; j < d; j++) {
        qv q[EXT_GROUPS];
        for (int u = 0; u < groups; u++) q[u] = qv_load(qt + j * nqp + c0 + u * EXT_LANES);
        for (int k = 0; k < EXT_KB; k++) {
            const qv b = qv_set1(kr[(i0 + k) * d + j]);
            for (int u = 0; u < groups; u++) acc[k][u] = qv_fma(b, q[u], acc[k][u]);
        }
    }
    for (int k = 0; k < EXT_KB; k++)
        for (int u = 0; u < groups; u++)
            qv_store(st + (i0 + k) * nqp + c0 + u * EXT_LANES, acc[k][u]);
}

/* score_block for `groups` lane groups, a constant for each call so its loops unroll */
static inline void score_groups(const float *qt, int64_t nqp, const float *kr, int64_t d,
                                int64_t i0, int64_t c0, int groups, float *st) {
    switch (groups) {
    case 1: score_block(qt, nqp, kr, d, i0, c0, 1, st); break;
    case 2: score_block(qt, nqp, kr, d, i0, c0, 2, st); break;
    default: score_block(qt, nqp, kr, d, i0, c0, EXT_GROUPS, st); break;
    }
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
/* add_weighted_rows for EXT_QUAD query vectors, acc[u] += sum over i < n of w[i * ws + u] *
 * v[i], the same chains term for term: each value row is loaded once for all of them, so a
 * load feeds EXT_QUAD fused multiply-adds, not one; the 4 x EXT_QUAD accumulators, a row's 4
 * vectors and a broadcast fit AVX-512's 32 registers. d % 64 == 0. */
static inline void add_weighted_rows_quad(float *const *acc, const float *w, int64_t ws,
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
                const __m512 x = _mm512_set1_ps(w[i * ws + u]);
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

/* Scratch floats of one extend_task of up to nq query vectors of d: the queries dim-major, the
 * chunk's scores (then weights), its keys and values widened, each query vector's running max
 * and sum, and its running sums. */
static inline int64_t ext_lanes(int64_t nq) { return (nq + EXT_LANES - 1) / EXT_LANES * EXT_LANES; }
static inline int64_t ext_scratch_floats(int64_t nq, int64_t d) {
    const int64_t nqp = ext_lanes(nq);
    return nqp * d + EXT_KEYS * nqp + 2 * EXT_KEYS * d + 2 * nqp + nq * partial_width(d);
}

/* One task: query rows [r0, r1) of an extend whose row r sits at position prefix + r and sees
 * positions [0, prefix + r], against positions [begin, end) only, for kv head g's query group.
 * q_rows[r - r0] points at row r's query heads (hq x d, contiguous). Head h of the group for
 * row r leaves its partial at part + (r - r0) * part_row_stride + h * (d + 2): the
 * unnormalized sum of values [d], then the running max m and sum l (m = -inf, l = 0 if it sees
 * none of the range); merge_splits (paged_attention.h) finishes it. scratch holds
 * ext_scratch_floats(nq, d) floats, nq = (r1 - r0) * group.
 *
 * The sums run in scratch, the thread's own, and reach part once, at the end: part interleaves
 * the splits of a row, so two threads on neighbouring splits would share the cache lines at
 * their edges, and every chunk's loads and stores of the sums passed those lines between the
 * cores (2 threads ran an extend of 32 rows after 2,048 positions 1.36x as fast as one).
 *
 * A query vector's arithmetic is its own: a key it does not see gets the weight 0 exactly
 * (the sums then add +0), whichever lane, group or tile it lands in. */
static inline void extend_task(const float *const *q_rows, int64_t r0, int64_t r1,
                               int64_t prefix, int64_t g, int64_t group, int64_t begin,
                               int64_t end, const void *k_cache, const void *v_cache,
                               int32_t kind, int64_t hkv, int64_t d, int64_t bs,
                               const int32_t *table, float scale, float *scratch, float *part,
                               int64_t part_row_stride) {
    const int64_t row = hkv * d, nq = (r1 - r0) * group, nqp = ext_lanes(nq);
    const int64_t pw = partial_width(d), groups = nqp / EXT_LANES;
    float *qt = scratch, *st = qt + nqp * d, *kr = st + EXT_KEYS * nqp, *vt = kr + EXT_KEYS * d;
    float *mx = vt + EXT_KEYS * d, *sum = mx + nqp, *run = sum + nqp;
    int64_t last[EXT_ROWS * MAX_GROUP + EXT_LANES]; /* the last position each query vector sees */
    float *acc[EXT_ROWS * MAX_GROUP + EXT_LANES];
    for (int64_t v = 0; v < nqp; v++) {
        /* lanes past nq repeat the last query vector's position with a zero query: their
         * results are never read */
        const int64_t real = v < nq ? v : nq - 1;
        const float *qv_src = q_rows[real / group] + (g * group + real % group) * d;
        for (int64_t j = 0; j < d; j++) qt[j * nqp + v] = v < nq ? qv_src[j] : 0.0f;
        last[v] = prefix + r0 + real / group;
        mx[v] = -INFINITY;
        sum[v] = 0.0f;
    }
    for (int64_t v = 0; v < nq; v++) {
        acc[v] = run + v * pw;
        memset(acc[v], 0, (size_t)d * sizeof(float));
    }
    if (end > prefix + r1) end = prefix + r1; /* the tile's last row sees [0, prefix + r1) */
    const qv scale_v = qv_set1(scale), neg_inf = qv_set1(-INFINITY), zero = qv_zero();
    for (int64_t p0 = begin; p0 < end; p0 += EXT_KEYS) {
        const int64_t n = end - p0 < EXT_KEYS ? end - p0 : EXT_KEYS;
        const int64_t nk = (n + EXT_KB - 1) / EXT_KB * EXT_KB; /* keys scored: past n, zero rows */
        for (int64_t i = 0; i < n; i++) {
            const int64_t p = p0 + i;
            const int64_t at = paged_slot(table, p, bs) * row + g * d;
            const float *k = kv_load(k_cache, kind, at, d, kr + i * d);
            if (k != kr + i * d) memcpy(kr + i * d, k, (size_t)d * sizeof(float));
            const float *v = kv_load(v_cache, kind, at, d, vt + i * d);
            if (v != vt + i * d) memcpy(vt + i * d, v, (size_t)d * sizeof(float));
        }
        if (nk > n) memset(kr + n * d, 0, (size_t)((nk - n) * d) * sizeof(float));
        /* groups before `first` see none of the chunk: positions ascend with the lanes */
        int64_t first = 0;
        while (first < groups && last[first * EXT_LANES + EXT_LANES - 1] < p0) first++;
        for (int64_t i0 = 0; i0 < nk; i0 += EXT_KB)
            for (int64_t c = first; c < groups; c += EXT_GROUPS) {
                const int take = groups - c < EXT_GROUPS ? (int)(groups - c) : EXT_GROUPS;
                score_groups(qt, nqp, kr, d, i0, c * EXT_LANES, take, st);
            }
        for (int64_t c = first; c < groups; c++) {
            const int64_t c0 = c * EXT_LANES;
            const int full = last[c0] >= p0 + n - 1; /* every lane sees all of it */
            qv lim = zero;
            if (!full) { /* each lane's last visible key, counted from p0 */
                _Alignas(64) float rel[EXT_LANES];
                for (int l = 0; l < EXT_LANES; l++)
                    rel[l] = (float)(last[c0 + l] - p0 < EXT_KEYS ? last[c0 + l] - p0 : EXT_KEYS);
                lim = qv_load(rel);
            }
            qv top = neg_inf;
            for (int64_t i = 0; i < n; i++) {
                qv x = qv_mul(qv_load(st + i * nqp + c0), scale_v);
                if (!full) x = qv_keep(qv_set1((float)i), lim, x, neg_inf);
                qv_store(st + i * nqp + c0, x);
                top = qv_max(top, x);
            }
            /* lanes whose chunk max passes their running max by more than the slack move it,
             * rescaling what they hold (always on a lane's first chunk: m = -inf) */
            _Alignas(64) float tops[EXT_LANES];
            qv_store(tops, top);
            for (int l = 0; l < EXT_LANES; l++) {
                const int64_t v = c0 + l;
                if (!(tops[l] > mx[v] + EXT_SLACK)) continue;
                const float correction = expf(mx[v] - tops[l]); /* 0 on the first chunk */
                sum[v] *= correction;
                if (v < nq)
                    for (int64_t j = 0; j < d; j++) acc[v][j] *= correction;
                mx[v] = tops[l];
            }
            const qv m = qv_load(mx + c0);
            qv total = qv_load(sum + c0);
            for (int64_t i = 0; i < n; i++) {
                qv e = qv_exp(qv_sub(qv_load(st + i * nqp + c0), m));
                if (!full) e = qv_keep(qv_set1((float)i), lim, e, zero);
                qv_store(st + i * nqp + c0, e);
                total = qv_add(total, e);
            }
            qv_store(sum + c0, total);
        }
        /* values: acc[v] += sum over the chunk's keys i of st[i][v] * value i */
        for (int64_t v0 = 0; v0 < nq; v0 += EXT_QUAD) {
            const int64_t nv = nq - v0 < EXT_QUAD ? nq - v0 : EXT_QUAD;
            if (last[v0 + nv - 1] < p0) continue; /* none of them sees the chunk */
#if defined(__AVX512F__)
            if (d % 64 == 0 && nv == EXT_QUAD) {
                add_weighted_rows_quad(acc + v0, st + v0, nqp, vt, n, d);
                continue;
            }
#endif
            float w[2][EXT_KEYS];
            for (int64_t u = 0; u < nv; u += 2) {
                const int pair = u + 1 < nv;
                for (int64_t i = 0; i < n; i++) {
                    w[0][i] = st[i * nqp + v0 + u];
                    if (pair) w[1][i] = st[i * nqp + v0 + u + 1];
                }
                if (pair)
                    add_weighted_rows2(acc[v0 + u], w[0], acc[v0 + u + 1], w[1], vt, n, d);
                else {
                    const float *rows[EXT_KEYS];
                    for (int64_t i = 0; i < n; i++) rows[i] = vt + i * d;
                    add_weighted_rows(acc[v0 + u], w[0], rows, 0, n, d);
                }
            }
        }
    }
    for (int64_t v = 0; v < nq; v++) {
        float *out = part + v / group * part_row_stride + v % group * pw;
        memcpy(out, acc[v], (size_t)d * sizeof(float));
        out[d] = mx[v];
        out[d + 1] = sum[v];
    }
}

#endif
