/* e^x for x <= 0 in float32, 16 (AVX-512) or 8 (AVX2) at a time: the softmax of the attention
 * kernels (paged_attention.h, extend_tiles.h) and the SiLU of the MLP (row_ops.h).
 */
#ifndef PREFIXRAG_FAST_EXP_H
#define PREFIXRAG_FAST_EXP_H
#include <math.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

/* e^x for x <= 0 (a score minus its running max), within 2 ulp of expf: x = n ln2 + r with
 * |r| <= ln2 / 2, e^r from a degree-7 polynomial, 2^n put into the exponent. libm's expf is a
 * call per score, and at a long context the scores' exponentials would cost as much as reading
 * their keys; this runs 16 (AVX-512) or 8 (AVX2) at a time. x is clamped at -87, where e^x is
 * about the smallest normal float: a position that far below the max adds nothing visible.
 * A small positive x (extend_tiles.h's lazy max) is as exact: only the exponent grows. */
#define EXP_LO -87.0f
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693145751953125f /* ln 2 = LN2_HI + LN2_LO, LN2_HI exact in few bits */
#define LN2_LO 1.428606765330187e-06f
#define EXP_C6 1.9875691500e-4f /* (e^r - 1 - r) / r^2 = C1 + C2 r + ... + C6 r^5 */
#define EXP_C5 1.3981999507e-3f
#define EXP_C4 8.3334519073e-3f
#define EXP_C3 4.1665795894e-2f
#define EXP_C2 1.6666665459e-1f
#define EXP_C1 5.0000001201e-1f

static inline float exp_nonpos(float x) {
    x = x < EXP_LO ? EXP_LO : x;
    const float n = nearbyintf(x * LOG2E);
    const float r = (x - n * LN2_HI) - n * LN2_LO;
    float p = EXP_C6;
    p = p * r + EXP_C5;
    p = p * r + EXP_C4;
    p = p * r + EXP_C3;
    p = p * r + EXP_C2;
    p = p * r + EXP_C1;
    return ldexpf((p * r) * r + r + 1.0f, (int)n);
}

#if defined(__AVX512F__)
static inline __m512 exp_nonpos16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(EXP_LO));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_C6);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C5));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C1));
    const __m512 er = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r),
                                    _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(er, n); /* er * 2^n */
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline __m256 exp_nonpos8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(EXP_LO));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_C6);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C5));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C1));
    const __m256 er = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r),
                                    _mm256_set1_ps(1.0f));
    const __m256i two_n = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(er, _mm256_castsi256_ps(two_n));
}
#endif

#endif
