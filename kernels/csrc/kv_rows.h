/* Rows of the paged KV cache in its storage type: float32, float16 or bfloat16.
 *
 * Attention math stays float32: a 16-bit row is widened into a small float buffer as it is read
 * (F16C's vcvtph2ps for float16, a 16-bit shift for bfloat16) and rounded on store. Rounding is
 * to nearest even, as torch's .to(float16 / bfloat16) does, so a row the C kernels write holds
 * the same bits as one the torch paths write.
 */
#ifndef PREFIXRAG_KV_ROWS_H
#define PREFIXRAG_KV_ROWS_H
#include <stdint.h>
#include <string.h>

#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#define KV_HAS_F16 1
#elif defined(__FLT16_MANT_DIG__)
#define KV_HAS_F16 1
#define KV_F16_SCALAR 1
#else
#define KV_HAS_F16 0 /* float16 caches are refused (the kernels return -1) */
#endif

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };

static inline int kv_kind_ok(int32_t kind) {
    return kind == KV_F32 || kind == KV_BF16 || (kind == KV_F16 && KV_HAS_F16);
}

static inline int64_t kv_elem_size(int32_t kind) { return kind == KV_F32 ? 4 : 2; }

static inline void f16_to_f32(const uint16_t *src, float *dst, int64_t n) {
#if KV_HAS_F16 && !defined(KV_F16_SCALAR)
    int64_t j = 0;
#if defined(__AVX512F__)
    /* full-width stores: the attention reads these rows back 16 floats at a time, and a load
     * that spans two narrower stores cannot be forwarded from them (it waits for both) */
    for (; j + 16 <= n; j += 16)
        _mm512_storeu_ps(dst + j, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + j))));
#endif
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + j))));
    for (; j < n; j++) dst[j] = _cvtsh_ss(src[j]);
#elif KV_HAS_F16
    for (int64_t j = 0; j < n; j++) {
        _Float16 h;
        memcpy(&h, src + j, 2);
        dst[j] = (float)h;
    }
#else
    (void)src, (void)dst, (void)n;
#endif
}

static inline void f32_to_f16(const float *src, uint16_t *dst, int64_t n) {
#if KV_HAS_F16 && !defined(KV_F16_SCALAR)
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        _mm_storeu_si128((__m128i *)(dst + j),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT));
    for (; j < n; j++) dst[j] = _cvtss_sh(src[j], _MM_FROUND_TO_NEAREST_INT);
#elif KV_HAS_F16
    for (int64_t j = 0; j < n; j++) {
        const _Float16 h = (_Float16)src[j];
        memcpy(dst + j, &h, 2);
    }
#else
    (void)src, (void)dst, (void)n;
#endif
}

static inline void bf16_to_f32(const uint16_t *src, float *dst, int64_t n) {
#pragma omp simd
    for (int64_t j = 0; j < n; j++) {
        const uint32_t bits = (uint32_t)src[j] << 16;
        float f;
        memcpy(&f, &bits, 4);
        dst[j] = f;
    }
}

static inline void f32_to_bf16(const float *src, uint16_t *dst, int64_t n) {
    for (int64_t j = 0; j < n; j++) {
        uint32_t bits;
        memcpy(&bits, src + j, 4);
        if ((bits & 0x7fffffffu) > 0x7f800000u) /* NaN: torch's canonical quiet NaN */
            dst[j] = 0x7fc0;
        else /* round to nearest, ties to even */
            dst[j] = (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    }
}

/* the slot (block * bs + offset) holding position p of a sequence whose block table is table */
static inline int64_t paged_slot(const int32_t *table, int64_t p, int64_t bs) {
    return (int64_t)table[p / bs] * bs + p % bs;
}

/* Asks for the K and V rows of kv head g at positions p0 .. p1 - 1 to be brought into cache:
 * a head's rows lie hkv * d elements apart, in blocks the table scatters, and after thousands
 * of cached positions over every layer they are no longer in L2 when an extend reads them. */
static inline void kv_prefetch_rows(const void *k_cache, const void *v_cache, int32_t kind,
                                    int64_t p0, int64_t p1, int64_t g, int64_t hkv, int64_t d,
                                    int64_t bs, const int32_t *table) {
    const int64_t elem = kind == KV_F32 ? 4 : 2;
    for (int64_t p = p0; p < p1; p++) {
        const int64_t at = (paged_slot(table, p, bs) * hkv + g) * d * elem;
        for (int64_t b = 0; b < d * elem; b += 64) {
            __builtin_prefetch((const char *)k_cache + at + b, 0, 3);
            __builtin_prefetch((const char *)v_cache + at + b, 0, 3);
        }
    }
}

/* n elements at element offset `at` of a cache, as float32: the row itself for a float32
 * cache, otherwise widened into buf (n floats) and buf returned */
static inline const float *kv_load(const void *cache, int32_t kind, int64_t at, int64_t n,
                                   float *buf) {
    if (kind == KV_F32) return (const float *)cache + at;
    const uint16_t *src = (const uint16_t *)cache + at;
    if (kind == KV_F16)
        f16_to_f32(src, buf, n);
    else
        bf16_to_f32(src, buf, n);
    return buf;
}

/* n float32 values stored at element offset `at` of a cache, rounded to its type */
static inline void kv_store(void *cache, int32_t kind, int64_t at, const float *src, int64_t n) {
    if (kind == KV_F32)
        memcpy((float *)cache + at, src, (size_t)n * sizeof(float));
    else if (kind == KV_F16)
        f32_to_f16(src, (uint16_t *)cache + at, n);
    else
        f32_to_bf16(src, (uint16_t *)cache + at, n);
}

#endif
