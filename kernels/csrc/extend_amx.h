/* extend_task (extend_tiles.h) on AMX's bfloat16 tile products, for a float16 or bfloat16
 * cache: the same task, the same partials, another summation order.
 *
 * Why: after 2,048 cached positions, the 32 rows of a new question spend about a third of
 * their TTFT in this attention, and extend_task's float32 fused multiply-adds run near their
 * peak. A tile product multiplies 16 x 32 by 32 x 16 bfloat16 matrices in one instruction.
 *
 * Accuracy, float32's: a cached float16 is exactly the sum of two bfloat16 (its 11 significant
 * bits in 8 + 8; a bfloat16 cache, one part). A query is split into three bfloat16 parts,
 * which hold a float32 exactly, and a score keeps the five products of parts above 2^-24 of
 * the whole: each product of parts is exact in float32, and the tile unit sums them in
 * float32. (Two query parts leave up to 2^-17 of a term: with wide scores, |s| ~ 30, outputs
 * then moved by 5e-5 where a float32 sum moves them by 1e-6, tests/kernels/test_extend_tiles.py.)
 * The softmax weights, in [0, 1], take two parts and the values' two parts three products:
 * a weighted value is off by at most about 2^-17 of itself, a long float32 sum's own rounding.
 *
 * Layout, per task (16 query vectors to a tile, as extend_task's lanes):
 *   scores transposed, S^T = K Q^T: the keys are the left operand as they lie (a row a key),
 *     the queries the right one, laid out once per task; a C tile then holds 16 keys by 16
 *     query vectors, one lane per query vector, so the softmax runs across lanes with no
 *     horizontal max or sum (as extend_tiles.h does);
 *   values transposed, O^T = V^T P^T: the values laid out once per task as the left operand
 *     (a row a head dimension, 32 keys), the weights the right one straight from S^T's rows.
 * A task covers at most EXT_SPLIT positions, so its softmax takes two plain passes (each query
 * vector's max over the range, then the exponentials) and never rescales a sum.
 *
 * A query vector's result depends on nothing but its own row: a tile product's element is its
 * own row of A times its own column of B, summed pair by pair in order, and a key a vector does
 * not see gets the weight 0 (its products then add +0), whichever tile or lane it lands in.
 */
#ifndef PREFIXRAG_EXTEND_AMX_H
#define PREFIXRAG_EXTEND_AMX_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "amx_tiles.h"
#include "extend_tiles.h"

#define XA_KEYS 32 /* keys of a value product: a tile row of bfloat16 */
#define XA_TILE 1024 /* bytes of a tile */
#define XA_QPARTS 3 /* bfloat16 parts of a query: all of its float32 */

/* the bytes of each of a task's buffers, for up to nq query vectors of d (d % 32 == 0) */
typedef struct {
    int64_t q, k, v, s, p, o, rows;
} xa_sizes;

static inline xa_sizes xa_layout(int64_t nq, int64_t d) {
    const int64_t dc = d / 32, keys = EXT_SPLIT;
    return (xa_sizes){
        .q = (nq + 15) / 16 * dc * XA_QPARTS * XA_TILE, /* [query tile][dim chunk][part] */
        .k = keys / 16 * dc * 2 * XA_TILE,              /* [key tile][dim chunk][part] */
        .v = keys / 32 * (d / 16) * 2 * XA_TILE,        /* [key chunk][dim block][part] */
        .s = keys * 16 * 4,                             /* S^T (then P^T), one query tile */
        .p = keys / 32 * 2 * XA_TILE,                   /* P^T: [key chunk][part] */
        .o = d * 16 * 4,                                /* O^T of one query tile */
        .rows = XA_KEYS * d * 4,                        /* a chunk's cached rows widened */
    };
}

/* scratch bytes of extend_task_amx for up to nq query vectors; 64-byte aligned, every buffer
 * a whole number of 64-byte lines */
static inline int64_t xa_scratch_bytes(int64_t nq, int64_t d) {
    const xa_sizes z = xa_layout(nq, d);
    return z.q + z.k + z.v + z.s + z.p + z.o + z.rows;
}

/* 16 floats each of a and b in two rounded bfloat16 parts, interleaved as AMX's pairs: word j
 * of part s holds a[j]'s part in its low half, b[j]'s in its high half */
static inline void xa_pair_parts(__m512 a, __m512 b, __m512i *out) {
    for (int s = 0; s < 2; s++) {
        const __m512i at = bf16_top(a), bt = bf16_top(b);
        out[s] = _mm512_or_si512(_mm512_srli_epi32(at, 16), bt);
        a = _mm512_sub_ps(a, _mm512_castsi512_ps(at));
        b = _mm512_sub_ps(b, _mm512_castsi512_ps(bt));
    }
}

/* rows i < n of a chunk's cached K or V (positions p0 + i, kv head g) widened into rows [32][d],
 * rows n and on zero */
static inline void xa_widen(const void *cache, int32_t kind, int64_t p0, int64_t n, int64_t g,
                            int64_t hkv, int64_t d, int64_t bs, const int32_t *table,
                            float *rows) {
    for (int64_t i = 0; i < XA_KEYS; i++) {
        float *r = rows + i * d;
        if (i >= n) {
            memset(r, 0, (size_t)d * sizeof(float));
            continue;
        }
        const int64_t at = paged_slot(table, p0 + i, bs) * hkv * d + g * d;
        const float *src = kv_load(cache, kind, at, d, r);
        if (src != r) memcpy(r, src, (size_t)d * sizeof(float));
    }
}

/* C tiles 0 to 3 zeroed: the four accumulators of xa_scores and xa_weighted_values */
static inline void xa_zero_c(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

/* C tiles 0 and 1, and 2 and 3 when `four`, to dst, 256 floats (a tile) apart */
static inline void xa_store_c(float *dst, int four) {
    _tile_stored(0, dst, 64);
    _tile_stored(1, dst + 256, 64);
    if (four) {
        _tile_stored(2, dst + 512, 64);
        _tile_stored(3, dst + 768, 64);
    }
}

/* M(j) for C tiles 0 and 1, and 2 and 3 when `four` (a tile index must be a constant) */
#define XA_EACH_C(M)                                                                             \
    do {                                                                                         \
        M(0);                                                                                    \
        M(1);                                                                                    \
        if (four) {                                                                              \
            M(2);                                                                                \
            M(3);                                                                                \
        }                                                                                        \
    } while (0)

/* scores of key tile kt + j (C tile j) for dim chunk c, the queries' three parts in tiles 4
 * to 6; a bfloat16 cache's keys have no low part */
#define XA_SCORES(j)                                                                             \
    do {                                                                                         \
        const uint8_t *kp = ka + ((kt + (j)) * dc + c) * 2 * XA_TILE;                           \
        _tile_loadd(7, kp, 64);                                                                  \
        _tile_dpbf16ps(j, 7, 4);                                                                 \
        _tile_dpbf16ps(j, 7, 5);                                                                 \
        _tile_dpbf16ps(j, 7, 6);                                                                 \
        if (low) {                                                                               \
            _tile_loadd(7, kp + XA_TILE, 64);                                                    \
            _tile_dpbf16ps(j, 7, 4);                                                             \
            _tile_dpbf16ps(j, 7, 5);                                                             \
        }                                                                                        \
    } while (0)

/* S^T [keys][16 lanes] of one query tile (its right operands at qb) for the key tiles of the
 * first `chunks` key chunks, four key tiles (four independent C tiles) at a time */
static inline void xa_scores(const uint8_t *qb, const uint8_t *ka, int64_t chunks, int64_t dc,
                             int low, float *st) {
    for (int64_t kt = 0; kt < chunks * 2; kt += 4) {
        const int four = chunks * 2 - kt >= 4;
        xa_zero_c();
        for (int64_t c = 0; c < dc; c++) {
            _tile_loadd(4, qb + c * XA_QPARTS * XA_TILE, 64); /* the queries' parts */
            _tile_loadd(5, qb + (c * XA_QPARTS + 1) * XA_TILE, 64);
            _tile_loadd(6, qb + (c * XA_QPARTS + 2) * XA_TILE, 64);
            XA_EACH_C(XA_SCORES);
        }
        xa_store_c(st + kt * 256, four);
    }
}

/* the queries of kv head g's group as right operands [query tile][dim chunk][part]: row i of
 * a tile holds dims 2i, 2i + 1 of its 16 query vectors; vectors past nq are zero */
static inline void xa_pack_queries(const float *const *q_rows, int64_t nq, int64_t g,
                                   int64_t group, int64_t d, uint8_t *qb) {
    const int64_t dc = d / 32;
    for (int64_t t = 0; t < (nq + 15) / 16; t++)
        for (int64_t c = 0; c < dc; c++) {
            __m512i part_rows[XA_QPARTS][16];
            for (int64_t l = 0; l < 16; l++) {
                const int64_t v = t * 16 + l;
                __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
                if (v < nq) {
                    const float *src = q_rows[v / group] + (g * group + v % group) * d + c * 32;
                    lo = _mm512_loadu_ps(src);
                    hi = _mm512_loadu_ps(src + 16);
                }
                __m512i parts[XA_QPARTS];
                split_bf16(lo, hi, parts, XA_QPARTS);
                for (int s = 0; s < XA_QPARTS; s++) part_rows[s][l] = parts[s];
            }
            for (int s = 0; s < XA_QPARTS; s++) {
                transpose16(part_rows[s]);
                memcpy(qb + ((t * dc + c) * XA_QPARTS + s) * XA_TILE, part_rows[s], XA_TILE);
            }
        }
}

/* keys as left operands, a row a key [key tile][dim chunk][part], from rows [32][d] of chunk kc */
static inline void xa_pack_keys(const float *rows, int64_t kc, int64_t d, uint8_t *ka) {
    const int64_t dc = d / 32;
    for (int64_t i = 0; i < XA_KEYS; i++)
        for (int64_t c = 0; c < dc; c++) {
            __m512i parts[2];
            const float *r = rows + i * d + c * 32;
            split_bf16(_mm512_loadu_ps(r), _mm512_loadu_ps(r + 16), parts, 2);
            uint8_t *dst = ka + ((kc * 2 + i / 16) * dc + c) * 2 * XA_TILE + (i % 16) * 64;
            _mm512_storeu_si512(dst, parts[0]);
            _mm512_storeu_si512(dst + XA_TILE, parts[1]);
        }
}

/* values transposed as left operands, a row a head dimension [key chunk][dim block][part],
 * from rows [32][d] of chunk kc: row j holds keys 2i and 2i + 1 in word i */
static inline void xa_pack_values(const float *rows, int64_t kc, int64_t d, uint8_t *va) {
    const int64_t blocks = d / 16;
    for (int64_t b = 0; b < blocks; b++) {
        __m512i words[2][16];
        for (int64_t i = 0; i < 16; i++) {
            __m512i parts[2];
            xa_pair_parts(_mm512_loadu_ps(rows + 2 * i * d + b * 16),
                          _mm512_loadu_ps(rows + (2 * i + 1) * d + b * 16), parts);
            words[0][i] = parts[0];
            words[1][i] = parts[1];
        }
        for (int s = 0; s < 2; s++) {
            transpose16(words[s]); /* row j: dim 16b + j */
            memcpy(va + ((kc * blocks + b) * 2 + s) * XA_TILE, words[s], XA_TILE);
        }
    }
}

/* The softmax of one query tile's scores st [keys][16 lanes], keys < 32 * chunks: scaled, keys
 * past a lane's lim masked (none below `full`, which every lane sees), exponentials against
 * the lane's max, into pb as the right operands of the value products [key chunk][part][16 key
 * pairs]. Leaves each lane's max (-inf where it sees none of them) in top and its sum in
 * total. */
static inline void xa_softmax(float *st, int64_t chunks, __m512 lim, int64_t full, float scale,
                              __m512i *pb, __m512 *top, __m512 *total) {
    const __m512 scale_v = _mm512_set1_ps(scale), neg_inf = _mm512_set1_ps(-INFINITY);
    const __m512 zero = _mm512_setzero_ps();
    const int64_t keys = chunks * XA_KEYS;
    __m512 mx = neg_inf, sum = zero;
    for (int64_t i = 0; i < keys; i++) {
        __m512 x = _mm512_mul_ps(_mm512_load_ps(st + i * 16), scale_v);
        if (i >= full) x = qv_keep(_mm512_set1_ps((float)i), lim, x, neg_inf);
        _mm512_store_ps(st + i * 16, x);
        mx = _mm512_max_ps(mx, x);
    }
    /* a lane that sees none of them keeps its max -inf; its exponentials are masked */
    const __m512 m = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mx, neg_inf, _CMP_EQ_OQ), mx, zero);
    for (int64_t i = 0; i < keys; i += 2) {
        __m512 e[2];
        for (int u = 0; u < 2; u++) {
            e[u] = exp_nonpos16(_mm512_sub_ps(_mm512_load_ps(st + (i + u) * 16), m));
            if (i + u >= full) e[u] = qv_keep(_mm512_set1_ps((float)(i + u)), lim, e[u], zero);
            sum = _mm512_add_ps(sum, e[u]);
        }
        __m512i w[2];
        xa_pair_parts(e[0], e[1], w);
        pb[(i / XA_KEYS) * 32 + (i % XA_KEYS) / 2] = w[0];
        pb[(i / XA_KEYS) * 32 + 16 + (i % XA_KEYS) / 2] = w[1];
    }
    *top = mx;
    *total = sum;
}

/* value products of dim block b (C tile b) over key chunk kc, the weights' parts in tiles 4
 * and 5; a bfloat16 cache's values have no low part */
#define XA_VALUES(b)                                                                             \
    do {                                                                                         \
        const uint8_t *vp = va + ((kc * blocks + db0 + (b)) * 2) * XA_TILE;                     \
        _tile_loadd(6, vp, 64);                                                                  \
        _tile_loadd(7, vp + XA_TILE, 64);                                                        \
        _tile_dpbf16ps(b, 6, 4);                                                                 \
        _tile_dpbf16ps(b, 6, 5);                                                                 \
        if (v_low) _tile_dpbf16ps(b, 7, 4);                                                      \
    } while (0)

/* O^T [d][16 lanes] = V^T P^T over the first `chunks` key chunks */
static inline void xa_weighted_values(const __m512i *pb, const uint8_t *va, int64_t chunks,
                                      int64_t d, int v_low, float *ot) {
    const int64_t blocks = d / 16;
    for (int64_t db0 = 0; db0 < blocks; db0 += 4) {
        const int four = blocks - db0 >= 4;
        xa_zero_c();
        for (int64_t kc = 0; kc < chunks; kc++) {
            _tile_loadd(4, pb + kc * 32, 64);      /* the weights' high part */
            _tile_loadd(5, pb + kc * 32 + 16, 64); /* their low part */
            XA_EACH_C(XA_VALUES);
        }
        xa_store_c(ot + db0 * 256, four);
    }
}

/* extend_task's contract (its arguments and its partials), for kind KV_F16 or KV_BF16, d % 32
 * == 0, on a process amx_permitted() lets use AMX; scratch: xa_scratch_bytes(nq, d) bytes,
 * 64-byte aligned */
static inline void extend_task_amx(const float *const *q_rows, int64_t r0, int64_t r1,
                                   int64_t prefix, int64_t g, int64_t group, int64_t begin,
                                   int64_t end, const void *k_cache, const void *v_cache,
                                   int32_t kind, int64_t hkv, int64_t d, int64_t bs,
                                   const int32_t *table, float scale, uint8_t *scratch,
                                   float *part, int64_t part_row_stride) {
    const int64_t nq = (r1 - r0) * group, dc = d / 32, pw = partial_width(d);
    const xa_sizes z = xa_layout(nq, d);
    uint8_t *qb = scratch, *ka = qb + z.q, *va = ka + z.k;
    float *st = (float *)(va + z.v);
    __m512i *pb = (__m512i *)((uint8_t *)st + z.s);
    float *ot = (float *)((uint8_t *)pb + z.p), *rows = ot + d * 16;
    if (end > prefix + r1) end = prefix + r1; /* the tile's last row sees [0, prefix + r1) */
    const int64_t n = end > begin ? end - begin : 0, chunks = (n + XA_KEYS - 1) / XA_KEYS;
    const int low = kind != KV_BF16; /* a float16's second bfloat16 part */

    xa_pack_queries(q_rows, nq, g, group, d, qb);
    for (int64_t kc = 0; kc < chunks; kc++) {
        const int64_t m = n - kc * XA_KEYS < XA_KEYS ? n - kc * XA_KEYS : XA_KEYS;
        /* the next chunk's rows, while this one is widened and packed. The widening's loads
         * were a quarter of this kernel's samples; the warm TTFT (32 tokens after 2,048,
         * SmolLM2-135M, float16 cache) took 0.974 and 0.976 of its time without it, one engine,
         * builds interleaved (a chunk or two ahead alike) */
        const int64_t next = begin + (kc + 1) * XA_KEYS;
        const int64_t stop = next + XA_KEYS < begin + n ? next + XA_KEYS : begin + n;
        kv_prefetch_rows(k_cache, v_cache, kind, next, stop, g, hkv, d, bs, table);
        xa_widen(k_cache, kind, begin + kc * XA_KEYS, m, g, hkv, d, bs, table, rows);
        xa_pack_keys(rows, kc, d, ka);
        xa_widen(v_cache, kind, begin + kc * XA_KEYS, m, g, hkv, d, bs, table, rows);
        xa_pack_values(rows, kc, d, va);
    }
    amx_configure();
    for (int64_t t = 0; t < (nq + 15) / 16; t++) {
        /* each lane's last visible key, counted from begin, within the range's n keys (past
         * them, zero rows); lanes past nq repeat the last query vector's (never read) */
        _Alignas(64) float lim[16];
        int64_t tile_last = -1, full = n;
        for (int l = 0; l < 16; l++) {
            const int64_t v = t * 16 + l < nq ? t * 16 + l : nq - 1;
            int64_t rel = prefix + r0 + v / group - begin;
            rel = rel < n - 1 ? rel : n - 1;
            lim[l] = (float)rel;
            tile_last = rel > tile_last ? rel : tile_last;
            full = rel + 1 < full ? rel + 1 : full;
        }
        const int64_t seen = (tile_last + XA_KEYS) / XA_KEYS; /* chunks holding what it sees */
        xa_scores(qb + t * dc * XA_QPARTS * XA_TILE, ka, seen, dc, low, st);
        __m512 top, total;
        xa_softmax(st, seen, _mm512_load_ps(lim), full, scale, pb, &top, &total);
        xa_weighted_values(pb, va, seen, d, low, ot);
        /* O^T's rows (a dim each, a lane a query vector) into each vector's partial */
        _Alignas(64) float tops[16], sums[16];
        _mm512_store_ps(tops, top);
        _mm512_store_ps(sums, total);
        for (int64_t b = 0; b < d / 16; b++) {
            __m512i block[16];
            memcpy(block, ot + b * 256, XA_TILE);
            transpose16(block); /* row l: lane l's dims 16b .. 16b + 15 */
            for (int l = 0; l < 16 && t * 16 + l < nq; l++) {
                const int64_t v = t * 16 + l;
                _mm512_storeu_si512(part + v / group * part_row_stride + v % group * pw + b * 16,
                                    block[l]);
            }
        }
        for (int l = 0; l < 16 && t * 16 + l < nq; l++) {
            const int64_t v = t * 16 + l;
            float *out = part + v / group * part_row_stride + v % group * pw;
            out[d] = tops[l];
            out[d + 1] = sums[l];
        }
    }
    _tile_release();
}

#undef XA_EACH_C
#undef XA_SCORES
#undef XA_VALUES
#endif
