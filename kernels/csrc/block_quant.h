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

#if defined(__AVX512F__)
/* The AVX-512 matmul never stores an expanded row: each block's two 16-lane pieces of w go
 * straight from registers into the accumulators of up to GROUP rows of x, in dot()'s order
 * (even blocks feed accumulators 0 and 1, odd blocks 2 and 3), so every result is bit-identical
 * to dot() over the expanded row. A q4 block's 16 possible weights fl(d * c + m) are one
 * vector; its codes index into it (vpermps reads the low four bits of each lane). */
#define GROUP 4
#define ALWAYS_INLINE inline __attribute__((always_inline))

static ALWAYS_INLINE void q4_pieces(const uint8_t *c, float d, float m, __m512 *lo, __m512 *hi) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = _mm512_fmadd_ps(_mm512_set1_ps(d), iota, _mm512_set1_ps(m));
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c));
    *lo = _mm512_permutexvar_ps(v, table);
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
}

static ALWAYS_INLINE void q8_pieces(const int8_t *c, float d, __m512 *lo, __m512 *hi) {
    const __m512 vd = _mm512_set1_ps(d);
    *lo = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c))));
    *hi = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + 16)))));
}

static ALWAYS_INLINE void block_pieces(int kind, const void *codes, const float *d, const float *m,
                                       int64_t b, __m512 *lo, __m512 *hi) {
    if (kind == 4)
        q4_pieces((const uint8_t *)codes + b * (QBLOCK / 2), d[b], m[b], lo, hi);
    else
        q8_pieces((const int8_t *)codes + b * QBLOCK, d[b], lo, hi);
}

/* res[r] = x[r] . W_row for r < R (R a constant after inlining) */
static ALWAYS_INLINE void dot_rows(int kind, const float *x, int64_t k, const void *codes,
                                   const float *d, const float *m, const int R, float *res) {
    __m512 acc[GROUP][4];
    for (int r = 0; r < R; r++)
        for (int a = 0; a < 4; a++) acc[r][a] = _mm512_setzero_ps();
    const int64_t nb = k / QBLOCK;
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        __m512 w0, w1, w2, w3;
        block_pieces(kind, codes, d, m, b, &w0, &w1);
        block_pieces(kind, codes, d, m, b + 1, &w2, &w3);
        for (int r = 0; r < R; r++) {
            const float *xr = x + r * k + b * QBLOCK;
            acc[r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(xr), w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 16), w1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 32), w2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 48), w3, acc[r][3]);
        }
    }
    if (b < nb) {
        __m512 w0, w1;
        block_pieces(kind, codes, d, m, b, &w0, &w1);
        for (int r = 0; r < R; r++) {
            const float *xr = x + r * k + b * QBLOCK;
            acc[r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(xr), w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 16), w1, acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++)
        res[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]),
                                                    _mm512_add_ps(acc[r][2], acc[r][3])));
}

static ALWAYS_INLINE void dot_rows_kind(int kind, const float *x, int64_t k, const void *codes,
                                        const float *d, const float *m, int rows, float *res) {
    switch (rows) {
    case 1: dot_rows(kind, x, k, codes, d, m, 1, res); break;
    case 2: dot_rows(kind, x, k, codes, d, m, 2, res); break;
    case 3: dot_rows(kind, x, k, codes, d, m, 3, res); break;
    default: dot_rows(kind, x, k, codes, d, m, 4, res); break;
    }
}
#endif

/* out[r, j] = x[r] . W[j] for r < rows, j < n; call from every thread of a parallel region,
 * each with its own float buffer w of at least k floats (the portable path expands rows there).
 * Ends with the loop's barrier. */
static inline void bq_matmul_for(int kind, const float *x, const void *codes, const float *d,
                                 const float *m, float *out, int64_t rows, int64_t n, int64_t k,
                                 float *w) {
    const int64_t nb = k / QBLOCK;
#pragma omp for schedule(static)
    for (int64_t j = 0; j < n; j++) {
#if defined(__AVX512F__)
        (void)w;
        const void *cj = kind == 4 ? (const void *)((const uint8_t *)codes + j * (k / 2))
                                   : (const void *)((const int8_t *)codes + j * k);
        const float *mj = kind == 4 ? m + j * nb : NULL;
        for (int64_t r0 = 0; r0 < rows; r0 += GROUP) {
            float res[GROUP];
            const int g = rows - r0 < GROUP ? (int)(rows - r0) : GROUP;
            if (kind == 4)
                dot_rows_kind(4, x + r0 * k, k, cj, d + j * nb, mj, g, res);
            else
                dot_rows_kind(8, x + r0 * k, k, cj, d + j * nb, mj, g, res);
            for (int r = 0; r < g; r++) out[(r0 + r) * n + j] = res[r];
        }
#else
        if (kind == 4)
            expand_q4((const uint8_t *)codes + j * (k / 2), d + j * nb, m + j * nb, k, w);
        else
            expand_q8((const int8_t *)codes + j * k, d + j * nb, k, w);
        for (int64_t r = 0; r < rows; r++) out[r * n + j] = dot(x + r * k, w, k);
#endif
    }
}

#endif
