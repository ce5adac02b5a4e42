/* A GGUF file's Q4_K and Q6_K rows against activations quantized per super-block of 256, as
 * llama.cpp's Q8_K: the integer arithmetic that makes a K-quant dot product cheap.
 *
 * With activations quantized per 32 (q8_act.h), every 32-element block of a product needs its
 * own float multiply-add: a K-quant row's 6- or 8-bit sub-block scales must first be widened
 * into floats, and the float work per block costs as much as the integer products. Here an
 * activation row has one scale dx per 256 elements, its codes round(x / dx), and the sum of its
 * codes per 16 (bsum). A super-block's sub-block scales then stay integers and multiply the
 * integer block sums in int16 x int16 products (vpmaddwd), and the whole super-block meets
 * floats once:
 *
 *   x . w over super-block s = dx_s (D_s isum_s - M_s msum_s),
 *   isum_s = sum over elements e of sc[e / 16] u_e xq_e,  msum_s = sum over 16-groups g of
 *   mn[g] bsum_g
 *
 * with u the unsigned codes and, per kind:
 *   Q4_K: u = q in [0, 15], sc = the 6-bit scale of e's 32-block, mn its 6-bit min, D = d,
 *         M = dmin (w = d sc q - dmin mn);
 *   Q6_K: u = q + 32 in [0, 63], sc = the int8 scale of e's 16-group, mn = sc, D = d,
 *         M = 32 d (w = d sc (u - 32)).
 * Every integer is exact: |u xq| pair sums stay under 2 * 63 * 127 in int16, and a lane's
 * super-block sum under 2^26 in int32.
 *
 * The fixed order, the same bits on the AVX2 and portable paths: lane l (0-7) of 32-element
 * chunk c holds elements 32c + 4l .. 32c + 4l + 3 (vpmaddubsw then vpmaddwd keep element
 * order), and sums them over the super-block's 8 chunks as exact integers; its msum lane holds
 * groups 2l and 2l + 1. Per super-block each lane then does acc_l = fma(float(isum_l), fl(D dx),
 * acc_l) and macc_l = fma(float(msum_l), fl(M dx), macc_l); the result is hsum8(acc) -
 * hsum8(macc) (block_quant.h's order).
 *
 * The new error against float32 activations is x's rounding to 8 bits against its super-block's
 * largest element: llama.cpp's CPU arithmetic for these types, not the dequantized model's.
 */
#ifndef PREFIXRAG_Q8K_ACT_H
#define PREFIXRAG_Q8K_ACT_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "block_quant.h"
#include "kquant_rows.h"

#if defined(__AVX2__) && defined(__FMA__)
#define Q8K_AVX2 1
#include <immintrin.h>
#endif

/* rows of x that share one unpacking of a super-block's codes */
#define Q8K_ROWS 4
#define Q8K_GROUPS (QK_K / 16)
#ifndef Q8K_PREFETCH
#define Q8K_PREFETCH 512
#endif

/* One activation row quantized per super-block: codes q [k], scales d [k / 256], and the sums
 * of its codes per 16, bsum [k / 16]. */
typedef struct {
    int8_t *q;
    float *d;
    int16_t *bsum;
} q8k_row;

static inline int64_t q8k_align(int64_t bytes) { return (bytes + 63) / 64 * 64; }

/* bytes a q8k_row of k needs, its parts 64-byte aligned (0 when k is no multiple of 256) */
static inline int64_t q8k_row_bytes(int64_t k) {
    if (k % QK_K) return 0;
    return q8k_align(k) + q8k_align(k / QK_K * 4) + q8k_align(k / 16 * 2);
}

/* lays a q8k_row over buf (q8k_row_bytes(k) bytes, 64-byte aligned) */
static inline q8k_row q8k_row_at(void *buf, int64_t k) {
    char *p = (char *)buf;
    q8k_row r;
    r.q = (int8_t *)p;
    r.d = (float *)(p + q8k_align(k));
    r.bsum = (int16_t *)(p + q8k_align(k) + q8k_align(k / QK_K * 4));
    return r;
}

/* Super-block s of a row, its 256 floats at xs: dx = max|x| / 127, codes nearbyint(x * 127 /
 * max|x|) (0 for an all-zero super-block), and the codes' sums per 16. Super-blocks touch
 * disjoint bytes, so threads may quantize a row's super-blocks at once. */
static inline void quantize_superblock_q8k(const float *xs, int64_t s, q8k_row *q) {
    int8_t *dst = q->q + s * QK_K;
    int16_t *bsum = q->bsum + s * Q8K_GROUPS;
#if defined(Q8K_AVX2)
    /* the loop below in vectors, the same bits: max is exact in any order, cvtps2dq rounds half
     * to even as nearbyintf does, and the code sums are exact */
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 mx = _mm256_setzero_ps();
    for (int i = 0; i < QK_K; i += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(xs + i)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    for (int g = 0; g < Q8K_GROUPS; g++) {
        const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xs + 16 * g), inv));
        const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xs + 16 * g + 8), inv));
        const __m128i a0 = _mm256_castsi256_si128(a), a1 = _mm256_extracti128_si256(a, 1);
        const __m128i b0 = _mm256_castsi256_si128(b), b1 = _mm256_extracti128_si256(b, 1);
        /* |codes| <= 127: the saturating packs are exact and keep element order */
        const __m128i w16a = _mm_packs_epi32(a0, a1), w16b = _mm_packs_epi32(b0, b1);
        _mm_storeu_si128((__m128i *)(dst + 16 * g), _mm_packs_epi16(w16a, w16b));
        __m128i t = _mm_madd_epi16(_mm_add_epi16(w16a, w16b), _mm_set1_epi16(1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
        bsum[g] = (int16_t)_mm_cvtsi128_si32(t);
    }
    q->d[s] = amax / 127.0f;
#else
    float amax = 0.0f;
    for (int i = 0; i < QK_K; i++) amax = fmaxf(amax, fabsf(xs[i]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int g = 0; g < Q8K_GROUPS; g++) {
        int32_t sum = 0;
        for (int i = 16 * g; i < 16 * g + 16; i++) {
            dst[i] = (int8_t)nearbyintf(xs[i] * inv);
            sum += dst[i];
        }
        bsum[g] = (int16_t)sum;
    }
    q->d[s] = amax / 127.0f;
#endif
}

/* x [k] (k a multiple of 256) into q */
static inline void quantize_row_q8k(const float *x, int64_t k, q8k_row *q) {
    for (int64_t s = 0; s < k / QK_K; s++) quantize_superblock_q8k(x + s * QK_K, s, q);
}

/* A super-block's integer scales per 16-group (sc, mn) and its float D and M (see the top) */
static inline void kq_superblock_scales(int kind, const uint8_t *sb, int16_t *sc, int16_t *mn,
                                        float *D, float *M) {
    if (kind == KIND_Q4K) {
        uint8_t s8[8], m8[8];
        q4k_scale_bytes(sb + 4, s8, m8);
        for (int g = 0; g < Q8K_GROUPS; g++) {
            sc[g] = s8[g / 2];
            mn[g] = m8[g / 2];
        }
        *D = half_at(sb);
        *M = half_at(sb + 2);
        return;
    }
    const int8_t *s8 = (const int8_t *)(sb + 192);
    for (int g = 0; g < Q8K_GROUPS; g++) sc[g] = mn[g] = s8[g];
    *D = half_at(sb + 208);
    *M = 32.0f * *D; /* exact: a power of two times a half */
}

/* chunk c's 32 unsigned codes (see the top) into u */
static inline void kq_chunk_codes_scalar(int kind, const uint8_t *sb, int c, uint8_t *u) {
    if (kind == KIND_Q4K) {
        const uint8_t *qs = sb + 16 + (c / 2) * 32;
        for (int i = 0; i < 32; i++) u[i] = (c & 1) ? qs[i] >> 4 : qs[i] & 15;
        return;
    }
    const int half = c / 4, part = c % 4;
    const uint8_t *ql = sb + half * 64 + 32 * (part & 1), *qh = sb + 128 + half * 32;
    for (int i = 0; i < 32; i++)
        u[i] = (uint8_t)(((ql[i] >> (4 * (part >> 1))) & 15) | (((qh[i] >> (2 * part)) & 3) << 4));
}

/* x . W_row in the fixed order, portable C (the AVX2 path's yardstick) */
static inline float q8k_dot_portable(int kind, const uint8_t *row, int64_t k, const q8k_row *x) {
    const int64_t bytes = kind == KIND_Q4K ? Q4K_BYTES : Q6K_BYTES;
    float acc[8] = {0}, macc[8] = {0};
    for (int64_t s = 0; s < k / QK_K; s++) {
        const uint8_t *sb = row + s * bytes;
        int16_t sc[Q8K_GROUPS], mn[Q8K_GROUPS];
        float D, M;
        kq_superblock_scales(kind, sb, sc, mn, &D, &M);
        int32_t isum[8] = {0}, msum[8];
        for (int c = 0; c < 8; c++) {
            uint8_t u[32];
            kq_chunk_codes_scalar(kind, sb, c, u);
            const int8_t *xq = x->q + s * QK_K + 32 * c;
            for (int l = 0; l < 8; l++) {
                int32_t t = 0;
                for (int i = 4 * l; i < 4 * l + 4; i++) t += (int32_t)u[i] * xq[i];
                isum[l] += sc[(32 * c + 4 * l) / 16] * t;
            }
        }
        const int16_t *bs = x->bsum + s * Q8K_GROUPS;
        for (int l = 0; l < 8; l++) msum[l] = mn[2 * l] * bs[2 * l] + mn[2 * l + 1] * bs[2 * l + 1];
        const float dd = D * x->d[s], dm = M * x->d[s];
        for (int l = 0; l < 8; l++) {
            acc[l] = fmaf((float)isum[l], dd, acc[l]);
            macc[l] = fmaf((float)msum[l], dm, macc[l]);
        }
    }
    /* hsum8's order: (l, l + 4), then (u0 + u2) + (u1 + u3) */
    float a[4], b[4];
    for (int l = 0; l < 4; l++) {
        a[l] = acc[l] + acc[l + 4];
        b[l] = macc[l] + macc[l + 4];
    }
    return ((a[0] + a[2]) + (a[1] + a[3])) - ((b[0] + b[2]) + (b[1] + b[3]));
}

#if defined(Q8K_AVX2)
/* super-block sb's 8 chunks of unsigned codes */
static ALWAYS_INLINE void kq_codes8(int kind, const uint8_t *sb, __m256i *u) {
    const __m256i low4 = _mm256_set1_epi8(15);
    if (kind == KIND_Q4K) {
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(sb + 16 + 32 * c));
            u[2 * c] = _mm256_and_si256(v, low4);
            u[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        }
        return;
    }
    const __m256i two = _mm256_set1_epi8(3);
    for (int half = 0; half < 2; half++) {
        const __m256i la = _mm256_loadu_si256((const __m256i *)(sb + 64 * half));
        const __m256i lb = _mm256_loadu_si256((const __m256i *)(sb + 64 * half + 32));
        const __m256i h = _mm256_loadu_si256((const __m256i *)(sb + 128 + 32 * half));
        /* high bit pairs masked before the 16-bit shifts, so no bits cross bytes */
        const __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(h, two), 4);
        const __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), two), 4);
        const __m256i h2 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), two), 4);
        const __m256i h3 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), two), 4);
        __m256i *o = u + 4 * half;
        o[0] = _mm256_or_si256(_mm256_and_si256(la, low4), h0);
        o[1] = _mm256_or_si256(_mm256_and_si256(lb, low4), h1);
        o[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(la, 4), low4), h2);
        o[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lb, 4), low4), h3);
    }
}

/* A super-block's scales as vectors: per chunk c, shuffle(sv, pick[c]) gives the 16 int16
 * multipliers of its maddubs sums (the scale of elements 0-15 in the low half, of 16-31 in the
 * high); mnv holds mn per 16-group, for vpmaddwd against bsum. */
static ALWAYS_INLINE void kq_scale_vectors(int kind, const uint8_t *sb, __m256i *sv, __m256i *mnv,
                                           float *D, float *M) {
    if (kind == KIND_Q4K) {
        uint8_t s8[8], m8[8];
        q4k_scale_bytes(sb + 4, s8, m8);
        uint64_t sw, mw;
        memcpy(&sw, s8, 8);
        memcpy(&mw, m8, 8);
        const __m128i s16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sw));
        const __m128i m16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mw));
        *sv = _mm256_broadcastsi128_si256(s16); /* a 32-block's scale serves both its halves */
        *mnv = _mm256_set_m128i(_mm_unpackhi_epi16(m16, m16), _mm_unpacklo_epi16(m16, m16));
        *D = half_at(sb);
        *M = half_at(sb + 2);
        return;
    }
    const __m128i s8 = _mm_loadu_si128((const __m128i *)(sb + 192));
    /* even 16-groups to the low half, odd ones to the high: chunk c's are groups 2c and 2c + 1 */
    const __m128i evens_odds = _mm_shuffle_epi8(s8, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    *sv = _mm256_cvtepi8_epi16(evens_odds);
    *mnv = _mm256_cvtepi8_epi16(s8);
    *D = half_at(sb + 208);
    *M = 32.0f * *D; /* exact: a power of two times a half */
}

/* the shuffle that spreads int16 number c of each 128-bit half over that half */
static ALWAYS_INLINE __m256i kq_pick(int c) {
    return _mm256_set1_epi16((short)((2 * c) | ((2 * c + 1) << 8)));
}

/* res[r] = x[r] . W_row for r < R: each super-block's codes and scales unpacked once for all R
 * rows */
static ALWAYS_INLINE void q8k_dot_rows(int kind, const uint8_t *row, int64_t k, const q8k_row *x,
                                       const int R, float *res) {
    const int64_t bytes = kind == KIND_Q4K ? Q4K_BYTES : Q6K_BYTES;
    __m256 acc[Q8K_ROWS], macc[Q8K_ROWS];
    for (int r = 0; r < R; r++) acc[r] = macc[r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < k / QK_K; s++) {
        const uint8_t *sb = row + s * bytes;
        __m256i u[8], scv[8], sv, mnv;
        float D, M;
        kq_scale_vectors(kind, sb, &sv, &mnv, &D, &M);
        kq_codes8(kind, sb, u);
        for (int c = 0; c < 8; c++)
            scv[c] = _mm256_shuffle_epi8(sv, kq_pick(c));
        for (int r = 0; r < R; r++) {
            const int8_t *xq = x[r].q + s * QK_K;
            __m256i isum = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + 32 * c));
                isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(u[c], xv), scv[c]));
            }
            const __m256i bs = _mm256_loadu_si256((const __m256i *)(x[r].bsum + s * Q8K_GROUPS));
            const __m256i msum = _mm256_madd_epi16(mnv, bs);
            const float dx = x[r].d[s];
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(D * dx), acc[r]);
            macc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(M * dx), macc[r]);
        }
    }
    for (int r = 0; r < R; r++) res[r] = hsum8(acc[r]) - hsum8(macc[r]);
}

static ALWAYS_INLINE void q8k_dot_rows_kind(int kind, const uint8_t *row, int64_t k,
                                            const q8k_row *x, int rows, float *res) {
    switch (rows) {
    case 1: q8k_dot_rows(kind, row, k, x, 1, res); break;
    case 2: q8k_dot_rows(kind, row, k, x, 2, res); break;
    case 3: q8k_dot_rows(kind, row, k, x, 3, res); break;
    case 4: q8k_dot_rows(kind, row, k, x, 4, res); break;
    default: q8k_dot_rows(kind, row, k, x, Q8K_ROWS, res); break;
    }
}
#endif

/* out[r * ldo + j] = x[r] . W[j] for r < rows, j < n over K-quant rows (codes: n rows of
 * kquant_row_bytes) and rows x quantized per super-block; call from every thread of a parallel
 * region. Ends with the loop's barrier. */
static inline void q8k_matmul_for(int kind, const q8k_row *x, const void *codes, float *out,
                                  int64_t rows, int64_t n, int64_t k, int64_t ldo) {
    const int64_t row_bytes = kquant_row_bytes(kind, k);
#pragma omp for schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *wj = (const uint8_t *)codes + j * row_bytes;
#if defined(Q8K_AVX2)
#if Q8K_PREFETCH > 0
        {
            const uint8_t *ahead = wj + Q8K_PREFETCH;
            const uint8_t *end = (const uint8_t *)codes + n * row_bytes;
            for (int64_t b = 0; b < row_bytes && ahead + b < end; b += 64) __builtin_prefetch(ahead + b);
        }
#endif
        for (int64_t r0 = 0; r0 < rows; r0 += Q8K_ROWS) {
            float res[Q8K_ROWS];
            const int g = rows - r0 < Q8K_ROWS ? (int)(rows - r0) : Q8K_ROWS;
            if (kind == KIND_Q4K)
                q8k_dot_rows_kind(KIND_Q4K, wj, k, x + r0, g, res);
            else
                q8k_dot_rows_kind(KIND_Q6K, wj, k, x + r0, g, res);
            for (int r = 0; r < g; r++) out[(r0 + r) * ldo + j] = res[r];
        }
#else
        for (int64_t r = 0; r < rows; r++) out[r * ldo + j] = q8k_dot_portable(kind, wj, k, x + r);
#endif
    }
}

#endif
