/* GGUF-style block weights (see block_quant_matmul.c): expansion of one weight row to float32 in
 * cache, the fixed-order dot product, and the matmul as an OpenMP worksharing loop, so callers
 * that already run inside a parallel region (decode_step.c) split N without a fork per matmul.
 */
#ifndef PREFIXRAG_BLOCK_QUANT_H
#define PREFIXRAG_BLOCK_QUANT_H
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define QBLOCK 32
#define MAX_K 16384

static inline void expand_q4(const uint8_t *codes, const float *d, const float *m, int64_t k, float *w) {
    for (int64_t b = 0; b < k / QBLOCK; b++) {
        const uint8_t *c = codes + b * (QBLOCK / 2);
        float *o = w + b * QBLOCK;
#if defined(__AVX512F__)
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c));
        __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
        __m512 vd = _mm512_set1_ps(d[b]), vm = _mm512_set1_ps(m[b]);
        _mm512_storeu_ps(o, _mm512_fmadd_ps(vd, lo, vm));
        _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(vd, hi, vm));
#else
        for (int j = 0; j < QBLOCK / 2; j++) {
            o[j] = __builtin_fmaf(d[b], (float)(c[j] & 15), m[b]);
            o[j + 16] = __builtin_fmaf(d[b], (float)(c[j] >> 4), m[b]);
        }
#endif
    }
}

static inline void expand_q8(const int8_t *codes, const float *d, int64_t k, float *w) {
    for (int64_t b = 0; b < k / QBLOCK; b++) {
        const int8_t *c = codes + b * QBLOCK;
        float *o = w + b * QBLOCK;
#if defined(__AVX512F__)
        __m512 vd = _mm512_set1_ps(d[b]);
        for (int h = 0; h < QBLOCK; h += 16) {
            __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + h)));
            _mm512_storeu_ps(o + h, _mm512_mul_ps(vd, _mm512_cvtepi32_ps(v)));
        }
#else
        for (int j = 0; j < QBLOCK; j++) o[j] = d[b] * (float)c[j];
#endif
    }
}

/* k is a multiple of 32; the fixed order: lane l of accumulator a sums k = 64*i + 16*a + l. */
static inline float dot(const float *x, const float *w, int64_t k) {
#if defined(__AVX512F__)
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
    int64_t i = 0;
    for (; i + 64 <= k; i += 64)
        for (int a = 0; a < 4; a++)
            acc[a] = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 16 * a),
                                     _mm512_loadu_ps(w + i + 16 * a), acc[a]);
    for (int a = 0; i < k; i += 16, a++)
        acc[a] = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(w + i), acc[a]);
    __m512 s = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    return _mm512_reduce_add_ps(s);
#else
    float acc[64] = {0};
    for (int64_t i = 0; i < k; i += 64)
        for (int j = 0; j < 64 && i + j < k; j++) acc[j] = __builtin_fmaf(x[i + j], w[i + j], acc[j]);
    float s = 0.0f;
    for (int j = 0; j < 64; j++) s += acc[j];
    return s;
#endif
}

/* out[r, j] = x[r] . W[j] for r < rows, j < n; call from every thread of a parallel region,
 * each with its own float buffer w of at least k floats. Ends with the loop's barrier. */
static inline void bq_matmul_for(int kind, const float *x, const void *codes, const float *d,
                                 const float *m, float *out, int64_t rows, int64_t n, int64_t k,
                                 float *w) {
    const int64_t nb = k / QBLOCK;
#pragma omp for schedule(static)
    for (int64_t j = 0; j < n; j++) {
        if (kind == 4)
            expand_q4((const uint8_t *)codes + j * (k / 2), d + j * nb, m + j * nb, k, w);
        else
            expand_q8((const int8_t *)codes + j * k, d + j * nb, k, w);
        for (int64_t r = 0; r < rows; r++) out[r * n + j] = dot(x + r * k, w, k);
    }
}

#endif
