/* GGUF-style block weights (see block_quant_matmul.c): expansion of one weight row to float32,
 * the fixed-order dot product, and the matmul as an OpenMP worksharing loop, so callers that
 * already run inside a parallel region (decode_step.c) split N without a fork per matmul.
 *
 * The fixed order, the same on every path (AVX-512, AVX2+FMA, portable), so a result depends
 * neither on the batch, nor on the thread split, nor on which of the paths the host compiled:
 *   - 64 partial sums, p[j] = fma-chain over k = 64 i + j in increasing i (a K that is an odd
 *     number of blocks ends with a half round that feeds p[0..31] only);
 *   - s[l] = ((p[l] + p[16+l]) + (p[32+l] + p[48+l])) + ((p[8+l] + p[24+l]) + (p[40+l] + p[56+l]))
 *     for l < 8, then u[l] = s[l] + s[l+4] for l < 4, then (u[0] + u[2]) + (u[1] + u[3]).
 * In vector terms: lane l of accumulator a holds p[LANES * a + l] (4 x 16 lanes, 8 x 8 lanes);
 * the AVX-512 path adds (acc0 + acc1) + (acc2 + acc3) and folds 512 -> 256 bits, the AVX2 path
 * adds ((acc0 + acc2) + (acc4 + acc6)) + ((acc1 + acc3) + (acc5 + acc7)); both then fold 256 ->
 * 128 bits and finish with hsum8's two steps. That is also the order of GCC's
 * _mm512_reduce_add_ps, which the AVX-512 path used before the AVX2 path existed.
 */
#ifndef PREFIXRAG_BLOCK_QUANT_H
#define PREFIXRAG_BLOCK_QUANT_H
#include <stdint.h>
#include <string.h>

#include "kquant_rows.h"

#define QBLOCK 32
#define MAX_K 16384
#define NUM_PARTIALS 64
#define ALWAYS_INLINE inline __attribute__((always_inline))

/* 4: q4 (4-bit codes, d and m per 32, w = d * code + m); 8: q8 (int8 codes, d per 32,
 * w = d * code); 16: q8_16 (q8 with a d per 16); 9: q8m (int8 codes, d and m per 32, as q4);
 * 44 and 66: a GGUF file's own Q4_K and Q6_K rows (kquant_rows.h), no d or m planes */
static inline int valid_kind(int kind) {
    return kind == 4 || kind == 8 || kind == 16 || kind == 9 || is_kquant(kind);
}
/* K must hold whole blocks, and for the K-quants whole super-blocks */
static inline int valid_k(int kind, int64_t k) {
    return k % QBLOCK == 0 && (!is_kquant(kind) || k % QK_K == 0);
}
/* Not a block kind: plain float32 rows passed as the codes (no d, no m), for small matmuls
 * over float32 weights in the same fixed order (fixed_order_matmul in block_quant_matmul.c). */
#define KIND_F32 32
/* the kinds with an offset m, and their code bytes per row */
static inline int has_m(int kind) { return kind == 4 || kind == 9 || kind == KIND_Q4K; }
static inline int64_t code_bytes(int kind, int64_t k) {
    if (is_kquant(kind)) return kquant_row_bytes(kind, k);
    return kind == 4 ? k / 2 : kind == KIND_F32 ? 4 * k : k;
}
/* the scale buffers a K-quant row's widened scales need (row_weights) */
#define ROW_D_FLOATS (MAX_K / 16)
#define ROW_M_FLOATS (MAX_K / 32)

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define BQ_SIMD 1
#include <immintrin.h>

/* 8 lanes to one float: lanes l and l + 4, then (u0 + u2) + (u1 + u3) */
static ALWAYS_INLINE float hsum8(__m256 t) {
    const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    const __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
    return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}
#endif

#if defined(__AVX512F__)
/* A q4 block's 16 possible weights fl(d * c + m) are one vector; its codes index into it
 * (vpermps reads the low four bits of each lane). */
#define LANES 16
#define GROUP 4
typedef __m512 vec;
#define vzero _mm512_setzero_ps
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vfma _mm512_fmadd_ps

static ALWAYS_INLINE void q4_pieces(const uint8_t *c, float d, float m, vec *w) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = _mm512_fmadd_ps(_mm512_set1_ps(d), iota, _mm512_set1_ps(m));
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c));
    w[0] = _mm512_permutexvar_ps(v, table);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
}

/* d_lo scales elements 0..15, d_hi 16..31 (the same d for q8, two for q8_16); with_m adds m
 * in the same rounding (q8m) */
static ALWAYS_INLINE void q8_pieces(const int8_t *c, float d_lo, float d_hi, int with_m, float m,
                                    vec *w) {
    for (int h = 0; h < 2; h++) {
        const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + 16 * h)));
        const __m512 vd = _mm512_set1_ps(h ? d_hi : d_lo), code = _mm512_cvtepi32_ps(v);
        w[h] = with_m ? _mm512_fmadd_ps(vd, code, _mm512_set1_ps(m)) : _mm512_mul_ps(vd, code);
    }
}

/* Q4_K block codes (kquant_rows.h) at nibble shift: as q4_pieces, the same fma a code */
static ALWAYS_INLINE void q4k_pieces(const uint8_t *c, int shift, float d, float m, vec *w) {
    const __m128i cnt = _mm_cvtsi32_si128(shift);
    const __m512i low4 = _mm512_set1_epi32(15);
    const __m512 vd = _mm512_set1_ps(d), vm = _mm512_set1_ps(m);
    for (int h = 0; h < 2; h++) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + 16 * h)));
        const __m512i code = _mm512_and_si512(_mm512_srl_epi32(v, cnt), low4);
        w[h] = _mm512_fmadd_ps(vd, _mm512_cvtepi32_ps(code), vm);
    }
}

static ALWAYS_INLINE float reduce_partials(const vec *acc) {
    const __m512 s = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1));
    return hsum8(_mm256_add_ps(_mm512_castps512_ps256(s), hi));
}

#elif defined(__AVX2__) && defined(__FMA__)
/* NOTE: AVX2 has no 16-lane permute, and a 16-entry table from two 8-lane permutes and a blend
 * costs more than converting the codes (cvtdq2ps + fma), so the codes are converted. GROUP is 2:
 * eight accumulators a row, so two rows fill the 16 ymm registers (the compiler spills a few);
 * measured at 4 rows, GROUP 2 beat 1 and 4 by about 1.5x. */
#define LANES 8
#define GROUP 2
typedef __m256 vec;
#define vzero _mm256_setzero_ps
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vfma _mm256_fmadd_ps

/* bytes 8h..8h+7 hold elements 8h.. (low nibbles) and 16+8h.. (high): pieces h and h + 2 */
static ALWAYS_INLINE void q4_pieces(const uint8_t *c, float d, float m, vec *w) {
    const __m256i low4 = _mm256_set1_epi32(15);
    const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    for (int h = 0; h < 2; h++) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + 8 * h)));
        w[h] = _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_and_si256(v, low4)), vm);
        w[h + 2] = _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), vm);
    }
}

/* d_lo scales elements 0..15, d_hi 16..31 (the same d for q8, two for q8_16); with_m adds m
 * in the same rounding (q8m) */
static ALWAYS_INLINE void q8_pieces(const int8_t *c, float d_lo, float d_hi, int with_m, float m,
                                    vec *w) {
    const __m256 vd_lo = _mm256_set1_ps(d_lo), vd_hi = _mm256_set1_ps(d_hi);
    for (int h = 0; h < 4; h++) {
        const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c + 8 * h)));
        const __m256 vd = h < 2 ? vd_lo : vd_hi, code = _mm256_cvtepi32_ps(v);
        w[h] = with_m ? _mm256_fmadd_ps(vd, code, _mm256_set1_ps(m)) : _mm256_mul_ps(vd, code);
    }
}

/* Q4_K block codes (kquant_rows.h) at nibble shift: as q4_pieces, the same fma a code */
static ALWAYS_INLINE void q4k_pieces(const uint8_t *c, int shift, float d, float m, vec *w) {
    const __m128i cnt = _mm_cvtsi32_si128(shift);
    const __m256i low4 = _mm256_set1_epi32(15);
    const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    for (int h = 0; h < 4; h++) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + 8 * h)));
        const __m256i code = _mm256_and_si256(_mm256_srl_epi32(v, cnt), low4);
        w[h] = _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(code), vm);
    }
}

static ALWAYS_INLINE float reduce_partials(const vec *acc) {
    const __m256 even = _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[4], acc[6]));
    const __m256 odd = _mm256_add_ps(_mm256_add_ps(acc[1], acc[3]), _mm256_add_ps(acc[5], acc[7]));
    return hsum8(_mm256_add_ps(even, odd));
}
#endif

#if defined(BQ_SIMD)
#define PIECES (QBLOCK / LANES)      /* vectors per block */
#define NACC (NUM_PARTIALS / LANES) /* accumulators: one round of them covers two blocks */
#endif

static inline void expand_q4(const uint8_t *codes, const float *d, const float *m, int64_t k, float *w) {
    for (int64_t b = 0; b < k / QBLOCK; b++) {
        const uint8_t *c = codes + b * (QBLOCK / 2);
        float *o = w + b * QBLOCK;
#if defined(BQ_SIMD)
        vec p[PIECES];
        q4_pieces(c, d[b], m[b], p);
        for (int i = 0; i < PIECES; i++) vstore(o + i * LANES, p[i]);
#else
        for (int j = 0; j < QBLOCK / 2; j++) {
            o[j] = __builtin_fmaf(d[b], (float)(c[j] & 15), m[b]);
            o[j + 16] = __builtin_fmaf(d[b], (float)(c[j] >> 4), m[b]);
        }
#endif
    }
}

/* kinds 8 and 9: a scale per 32 codes; kind 16 (q8_16): one per 16 */
static ALWAYS_INLINE float q8_scale(int kind, const float *d, int64_t b, int hi) {
    return kind == 16 ? d[2 * b + hi] : d[b];
}

/* kind 8, 16 or 9 (m used by 9 only) */
static inline void expand_q8(int kind, const int8_t *codes, const float *d, const float *m,
                             int64_t k, float *w) {
    for (int64_t b = 0; b < k / QBLOCK; b++) {
        const int8_t *c = codes + b * QBLOCK;
        float *o = w + b * QBLOCK;
        const float d_lo = q8_scale(kind, d, b, 0), d_hi = q8_scale(kind, d, b, 1);
        const float mb = kind == 9 ? m[b] : 0.0f;
#if defined(BQ_SIMD)
        vec p[PIECES];
        q8_pieces(c, d_lo, d_hi, kind == 9, mb, p);
        for (int i = 0; i < PIECES; i++) vstore(o + i * LANES, p[i]);
#else
        for (int j = 0; j < QBLOCK; j++) {
            const float dj = j < QBLOCK / 2 ? d_lo : d_hi;
            o[j] = kind == 9 ? __builtin_fmaf(dj, (float)c[j], mb) : dj * (float)c[j];
        }
#endif
    }
}

/* row j's planes: codes, d and m (NULL for kinds without m), nb = K / 32 */
static inline void row_planes(int kind, const void *codes, const float *d, const float *m,
                              int64_t j, int64_t k, const void **cj, const float **dj,
                              const float **mj) {
    const int64_t nb = k / QBLOCK;
    *cj = (const uint8_t *)codes + j * code_bytes(kind, k);
    *dj = d ? d + j * (kind == 16 ? 2 * nb : nb) : NULL;
    *mj = has_m(kind) && m ? m + j * nb : NULL;
}

/* row j's planes, a K-quant row's scales widened into dbuf (ROW_D_FLOATS) and mbuf
 * (ROW_M_FLOATS) first: what every kernel reads a row through */
static inline void row_weights(int kind, const void *codes, const float *d, const float *m,
                               int64_t j, int64_t k, float *dbuf, float *mbuf, const void **cj,
                               const float **dj, const float **mj) {
    row_planes(kind, codes, d, m, j, k, cj, dj, mj);
    if (!is_kquant(kind)) return;
    kquant_row_scales(kind, (const uint8_t *)*cj, k, dbuf, mbuf);
    *dj = dbuf;
    *mj = kind == KIND_Q4K ? mbuf : NULL;
}

/* a K-quant row (scales already widened into d, m) as float32 */
static inline void expand_kquant(int kind, const uint8_t *row, const float *d, const float *m,
                                 int64_t k, float *w) {
    for (int64_t b = 0; b < k / QBLOCK; b++) {
        float *o = w + b * QBLOCK;
        if (kind == KIND_Q4K) {
            const uint8_t *c = q4k_chunk(row, b);
            const int shift = q4k_shift(b);
            for (int j = 0; j < QBLOCK; j++)
                o[j] = __builtin_fmaf(d[b], (float)((c[j] >> shift) & 15), m[b]);
        } else {
            int8_t c[QBLOCK];
            q6k_codes(row, b, c);
            for (int j = 0; j < QBLOCK; j++) o[j] = d[2 * b + j / 16] * (float)c[j];
        }
    }
}

/* the float32 row j */
static inline void expand_row(int kind, const void *codes, const float *d, const float *m,
                              int64_t j, int64_t k, float *w) {
    const void *cj;
    const float *dj, *mj;
    if (is_kquant(kind)) {
        float dbuf[ROW_D_FLOATS], mbuf[ROW_M_FLOATS];
        row_weights(kind, codes, d, m, j, k, dbuf, mbuf, &cj, &dj, &mj);
        expand_kquant(kind, (const uint8_t *)cj, dj, mj, k, w);
        return;
    }
    row_planes(kind, codes, d, m, j, k, &cj, &dj, &mj);
    if (kind == KIND_F32)
        memcpy(w, cj, (size_t)k * sizeof(float));
    else if (kind == 4)
        expand_q4((const uint8_t *)cj, dj, mj, k, w);
    else
        expand_q8(kind, (const int8_t *)cj, dj, mj, k, w);
}

#if !defined(BQ_SIMD)
static inline float reduce_partials(const float *p) {
    float s[8], u[4];
    for (int l = 0; l < 8; l++)
        s[l] = ((p[l] + p[16 + l]) + (p[32 + l] + p[48 + l])) +
               ((p[8 + l] + p[24 + l]) + (p[40 + l] + p[56 + l]));
    for (int l = 0; l < 4; l++) u[l] = s[l] + s[l + 4];
    return (u[0] + u[2]) + (u[1] + u[3]);
}
#endif

/* x . w over k floats (k a multiple of 32) in the fixed order */
static inline float dot(const float *x, const float *w, int64_t k) {
    int64_t i = 0;
#if defined(BQ_SIMD)
    vec acc[NACC];
    for (int a = 0; a < NACC; a++) acc[a] = vzero();
    for (; i + NUM_PARTIALS <= k; i += NUM_PARTIALS)
        for (int a = 0; a < NACC; a++)
            acc[a] = vfma(vload(x + i + LANES * a), vload(w + i + LANES * a), acc[a]);
    for (int a = 0; i < k; i += LANES, a++) acc[a] = vfma(vload(x + i), vload(w + i), acc[a]);
#else
    float acc[NUM_PARTIALS] = {0};
    for (; i + NUM_PARTIALS <= k; i += NUM_PARTIALS)
        for (int j = 0; j < NUM_PARTIALS; j++) acc[j] = __builtin_fmaf(x[i + j], w[i + j], acc[j]);
    for (int j = 0; i + j < k; j++) acc[j] = __builtin_fmaf(x[i + j], w[i + j], acc[j]);
#endif
    return reduce_partials(acc);
}

#if defined(BQ_SIMD)
/* The SIMD matmul never stores an expanded row: each block's pieces of w go straight from
 * registers into the accumulators of up to GROUP rows of x, in dot()'s order (even blocks feed
 * the first half of the accumulators, odd blocks the second), so every result is bit-identical
 * to dot() over the expanded row, and a block is unpacked once per GROUP rows. */
static ALWAYS_INLINE void block_pieces(int kind, const void *codes, const float *d, const float *m,
                                       int64_t b, vec *w) {
    if (kind == KIND_F32) {
        const float *row = (const float *)codes + b * QBLOCK;
        for (int i = 0; i < PIECES; i++) w[i] = vload(row + LANES * i);
    } else if (kind == KIND_Q4K) {
        q4k_pieces(q4k_chunk((const uint8_t *)codes, b), q4k_shift(b), d[b], m[b], w);
    } else if (kind == KIND_Q6K) {
        int8_t c[QBLOCK] __attribute__((aligned(32)));
        q6k_codes((const uint8_t *)codes, b, c);
        q8_pieces(c, d[2 * b], d[2 * b + 1], 0, 0.0f, w);
    } else if (kind == 4)
        q4_pieces((const uint8_t *)codes + b * (QBLOCK / 2), d[b], m[b], w);
    else
        q8_pieces((const int8_t *)codes + b * QBLOCK, q8_scale(kind, d, b, 0),
                  q8_scale(kind, d, b, 1), kind == 9, kind == 9 ? m[b] : 0.0f, w);
}

/* res[r] = x[r] . W_row for r < R (R a constant after inlining) */
static ALWAYS_INLINE void dot_rows(int kind, const float *x, int64_t k, const void *codes,
                                   const float *d, const float *m, const int R, float *res) {
    vec acc[GROUP][NACC];
    for (int r = 0; r < R; r++)
        for (int a = 0; a < NACC; a++) acc[r][a] = vzero();
    const int64_t nb = k / QBLOCK;
    int64_t b = 0;
    /* constant accumulator indices (a pair of blocks a round) keep acc in registers */
    for (; b + 2 <= nb; b += 2)
        for (int half = 0; half < 2; half++) {
            vec w[PIECES];
            block_pieces(kind, codes, d, m, b + half, w);
            for (int r = 0; r < R; r++) {
                const float *xr = x + r * k + (b + half) * QBLOCK;
                for (int i = 0; i < PIECES; i++) {
                    vec *a = &acc[r][half * PIECES + i];
                    *a = vfma(vload(xr + LANES * i), w[i], *a);
                }
            }
        }
    if (b < nb) {
        vec w[PIECES];
        block_pieces(kind, codes, d, m, b, w);
        for (int r = 0; r < R; r++)
            for (int i = 0; i < PIECES; i++)
                acc[r][i] = vfma(vload(x + r * k + b * QBLOCK + LANES * i), w[i], acc[r][i]);
    }
    for (int r = 0; r < R; r++) res[r] = reduce_partials(acc[r]);
}

/* Up to SLOT_ROWS rows of x against one float32 weight row, bit-identical to dot_rows: the
 * same chain for each partial, run accumulator by accumulator (a "slot": lanes LANES * a ..
 * of every 64 elements) with the rows inside. dot_rows holds NACC accumulators a row, so on
 * AVX2 two rows fill the registers and each weight vector is loaded once per two rows; here
 * a slot's R accumulators, the weight vector and x fit, each weight vector is loaded once for
 * R rows, and a load feeds about one FMA (the fixed order costs nothing at a batch of 8).
 * With fewer than SLOT_MIN_ROWS rows its R dependent chains would wait on the FMA latency.
 * SLOT_PASS slots run together in a pass over the row; the settings may be set at build time
 * (-D), to compare builds in one engine (bench/kernel_flags_ab.py). */
#define SLOT_MIN_ROWS 4
#if defined(__AVX512F__)
/* All four slots a pass, four rows a group: a pass reads the weight row front to back, as the
 * hardware prefetcher expects, and a batch of 8 reads each row twice, the second time from L1.
 * Two slots a pass over 8 rows read 128 bytes of every 256, in strides the prefetcher does not
 * follow, and the two passes' x (8 rows) strained L1 at K = 1,536. A float32 SmolLM2-135M at
 * batch 8, 2 threads, 2-core Xeon, interleaved builds in one engine: 4.2% more tok/s (faster
 * in 12 of 13 repeats; two more runs: 6.5%, 7 of 7, and -1.3%, 3 of 7). Before, two slots a
 * pass had beaten one (34.3 -> 29.6 ms over the model's matrices at 8 rows). */
#ifndef SLOT_ROWS
#define SLOT_ROWS 4
#endif
#ifndef SLOT_PASS
#define SLOT_PASS 4
#endif
/* the prefetch settings here may be set at build time (-D), to compare builds of the kernels in
 * one engine: bench/kernel_flags_ab.py */
#ifndef SLOT_PREFETCH_ROWS
#define SLOT_PREFETCH_ROWS 2
#endif
#ifndef SLOT_PREFETCH_HINT
#define SLOT_PREFETCH_HINT 2
#endif
/* A block row's three planes (codes, d, m) are three streams, which the hardware prefetcher
 * follows late at a decode step's pace: the row eight ahead is prefetched into L2. Decode of the
 * SmolLM2-135M on a 2-core Xeon, interleaved builds: two rows ahead against none gave +3% to +17%
 * tok/s on Q4_1 and +20% on Q4_K_M with int8 activations (one row ahead gained nothing, and
 * prefetchnta lost 15%); eight rows against two then gave +19% on Q4_K_M with int8 activations,
 * +7% in float32 and +4% on Q4_1 (bench/results/kernel_flags_ab_prefetch_*.json; sixteen: the
 * same as eight, thirty-two: less). Not measured on AVX2 hosts: left off there. */
#ifndef BLOCK_PREFETCH_ROWS
#define BLOCK_PREFETCH_ROWS 8
#endif
#else
/* one slot a pass: two would overflow AVX2's 16 registers */
#define SLOT_ROWS 8
#define SLOT_PASS 1
#define SLOT_PREFETCH_ROWS 1
#define SLOT_PREFETCH_HINT 3
#endif
/* ahead: the weight row SLOT_PREFETCH_ROWS on, or NULL; the first pass prefetches its rounds
 * one by one as it reads its own (a whole row's 36 prefetches at once, at the start of the row,
 * were slower: a float32 SmolLM2-135M's matrices at 8 rows, 2 threads, interleaved builds on a
 * 2-core Xeon: 41.2 -> 36.2 ms, at 4 rows 29.6 -> 27.4) */
static ALWAYS_INLINE void dot_rows_f32_slots(const float *x, int64_t k, const float *w,
                                             const int R, float *res, const float *ahead) {
    vec part[SLOT_ROWS][NACC];
    const int64_t rounds = k / NUM_PARTIALS, half = k % NUM_PARTIALS ? 1 : 0;
    for (int a = 0; a < NACC; a += SLOT_PASS) {
        vec acc[SLOT_PASS][SLOT_ROWS];
        for (int s = 0; s < SLOT_PASS; s++)
            for (int r = 0; r < R; r++) acc[s][r] = vzero();
        /* an odd last block (a half round) feeds slots a < NACC / 2 only */
        const int64_t end = rounds + half;
        for (int64_t i = 0; i < end; i++) {
            const int64_t at = i * NUM_PARTIALS + LANES * a;
            if (ahead && a == 0) /* round i of that row, a 64-byte line (16 floats) at a time */
                for (int64_t l = i * NUM_PARTIALS; l < (i + 1) * NUM_PARTIALS && l < k; l += 16)
                    __builtin_prefetch(ahead + l, 0, SLOT_PREFETCH_HINT);
            const int live = i < rounds ? SLOT_PASS : NACC / 2 - a;
            if (live <= 0) break;
            vec wv[SLOT_PASS];
            for (int s = 0; s < SLOT_PASS; s++)
                if (s < live) wv[s] = vload(w + at + LANES * s);
            for (int r = 0; r < R; r++)
                for (int s = 0; s < SLOT_PASS; s++)
                    if (s < live)
                        acc[s][r] = vfma(vload(x + r * k + at + LANES * s), wv[s], acc[s][r]);
        }
        for (int s = 0; s < SLOT_PASS; s++)
            for (int r = 0; r < R; r++) part[r][a + s] = acc[s][r];
    }
    for (int r = 0; r < R; r++) res[r] = reduce_partials(part[r]);
}

static ALWAYS_INLINE void dot_rows_f32_kind(const float *x, int64_t k, const float *w, int rows,
                                            float *res, const float *ahead) {
    switch (rows) { /* a constant R: the accumulators stay in registers */
#if SLOT_ROWS > 4
    case 4: dot_rows_f32_slots(x, k, w, 4, res, ahead); break;
    case 5: dot_rows_f32_slots(x, k, w, 5, res, ahead); break;
    case 6: dot_rows_f32_slots(x, k, w, 6, res, ahead); break;
    case 7: dot_rows_f32_slots(x, k, w, 7, res, ahead); break;
#endif
    default: dot_rows_f32_slots(x, k, w, SLOT_ROWS, res, ahead); break;
    }
}

static ALWAYS_INLINE void dot_rows_kind(int kind, const float *x, int64_t k, const void *codes,
                                        const float *d, const float *m, int rows, float *res) {
    switch (rows) {
    case 1: dot_rows(kind, x, k, codes, d, m, 1, res); break;
#if GROUP > 2
    case 2: dot_rows(kind, x, k, codes, d, m, 2, res); break;
#endif
#if GROUP > 3
    case 3: dot_rows(kind, x, k, codes, d, m, 3, res); break;
#endif
    default: dot_rows(kind, x, k, codes, d, m, GROUP, res); break;
    }
}
#endif

/* Row j + BLOCK_PREFETCH_ROWS's planes into L2 (see BLOCK_PREFETCH_ROWS), where defined */
static ALWAYS_INLINE void prefetch_block_row(int kind, const void *codes, const float *d,
                                             const float *m, int64_t j, int64_t n, int64_t k) {
#if defined(BLOCK_PREFETCH_ROWS)
    if (kind == KIND_F32 || j + BLOCK_PREFETCH_ROWS >= n) return;
    const void *cp;
    const float *dp, *mp;
    row_planes(kind, codes, d, m, j + BLOCK_PREFETCH_ROWS, k, &cp, &dp, &mp);
    for (int64_t b = 0; b < code_bytes(kind, k); b += 64)
        __builtin_prefetch((const char *)cp + b, 0, 1);
    if (dp) __builtin_prefetch(dp, 0, 1);
    if (mp) __builtin_prefetch(mp, 0, 1);
#else
    (void)kind, (void)codes, (void)d, (void)m, (void)j, (void)n, (void)k;
#endif
}

/* out[r * ldo + j] = x[r] . W[j] for r < rows, j < n; call from every thread of a parallel
 * region, each with its own float buffer w of at least k floats (the portable path expands rows
 * there). Ends with the loop's barrier. */
static inline void bq_matmul_for(int kind, const float *x, const void *codes, const float *d,
                                 const float *m, float *out, int64_t rows, int64_t n, int64_t k,
                                 int64_t ldo, float *w) {
#pragma omp for schedule(static)
    for (int64_t j = 0; j < n; j++) {
#if defined(BQ_SIMD)
        (void)w;
        const void *cj;
        const float *dj, *mj;
        float dbuf[ROW_D_FLOATS], mbuf[ROW_M_FLOATS];
        row_weights(kind, codes, d, m, j, k, dbuf, mbuf, &cj, &dj, &mj);
        int64_t r0 = 0;
        prefetch_block_row(kind, codes, d, m, j, n, k);
        if (kind == KIND_F32)
            for (; rows - r0 >= SLOT_MIN_ROWS; r0 += SLOT_ROWS) {
                float res[SLOT_ROWS];
                const int g = rows - r0 < SLOT_ROWS ? (int)(rows - r0) : SLOT_ROWS;
                /* the slots sweep a row in passes, in strides that the hardware prefetcher
                 * does not follow */
                const int ahead = r0 == 0 && j + SLOT_PREFETCH_ROWS < n;
                dot_rows_f32_kind(x + r0 * k, k, (const float *)cj, g, res,
                                  ahead ? (const float *)cj + SLOT_PREFETCH_ROWS * k : NULL);
                for (int r = 0; r < g; r++) out[(r0 + r) * ldo + j] = res[r];
            }
        for (; r0 < rows; r0 += GROUP) {
            float res[GROUP];
            const int g = rows - r0 < GROUP ? (int)(rows - r0) : GROUP;
            /* a constant kind per call: each gets its own inlined loop */
            if (kind == 4)
                dot_rows_kind(4, x + r0 * k, k, cj, dj, mj, g, res);
            else if (kind == 8)
                dot_rows_kind(8, x + r0 * k, k, cj, dj, mj, g, res);
            else if (kind == 16)
                dot_rows_kind(16, x + r0 * k, k, cj, dj, mj, g, res);
            else if (kind == KIND_F32)
                dot_rows_kind(KIND_F32, x + r0 * k, k, cj, dj, mj, g, res);
            else if (kind == KIND_Q4K)
                dot_rows_kind(KIND_Q4K, x + r0 * k, k, cj, dj, mj, g, res);
            else if (kind == KIND_Q6K)
                dot_rows_kind(KIND_Q6K, x + r0 * k, k, cj, dj, mj, g, res);
            else
                dot_rows_kind(9, x + r0 * k, k, cj, dj, mj, g, res);
            for (int r = 0; r < g; r++) out[(r0 + r) * ldo + j] = res[r];
        }
#else
        expand_row(kind, codes, d, m, j, k, w);
        for (int64_t r = 0; r < rows; r++) out[r * ldo + j] = dot(x + r * k, w, k);
#endif
    }
}

#endif
