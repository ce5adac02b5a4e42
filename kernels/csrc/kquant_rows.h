/* GGUF's K-quant super-blocks read where they lie: Q4_K (kind 44) and Q6_K (kind 66).
 *
 * The engine maps a GGUF file and passes the file's own bytes as a weight's codes: each row is
 * K / 256 super-blocks, and no plane is ever made from them. Before a row's dot products its
 * scales are widened once into the floats of the planes kinds the row stands for (q4's d and m
 * per 32 for Q4_K, q8_16's d per 16 for Q6_K), computed as kernels/gguf_planes.py computes them;
 * each 32-element block's codes are then unpacked from its super-block. So a row's result is bit
 * for bit the q4 / q8_16 planes' result, and so the fixed-order dot product over the matrix gguf
 * dequantizes (block_quant.h), at the file's 4.5 and 6.56 bits a weight instead of 6 and 10.
 *
 *   Q4_K, 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of codes in
 *         32-byte chunks, sub-block 2c in chunk c's low nibbles and 2c + 1 in its high ones;
 *         w = fl(d sc) q - fl(dmin mn), one rounding (the products are exact).
 *   Q6_K, 210 bytes: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, fp16 d;
 *         w = fl(d sc) (q - 32), one rounding.
 */
#ifndef PREFIXRAG_KQUANT_ROWS_H
#define PREFIXRAG_KQUANT_ROWS_H
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define KIND_Q4K 44
#define KIND_Q6K 66
#define QK_K 256
#define Q4K_BYTES 144
#define Q6K_BYTES 210

static inline int is_kquant(int kind) { return kind == KIND_Q4K || kind == KIND_Q6K; }

static inline int64_t kquant_row_bytes(int kind, int64_t k) {
    return (k / QK_K) * (kind == KIND_Q4K ? Q4K_BYTES : Q6K_BYTES);
}

/* IEEE half to float, exact (F16C where the build has it) */
static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, mant = h & 1023;
    if (exp == 0) {
        const float f = (float)mant * 5.9604644775390625e-8f; /* mant * 2^-24, exact */
        return sign ? -f : f;
    }
    const uint32_t bits = exp == 31 ? sign | 0x7f800000u | (mant << 13)
                                    : sign | ((exp + 112) << 23) | (mant << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* A Q4_K super-block's eight 6-bit scales and mins (bytes 4..15) as bytes sc[8], mn[8]:
 * sub-block j < 4 keeps its scale and min in the low 6 bits of bytes j and j + 4; j >= 4 in the
 * nibbles of byte j + 4, with the top 2 bits in the spare high bits of bytes j - 4 and j. Done
 * four bytes at a time in 32-bit words: a row's scales cost as much as its codes otherwise. */
static inline void q4k_scale_bytes(const uint8_t *q, uint8_t *sc, uint8_t *mn) {
    uint32_t w[3], out[4];
    memcpy(w, q, 12);
    out[0] = w[0] & 0x3f3f3f3fu;
    out[1] = (w[2] & 0x0f0f0f0fu) | (((w[0] >> 6) & 0x03030303u) << 4);
    out[2] = w[1] & 0x3f3f3f3fu;
    out[3] = ((w[2] >> 4) & 0x0f0f0f0fu) | (((w[1] >> 6) & 0x03030303u) << 4);
    memcpy(sc, out, 8);
    memcpy(mn, out + 2, 8);
}

/* A row's scales as plane floats: Q4_K d[b] = fl(d sc_b), m[b] = -fl(dmin mn_b) per 32; Q6_K
 * d[i] = fl(d sc_i) per 16 (m untouched). -fl(a b) is fl((-a) b): rounding is symmetric. */
static inline __attribute__((always_inline)) void kquant_row_scales(int kind, const uint8_t *row, int64_t k, float *d,
                                     float *m) {
    for (int64_t s = 0; s < k / QK_K; s++) {
        if (kind == KIND_Q4K) {
            const uint8_t *sb = row + s * Q4K_BYTES;
            const float dd = half_at(sb), dmin = half_at(sb + 2);
            uint8_t sc[8], mn[8];
            q4k_scale_bytes(sb + 4, sc, mn);
#if defined(__AVX2__)
            const __m256 vsc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc)));
            const __m256 vmn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)mn)));
            _mm256_storeu_ps(d + s * 8, _mm256_mul_ps(_mm256_set1_ps(dd), vsc));
            _mm256_storeu_ps(m + s * 8, _mm256_mul_ps(_mm256_set1_ps(-dmin), vmn));
#else
            for (int j = 0; j < 8; j++) {
                d[s * 8 + j] = dd * (float)sc[j];
                m[s * 8 + j] = -(dmin * (float)mn[j]);
            }
#endif
        } else {
            const uint8_t *sb = row + s * Q6K_BYTES;
            const float dd = half_at(sb + 208);
#if defined(__AVX2__)
            const __m128i sc = _mm_loadu_si128((const __m128i *)(sb + 192));
            const __m256 vd = _mm256_set1_ps(dd);
            _mm256_storeu_ps(d + s * 16, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
            _mm256_storeu_ps(d + s * 16 + 8, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
#else
            const int8_t *sc = (const int8_t *)(sb + 192);
            for (int i = 0; i < 16; i++) d[s * 16 + i] = dd * (float)sc[i];
#endif
        }
    }
}

/* Q4_K block b: the 32-byte chunk holding its codes, and the nibble they sit in (0 or 4) */
static inline const uint8_t *q4k_chunk(const uint8_t *row, int64_t b) {
    return row + (b >> 3) * Q4K_BYTES + 16 + ((b & 7) >> 1) * 32;
}
static inline int q4k_shift(int64_t b) { return (int)(b & 1) * 4; }

/* Q6_K block b's 32 codes (q - 32, in [-32, 31]) into c */
static inline void q6k_block_codes_scalar(const uint8_t *row, int64_t b, int8_t *c) {
    const int sub = (int)(b & 7), half = sub >> 2, q = sub & 3;
    const uint8_t *sb = row + (b >> 3) * Q6K_BYTES;
    const uint8_t *ql = sb + half * 64 + 32 * (q & 1), *qh = sb + 128 + half * 32;
    const int nib = 4 * (q >> 1), hs = 2 * q;
    for (int l = 0; l < 32; l++)
        c[l] = (int8_t)((((ql[l] >> nib) & 15) | (((qh[l] >> hs) & 3) << 4)) - 32);
}

#if defined(__AVX2__)
/* q6k_block_codes_scalar in one vector: 16-bit shifts, then byte masks, keep bytes apart */
static inline __attribute__((always_inline)) __m256i q6k_block_codes(const uint8_t *row, int64_t b) {
    const int sub = (int)(b & 7), half = sub >> 2, q = sub & 3;
    const uint8_t *sb = row + (b >> 3) * Q6K_BYTES;
    const __m256i l = _mm256_loadu_si256((const __m256i *)(sb + half * 64 + 32 * (q & 1)));
    const __m256i h = _mm256_loadu_si256((const __m256i *)(sb + 128 + half * 32));
    const __m256i lo =
        _mm256_and_si256(_mm256_srl_epi16(l, _mm_cvtsi32_si128(4 * (q >> 1))), _mm256_set1_epi8(15));
    const __m256i hi =
        _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * q)), _mm256_set1_epi8(3));
    return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
}
#endif

static inline __attribute__((always_inline)) void q6k_codes(const uint8_t *row, int64_t b, int8_t *c) {
#if defined(__AVX2__)
    _mm256_storeu_si256((__m256i *)c, q6k_block_codes(row, b));
#else
    q6k_block_codes_scalar(row, b, c);
#endif
}

#endif
