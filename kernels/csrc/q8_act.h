/* Block weights against int8 activations: the arithmetic llama.cpp's CPU decode uses.
 *
 * A decode step reads each weight once and does one multiply-add with it, so with float32
 * activations the block kernel (block_quant.h) spends its time widening codes to floats, not
 * reading them. Here each 32-element block of an activation row is quantized to int8 with its
 * own scale (dx = max|x| / 127, codes round(x / dx)), and a weight block's dot product with it is
 * a sum of integer products, exact in int32 (AVX-512 VNNI does 64 byte products an instruction,
 * AVX2 32 in two, vpmaddubsw then vpmaddwd, as llama.cpp's AVX2 path does):
 *
 *   x . w = sum over blocks b of d_b dx_b sum_i c_bi xq_bi  +  m_b dx_b sum_i xq_bi
 *
 * for w = d * c + m (q4, q8m; m = 0 for q8, q8_16). A GGUF file's own Q4_K and Q6_K rows take
 * activations quantized per super-block instead (q8k_act.h). The only new error is x's rounding to 8 bits,
 * about 0.4% of a block's largest element, as in llama.cpp's Q8 activations. Off by default:
 * the float32 path gives the dequantized model's logits (kernels/block_quant_matmul.py).
 *
 * Bytes come in pairs of blocks (b, b+1), laid out so that one 32-byte load of q4 codes unpacks
 * straight into place: bytes 0-15 are elements 0-15 of b, 16-31 those of b+1, 32-47 elements
 * 16-31 of b, 48-63 those of b+1. Lane l of a pair (bytes 4l..4l+3) so belongs to block b + (l/4)
 * % 2, and, for q8_16, to its first half when l < 8. A row with an odd number of blocks ends in a
 * half pair whose second block is all zeros and is never read from the weights.
 *
 * One fixed order on every path, so the VNNI, AVX2 and portable builds give the same bits:
 * lane l accumulates fma(float(isum_l), fl(d_l * dx_l), acc_l) pair by pair; the 16 lanes are
 * added as (l, l+8), (l, l+4), (l, l+2), (l, l+1); then the m terms are added: fma(m_b, sx_b, .)
 * into lane b % 16 in block order from zero, its lanes added in the same fixed order.
 */
#ifndef PREFIXRAG_Q8_ACT_H
#define PREFIXRAG_Q8_ACT_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "block_quant.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q8A_VNNI 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define Q8A_AVX2 1
#include <immintrin.h>
#elif defined(__AVX2__)
#include <immintrin.h> /* quantize_block_q8's vector loop */
#endif
#if defined(Q8A_VNNI) || defined(Q8A_AVX2)
#define Q8A_SIMD 1
/* rows of x that share one unpacking of a pair's codes */
#define Q8A_ROWS 4
#endif

#define PAIR_BYTES 64
#define PAIR_LANES 16

/* One activation row, quantized: xq [pairs * 64] in pair order; per lane of each pair its
 * block's scale dxl and the sum of its four codes xs; per block sx = dx * (sum of its codes). */
typedef struct {
    int8_t *xq;
    float *dxl;
    int32_t *xs;
    float *sx;
} q8_row;

static inline int64_t q8_pairs(int64_t k) { return (k / QBLOCK + 1) / 2; }

/* bytes a q8_row of k needs, 64-byte aligned parts: xq, dxl, xs, sx */
static inline int64_t q8_row_bytes(int64_t k) {
    const int64_t pairs = q8_pairs(k);
    return pairs * PAIR_BYTES + 2 * pairs * PAIR_LANES * 4 + ((2 * pairs * 4 + 63) / 64) * 64;
}

/* lays a q8_row over buf (q8_row_bytes(k) bytes, 64-byte aligned) */
static inline q8_row q8_row_at(void *buf, int64_t k) {
    const int64_t pairs = q8_pairs(k);
    char *p = (char *)buf;
    q8_row r;
    r.xq = (int8_t *)p;
    r.dxl = (float *)(p + pairs * PAIR_BYTES);
    r.xs = (int32_t *)(p + pairs * PAIR_BYTES + pairs * PAIR_LANES * 4);
    r.sx = (float *)(p + pairs * PAIR_BYTES + 2 * pairs * PAIR_LANES * 4);
    return r;
}

/* Block b of a row, x's 32 floats at xb, into q: its codes, its lanes' dx and code sums (xs),
 * and sx[b]. Blocks touch disjoint bytes of q, so threads may quantize a row's blocks at once. */
static inline void quantize_block_q8(const float *xb, int64_t b, q8_row *q) {
    const int64_t h = b % 2;
    int8_t *pair = q->xq + (b / 2) * PAIR_BYTES;
    float *dxl = q->dxl + (b / 2) * PAIR_LANES;
    int32_t *xs = q->xs + (b / 2) * PAIR_LANES;
#if defined(__AVX2__)
    /* the loop below in vectors, the same bits: max is exact in any order, cvtps2dq rounds
     * half to even as nearbyintf does (the default rounding mode), and sums of codes are exact */
    __m256 v[4];
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(xb + 8 * i);
    const __m256 m01 = _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1]));
    const __m256 m23 = _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3]));
    const __m256 m8 = _mm256_max_ps(m01, m23);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float dx = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    __m128i total = _mm_setzero_si128();
    for (int half = 0; half < 2; half++) { /* elements 0-15, then 16-31 */
        const __m256i c0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * half], _mm256_set1_ps(inv)));
        const __m256i c1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * half + 1], _mm256_set1_ps(inv)));
        const __m128i a0 = _mm256_castsi256_si128(c0), a1 = _mm256_extracti128_si256(c0, 1);
        const __m128i b0 = _mm256_castsi256_si128(c1), b1 = _mm256_extracti128_si256(c1, 1);
        /* |codes| <= 127: the saturating packs are exact and keep element order */
        const __m128i bytes = _mm_packs_epi16(_mm_packs_epi32(a0, a1), _mm_packs_epi32(b0, b1));
        _mm_storeu_si128((__m128i *)(pair + half * 32 + h * 16), bytes);
        /* lane sums of four codes: elements 0-3, 4-7, 8-11, 12-15 of this half */
        const __m128i lanes = _mm_hadd_epi32(_mm_hadd_epi32(a0, a1), _mm_hadd_epi32(b0, b1));
        _mm_storeu_si128((__m128i *)(xs + half * 8 + h * 4), lanes);
        _mm_storeu_ps(dxl + half * 8 + h * 4, _mm_set1_ps(dx));
        total = _mm_add_epi32(total, lanes);
    }
    total = _mm_add_epi32(total, _mm_shuffle_epi32(total, _MM_SHUFFLE(1, 0, 3, 2)));
    total = _mm_add_epi32(total, _mm_shuffle_epi32(total, _MM_SHUFFLE(2, 3, 0, 1)));
    q->sx[b] = dx * (float)_mm_cvtsi128_si32(total);
#else
    float amax = 0.0f;
    for (int j = 0; j < QBLOCK; j++) amax = fmaxf(amax, fabsf(xb[j]));
    const float dx = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum = 0;
    for (int half = 0; half < 2; half++) { /* elements 0-15, then 16-31 */
        int8_t *dst = pair + half * 32 + h * 16;
        for (int j = 0; j < 16; j++) {
            dst[j] = (int8_t)nearbyintf(xb[half * 16 + j] * inv);
            sum += dst[j];
        }
        for (int l = 0; l < 4; l++) {
            const int8_t *c = dst + 4 * l;
            xs[half * 8 + h * 4 + l] = c[0] + c[1] + c[2] + c[3];
            dxl[half * 8 + h * 4 + l] = dx;
        }
    }
    q->sx[b] = dx * (float)sum;
#endif
}

/* A row with an odd number of blocks ends in a half pair: its absent second block is zeros. */
static inline void pad_q8_row(q8_row *q, int64_t nb) {
    if (nb % 2 == 0) return;
    const int64_t p = nb / 2;
    for (int half = 0; half < 2; half++) {
        memset(q->xq + p * PAIR_BYTES + half * 32 + 16, 0, 16);
        memset(q->dxl + p * PAIR_LANES + half * 8 + 4, 0, 4 * sizeof(float));
        memset(q->xs + p * PAIR_LANES + half * 8 + 4, 0, 4 * sizeof(int32_t));
    }
}

/* x [k] (k a multiple of 32) into q */
static inline void quantize_row_q8(const float *x, int64_t k, q8_row *q) {
    const int64_t nb = k / QBLOCK;
    for (int64_t b = 0; b < nb; b++) quantize_block_q8(x + b * QBLOCK, b, q);
    pad_q8_row(q, nb);
}

/* kinds whose codes are unsigned 4-bit (q4); the others' are signed bytes */
static inline int nibble_codes(int kind) { return kind == 4; }
/* kinds with a d per 16 codes (q8_16) */
static inline int d_per_16(int kind) { return kind == 16; }

/* lane l of a pair: its block within the pair (0 or 1) and, for q8_16, its half of that block */
static inline int lane_block(int l) { return (l / 4) % 2; }
static inline int lane_half(int l) { return l / 8; }

/* The pair's weight scale per lane: d of the lane's block (and half, for q8_16); 0 for the
 * absent block of a half pair. */
static inline float lane_d(int kind, const float *d, int64_t p, int64_t nb, int l) {
    const int64_t b = 2 * p + lane_block(l);
    if (b >= nb) return 0.0f;
    return d_per_16(kind) ? d[2 * b + lane_half(l)] : d[b];
}

/* the pair's 64 weight codes as unsigned bytes in pair order (q8 kinds: code + 128) */
static inline void pair_codes(int kind, const void *codes, int64_t p, int64_t nb, uint8_t *u) {
    for (int h = 0; h < 2; h++) {
        const int64_t b = 2 * p + h;
        for (int half = 0; half < 2; half++)
            for (int j = 0; j < 16; j++) {
                uint8_t v = 0;
                if (b < nb && kind == 4) {
                    const uint8_t c = ((const uint8_t *)codes)[b * 16 + j];
                    v = half ? c >> 4 : c & 15;
                } else if (kind != 4) {
                    const int8_t c = b < nb ? ((const int8_t *)codes)[b * 32 + half * 16 + j] : 0;
                    v = (uint8_t)(c + 128);
                }
                u[half * 32 + h * 16 + j] = v;
            }
    }
}

/* 16 lanes to one float in the fixed order */
static inline float reduce_lanes(const float *a) {
    float t8[8], t4[4];
    for (int l = 0; l < 8; l++) t8[l] = a[l] + a[l + 8];
    for (int l = 0; l < 4; l++) t4[l] = t8[l] + t8[l + 4];
    return (t4[0] + t4[2]) + (t4[1] + t4[3]);
}

/* m_b dx_b sum(xq_b) over the row's blocks (q4 and q8m; 0 otherwise): block b into lane b % 16
 * in block order, then the lanes in the fixed order. A serial chain of fmas would cost as much
 * as the integer dot products it completes. */
static inline float m_term(int kind, const float *m, const float *sx, int64_t nb) {
    if (kind != 4 && kind != 9) return 0.0f;
#if defined(Q8A_VNNI)
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b += 16) {
        const __mmask16 live = nb - b >= 16 ? 0xffff : (__mmask16)((1u << (nb - b)) - 1);
        acc = _mm512_mask3_fmadd_ps(_mm512_maskz_loadu_ps(live, m + b),
                                    _mm512_maskz_loadu_ps(live, sx + b), acc, live);
    }
    float lanes[PAIR_LANES];
    _mm512_storeu_ps(lanes, acc);
    return reduce_lanes(lanes);
#elif defined(Q8A_AVX2)
    /* lanes 0-7 and 8-15 of whole rounds of 16 blocks in two vectors, the last round's blocks
     * one at a time into the same lanes: the same fmas, in the same order, as the loop below */
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 16 <= nb; b += 16) {
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(m + b), _mm256_loadu_ps(sx + b), lo);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(m + b + 8), _mm256_loadu_ps(sx + b + 8), hi);
    }
    float lanes[PAIR_LANES];
    _mm256_storeu_ps(lanes, lo);
    _mm256_storeu_ps(lanes + 8, hi);
    for (; b < nb; b++) lanes[b % 16] = fmaf(m[b], sx[b], lanes[b % 16]);
    return reduce_lanes(lanes);
#else
    float acc[PAIR_LANES] = {0};
    for (int64_t b = 0; b < nb; b++) acc[b % 16] = fmaf(m[b], sx[b], acc[b % 16]);
    return reduce_lanes(acc);
#endif
}

/* x . W_row for one quantized activation row, portable C (the VNNI path's yardstick) */
static inline float q8a_dot_portable(int kind, const q8_row *x, int64_t k, const void *codes,
                                     const float *d, const float *m) {
    const int64_t nb = k / QBLOCK, pairs = q8_pairs(k);
    float acc[PAIR_LANES] = {0};
    uint8_t u[PAIR_BYTES];
    for (int64_t p = 0; p < pairs; p++) {
        pair_codes(kind, codes, p, nb, u);
        const int8_t *xq = x->xq + p * PAIR_BYTES;
        for (int l = 0; l < PAIR_LANES; l++) {
            int32_t s = 0;
            for (int t = 0; t < 4; t++) s += (int32_t)u[4 * l + t] * xq[4 * l + t];
            if (!nibble_codes(kind)) s -= 128 * x->xs[p * PAIR_LANES + l];
            const float scale = lane_d(kind, d, p, nb, l) * x->dxl[p * PAIR_LANES + l];
            acc[l] = fmaf((float)s, scale, acc[l]);
        }
    }
    return reduce_lanes(acc) + m_term(kind, m, x->sx, nb);
}

#if defined(Q8A_VNNI)
/* reduce_lanes' order: (l, l+8) here, then hsum8's (l, l+4), (l, l+2), (l, l+1) */
static ALWAYS_INLINE float reduce_lanes16(__m512 a) {
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    return hsum8(_mm256_add_ps(_mm512_castps512_ps256(a), hi));
}

/* the pair's codes as unsigned bytes in pair order (see pair_codes) */
static ALWAYS_INLINE __m512i pair_codes16(int kind, const void *codes, int64_t p, int full) {
    if (kind == 4) {
        const uint8_t *c = (const uint8_t *)codes + p * 32;
        const __m256i v = full ? _mm256_loadu_si256((const __m256i *)c)
                               : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)c));
        const __m256i lo = _mm256_and_si256(v, _mm256_set1_epi8(15));
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15));
        return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
    const int8_t *c = (const int8_t *)codes + p * 64;
    const __m512i v = full ? _mm512_loadu_si512(c)
                           : _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)c));
    /* 16-byte quarters [b lo, b hi, b+1 lo, b+1 hi] to [b lo, b+1 lo, b hi, b+1 hi], + 128 */
    return _mm512_xor_si512(_mm512_shuffle_i64x2(v, v, _MM_SHUFFLE(3, 1, 2, 0)),
                            _mm512_set1_epi8((char)0x80));
}

/* the pair's weight scales per lane (see lane_d) */
static ALWAYS_INLINE __m512 pair_scales16(int kind, const float *d, int64_t p, int full) {
    if (d_per_16(kind)) {
        const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 3, 3, 3, 3);
        const __m128 v = _mm_maskz_loadu_ps(full ? 0xf : 0x3, d + 4 * p);
        return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(v));
    }
    const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
    const __m128 v = _mm_maskz_loadu_ps(full ? 0x3 : 0x1, d + 2 * p);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(v));
}

/* res[r] = x[r] . W_row for r < R: the pair's codes unpacked once for all R rows */
static ALWAYS_INLINE void q8a_dot_rows(int kind, const q8_row *x, int64_t k, const void *codes,
                                       const float *d, const float *m, const int R, float *res) {
    const int64_t nb = k / QBLOCK, pairs = q8_pairs(k);
    __m512 acc[Q8A_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const int full = 2 * p + 1 < nb;
        const __m512i u = pair_codes16(kind, codes, p, full);
        const __m512 dv = pair_scales16(kind, d, p, full);
        for (int r = 0; r < R; r++) {
            const __m512i xq = _mm512_loadu_si512(x[r].xq + p * PAIR_BYTES);
            __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, xq);
            if (!nibble_codes(kind))
                s = _mm512_sub_epi32(
                    s, _mm512_slli_epi32(_mm512_loadu_si512(x[r].xs + p * PAIR_LANES), 7));
            const __m512 scale = _mm512_mul_ps(dv, _mm512_loadu_ps(x[r].dxl + p * PAIR_LANES));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) res[r] = reduce_lanes16(acc[r]) + m_term(kind, m, x[r].sx, nb);
}

#elif defined(Q8A_AVX2)
/* A pair is two 256-bit halves here: lanes 0-7 (bytes 0-31) and lanes 8-15 (bytes 32-63). */

/* the pair's codes in pair order, as the bytes vpmaddubsw multiplies: q4 codes (0..15) as they
 * are; q8 codes signed, so their absolute values, with their signs moved onto x (sign_x). The
 * +128 of pair_codes would overflow vpmaddubsw's int16 sums (2 * 255 * 127), and |c| <= 128
 * cannot (2 * 128 * 127 = 32512); the lane sums are the same integers either way. */
static ALWAYS_INLINE void pair_codes8(int kind, const void *codes, int64_t p, int full,
                                      __m256i *u, __m256i *sign) {
    if (kind == 4) {
        const uint8_t *c = (const uint8_t *)codes + p * 32;
        const __m256i v = full ? _mm256_loadu_si256((const __m256i *)c)
                               : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)c));
        const __m256i low4 = _mm256_set1_epi8(15);
        u[0] = _mm256_and_si256(v, low4);
        u[1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        sign[0] = sign[1] = _mm256_setzero_si256(); /* unused for q4 */
        return;
    }
    /* 16-byte quarters [b lo, b hi, b+1 lo, b+1 hi] to [b lo, b+1 lo] and [b hi, b+1 hi], loaded
     * as halves (vinserti128 from memory: a cross-lane permute costs 8 uops on Zen 1) */
    const int8_t *c = (const int8_t *)codes + p * 64;
    for (int h = 0; h < 2; h++) {
        const __m128i *lo = (const __m128i *)(c + 16 * h);
        const __m256i first = _mm256_zextsi128_si256(_mm_loadu_si128(lo));
        const __m128i *second = (const __m128i *)(c + 32 + 16 * h);
        sign[h] = full ? _mm256_inserti128_si256(first, _mm_loadu_si128(second), 1) : first;
    }
    u[0] = _mm256_abs_epi8(sign[0]);
    u[1] = _mm256_abs_epi8(sign[1]);
}

/* the pair's weight scales per lane (see lane_d), lanes 0-7 and 8-15 */
static ALWAYS_INLINE void pair_scales8(int kind, const float *d, int64_t p, int full, __m256 *dv) {
    if (d_per_16(kind)) {
        const float *q = d + 4 * p;
        const float b1_lo = full ? q[2] : 0.0f, b1_hi = full ? q[3] : 0.0f;
        dv[0] = _mm256_set_m128(_mm_set1_ps(b1_lo), _mm_set1_ps(q[0]));
        dv[1] = _mm256_set_m128(_mm_set1_ps(b1_hi), _mm_set1_ps(q[1]));
        return;
    }
    const float b1 = full ? d[2 * p + 1] : 0.0f;
    dv[0] = dv[1] = _mm256_set_m128(_mm_set1_ps(b1), _mm_set1_ps(d[2 * p]));
}

/* res[r] = x[r] . W_row for r < R: the pair's codes unpacked once for all R rows */
static ALWAYS_INLINE void q8a_dot_rows(int kind, const q8_row *x, int64_t k, const void *codes,
                                       const float *d, const float *m, const int R, float *res) {
    const int64_t nb = k / QBLOCK, pairs = q8_pairs(k);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[Q8A_ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const int full = 2 * p + 1 < nb;
        __m256i u[2], sign[2];
        __m256 dv[2];
        pair_codes8(kind, codes, p, full, u, sign);
        pair_scales8(kind, d, p, full, dv);
        for (int r = 0; r < R; r++)
            for (int h = 0; h < 2; h++) {
                const int8_t *xp = x[r].xq + p * PAIR_BYTES + 32 * h;
                __m256i xq = _mm256_loadu_si256((const __m256i *)xp);
                if (!nibble_codes(kind)) xq = _mm256_sign_epi8(xq, sign[h]);
                const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(u[h], xq), ones);
                const __m256 scale =
                    _mm256_mul_ps(dv[h], _mm256_loadu_ps(x[r].dxl + p * PAIR_LANES + 8 * h));
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[r][h]);
            }
    }
    /* reduce_lanes' order: (l, l+8), then hsum8's */
    for (int r = 0; r < R; r++)
        res[r] = hsum8(_mm256_add_ps(acc[r][0], acc[r][1])) + m_term(kind, m, x[r].sx, nb);
}
#endif

#if defined(Q8A_SIMD)

static ALWAYS_INLINE void q8a_dot_rows_kind(int kind, const q8_row *x, int64_t k,
                                            const void *codes, const float *d, const float *m,
                                            int rows, float *res) {
    switch (rows) {
    case 1: q8a_dot_rows(kind, x, k, codes, d, m, 1, res); break;
    case 2: q8a_dot_rows(kind, x, k, codes, d, m, 2, res); break;
    case 3: q8a_dot_rows(kind, x, k, codes, d, m, 3, res); break;
    default: q8a_dot_rows(kind, x, k, codes, d, m, Q8A_ROWS, res); break;
    }
}
#endif

/* out[r * ldo + j] = x[r] . W[j] for r < rows, j < n over quantized rows x and a plane kind's
 * W (a file's K-quant rows take q8k_act.h); call from every thread of a parallel region. Ends
 * with the loop's barrier. */
static inline void q8a_matmul_for(int kind, const q8_row *x, const void *codes, const float *d,
                                  const float *m, float *out, int64_t rows, int64_t n,
                                  int64_t k, int64_t ldo) {
#pragma omp for schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const void *cj;
        const float *dj, *mj;
        row_planes(kind, codes, d, m, j, k, &cj, &dj, &mj);
#if defined(Q8A_SIMD)
        prefetch_block_row(kind, codes, d, m, j, n, k);
        for (int64_t r0 = 0; r0 < rows; r0 += Q8A_ROWS) {
            float res[Q8A_ROWS];
            const int g = rows - r0 < Q8A_ROWS ? (int)(rows - r0) : Q8A_ROWS;
            if (kind == 4)
                q8a_dot_rows_kind(4, x + r0, k, cj, dj, mj, g, res);
            else if (kind == 8)
                q8a_dot_rows_kind(8, x + r0, k, cj, dj, mj, g, res);
            else if (kind == 16)
                q8a_dot_rows_kind(16, x + r0, k, cj, dj, mj, g, res);
            else
                q8a_dot_rows_kind(9, x + r0, k, cj, dj, mj, g, res);
            for (int r = 0; r < g; r++) out[(r0 + r) * ldo + j] = res[r];
        }
#else
        for (int64_t r = 0; r < rows; r++)
            out[r * ldo + j] = q8a_dot_portable(kind, x + r, k, cj, dj, mj);
#endif
    }
}

#endif
